"""Scale: one pool over hundreds of nodes converges, and what it costs the operator.

Real Node objects; the real operator process (its own RBAC) creates the DaemonSet (the real
DaemonSet controller then creates the pods, left unscheduled: starting that many agent
processes would measure this 2-core machine, not the operator). The agents run in this one
process instead — the real ``offloadpool.agent.loop.Agent``, one per node, each started when
the DaemonSet controller makes its node's pod, as a kubelet would start it (the control
plane's controller manager runs at Kubernetes' own scale-test rate limits), each with its own
host root, its own real 64 KiB tmpfs region, its own OffloadPoolNode (which it creates, as a
real agent does when it starts) and heartbeat Lease, talking to the API server with the agent
ServiceAccount's token.

Each real agent watches its own pool and OffloadPoolNode. A thousand agents in one process
cannot each hold two watches on this machine, so one watch over the pool's OffloadPoolNodes
hands each event to the agent whose object changed (``Agent.notice``, what its own watch
does); agents otherwise step only every heartbeat. Without it they would poll, and the
polling would be what is measured. For the same reason the agents' regions are built at most
``REGIONS_AT_ONCE`` at a time (a node builds on its own CPU) and the GIL switch interval is
``HARNESS_SWITCH_SECONDS`` while they run (see each).

The test asserts convergence (all Ready, pool Ready N/N, every node's ResourceSlice with the
pool's device), that a steady pool makes no OffloadPoolNode status writes (liveness is the
Leases'), that the pool's deletion removes every node's slice (``slices_gone_with_the_pool``:
each agent deletes its own as it drains) and that it releases every node. It reports the
slices' change (seconds, slice requests per node by verb, CPU per node of each process) and,
without asserting on them, the time to converge, the operator's CPU per node and peak RSS, the
API writes per node (all clients, by resource) and the CPU per node of each process on the
machine (agents, API server, etcd, controller manager, operator) from the
pool's creation to its convergence, and steady-state operator CPU and API writes per second.

``OFFLOADPOOL_SCALE_NODES`` is a comma-separated list of node counts run one after the other
against one operator (CI: 200), after a warm-up pool of ``OFFLOADPOOL_SCALE_WARMUP_NODES``
(20; asserted the same way, not reported); ``OFFLOADPOOL_SCALE_REPORT=<file>`` writes the
reports as JSON (``bench/scale.py`` runs 200, 500 and 1,000).
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.watch.watch import iter_resp_lines
from prometheus_client import CollectorRegistry

from fixtures import node_tokens
from fixtures.cluster import mounts_under, release_everything
from fixtures.cluster_client import ClusterClient
from fixtures.operator_process import OperatorProcess
from fixtures.wait import wait_for
from offloadpool.agent import actions, kube
from offloadpool.agent.loop import Agent
from offloadpool.agent.metrics import AgentMetrics
from offloadpool.agent.observation import REREAD_PERIODS
from offloadpool.api import dra
from offloadpool.api.constants import GROUP, NODE_PLURAL, POOL_NAME_LABEL, POOL_PLURAL, VERSION
from offloadpool.operator.daemonset import daemonset_name, pod_node, selector_labels

pytestmark = pytest.mark.controlplane

COUNTS = [int(n) for n in os.environ.get("OFFLOADPOOL_SCALE_NODES", "200").split(",")]
STEADY_SECONDS = float(os.environ.get("OFFLOADPOOL_SCALE_STEADY_SECONDS", "30"))
#: A small pool first, converged and deleted but not reported (0: none): the operator's first
#: pool pays once for what its later ones do not (first calls of its code paths, connections),
#: 0.3–1.7 CPU-s here — as much as 200 nodes' whole convergence.
WARMUP_NODES = int(os.environ.get("OFFLOADPOOL_SCALE_WARMUP_NODES", "20"))
HEARTBEAT_SECONDS = 10.0
#: The GIL switch interval while a thousand agents share this process. Every thread waiting
#: for the GIL wakes once per interval to ask for it: with hundreds of agents woken by one pool
#: event, the default 5 ms made the process spend most of its time in futex wake-ups and
#: context switches (perf: 65 % kernel, a third in the scheduler), not in the agents' code.
#: Real agents are one process per node, with a handful of threads.
HARNESS_SWITCH_SECONDS = 0.1
#: Regions built or released at once in this process. A node builds its region on its own
#: CPU, in milliseconds for a small region; a thousand builds interleaved on two cores would
#: each take seconds to tens of seconds of wall time, so every agent would also write the
#: transient phases (Provisioning, Populating, progress) a real node is done with before they
#: are due: three more status writes per node, and the regions would all finish late together
#: instead of one after another. The work is the same; only how much of it runs at once is the
#: node's.
REGIONS_AT_ONCE = 4 * (os.cpu_count() or 2)
#: Each agent's region: the smallest real one the issue allows is a page; 64 KiB (16 pages)
#: keeps a populate of several pages. Zeroing 1,000 regions of 4 MiB would be a tenth of the
#: test process's CPU (perf), work that tells nothing about the operator.
REGION, REGION_BYTES = "64Ki", 64 << 10
#: where the simulated nodes' host roots are made (tmpfs; see _run_one)
SHARED_MEMORY = "/dev/shm"
WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "DELETE", "APPLY"})
_REQUESTS = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$", re.M)


def through_gate(work: Callable[..., Any], gate: threading.BoundedSemaphore) -> Callable[..., Any]:
    """``work`` (the agent's own provision or release) run by at most the gate's count of
    threads at once (``REGIONS_AT_ONCE``)."""

    def gated(*args: Any, **kwargs: Any) -> Any:
        with gate:
            return work(*args, **kwargs)

    return gated


def machine_cpu(op: OperatorProcess) -> dict[str, float]:
    """CPU-seconds used so far by each process on this machine that takes part: the control
    plane's components, the operator, and this test process (the agents and their watches)."""
    used = dict(op.cp.plane.cpu_seconds()) if op.cp.plane is not None else {}
    used["operator"] = op.cpu_seconds()
    used["agents (test process)"] = time.process_time()
    return used


def api_writes(cp: Any) -> tuple[Counter[str], int]:
    """Write requests the API server has answered so far, per resource, and how many requests
    of any verb it refused with 429 (its own /metrics; a refused write counts in both)."""
    text = cp.kubectl("get", "--raw", "/metrics").stdout
    out: Counter[str] = Counter()
    refused = 0
    for m in _REQUESTS.finditer(text):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
        if labels.get("code") == "429":
            refused += int(float(m["value"]))
        if labels.get("verb") in WRITE_VERBS:
            key = labels.get("resource", "?") + (
                f"/{labels['subresource']}" if labels.get("subresource") else ""
            )
            out[key] += int(float(m["value"]))
    return out, refused


# The operator allows a heartbeat 5 minutes: a thousand in-process agents share this machine's
# two cores with the API server, and under that load an agent's step can come later than the
# default 60 s would allow (a real node's agent has a machine of its own).
@pytest.mark.operator_args("--heartbeat-timeout", "300")
def test_pool_converges_at_scale(
    offloadpool_operator: OperatorProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    op = offloadpool_operator
    on_its_own_cpu = threading.BoundedSemaphore(REGIONS_AT_ONCE)
    for name in ("provision", "release"):
        monkeypatch.setattr(actions, name, through_gate(getattr(actions, name), on_its_own_cpu))
    if WARMUP_NODES:
        print(f"\nSCALE WARMUP {json.dumps(run_one(op, WARMUP_NODES, warmup=True))}")
    reports: list[dict[str, Any]] = []
    for n in COUNTS:
        reports.append(run_one(op, n))
        if os.environ.get("OFFLOADPOOL_SCALE_REPORT"):  # after each count: a later one may not finish
            Path(os.environ["OFFLOADPOOL_SCALE_REPORT"]).write_text(json.dumps(reports, indent=2) + "\n")


def run_one(op: OperatorProcess, nodes: int, *, warmup: bool = False) -> dict[str, Any]:
    switch = sys.getswitchinterval()
    sys.setswitchinterval(HARNESS_SWITCH_SECONDS)
    try:
        return _run_one(op, nodes, warmup)
    finally:
        sys.setswitchinterval(switch)


def _run_one(op: OperatorProcess, nodes: int, warmup: bool) -> dict[str, Any]:
    cp = op.cp
    tag = uuid.uuid4().hex[:6]
    label = {f"scale.offloadpool.io/{tag}": "true"}
    # The simulated nodes' host roots on tmpfs: a node writes its pool records to its own disk,
    # here a thousand nodes' records would share one file system, whose inode allocator (ext4)
    # steps over the inodes freed in the last seconds — and every record rewrite (temp file,
    # rename) frees one: 3.3 % of the agents' CPU at 1,000 nodes and growing with the count.
    work = Path(tempfile.mkdtemp(prefix="offloadpool-scale-", dir=SHARED_MEMORY))
    admin = cp.api_client()
    cluster = ClusterClient(admin, tag, node_selector=label)
    core, custom = cluster.core, cluster.custom
    names = [f"scale-{tag}-{i:04d}" for i in range(nodes)]
    pool = cluster.name("scale")

    agent_apis: list[client.ApiClient] = []
    tokens: list[node_tokens.NodeToken] = []
    agents: list[Agent] = []
    stop_watch = threading.Event()
    try:
        for name in names:
            core.create_node(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **label}},
                }
            )
        # each agent's token names its node, as a kubelet's does (deploy/policy-agent.yaml
        # refuses an agent's write of any other node's objects): made before the count starts
        with ThreadPoolExecutor(8) as pool_of_requests:
            tokens += pool_of_requests.map(
                lambda n: node_tokens.node_token(cp, core, op.namespace, "offloadpool-agent", n), names
            )
        for name, token in zip(names, tokens, strict=True):
            # the agent's own client configuration (throttled requests sent again, as a real
            # agent's); one client per agent, as on a real node: a thousand agent threads
            # sharing one client's connection pool queue on its lock (and a pool smaller than
            # the threads discards connections, so requests beyond it pay a new TLS handshake)
            # — the harness's cost, not an agent's.
            agent_cfg = kube.configuration(
                str(cp.kubeconfig_for_token(token.token, work / f"{name}.kubeconfig"))
            )
            agent_cfg.connection_pool_maxsize = 2
            agent_apis.append(client.ApiClient(agent_cfg))
            access = kube.KubeAccess(agent_apis[-1], pool, f"{pool}.{name}", op.namespace)
            agents.append(
                Agent(
                    access,
                    work / name,
                    metrics=AgentMetrics(pool, name, CollectorRegistry()),
                    heartbeat_seconds=HEARTBEAT_SECONDS,
                    retry_seconds=HEARTBEAT_SECONDS,
                    watches=False,  # wake_agents below is their watches
                    reread_seconds=REREAD_PERIODS * HEARTBEAT_SECONDS,
                )
            )
        threading.Thread(
            target=wake_agents,
            args=(custom, pool, {a.access.node_object: a for a in agents}, stop_watch),
            daemon=True,
        ).start()
        started: dict[str, float] = {}
        threading.Thread(
            target=start_agents_with_pods,
            args=(core, op.namespace, pool, dict(zip(names, agents, strict=True)), started, stop_watch),
            daemon=True,
        ).start()
        # A thousand agents share this process's heap; on nodes each has its own, a thousandth
        # the size. Frozen (until this count ends), the objects made so far — the agents, their
        # clients — are not walked by every full collection (1.1 s of collections at 1,000
        # nodes, most of them walking those).
        gc.freeze()
        op.reset_peak_rss()  # the peak of this count, not of an earlier (larger) one
        rss_before = op.rss_bytes()
        machine0, (writes_start, refused_start) = machine_cpu(op), api_writes(cp)
        t0 = time.monotonic()
        cluster.create_pool("scale", {"capacity": REGION, "medium": "Memory"})

        def converged() -> dict[str, Any] | None:
            st = cluster.pool_status(pool)
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])
            return st if ready and st.get("readyNodes") == nodes == st.get("desiredNodes") else None

        agents_ready: list[float] = []

        def all_converged() -> dict[str, Any] | None:
            if not agents_ready and all(a.status.phase == "Ready" and a.status.exists for a in agents):
                agents_ready.append(time.monotonic())
            return converged() if agents_ready else None

        st = wait_for(f"pool Ready {nodes}/{nodes}", all_converged, timeout=900, interval=0.25)
        seconds = time.monotonic() - t0
        machine = {k: v - machine0.get(k, 0.0) for k, v in machine_cpu(op).items()}
        cpu = machine["operator"]
        converge_writes, refused = api_writes(cp)
        converge_writes -= writes_start
        refused -= refused_start
        assert st["totalBytes"] == nodes * REGION_BYTES

        # steady state: heartbeats only (a Lease renewal per agent every 10 s), once the
        # DaemonSet's status counts every pod (its controller's last writes are the rollout's)
        agent_pods_made(cluster, op.namespace, pool, nodes)
        time.sleep(2 * op_debounce())  # let the last passes of the convergence finish
        (writes0, _), cpu1, t1 = api_writes(cp), op.live_threads_cpu_seconds(), time.monotonic()
        time.sleep(0 if warmup else STEADY_SECONDS)
        elapsed = max(time.monotonic() - t1, 1e-3)
        steady_cpu = op.live_threads_cpu_seconds() - cpu1
        writes = api_writes(cp)[0] - writes0
        # the agents made their OffloadPoolNodes; the operator makes one only for a node whose
        # agent has not within its grace (one NodeSelected Event per pass, counting them)
        made_by_operator = sum(
            int(e.message.split()[0]) for e in cluster.events(pool) if e.reason == "NodeSelected"
        )
        report = {
            "nodes": nodes,
            "seconds_to_converge": round(seconds, 1),
            # from the last agent's Ready status write to the pool's Ready: the operator's share
            "operator_seconds_after_last_agent": round(seconds - (agents_ready[0] - t0), 2),
            # from the pool's creation to the DaemonSet controller's last agent pod (its agent
            # starts then): on a cluster no agent runs before its pod
            "seconds_to_last_agent_pod": round(max(started.values()) - t0, 1),
            "operator_cpu_ms_per_node_to_converge": round(1000 * cpu / nodes, 2),
            "operator_cpu_seconds_to_converge": round(cpu, 2),
            # every client's writes from the pool's creation to its Ready N/N, per node
            "api_writes_per_node_to_converge": round(sum(converge_writes.values()) / nodes, 2),
            "api_writes_per_node_to_converge_by_resource": {
                k: round(v / nodes, 2) for k, v in converge_writes.most_common()
            },
            # requests of any verb refused with 429 (API priority and fairness) and sent again
            "api_requests_refused_per_node_to_converge": round(refused / nodes, 2),
            # where this machine's CPU went from the pool's creation to its Ready N/N: the
            # agents of a thousand nodes and the API server share its few cores
            "cpu_ms_per_node_to_converge_by_process": {
                k: round(1000 * v / nodes, 1) for k, v in sorted(machine.items(), key=lambda kv: -kv[1])
            },
            "machine_cpu_busy_percent_to_converge": round(
                100 * sum(machine.values()) / (seconds * (os.cpu_count() or 1)), 1
            ),
            "operator_cpu_percent_steady": round(100 * steady_cpu / elapsed, 3),
            "api_writes_per_second_steady": round(sum(writes.values()) / elapsed, 1),
            "api_writes_per_second_steady_by_resource": {
                k: round(v / elapsed, 2) for k, v in writes.most_common()
            },
            "operator_peak_rss_mib": round(op.peak_rss_bytes() / (1 << 20), 1),
            # before the pool: what the operator kept from the counts before (a leak shows here)
            "operator_rss_mib_before": round(rss_before / (1 << 20), 1),
            "offloadpoolnodes_created_by_operator": made_by_operator,
        }
        print(f"\nSCALE REPORT {json.dumps(report)}")
        # liveness costs no OffloadPoolNode write: a steady pool's statuses stay unwritten
        assert writes.get("offloadpoolnodes/status", 0) == 0, writes
        assert warmup or writes.get("leases", 0) > 0, writes
        if seconds < node_object_grace():  # every agent was Ready (so had made its object) in time
            assert made_by_operator == 0, report

        # the slices' change: the pool deleted, every node's agent deletes its slice as it drains
        report.update(slices_gone_with_the_pool(op, custom, pool, names))
        print(f"\nSCALE SLICES {json.dumps({k: v for k, v in report.items() if 'slice' in k})}")
        wait_for(
            "pool deleted after every node released", lambda: cluster.pool(pool) is None, 900, interval=1
        )
        assert not mounts_under(work), "released pools left mounts"
        # the garbage collector removes the pool's agent pods at its own rate: the next count
        # starts on a quiet API server, not during the last one's clean-up
        agent_pods_gone(cluster, op.namespace, pool)
        return report
    finally:
        gc.unfreeze()  # this count's agents may be collected again once they are gone
        # The host first, then the API: a failed or slow API call here (a busy server after a
        # timeout) must not leave a thousand mounts on the machine.
        stop_watch.set()
        for a in agents:
            a.stop.set()
            a.wake.set()
        joined_by = time.monotonic() + 60  # one deadline for all, not 30 s per agent
        for a in agents:
            if a.thread is not None:
                a.thread.join(timeout=max(0.0, joined_by - time.monotonic()))
        release_everything(work)
        left = mounts_under(work)
        shutil.rmtree(work, ignore_errors=True)
        try:
            cluster.delete_pools()  # a pool the test did not see deleted: finalizer stripped
            node_tokens.end(core, tokens)
            for name in names:
                try:
                    core.delete_node(name)
                except client.rest.ApiException:
                    pass
        finally:
            for agent_api in agent_apis:
                agent_api.close()
            admin.close()
        assert not left, f"mounts left: {left}"


