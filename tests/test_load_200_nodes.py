"""Load: one pool over 200 nodes converges; what it costs the operator.

200 real Node objects; the real operator process (its own RBAC) creates 200 OffloadPoolNodes and
the DaemonSet (the real DaemonSet controller then creates 200 pods, left unscheduled: starting
200 agent processes would measure this 2-core machine, not the operator). The agents run in
this one process instead — the real ``offloadpool.agent.loop.Agent``, one per node, each with its
own host root, its own real 4 MiB tmpfs region and its own OffloadPoolNode status, talking to
the API server with the agent ServiceAccount's token.

The test asserts convergence (all 200 Ready, pool Ready 200/200) and reports, without asserting
on them, the time to converge and the operator's peak RSS and CPU seconds (from /proc). Set
OFFLOADPOOL_LOAD_REPORT=<file> to get them as JSON (bench/load_200_nodes.py does).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from prometheus_client import CollectorRegistry

from fixtures.cluster import release_everything, mounts_under, wait_for
from fixtures.operator_process import OperatorProcess

from offloadpool.agent import kube
from offloadpool.agent.loop import Agent
from offloadpool.agent.metrics import AgentMetrics

pytestmark = pytest.mark.controlplane

NODES = int(os.environ.get("OFFLOADPOOL_LOAD_NODES", "200"))
GROUP, VERSION = "offloadpool.io", "v1alpha1"


def test_pool_over_200_nodes_converges(offloadpool_operator: OperatorProcess) -> None:
    op = offloadpool_operator
    cp = op.cp
    tag = uuid.uuid4().hex[:6]
    label = {f"load.offloadpool.io/{tag}": "true"}
    work = Path(tempfile.mkdtemp(prefix="offloadpool-load-"))
    admin = cp.api_client()
    core = client.CoreV1Api(admin)
    custom = client.CustomObjectsApi(admin)
    names = [f"load-{tag}-{i:03d}" for i in range(NODES)]
    pool = f"load-{tag}"

    token = cp.token_for(op.namespace, "offloadpool-agent", expiration_seconds=3600)
    agent_cfg = client.Configuration()
    from kubernetes import config as kconfig
    kconfig.load_kube_config(str(cp.kubeconfig_for_token(token, work / "agent.kubeconfig")),
                             client_configuration=agent_cfg)
    agent_cfg.connection_pool_maxsize = 64
    agent_api = client.ApiClient(agent_cfg)
    agents: list[Agent] = []
    try:
        for name in names:
            core.create_node({"apiVersion": "v1", "kind": "Node",
                              "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **label}}})
        for name in names:
            access = kube.KubeAccess(agent_api, pool, f"{pool}.{name}", op.namespace)
            agents.append(Agent(access, work / name, metrics=AgentMetrics(pool, name, CollectorRegistry()),
                                heartbeat_seconds=10, retry_seconds=2, watches=False).start())
        cpu0 = op.cpu_seconds()
        t0 = time.monotonic()
        custom.create_cluster_custom_object(GROUP, VERSION, "offloadpools", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "OffloadPool", "metadata": {"name": pool},
            "spec": {"capacity": "4Mi", "medium": "Memory", "nodeSelector": label}})

        def converged() -> dict[str, Any] | None:
            st = (custom.get_cluster_custom_object(GROUP, VERSION, "offloadpools", pool).get("status") or {})
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])
            return st if ready and st.get("readyNodes") == NODES == st.get("desiredNodes") else None

        st = wait_for(f"pool Ready {NODES}/{NODES}", converged, timeout=600, interval=0.5)
        seconds = time.monotonic() - t0
        report = {
            "nodes": NODES,
            "seconds_to_converge": round(seconds, 1),
            "operator_peak_rss_mib": round(op.peak_rss_bytes() / (1 << 20), 1),
            "operator_cpu_seconds_to_converge": round(op.cpu_seconds() - cpu0, 2),
            "operator_cpu_seconds_total": round(op.cpu_seconds(), 2),
            "total_bytes": st.get("totalBytes"),
        }
        # steady state: one more minute of heartbeats (200 status writes every 10 s)
        cpu1, t1 = op.cpu_seconds(), time.monotonic()
        time.sleep(float(os.environ.get("OFFLOADPOOL_LOAD_STEADY_SECONDS", "30")))
        report["operator_cpu_percent_steady"] = round(100 * (op.cpu_seconds() - cpu1) / (time.monotonic() - t1), 1)
        report["operator_peak_rss_mib"] = round(op.peak_rss_bytes() / (1 << 20), 1)
        print("\nLOAD REPORT " + json.dumps(report))
        if os.environ.get("OFFLOADPOOL_LOAD_REPORT"):
            Path(os.environ["OFFLOADPOOL_LOAD_REPORT"]).write_text(json.dumps(report, indent=2) + "\n")
        assert st["totalBytes"] == NODES * 4 * (1 << 20)

        custom.delete_cluster_custom_object(GROUP, VERSION, "offloadpools", pool)
        wait_for("pool deleted after every node released", lambda: not _exists(custom, pool), 600, interval=1)
        assert not mounts_under(work), "released pools left mounts"
    finally:
        for a in agents:
            a.stop.set()
            a.wake.set()
        for a in agents:
            if a.thread is not None:
                a.thread.join(timeout=30)
        if _exists(custom, pool):
            custom.patch_cluster_custom_object(GROUP, VERSION, "offloadpools", pool, {"metadata": {"finalizers": None}})
            custom.delete_cluster_custom_object(GROUP, VERSION, "offloadpools", pool)
        for name in names:
            try:
                core.delete_node(name)
            except client.rest.ApiException:
                pass
        release_everything(work)
        left = mounts_under(work)
        shutil.rmtree(work, ignore_errors=True)
        agent_api.close()
        admin.close()
        assert not left, f"mounts left: {left}"


def _exists(custom: client.CustomObjectsApi, pool: str) -> bool:
    try:
        custom.get_cluster_custom_object(GROUP, VERSION, "offloadpools", pool)
        return True
    except client.rest.ApiException as exc:
        if exc.status == 404:
            return False
        raise
