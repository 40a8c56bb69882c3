"""End to end: the operator and the agents as real processes on simulated nodes.

Real control plane (etcd, kube-apiserver, kube-controller-manager: the DaemonSet controller
creates the agent pods, the garbage collector removes owned objects), the operator process under
its own RBAC, one agent process per node started by the simulated kubelet from the pod the
DaemonSet controller created (command, args, env, hostPath mounted onto that node's own root,
the agent ServiceAccount's token). Memory is real: hugetlbfs/tmpfs mounts on the node roots.

Each test uses its own node and pool names, so tests sharing the session's control plane never
see each other's objects.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.cluster import SimCluster, SimNode, mounts_under
from fixtures.cluster_client import ClusterClient
from fixtures.host import other_tenant_holds_free_hugepages
from fixtures.operator_process import OperatorProcess
from fixtures.wait import wait_for
from offloadpool.agent.status_writer import PROGRESS_INTERVAL
from offloadpool.api.agent_env import HEARTBEAT_ENV, NODE_NAME_ENV

pytestmark = pytest.mark.e2e

GROUP, VERSION = "offloadpool.io", "v1alpha1"
MiB = 1 << 20
HOST_ROOT = "/var/lib/offloadpool"


class E2E(ClusterClient):
    """What a test drives: the cluster, the operator, and short-hands for reading state."""

    def __init__(self, cluster: SimCluster, operator: OperatorProcess) -> None:
        tag = uuid.uuid4().hex[:6]
        # every node of this test carries the run label and every pool selects it, so no pool
        # sees another test's nodes
        super().__init__(cluster.api, tag, node_selector={"e2e.offloadpool.io/run": tag})
        self.cluster = cluster
        self.operator = operator
        self.cp = cluster.cp
        self.tag = tag
        self.engines: list[subprocess.Popen[str]] = []

    # -- objects -----------------------------------------------------------------------------
    @property
    def run_label(self) -> dict[str, str]:
        """Every node of this test carries it; pools select it, so no pool sees another test's nodes."""
        return dict(self.node_selector)

    def daemonsets(self, pool: str) -> list[Any]:
        return [
            d
            for d in self.apps.list_daemon_set_for_all_namespaces().items
            if d.metadata.name.endswith(pool) or (d.metadata.labels or {}).get("offloadpool.io/pool") == pool
        ]

    def wait_pool_ready(self, pool: str, nodes: int, timeout: float = 180) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            st = self.pool_status(pool)
            ok = (
                st.get("readyNodes") == nodes
                and st.get("desiredNodes") == nodes
                and self.condition(pool, "Ready").get("status") == "True"
            )
            return st if ok else None

        try:
            return wait_for(f"pool {pool} Ready {nodes}/{nodes}", ready, timeout)
        except AssertionError:
            raise AssertionError(self.diagnose(pool)) from None

    def wait_node_phase(
        self, pool: str, node: str, phase: str, timeout: float = 120, **fields: Any
    ) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            st = self.node_status(pool, node)
            if st.get("phase") == phase and all(st.get(k) == v for k, v in fields.items()):
                return st
            return None

        try:
            return wait_for(f"{pool}.{node} {phase} {fields}", check, timeout)
        except AssertionError:
            raise AssertionError(self.diagnose(pool)) from None

    def diagnose(self, pool: str) -> str:
        """Everything one needs when a wait fails: statuses, pods, agent and operator logs."""
        out = [f"pool {pool} status: {json.dumps(self.pool_status(pool), indent=1)}"]
        for node, obj in self.pool_nodes(pool).items():
            out.append(f"node {node}: spec {obj.get('spec')} status {json.dumps(obj.get('status'))}")
        for a in list(self.cluster.agents.values()):
            state = f"alive {a.alive()}, restarts {a.restarts}"
            out.append(f"--- agent {a.pod} on {a.node.name} ({state}):\n{a.log(2500)}")
        out.append(f"kubelet errors: {self.cluster.errors[-5:]}")
        out.append(f"--- operator log:\n{self.operator.log(5000)}")
        return "\n".join(out)

    # -- nodes and memory --------------------------------------------------------------------
    def add_nodes(self, count: int, labels: dict[str, str] | None = None, **kw: Any) -> list[SimNode]:
        start = len(self.cluster.nodes)
        labels = {**self.run_label, **(labels or {})}
        return [self.cluster.add_node(f"n{start + i}-{self.tag}", labels, **kw) for i in range(count)]

    def pool_dir(self, node: SimNode, pool: str) -> Path:
        return node.host_path(HOST_ROOT) / pool

    def hold_lease(self, node: SimNode, pool: str) -> subprocess.Popen[str]:
        """An engine on ``node``: a separate process that attaches the pool with the pinning
        helper (maps it, holds the shared lease), writes into it and pins it with mlock, until
        it exits."""
        code = (
            "import sys; from offloadpool.pinning import attach; "
            f"r = attach({str(self.pool_dir(node, pool))!r}, rank=0); "
            "r.memoryview()[:6] = b'engine'; r.pin(backend='mlock'); "
            "print('held', flush=True); sys.stdin.read()"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.engines.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held", (
            "the engine could not attach"
        )
        return proc

    def add_pool_node_label(self, node: SimNode, labels: dict[str, str]) -> None:
        """Label a node into a pool's selector (so its agent starts now, not at creation)."""
        self.cluster.label_node(node.name, labels)

    # -- cleanup -----------------------------------------------------------------------------
    def cleanup(self) -> None:
        for e in self.engines:
            if e.poll() is None:
                e.kill()
                e.wait(10)
        self.delete_pools(wait=60)