def api_requests_of(cp: Any, resource: str) -> Counter[str]:
    """Requests of every verb the API server has answered so far for ``resource``, by verb
    (its own /metrics, every response code)."""
    text = cp.kubectl("get", "--raw", "/metrics").stdout
    out: Counter[str] = Counter()
    for m in _REQUESTS.finditer(text):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
        if labels.get("resource") == resource and not labels.get("subresource"):
            out[labels.get("verb", "?")] += int(float(m["value"]))
    return out


def devices_of(obj: dict[str, Any]) -> list[str]:
    """The device names a ResourceSlice lists."""
    return sorted(d.get("name", "") for d in (obj.get("spec") or {}).get("devices") or [])


def slices_gone_with_the_pool(
    op: OperatorProcess, custom: client.CustomObjectsApi, pool: str, nodes: list[str]
) -> dict[str, Any]:
    """Delete the pool and measure until every node's ResourceSlice is gone: each agent deletes
    its own as its pool stops being Ready here (draining), the garbage collector any left with
    the node's OffloadPoolNode. Seconds from the deletion; the slice requests per node by verb
    and every client's writes per node by resource; the CPU per node of each process (the
    operator's is its share of the deletion: its Node marks taken off). A watch of the pool's
    slices (from a list's resourceVersion, as a scheduler's informer reads them) says when each
    went. Asserts every node had its slice, with the pool's device, and that none is left.

    Why the deletion and not a share taken on every node (a slice rewritten): agents see a
    reservation only at their next heartbeat step, and at 1,000 nodes this harness's agents no
    longer keep to their heartbeats (their mounted-view scan reads one mount table that all the
    simulated nodes share; docs/scale.md), so that change did not reach every slice in 300 s;
    the pool's deletion wakes every agent through its pool watch. A share's change is one write
    per node too (tests/test_agent_slice_writes.py)."""
    cp, count = op.cp, len(nodes)
    slice_names = {dra.slice_name(pool, node) for node in nodes}
    args = (dra.RESOURCE_GROUP, dra.RESOURCE_VERSION, dra.SLICE_PLURAL)
    selector = f"{POOL_NAME_LABEL}={pool}"
    listed = custom.list_cluster_custom_object(*args, label_selector=selector)
    before = {o["metadata"]["name"]: devices_of(o) for o in listed["items"]}
    assert before == {name: [dra.POOL_DEVICE] for name in slice_names}, before
    gone: dict[str, float] = {}
    all_gone = threading.Event()

    def watch_slices() -> None:
        """Watch from the list, again from the last event's resourceVersion when the API
        server ends a watch, until every slice went or 600 s passed."""
        version, deadline = listed["metadata"]["resourceVersion"], time.monotonic() + 600
        try:
            while len(gone) < count and time.monotonic() < deadline:
                w = watch.Watch()
                try:
                    for event in w.stream(
                        custom.list_cluster_custom_object,
                        *args,
                        label_selector=selector,
                        resource_version=version,
                        timeout_seconds=60,
                    ):
                        meta = event["object"].get("metadata", {})
                        version = meta.get("resourceVersion", version)
                        name = meta.get("name", "")
                        if event["type"] == "DELETED" and name in slice_names and name not in gone:
                            gone[name] = time.monotonic()
                            if len(gone) == count:
                                break
                finally:
                    w.stop()
        finally:
            all_gone.set()

    watcher = threading.Thread(target=watch_slices, daemon=True)
    watcher.start()
    # the API server's /metrics scrapes outside the CPU measured (one costs it tens of CPU-ms)
    (writes0, _), slice0 = api_writes(cp), api_requests_of(cp, dra.SLICE_PLURAL)
    machine0, t0 = machine_cpu(op), time.monotonic()
    custom.delete_cluster_custom_object(GROUP, VERSION, POOL_PLURAL, pool)
    wait_for("every node's slice deleted", all_gone.is_set, timeout=600, interval=0.1)
    assert len(gone) == count, f"{count - len(gone)} slices not seen deleted"
    seconds = max(gone.values()) - t0
    machine = {k: v - machine0.get(k, 0.0) for k, v in machine_cpu(op).items()}
    writes, slice_requests = api_writes(cp)[0] - writes0, api_requests_of(cp, dra.SLICE_PLURAL) - slice0
    assert not custom.list_cluster_custom_object(*args, label_selector=selector)["items"]
    slice_writes = sum(v for verb, v in slice_requests.items() if verb in WRITE_VERBS)
    return {
        "seconds_to_slices_gone": round(seconds, 1),
        "slice_writes_per_node_gone": round(slice_writes / count, 2),
        "slice_requests_per_node_gone": round(sum(slice_requests.values()) / count, 2),
        "slice_requests_per_node_gone_by_verb": {
            k: round(v / count, 2) for k, v in slice_requests.most_common()
        },
        # every client's writes from the deletion until the last slice went
        "api_writes_per_node_slices_gone_by_resource": {
            k: round(v / count, 2) for k, v in writes.most_common()
        },
        "operator_cpu_ms_per_node_slices_gone": round(1000 * machine["operator"] / count, 3),
        "apiserver_cpu_ms_per_node_slices_gone": round(1000 * machine.get("kube-apiserver", 0.0) / count, 2),
        "cpu_ms_per_node_slices_gone_by_process": {
            k: round(1000 * v / count, 2) for k, v in sorted(machine.items(), key=lambda kv: -kv[1])
        },
    }


