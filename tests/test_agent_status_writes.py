"""How many status writes an agent makes while its pool converges.

Every OffloadPoolNode status write is a watch event the operator must process; at 1,000 nodes
an agent's Provisioning, Populating, first progress and Ready — 3-4 writes within a second —
would be the operator's main input. The agent writes the transient phases only when they
outlast its progress interval (``StatusWriter.progress_interval``, 0.5 s): a small pool costs one
write, a long populate still shows Populating with its progress.

The agent is a real process against the real API server, without the operator (the test plays
its part, as in test_agent_process.py), and the writes are counted by watching the
OffloadPoolNode from its creation: with no operator, every change of the object is the
agent's status write, and the watch from the creation's resourceVersion replays each one.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from kubernetes import watch

from fixtures.cluster import mounts_under
from fixtures.wait import wait_for
from offloadpool.agent.status_writer import PROGRESS_INTERVAL
from test_agent_process import GROUP, VERSION, create, env, node_object_body, start_agent  # noqa: F401  (env: the fixture)

pytestmark = pytest.mark.controlplane

MiB = 1 << 20
NAMESPACE = "offloadpool-system"
#: The agents' ClusterRole (deploy/rbac-agent.yaml).
AGENT_ROLE = "offloadpool-agent"
RBAC_GROUP = "rbac.authorization.k8s.io"


def statuses_until_ready(
    state: dict[str, Any], name: str, since: str, timeout: float = 90
) -> list[dict[str, Any]]:
    """Each status the object had after resourceVersion ``since``, in order, up to Ready."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    rv = since
    while time.monotonic() < deadline:
        w = watch.Watch()
        for ev in w.stream(
            state["custom"].list_cluster_custom_object,
            GROUP,
            VERSION,
            "offloadpoolnodes",
            field_selector=f"metadata.name={name}",
            resource_version=rv,
            timeout_seconds=max(1, int(deadline - time.monotonic())),
        ):
            obj = ev["object"]
            assert ev["type"] == "MODIFIED", (ev["type"], seen)
            rv = obj["metadata"]["resourceVersion"]
            seen.append(obj.get("status") or {})
            if seen[-1].get("phase") == "Ready":
                w.stop()
                return seen
    raise AssertionError(f"no Ready within {timeout} s; statuses seen: {seen}")


def created(state: dict[str, Any], pool: str, node: str, spec: dict[str, Any]) -> str:
    """Create the pool and its OffloadPoolNode; the node object's resourceVersion at creation."""
    create(state, pool, node, spec)
    obj = state["custom"].get_cluster_custom_object(GROUP, VERSION, "offloadpoolnodes", f"{pool}.{node}")
    return str(obj["metadata"]["resourceVersion"])  # nothing writes it before the agent starts


def test_a_small_pool_is_ready_in_one_status_write(env: dict[str, Any]) -> None:  # noqa: F811
    pool, node = "writes-small", "node-w"
    name = f"{pool}.{node}"
    since = created(env, pool, node, {"capacity": "4Mi", "medium": "Memory"})
    start_agent(env, pool, node)

    seen = statuses_until_ready(env, name, since)
    # A 4 MiB region is mounted and populated in milliseconds, well within the progress
    # interval: the Ready write carries everything, Populating (the phase, its progress) is
    # never written. Exactly one write is what the agent does on an idle machine; two are
    # allowed because on these 2 shared cores an agent descheduled between Provisioning and
    # Ready for longer than the interval rightly writes Provisioning first. A writer that wrote
    # every phase at once would make 3-4 writes, Populating always among them.
    phases = [s.get("phase") for s in seen]
    assert "Populating" not in phases, seen
    assert len(seen) <= 2 and phases[-1] == "Ready", phases
    ready = seen[-1]
    assert ready["progress"] == 100 and ready["bytesPopulated"] == ready["bytesTotal"] == 4 * MiB, ready
    assert ready["reason"] == "Populated" and ready["observedGeneration"] == 1, ready

    # the deferred write (due one interval after Provisioning) then finds nothing changed:
    # no write after Ready, through the deferral and a heartbeat (1 s here)
    get = env["custom"].get_cluster_custom_object
    written = get(GROUP, VERSION, "offloadpoolnodes", name)["metadata"]["resourceVersion"]
    time.sleep(max(2.0, 3 * PROGRESS_INTERVAL))
    after = get(GROUP, VERSION, "offloadpoolnodes", name)
    assert after["metadata"]["resourceVersion"] == written, after.get("status")