@pytest.fixture
def e2e(sim_cluster: SimCluster, offloadpool_operator: OperatorProcess) -> Iterator[E2E]:
    env = E2E(sim_cluster, offloadpool_operator)
    try:
        yield env
    finally:
        env.cleanup()


def hugetlb_mount(path: Path) -> bool:
    return any(
        line.split()[4] == str(path) and " hugetlbfs " in line for line in open("/proc/self/mountinfo")
    )


# ---------------------------------------------------------------------------------------------
#: the operator's --agent-heartbeat in test_pool_on_three_of_four_nodes (not the default)
AGENT_HEARTBEAT = 4


@pytest.mark.operator_args("--agent-heartbeat", str(AGENT_HEARTBEAT))
def test_pool_on_three_of_four_nodes(e2e: E2E) -> None:
    label = {f"e2e.offloadpool.io/gpu-{e2e.tag}": "true"}
    gpu = e2e.add_nodes(3, label)
    other = e2e.add_nodes(1)[0]
    pool = e2e.create_pool(
        "three",
        {
            "capacity": "64Mi",
            "medium": "HugePages-2Mi",
            "nodeSelector": label,
            "segments": {"minSize": "16Mi"},
        },
    )
    st = e2e.wait_pool_ready(pool, 3)
    assert st["totalBytes"] == 3 * 64 * MiB and st.get("failedNodes", 0) == 0

    nodes = e2e.pool_nodes(pool)
    assert sorted(nodes) == sorted(n.name for n in gpu), (
        "one OffloadPoolNode per selected node, none for the 4th"
    )
    for n in gpu:
        s = nodes[n.name]["status"]
        assert (s["phase"], s["bytesTotal"], s["hugePageCoverage"]) == ("Ready", 64 * MiB, 100.0)
        pool_dir = e2e.pool_dir(n, pool)
        assert hugetlb_mount(pool_dir / "mnt"), f"no hugetlbfs mount on {n.name}'s host root"
        manifest = json.loads((pool_dir / "manifest.json").read_text())
        assert (manifest["pool"], manifest["total_bytes"], manifest["medium"]) == (
            pool,
            64 * MiB,
            "HugePages-2Mi",
        )
        agent = e2e.cluster.agent(n.name)
        assert agent.argv[1:] == ["--pool", pool] and agent.env[NODE_NAME_ENV] == n.name
        assert agent.get("/readyz")[0] == 200
        # the operator's --agent-heartbeat reached the agent through its pod, and the agent
        # renews its Lease on it: the Lease says four heartbeats (16 s; 40 s by default)
        assert agent.env[HEARTBEAT_ENV] == str(AGENT_HEARTBEAT)
        lease = wait_for(
            f"{n.name}'s heartbeat Lease",
            lambda n=n: e2e.lease(e2e.operator.namespace, f"{pool}.{n.name}"),
            60,
        )
        assert lease["spec"]["leaseDurationSeconds"] == 4 * AGENT_HEARTBEAT, lease
    assert not e2e.pool_dir(other, pool).exists() and not e2e.cluster.agents_on(other.name)
    # the pods' readiness probes (/readyz on the agents' port) make the DaemonSet tell the same story
    wait_for(
        "DaemonSet 3/3 ready",
        lambda: (
            (ds := e2e.daemonsets(pool))
            and ds[0].status.desired_number_scheduled == 3
            and ds[0].status.number_ready == 3
        ),
        60,
    )

    def labelled() -> bool:
        for n in gpu:
            node = e2e.core.read_node(n.name)
            if (node.metadata.labels or {}).get(f"pool.offloadpool.io/{pool}") != "ready":
                return False
            if (node.status.capacity or {}).get(f"offloadpool.io/{pool}") != "1":
                return False
        return True

    wait_for("ready nodes labelled and advertising the resource", labelled, 60)
    node4 = e2e.core.read_node(other.name)
    assert f"pool.offloadpool.io/{pool}" not in (node4.metadata.labels or {})
    assert f"offloadpool.io/{pool}" not in (node4.status.capacity or {})

    def events_by_kind() -> dict[str, set[str]]:
        items = json.loads(e2e.cp.kubectl("get", "events", "-A", "-o", "json").stdout)["items"]
        out: dict[str, set[str]] = {}
        for e in items:
            if e["involvedObject"].get("name", "").startswith(pool):
                out.setdefault(e["involvedObject"]["kind"], set()).add(e["reason"])
        return out

    # Events are posted after the writes they report: wait for the one asserted on, not for
    # the first of its kind.
    events = wait_for(
        "events from the operator (pool) and the agents' Ready (OffloadPoolNodes)",
        lambda: (
            (ev := events_by_kind()).get("OffloadPool") and "Ready" in ev.get("OffloadPoolNode", ()) and ev
        ),
        30,
    )
    assert "Ready" in events["OffloadPoolNode"], events

    table = e2e.cp.kubectl("get", "offloadpools,offloadpoolnodes").stdout
    assert (
        pool in table and sum(f"{pool}." in line and "Ready" in line for line in table.splitlines()) == 3
    ), table

    # deleting the pool gives every node's memory back and removes everything it owned
    e2e.custom.delete_cluster_custom_object(GROUP, VERSION, "offloadpools", pool)
    wait_for("pool gone", lambda: e2e.pool(pool) is None, 120)
    wait_for(
        "OffloadPoolNodes and DaemonSet garbage-collected",
        lambda: not e2e.pool_nodes(pool) and not e2e.daemonsets(pool),
        60,
    )
    for n in gpu:
        assert not e2e.pool_dir(n, pool).exists() and not mounts_under(n.root)
    wait_for(
        "labels removed",
        lambda: all(
            f"pool.offloadpool.io/{pool}" not in (e2e.core.read_node(n.name).metadata.labels or {})
            for n in gpu
        ),
        60,
    )