def wake_agents(
    custom: client.CustomObjectsApi, pool: str, agents: dict[str, Agent], stop: threading.Event
) -> None:
    """The agents' watches: one over the pool's OffloadPoolNodes that hands each event to the
    agent whose object it is, one over the pool that hands its events to every agent."""
    threading.Thread(
        target=deliver,
        args=(custom, POOL_PLURAL, {"field_selector": f"metadata.name={pool}"}, agents, stop),
        daemon=True,
    ).start()
    deliver(custom, NODE_PLURAL, {"label_selector": f"{POOL_NAME_LABEL}={pool}"}, agents, stop)


def deliver(
    custom: client.CustomObjectsApi,
    plural: str,
    selector: dict[str, str],
    agents: dict[str, Agent],
    stop: threading.Event,
) -> None:
    while not stop.is_set():
        w = watch.Watch()
        try:
            for event in w.stream(
                custom.list_cluster_custom_object, GROUP, VERSION, plural, timeout_seconds=30, **selector
            ):
                obj, deleted = event["object"], event["type"] == "DELETED"
                if plural == POOL_PLURAL:
                    for agent in agents.values():
                        agent.notice(obj, deleted=deleted)
                elif (agent := agents.get(obj["metadata"]["name"])) is not None:
                    agent.notice(obj, deleted=deleted)
                if stop.is_set():
                    break
        except Exception:  # the API server is busy or restarting: watch again
            stop.wait(0.5)
        finally:
            w.stop()