def test_a_populate_longer_than_the_interval_shows_populating(
    env: dict[str, Any],  # noqa: F811
) -> None:
    """The populate is made to outlast the interval on any machine: the agent is frozen
    (SIGSTOP) a quarter of the way in for several intervals, then let go. Its deferred write is
    overdue then, so it shows Populating with the progress reached while the rest populates."""
    pool, node = "writes-slow", "node-w"
    name = f"{pool}.{node}"
    capacity = 1024 * MiB
    since = created(env, pool, node, {"capacity": "1Gi", "medium": "Memory", "prefault": {"workers": 1}})
    mnt = env["root"] / pool / "mnt"

    def populated() -> int:
        if not mounts_under(mnt) or (mnt.parent / "manifest.json").exists():
            return 0
        st = os.statvfs(mnt)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    agent = start_agent(env, pool, node)
    wait_for("populate a quarter done", lambda: populated() >= capacity // 4, 90, interval=0.005)
    os.killpg(agent.proc.pid, signal.SIGSTOP)
    try:
        used = populated()
        assert 0 < used < capacity, f"populate was not caught mid-way ({used} of {capacity} bytes)"
        time.sleep(4 * PROGRESS_INTERVAL)
    finally:
        os.killpg(agent.proc.pid, signal.SIGCONT)

    seen = statuses_until_ready(env, name, since)
    populating = [s for s in seen if s.get("phase") == "Populating"]
    assert any(0 < s.get("progress", 0) < 100 for s in populating), seen
    assert all(s["bytesTotal"] == capacity for s in populating), populating
    progress = [s.get("progress", 0) for s in seen]
    assert progress == sorted(progress) and progress[-1] == 100, progress
    assert seen[-1]["reason"] == "Populated", seen[-1]


def test_a_refused_write_is_retried_without_waiting_for_a_heartbeat(
    crds_installed: Any, operator_rbac: Any, tmp_path: Any
) -> None:
    """A status write the API server refuses (here 403: the agent's ServiceAccount is not bound
    yet; at scale, 429 from a busy server) is tried again by the writer itself, after
    RETRY_FIRST_SECONDS and doubling — not only with the next write or heartbeat, which for a
    Ready that was refused could be a heartbeat period later. Real RBAC, real API server; no
    heartbeat or other write happens in this test, so only the retry can land the status."""
    import uuid

    from kubernetes import client, config

    from offloadpool.agent.kube import KubeAccess
    from offloadpool.agent.status_writer import RETRY_FIRST_SECONDS, StatusWriter
    from offloadpool.api.base import format_time, now

    cp = crds_installed  # deploy/ applied by operator_rbac: the namespace and the agent's ClusterRole
    tag = uuid.uuid4().hex[:6]
    sa, pool, node = f"retry-{tag}", f"retry-{tag}", f"n-{tag}"
    admin = cp.api_client()
    core, rbac = client.CoreV1Api(admin), client.RbacAuthorizationV1Api(admin)
    custom = client.CustomObjectsApi(admin)
    core.create_namespaced_service_account(NAMESPACE, {"metadata": {"name": sa}})
    custom.create_cluster_custom_object(
        GROUP, VERSION, "offloadpoolnodes", node_object_body(pool, node, targetGeneration=1)
    )
    agent_api = config.new_client_from_config(
        config_file=str(cp.kubeconfig_for_token(cp.token_for(NAMESPACE, sa), tmp_path / "sa.kubeconfig"))
    )
    try:
        access = KubeAccess(agent_api, pool, f"{pool}.{node}", NAMESPACE)
        writer = StatusWriter(access.patch_status, lambda: format_time(now()))
        assert writer.set(phase="Ready", observed_generation=1) is False  # 403: not bound yet
        rbac.create_cluster_role_binding(
            {
                "metadata": {"name": sa},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": AGENT_ROLE,
                },
                "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}],
            }
        )
        t0 = time.monotonic()

        def phase() -> str | None:
            obj = custom.get_cluster_custom_object(GROUP, VERSION, "offloadpoolnodes", f"{pool}.{node}")
            return (obj.get("status") or {}).get("phase")

        wait_for("the refused Ready, written by its own retry", lambda: phase() == "Ready", 60, interval=0.2)
        # retries back off (1, 2, 4, 8, 10 s): the binding took effect within that schedule
        print(f"landed {time.monotonic() - t0:.1f} s after the binding (first retry {RETRY_FIRST_SECONDS} s)")
        assert writer.exists and writer.current.phase == "Ready"
    finally:
        agent_api.close()
        for delete in (
            lambda: rbac.delete_cluster_role_binding(sa),
            lambda: core.delete_namespaced_service_account(sa, NAMESPACE),
            lambda: custom.delete_cluster_custom_object(GROUP, VERSION, "offloadpoolnodes", f"{pool}.{node}"),
        ):
            try:
                delete()
            except client.ApiException:
                pass
        admin.close()