def test_agent_killed_mid_populate_is_finished_by_its_replacement(e2e: E2E) -> None:
    node = e2e.add_nodes(1)[0]
    capacity = 1024 * MiB
    pool = e2e.create_pool("resume", {"capacity": "1Gi", "medium": "Memory", "prefault": {"workers": 1}})
    mnt = e2e.pool_dir(node, pool) / "mnt"

    def populating() -> int:
        if not mounts_under(mnt) or (mnt.parent / "manifest.json").exists():
            return 0
        st = os.statvfs(mnt)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    agent = e2e.cluster.agent(node.name, timeout=120)
    # a quarter in: the engine's journal has recorded finished parts by then
    wait_for("populate a quarter done", lambda: populating() >= capacity // 4, 120, interval=0.005)
    os.kill(agent.pid, signal.SIGSTOP)  # freeze it mid-populate, then check it really was mid-way
    used = populating()
    assert 0 < used < capacity, f"populate was not caught mid-way ({used} of {capacity} bytes)"
    # the agent writes Populating only once it has lasted the status writer's progress interval
    # (a pool Ready sooner costs one status write): held this long, the populate has, so once
    # let go the agent shows it while the rest populates; then it is frozen again, mid-way
    time.sleep(4 * PROGRESS_INTERVAL)
    os.kill(agent.pid, signal.SIGCONT)
    st = wait_for(
        "status shows the populate",
        lambda: (s := e2e.node_status(pool, node.name)).get("phase") == "Populating" and s,
        30,
        interval=0.005,
    )
    os.kill(agent.pid, signal.SIGSTOP)
    assert 0 < st.get("progress", 0) < 100, f"status does not show the populate mid-way: {st}"
    used = populating()
    assert 0 < used < capacity, f"populate was not frozen mid-way again ({used} of {capacity} bytes)"
    segment = sorted(p for p in mnt.iterdir() if p.is_file())[0]
    sentinel = b"engine data that must survive " + e2e.tag.encode()
    with open(segment, "r+b") as fh:  # data written into the region before the replacement runs
        fh.write(sentinel)
    first_pid = agent.pid
    os.kill(agent.pid, signal.SIGKILL)

    st = e2e.wait_node_phase(pool, node.name, "Ready", timeout=180)
    replacement = e2e.cluster.agent(node.name)
    assert replacement.pid != first_pid and replacement.restarts >= 1
    assert st["reason"] == "Resumed", st
    assert "already populated by an interrupted run" in st["message"]
    with open(segment, "rb") as fh:
        assert fh.read(len(sentinel)) == sentinel, "the replacement re-zeroed memory"
    st = os.statvfs(mnt)
    assert (st.f_blocks - st.f_bfree) * st.f_frsize >= capacity
    e2e.wait_pool_ready(pool, 1)
    pod = e2e.core.read_namespaced_pod(replacement.pod, replacement.namespace)
    assert pod.status.container_statuses[0].restart_count >= 1


def test_deletion_waits_for_an_attached_engine(e2e: E2E) -> None:
    a, b = e2e.add_nodes(2)
    pool = e2e.create_pool("held", {"capacity": "64Mi", "medium": "Memory"})
    e2e.wait_pool_ready(pool, 2)
    engine = e2e.hold_lease(a, pool)
    ds = e2e.daemonsets(pool)
    assert len(ds) == 1

    e2e.custom.delete_cluster_custom_object(GROUP, VERSION, "offloadpools", pool)
    e2e.wait_node_phase(pool, a.name, "Draining", reason="LeaseHeld")
    e2e.wait_node_phase(pool, b.name, "Released")
    time.sleep(3)  # the finalizer must keep holding while the engine is attached
    obj = e2e.pool(pool)
    assert obj is not None and obj["metadata"].get("deletionTimestamp"), (
        "pool went away under an attached engine"
    )

    def says_why() -> str | None:
        why = json.dumps(e2e.pool_status(pool))
        return why if a.name in why and "LeaseHeld" in why and b.name not in why else None

    try:
        wait_for("the pool saying which node waits and why", says_why, 30)
    except AssertionError:
        raise AssertionError(
            f"the pool does not say why it waits: {json.dumps(e2e.pool_status(pool))}"
        ) from None
    assert mounts_under(e2e.pool_dir(a, pool) / "mnt"), "memory released under an attached engine"
    assert not e2e.pool_dir(b, pool).exists(), "the free node was not released"
    # A deletion that waits is no error: the operator's own log says what it waits for, at
    # INFO, and no line about the pool is an ERROR (kopf logs a TemporaryError at ERROR).
    # (kopf's own lines name no pool, only the nodes its message lists)
    lines = [line for line in e2e.operator.log(200_000).splitlines() if pool in line or a.name in line]
    waits = [line for line in lines if "deletion waits for 1 node(s)" in line and a.name in line]
    assert waits and all("[INFO" in line for line in waits), "\n".join(lines)
    assert not [line for line in lines if "ERROR" in line or "failed temporarily" in line], "\n".join(lines)

    engine.kill()
    engine.wait(10)
    wait_for("pool gone (finalizer removed)", lambda: e2e.pool(pool) is None, 120)
    wait_for(
        "DaemonSet and OffloadPoolNodes gone",
        lambda: not e2e.pool_nodes(pool) and not e2e.daemonsets(pool),
        60,
    )
    wait_for(
        "agents stopped",
        lambda: not any(ag.alive() for n in (a, b) for ag in e2e.cluster.agents_on(n.name)),
        60,
    )
    for n in (a, b):
        assert not e2e.pool_dir(n, pool).exists() and not mounts_under(n.root), f"memory left on {n.name}"


def test_node_without_huge_pages_fails_and_a_deleted_node_leaves(e2e: E2E) -> None:
    label = {f"e2e.offloadpool.io/hp-{e2e.tag}": "true"}
    a, b = e2e.add_nodes(2, label)
    pool = e2e.create_pool(
        "hp",
        {
            "capacity": "64Mi",
            "medium": "HugePages-2Mi",
            "nodeSelector": label,
            "segments": {"minSize": "16Mi"},
        },
    )
    e2e.wait_pool_ready(pool, 2)

    # a node whose huge page pool is fixed at boot and whose free pages other tenants hold
    c = e2e.add_nodes(1, hugepages_fixed=True)[0]  # selected only once labelled, below
    with other_tenant_holds_free_hugepages(c.root / "tenant"):
        e2e.add_pool_node_label(c, label)
        st = e2e.wait_node_phase(pool, c.name, "Failed")
    assert st["reason"] == "InsufficientHugePages", st
    assert "short by" in st["message"] and "32" in st["message"], st["message"]
    assert not mounts_under(c.root / "var"), "half-built pool left mounted on the failed node"
    # the agent retries every few seconds (memory may free up); between tries nothing is there
    wait_for(
        "nothing half-built on the failed node", lambda: not e2e.pool_dir(c, pool).exists(), 15, interval=0.05
    )
    pst = wait_for(
        "pool counts 2 ready + 1 failed",
        lambda: (
            (s := e2e.pool_status(pool)).get("failedNodes") == 1
            and s.get("readyNodes") == 2
            and s.get("desiredNodes") == 3
            and s
        ),
        60,
    )
    assert any(
        f["node"] == c.name and "short by" in f.get("message", "") for f in pst.get("failingNodes", [])
    ), pst
    for n in (a, b):
        assert e2e.node_status(pool, n.name)["phase"] == "Ready"

    # node b leaves the cluster: its OffloadPoolNode goes, counts follow
    e2e.cluster.delete_node(b.name)
    wait_for("OffloadPoolNode of the deleted node gone", lambda: b.name not in e2e.pool_nodes(pool), 60)
    wait_for(
        "counts adjusted",
        lambda: (
            (s := e2e.pool_status(pool)).get("desiredNodes") == 2
            and s.get("readyNodes") == 1
            and s.get("failedNodes") == 1
        ),
        60,
    )


def test_operator_killed_mid_rollout_converges_without_duplicate_work(e2e: E2E) -> None:
    nodes = e2e.add_nodes(3)
    pool = e2e.create_pool("opkill", {"capacity": "256Mi", "medium": "Memory", "prefault": {"workers": 1}})
    wait_for(
        "rollout under way",
        lambda: len(e2e.pool_nodes(pool)) == 3 and e2e.daemonsets(pool) and len(e2e.cluster.agents) >= 1,
        120,
        interval=0.05,
    )
    e2e.operator.kill9()
    before_ds = [d.metadata.uid for d in e2e.daemonsets(pool)]
    before_nodes = {n: o["metadata"]["uid"] for n, o in e2e.pool_nodes(pool).items()}
    e2e.operator.start()
    e2e.wait_pool_ready(pool, 3)

    assert [d.metadata.uid for d in e2e.daemonsets(pool)] == before_ds, "the DaemonSet was re-created"
    assert {n: o["metadata"]["uid"] for n, o in e2e.pool_nodes(pool).items()} == before_nodes
    for n in nodes:
        agents = e2e.cluster.agents_on(n.name)
        assert len(agents) == 1 and agents[0].restarts == 0, "an agent was restarted or duplicated"
        st = e2e.node_status(pool, n.name)
        assert st["reason"] == "Populated" and st["observedGeneration"] == 1, st
    pods = [
        p
        for p in e2e.core.list_namespaced_pod(e2e.operator.namespace).items
        if any(o.uid in before_ds for o in p.metadata.owner_references or [])
    ]
    assert len(pods) == 3


def test_spec_change_applies_where_free_and_waits_under_an_engine(e2e: E2E) -> None:
    a, b, c = e2e.add_nodes(3)
    pool = e2e.create_pool("change", {"capacity": "64Mi", "medium": "Memory"})
    e2e.wait_pool_ready(pool, 3)
    engine = e2e.hold_lease(a, pool)
    e2e.wait_node_phase(pool, a.name, "Ready", enginesAttached=1, timeout=60)

    e2e.custom.patch_cluster_custom_object(
        GROUP, VERSION, "offloadpools", pool, {"spec": {"capacity": "128Mi"}}
    )
    for n in (b, c):
        e2e.wait_node_phase(pool, n.name, "Ready", observedGeneration=2, bytesTotal=128 * MiB, timeout=180)
    st = e2e.wait_node_phase(pool, a.name, "Ready", pendingGeneration=2, reason="LeaseHeld", timeout=120)
    assert st["observedGeneration"] == 1 and st["bytesTotal"] == 64 * MiB
    manifest = json.loads((e2e.pool_dir(a, pool) / "manifest.json").read_text())
    assert manifest["total_bytes"] == 64 * MiB, "the region was changed under the engine"
    wait_for("pool reports the pending node", lambda: e2e.pool_status(pool).get("pendingNodes") == 1, 60)

    engine.kill()
    engine.wait(10)
    e2e.wait_node_phase(pool, a.name, "Ready", observedGeneration=2, bytesTotal=128 * MiB, timeout=180)
    e2e.wait_pool_ready(pool, 3)