def start_agents_with_pods(
    core: client.CoreV1Api,
    namespace: str,
    pool: str,
    agents: dict[str, Agent],
    started: dict[str, float],
    stop: threading.Event,
) -> None:
    """Start each node's agent when the DaemonSet controller makes its pod, as a kubelet would
    (the pods stay unscheduled here: there are no kubelets), and note when (``started``)."""
    selector = agent_pod_selector(pool)
    while not stop.is_set():
        try:  # a watch without a resourceVersion lists first: a watch again misses no pod
            resp = core.list_namespaced_pod(
                namespace, label_selector=selector, watch=True, timeout_seconds=30, _preload_content=False
            )
            try:
                for line in iter_resp_lines(resp):
                    node = pod_node(json.loads(line).get("object") or {}) if line else None
                    if stop.is_set():
                        break
                    if node in agents and node not in started:
                        started[node] = time.monotonic()
                        agents[node].start()
            finally:
                resp.close()
                resp.release_conn()
        except Exception:  # the API server is busy or restarting: watch again
            stop.wait(0.5)


def agent_pods_made(cluster: ClusterClient, namespace: str, pool: str, nodes: int) -> None:
    """Wait until the pool's DaemonSet has a pod for every node (its status says so)."""

    def made() -> bool:
        ds = cluster.apps.read_namespaced_daemon_set_status(daemonset_name(pool), namespace).status
        return ds.desired_number_scheduled == nodes == ds.current_number_scheduled

    wait_for(f"an agent pod for each of the {nodes} nodes", made, timeout=600, interval=1)


def agent_pods_gone(cluster: ClusterClient, namespace: str, pool: str) -> None:
    """Wait until the garbage collector has removed the deleted pool's agent pods."""
    selector = agent_pod_selector(pool)

    def gone() -> bool:
        return not cluster.core.list_namespaced_pod(namespace, label_selector=selector, limit=1).items

    wait_for("the deleted pool's agent pods removed", gone, timeout=600, interval=1)


def agent_pod_selector(pool: str) -> str:
    """The label selector of the pool's agent pods, as the API takes it."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(pool).items())


def op_debounce() -> float:
    from offloadpool.operator.config import OperatorConfig

    return OperatorConfig().debounce_seconds


def node_object_grace() -> float:
    """The operator's default ``--node-object-grace`` (this test's operator runs with it)."""
    from offloadpool.operator.config import OperatorConfig

    return OperatorConfig().node_object_grace_seconds
