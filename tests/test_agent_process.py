"""The agent as a real process against the real API server, without the operator.

The test plays the operator's part by hand (creates the OffloadPool and this node's
OffloadPoolNode) so every behaviour here is the agent's own: status through the status
subresource, health and metrics on one port, keeping the region across an agent restart,
engines counted from the lease, deletion waiting for the lease, Failed with the shortfall.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

import offloadpool
from fixtures.cluster import free_port, mounts_under, release_everything
from fixtures.host import cli
from fixtures.wait import wait_for
from offloadpool.api import agent_env
from offloadpool.api.pods import compat_files
from offloadpool.region.files import manifest as manifests

pytestmark = pytest.mark.controlplane

GROUP, VERSION = "offloadpool.io", "v1alpha1"
MiB = 1 << 20
HOLD = "tests.offloadpool.io/hold"  # our own finalizer: lets the test see the deletion phase


class AgentRun:
    def __init__(
        self, cp: Any, root: Path, pool: str, node: str, log: Path, extra: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        env = {
            **(extra or {}),
            **os.environ,
            "KUBECONFIG": str(cp.kubeconfig),
            agent_env.POOL_NAME_ENV: pool,
            agent_env.NODE_NAME_ENV: node,
            agent_env.POD_NAMESPACE_ENV: "default",
            agent_env.ROOT_ENV: str(root),
            agent_env.HTTP_PORT_ENV: str(self.port),
            agent_env.HEARTBEAT_ENV: "1",
            agent_env.RETRY_ENV: "1",
            "PYTHONUNBUFFERED": "1",
        }
        exe = str(Path(sys.executable).parent / "offloadpool-agent")
        self.log = log
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen(
                [exe], env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )

    def get(self, path: str) -> int:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
            return r.read().decode()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def env(crds_installed: Any) -> Iterator[dict[str, Any]]:
    cp = crds_installed
    work = Path(tempfile.mkdtemp(prefix="offloadpool-agent-test-"))
    api = cp.api_client()
    custom = client.CustomObjectsApi(api)
    state: dict[str, Any] = {
        "cp": cp,
        "root": work / "root",
        "work": work,
        "custom": custom,
        "agents": [],
        "engines": [],
        "names": [],
    }
    try:
        yield state
    finally:
        for a in state["agents"]:
            a.kill()
        for e in state["engines"]:
            if e.poll() is None:
                e.kill()
                e.wait(10)
        remove_world(state, api)


def remove_world(state: dict[str, Any], api: Any) -> None:
    """Delete every object ``create`` made (our finalizer stripped first), release every pool
    under the world's work directory and remove it, close ``api``; a mount left fails."""
    custom, work = state["custom"], state["work"]
    for plural, name in state["names"]:
        try:
            custom.patch_cluster_custom_object(
                GROUP, VERSION, plural, name, {"metadata": {"finalizers": None}}
            )
            custom.delete_cluster_custom_object(GROUP, VERSION, plural, name)
        except ApiException:
            pass
    release_everything(work)
    left = mounts_under(work)
    subprocess.run(["rm", "-rf", str(work)], check=False)
    api.close()
    assert not left, f"mounts left: {left}"


def create(
    state: dict[str, Any], pool: str, node: str, spec: dict[str, Any], *, node_object: bool = True
) -> None:
    """The pool, and (as the operator makes it for a node whose agent has not) the node's
    OffloadPoolNode unless ``node_object`` is False."""
    custom = state["custom"]
    custom.create_cluster_custom_object(
        GROUP,
        VERSION,
        "offloadpools",
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "OffloadPool",
            "metadata": {"name": pool, "finalizers": [HOLD]},
            "spec": spec,
        },
    )
    state["names"].append(("offloadpools", pool))
    state["names"].append(("offloadpoolnodes", f"{pool}.{node}"))
    if not node_object:
        return
    custom.create_cluster_custom_object(GROUP, VERSION, "offloadpoolnodes", node_object_body(pool, node))


def node_object_body(pool: str, node: str, **spec: Any) -> dict[str, Any]:
    """An OffloadPoolNode of ``pool`` for ``node``, as the operator or the agent makes it,
    without labels or owner: ``spec`` adds to its spec."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "OffloadPoolNode",
        "metadata": {"name": f"{pool}.{node}"},
        "spec": {"pool": pool, "nodeName": node, **spec},
    }


def status(state: dict[str, Any], name: str) -> dict[str, Any]:
    obj = state["custom"].get_cluster_custom_object(GROUP, VERSION, "offloadpoolnodes", name)
    return obj.get("status") or {}


def start_agent(state: dict[str, Any], pool: str, node: str, **extra: str) -> AgentRun:
    agent = AgentRun(
        state["cp"], state["root"], pool, node, state["work"] / f"agent-{len(state['agents'])}.log", extra
    )
    state["agents"].append(agent)
    return agent


def hold_lease(state: dict[str, Any], pool_dir: Path) -> subprocess.Popen[str]:
    """An 'engine': a separate process holding the pool's lease shared until killed."""
    code = (
        "import sys; from offloadpool.region.holding.lease import Lease; "
        f"l = Lease.shared({str(pool_dir)!r}); print('held', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    state["engines"].append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_agent_lifecycle_on_one_node(env: dict[str, Any]) -> None:
    pool, node = "agent-life", "node-x"
    create(env, pool, node, {"capacity": "64Mi", "medium": "Memory", "segments": {"minSize": "16Mi"}})
    name = f"{pool}.{node}"
    agent = start_agent(env, pool, node)

    st = wait_for("Ready", lambda: (s := status(env, name)).get("phase") == "Ready" and s, timeout=90)
    assert st["bytesTotal"] == 64 * MiB and st["bytesPopulated"] == 64 * MiB and st["progress"] == 100
    assert st["observedGeneration"] == 1 and st["reason"] == "Populated"
    made_at = st["populateGiBPerSecond"]
    assert made_at > 0, st
    assert st["hugePageCoverage"] >= 0 and st["agentVersion"] == offloadpool.__version__ and st["heartbeat"]
    assert "pendingGeneration" not in st
    pool_dir = env["root"] / pool
    assert mounts_under(pool_dir / "mnt"), "the pool's own mount is on the host root"
    assert json.loads((pool_dir / "manifest.json").read_text())["total_bytes"] == 64 * MiB
    assert wait_for("/readyz 200", lambda: agent.get("/readyz") == 200, timeout=10)
    assert agent.get("/healthz") == 200
    assert (
        'offloadpool_phase{node="node-x",offloadpool_phase="Ready",pool="agent-life"} 1.0' in agent.metrics()
    )
    assert f'offloadpool_agent_build_info{{version="{offloadpool.__version__}"}} 1.0' in agent.metrics()

    # liveness is a coordination.k8s.io Lease, renewed every heartbeat (1 s here), owned by the
    # pool; the OffloadPoolNode is not written while nothing in its status changes. A status
    # write shows the agent alive too: the Lease is made half a heartbeat after the last one
    coordination = client.CoordinationV1Api(env["custom"].api_client)
    first = wait_for("the heartbeat Lease", lambda: lease_or_none(coordination, name), timeout=10)
    status_beat = datetime.fromisoformat(st["heartbeat"].replace("Z", "+00:00"))
    assert first.spec.acquire_time >= status_beat + timedelta(seconds=0.5), (
        "the Lease was made before the agent's status writes had shown it alive for half a heartbeat",
        first.spec.acquire_time,
        status_beat,
    )
    assert first.metadata.labels == {"offloadpool.io/pool": pool}
    owner = env["custom"].get_cluster_custom_object(GROUP, VERSION, "offloadpools", pool)["metadata"]["uid"]
    assert [(o.kind, o.name, o.uid) for o in first.metadata.owner_references] == [
        ("OffloadPool", pool, owner)
    ]
    assert first.spec.holder_identity == name and first.spec.lease_duration_seconds == 4
    obj0 = env["custom"].get_cluster_custom_object(GROUP, VERSION, "offloadpoolnodes", name)
    written = obj0["metadata"]["resourceVersion"]
    wait_renewals(coordination, name, 3, {first.spec.renew_time})
    obj1 = env["custom"].get_cluster_custom_object(GROUP, VERSION, "offloadpoolnodes", name)
    assert obj1["metadata"]["resourceVersion"] == written, (
        "an unchanged status was written again",
        {k: (obj0["status"].get(k), v) for k, v in obj1["status"].items() if obj0["status"].get(k) != v},
    )

    # an engine attaches: the heartbeat reports it, from the lease alone
    engine = hold_lease(env, pool_dir)
    wait_for("enginesAttached 1", lambda: status(env, name).get("enginesAttached") == 1, timeout=30)
    metrics = metric_values(agent.metrics())
    labels = (("node", node), ("pool", pool))
    assert metrics[("offloadpool_populated_bytes_total", labels)] == 64 * MiB
    assert metrics[("offloadpool_region_bytes", labels)] == 64 * MiB
    assert metrics[("offloadpool_populate_seconds", labels)] > 0
    assert metrics[("offloadpool_engines_attached", labels)] == 1

    # SIGTERM: the agent leaves promptly; the memory stays
    t0 = time.monotonic()
    os.killpg(agent.proc.pid, signal.SIGTERM)
    assert agent.proc.wait(20) == 0
    assert time.monotonic() - t0 < 15, "agent did not exit promptly on SIGTERM"
    assert mounts_under(pool_dir / "mnt") and (pool_dir / "manifest.json").exists()

    # a new agent validates and keeps the region: nothing re-populated. Its write is told by
    # the reason alone (the first agent's stays "Populated": it never provisions a Ready region
    # again), not by the heartbeat, whose 1 s resolution both agents' writes can share
    assert status(env, name)["reason"] == "Populated"
    agent2 = start_agent(env, pool, node)
    st = wait_for("Reused", lambda: (s := status(env, name)).get("reason") == "Reused" and s, timeout=60)
    assert st["phase"] == "Ready" and st["enginesAttached"] == 1
    assert "offloadpool_populated_bytes_total" in agent2.metrics()
    # GIB/S stays the rate measured when the region was made (the node's record), not blank
    assert st.get("populateGiBPerSecond") == made_at, st

    # deletion while the engine holds the lease: Draining with the reason; memory untouched
    env["custom"].delete_cluster_custom_object(GROUP, VERSION, "offloadpools", pool)
    st = wait_for(
        "Draining",
        lambda: (s := status(env, name)).get("phase") == "Draining" and s.get("reason") == "LeaseHeld" and s,
        timeout=30,
    )
    assert "engine" in st["message"]
    assert mounts_under(pool_dir / "mnt")

    engine.kill()
    engine.wait(10)
    wait_for("Released", lambda: status(env, name).get("phase") == "Released", timeout=30)
    assert not mounts_under(env["root"]) and not pool_dir.exists()


def test_a_deleted_pool_is_noted_in_the_nodes_record_while_it_drains(env: dict[str, Any]) -> None:
    """Issue 36 finding 7: the CSI and DRA plugins have no API credentials, so the agent notes a
    pool's deletion in its root-only record when it starts draining it; the plugins then give
    no new volume or claim of it (tests/test_csi_node.py shows the refusal)."""
    pool, node = "agent-deleting", "node-x"
    create(env, pool, node, {"capacity": "16Mi", "medium": "Memory"})
    name = f"{pool}.{node}"
    start_agent(env, pool, node)
    wait_for("Ready", lambda: status(env, name).get("phase") == "Ready", timeout=90)
    pool_dir = env["root"] / pool
    record = env["root"] / ".state" / pool / "state.json"
    assert json.loads(record.read_text()).get("deleting", "") == ""
    engine = hold_lease(env, pool_dir)
    wait_for("enginesAttached 1", lambda: status(env, name).get("enginesAttached") == 1, timeout=30)
    env["custom"].delete_cluster_custom_object(GROUP, VERSION, "offloadpools", pool)
    wait_for("Draining", lambda: status(env, name).get("phase") == "Draining", timeout=30)
    noted = json.loads(record.read_text()).get("deleting")
    assert noted == "its OffloadPool was deleted; the node is draining it for release", noted
    engine.kill()
    engine.wait(10)
    wait_for("Released", lambda: status(env, name).get("phase") == "Released", timeout=30)
    assert not pool_dir.exists() and not record.exists()


def threads_of(pid: int) -> int:
    """The number of threads of process ``pid`` (``Threads:`` of /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads line in /proc/{pid}/status")


def test_idle_connections_to_the_agents_port_hold_no_thread_and_are_closed(env: dict[str, Any]) -> None:
    """Issue 36, finding 8, through the agent's own port: 400 connections that never send a
    byte held 400 threads of the agent, and stayed open. Now the agent's threads barely move,
    the connections beyond its cap (64) are closed at once, a probe made after them is
    answered, and every idle one is closed after the agent's 10 s timeout."""
    import socket

    def closed(conn: socket.socket) -> bool:
        """Whether the agent has closed ``conn`` (end of file or reset), without waiting."""
        try:
            return conn.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except ConnectionResetError:
            return True

    pool, node = "agent-idle", "node-i"
    create(env, pool, node, {"capacity": "16Mi", "medium": "Memory"})
    agent = start_agent(env, pool, node)
    wait_for("/readyz 200", lambda: agent.get("/readyz") == 200, timeout=90)
    before = threads_of(agent.proc.pid)
    conns: list[socket.socket] = []
    try:
        for _ in range(400):
            conns.append(socket.create_connection(("127.0.0.1", agent.port), timeout=10))
            conns[-1].setblocking(False)
        time.sleep(1)
        grew = threads_of(agent.proc.pid) - before
        assert agent.get("/healthz") == 200, "no answer to a probe behind 400 idle connections"
        at_once = sum(closed(c) for c in conns)
        print(f"400 idle connections: {grew} more threads, {at_once} closed at once")
        assert grew < 32, f"the agent runs {grew} more threads with 400 idle connections open"
        assert at_once >= 400 - 64, f"{at_once} of 400 idle connections closed: no cap"
        wait_for("every idle connection closed", lambda: all(closed(c) for c in conns), timeout=20)
    finally:
        for c in conns:
            c.close()


def test_agent_creates_its_node_object_once_and_never_brings_back_a_removed_one(
    env: dict[str, Any],
) -> None:
    """A new pool's agent makes its node's OffloadPoolNode itself (no operator runs here) and
    builds; one removed after that (the operator's: the node was deselected) is not made again
    by the agent, which goes on reporting to it once it is back."""
    pool, node = "agent-claims", "node-c"
    create(env, pool, node, {"capacity": "16Mi", "medium": "Memory"}, node_object=False)
    name = f"{pool}.{node}"
    agent = start_agent(env, pool, node)
    custom = env["custom"]
    st = wait_for(
        "Ready on its own object",
        lambda: exists(custom, name) and (s := status(env, name)).get("phase") == "Ready" and s,
    )
    assert st["observedGeneration"] == 1 and st["bytesTotal"] == 16 * MiB
    obj = custom.get_cluster_custom_object(GROUP, VERSION, "offloadpoolnodes", name)
    owner = custom.get_cluster_custom_object(GROUP, VERSION, "offloadpools", pool)["metadata"]["uid"]
    assert [(o["kind"], o["uid"], o.get("controller")) for o in obj["metadata"]["ownerReferences"]] == [
        ("OffloadPool", owner, True)
    ]
    assert obj["spec"] == {"pool": pool, "nodeName": node, "targetGeneration": 1}

    populated = populated_bytes(agent)
    assert populated == 16 * MiB
    custom.delete_cluster_custom_object(GROUP, VERSION, "offloadpoolnodes", name)
    wait_for("deleted", lambda: not exists(custom, name))
    # a step renews the Lease each heartbeat (1 s): three steps without the object
    wait_renewals(client.CoordinationV1Api(custom.api_client), name, 4)
    assert not exists(custom, name), "the agent brought back an object the operator had removed"
    assert agent.proc.poll() is None, "the agent died without its object"

    custom.create_cluster_custom_object(  # the operator makes it again (the node is selected again)
        GROUP,
        VERSION,
        "offloadpoolnodes",
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "OffloadPoolNode",
            "metadata": {"name": name},
            "spec": {"pool": pool, "nodeName": node},
        },
    )
    wait_for("Ready again", lambda: status(env, name).get("phase") == "Ready", timeout=30)
    assert populated_bytes(agent) == populated, "the region was populated again for a new object"


def populated_bytes(agent: AgentRun) -> float:
    values = metric_values(agent.metrics())
    return sum(v for (metric, _), v in values.items() if metric == "offloadpool_populated_bytes_total")


def wait_renewals(
    coordination: client.CoordinationV1Api, name: str, count: int, seen: set[Any] | None = None
) -> None:
    """Until ``count`` different renewTimes of the Lease have been seen (``seen`` counts; a
    Lease not made yet counts none)."""
    renewals = set() if seen is None else seen

    def renewed() -> bool:
        lease = lease_or_none(coordination, name)
        if lease is not None:
            renewals.add(lease.spec.renew_time)
        return len(renewals) >= count

    wait_for(
        f"{count} Lease renewals",
        renewed,
        timeout=30,
        interval=0.2,
    )


def lease_or_none(coordination: client.CoordinationV1Api, name: str) -> Any:
    try:
        return coordination.read_namespaced_lease(name, "default")
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def exists(custom: client.CustomObjectsApi, name: str) -> bool:
    try:
        custom.get_cluster_custom_object(GROUP, VERSION, "offloadpoolnodes", name)
        return True
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise


def test_too_little_memory_fails_with_the_shortfall_and_builds_nothing(env: dict[str, Any]) -> None:
    pool, node = "agent-toobig", "node-y"
    create(env, pool, node, {"capacity": "64Ti", "medium": "Memory"})
    start_agent(env, pool, node)
    st = wait_for(
        "Failed", lambda: (s := status(env, f"{pool}.{node}")).get("phase") == "Failed" and s, timeout=60
    )
    assert st["reason"] == "InsufficientMemory"
    assert "short by" in st["message"], st["message"]
    assert not (env["root"] / pool).exists() and not mounts_under(env["root"])


def test_retain_reports_released_and_keeps_the_memory(env: dict[str, Any]) -> None:
    pool, node = "agent-retain", "node-z"
    create(env, pool, node, {"capacity": "64Mi", "medium": "Memory", "reclaimPolicy": "Retain"})
    name = f"{pool}.{node}"
    start_agent(env, pool, node)
    wait_for("Ready", lambda: status(env, name).get("phase") == "Ready", timeout=90)
    env["custom"].delete_cluster_custom_object(GROUP, VERSION, "offloadpools", pool)
    st = wait_for("Released", lambda: (s := status(env, name)).get("phase") == "Released" and s, timeout=30)
    assert st["reason"] == "Retained" and "Retain" in st["message"]
    pool_dir = env["root"] / pool
    assert mounts_under(pool_dir / "mnt") and (pool_dir / "manifest.json").exists(), (
        "Retain gave the memory back"
    )

    # On the node, with no API to ask, `offloadpool status` says no OffloadPool owns it...
    def node_status() -> dict[str, Any]:
        out = cli("status", "--root", str(env["root"]), "--json")
        return {p["name"]: p for p in json.loads(out.stdout)["pools"]}[pool]

    seen = node_status()
    assert seen["phase"] == "Orphaned", seen
    assert "deleted with reclaimPolicy Retain" in seen["message"], seen["message"]
    assert f"offloadpool release {pool}" in seen["message"], seen["message"]
    assert "Orphaned" in cli("status", "--root", str(env["root"])).stdout
    # ...until a pool of its name provisions it again: then it is that pool's, Ready
    cli("provision", "--root", str(env["root"]), "--name", pool, "--capacity", "64Mi", "--medium", "Memory")
    seen = node_status()
    assert (seen["phase"], seen["message"]) == ("Ready", ""), seen


def test_agent_waits_for_a_lockless_holder_in_another_mount_namespace(
    env: dict[str, Any], processes, tmp_path: Path
) -> None:
    """Stock vLLM's way of holding a pool — a mapping through a bind mount in its own mount
    namespace, no lease — keeps the agent from reshaping and from releasing it: the spec change
    stays pending and the deletion waits, both naming the holder; once it exits each proceeds,
    and nothing is left."""
    from test_region_holders import PATTERN, start_holder, stop

    pool, node = "agent-nsheld", "node-n"
    create(env, pool, node, {"capacity": "64Mi", "medium": "Memory", "segments": {"minSize": "16Mi"}})
    name = f"{pool}.{node}"
    start_agent(env, pool, node)
    wait_for("Ready", lambda: status(env, name).get("phase") == "Ready", timeout=90)
    pool_dir = env["root"] / pool
    segment = sorted((pool_dir / "mnt").iterdir())[0]
    holder = start_holder(processes, tmp_path, segment, "map")

    st = wait_for(
        "enginesAttached 1", lambda: (s := status(env, name)).get("enginesAttached") == 1 and s, timeout=30
    )
    # a reshaping spec change waits, naming the holder
    env["custom"].patch_cluster_custom_object(
        GROUP, VERSION, "offloadpools", pool, {"spec": {"capacity": "128Mi"}}
    )
    st = wait_for(
        "generation 2 pending",
        lambda: (s := status(env, name)).get("pendingGeneration") == 2 and s,
        timeout=30,
    )
    assert st["phase"] == "Ready" and st["observedGeneration"] == 1 and st["reason"] == "LeaseHeld", st
    assert f"pid {holder.pid}" in st["message"], st["message"]
    assert segment.read_bytes()[: len(PATTERN)] == PATTERN
    assert json.loads((pool_dir / "manifest.json").read_text())["total_bytes"] == 64 * MiB

    # the holder exits: the reshape is applied
    stop(holder)
    st = wait_for(
        "generation 2 applied",
        lambda: (s := status(env, name)).get("observedGeneration") == 2 and s.get("phase") == "Ready" and s,
        timeout=60,
    )
    assert st["bytesTotal"] == 128 * MiB and "pendingGeneration" not in st
    assert json.loads((pool_dir / "manifest.json").read_text())["total_bytes"] == 128 * MiB

    # deletion waits for a new holder, naming it; the memory and the holder's data stay
    segment = sorted((pool_dir / "mnt").iterdir())[0]
    holder = start_holder(processes, tmp_path, segment, "map")
    env["custom"].delete_cluster_custom_object(GROUP, VERSION, "offloadpools", pool)
    st = wait_for("Draining", lambda: (s := status(env, name)).get("phase") == "Draining" and s, timeout=30)
    assert f"pid {holder.pid}" in st["message"], st["message"]
    assert mounts_under(pool_dir / "mnt") and segment.read_bytes()[: len(PATTERN)] == PATTERN

    stop(holder)
    wait_for("Released", lambda: status(env, name).get("phase") == "Released", timeout=30)
    assert not mounts_under(env["root"]) and not pool_dir.exists()


def phases_seen(env: dict[str, Any], name: str) -> tuple[list[tuple[str, str, int]], threading.Event]:
    """Every (phase, reason, progress) the OffloadPoolNode's status goes through, from a watch
    (a scrub of a small pool is over long before a poll would see it); set the event to stop."""
    from kubernetes import watch

    seen: list[tuple[str, str, int]] = []
    stop = threading.Event()
    rv = env["custom"].get_cluster_custom_object(GROUP, VERSION, "offloadpoolnodes", name)["metadata"][
        "resourceVersion"
    ]

    def run() -> None:
        w = watch.Watch()
        for event in w.stream(
            env["custom"].list_cluster_custom_object,
            GROUP,
            VERSION,
            "offloadpoolnodes",
            field_selector=f"metadata.name={name}",
            resource_version=rv,
            timeout_seconds=120,
        ):
            st = event["object"].get("status") or {}
            seen.append((st.get("phase"), st.get("reason"), st.get("progress")))
            if stop.is_set():
                break
        w.stop()

    threading.Thread(target=run, daemon=True).start()
    return seen, stop


def write_pattern(pool_dir: Path) -> None:
    """A tenant's data at the start of every segment file."""
    for seg in sorted((pool_dir / "mnt").iterdir()):
        fd = os.open(seg, os.O_RDWR)
        m = mmap.mmap(fd, os.fstat(fd).st_size)
        m[: 8 * 512] = b"TENANT-A" * 512
        m.close()
        os.close(fd)


def all_zero(pool_dir: Path) -> bool:
    for seg in sorted((pool_dir / "mnt").iterdir()):
        fd = os.open(seg, os.O_RDONLY)
        m = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
        zero = m[:].count(0) == len(m)
        m.close()
        os.close(fd)
        if not zero:
            return False
    return True


def test_a_consumer_change_is_scrubbed_once_the_holder_leaves(env: dict[str, Any]) -> None:
    """spec.consumers.uid changes while an engine holds the pool: Pending (ScrubPending), the
    pool withheld and its memory untouched; once the engine leaves: Scrubbing, then Ready with
    every byte zero for the new consumer."""
    pool, node = "agent-scrub", "node-s"
    spec = {"capacity": "64Mi", "medium": "Memory", "segments": {"minSize": "16Mi"}}
    spec["consumers"] = {"uid": 1001}
    create(env, pool, node, spec)
    name = f"{pool}.{node}"
    start_agent(env, pool, node)
    wait_for("Ready", lambda: status(env, name).get("phase") == "Ready", timeout=90)
    pool_dir = env["root"] / pool
    write_pattern(pool_dir)
    engine = hold_lease(env, pool_dir)
    seen, stop = phases_seen(env, name)

    env["custom"].patch_cluster_custom_object(
        GROUP, VERSION, "offloadpools", pool, {"spec": {"consumers": {"uid": 1002}}}
    )
    st = wait_for(
        "ScrubPending", lambda: (s := status(env, name)).get("reason") == "ScrubPending" and s, timeout=30
    )
    assert st["phase"] == "Pending" and "consumers changed (uid 1001 -> 1002)" in st["message"]
    assert not (pool_dir / "manifest.json").exists() and not all_zero(pool_dir)

    engine.kill()
    engine.wait(10)
    st = wait_for(
        "Ready at generation 2",
        lambda: (s := status(env, name)).get("phase") == "Ready" and s.get("observedGeneration") == 2 and s,
        timeout=60,
    )
    stop.set()
    assert "zeroed first" in st["message"]
    assert ("Scrubbing", "Scrubbing", 0) in seen, seen
    assert seen.index(("Scrubbing", "Scrubbing", 0)) > [p for p, _, _ in seen].index("Pending")
    assert all_zero(pool_dir)
    assert {os.stat(p).st_uid for p in (pool_dir / "mnt").iterdir()} == {1002}


def test_scrub_always_zeroes_when_the_last_engine_leaves(env: dict[str, Any]) -> None:
    pool, node = "agent-always", "node-a"
    spec = {
        "capacity": "64Mi",
        "medium": "Memory",
        "segments": {"minSize": "16Mi"},
        "consumers": {"scrub": "Always"},
    }
    create(env, pool, node, spec)
    name = f"{pool}.{node}"
    start_agent(env, pool, node)
    wait_for("Ready", lambda: status(env, name).get("phase") == "Ready", timeout=90)
    pool_dir = env["root"] / pool
    engine = hold_lease(env, pool_dir)
    wait_for("enginesAttached 1", lambda: status(env, name).get("enginesAttached") == 1, timeout=30)
    write_pattern(pool_dir)
    time.sleep(2.5)  # heartbeats with the engine attached: its data stays
    assert not all_zero(pool_dir)
    seen, stop = phases_seen(env, name)

    engine.kill()
    engine.wait(10)

    def scrubbed_then_ready() -> bool:
        phases = [p for p, _, _ in seen]
        return "Scrubbing" in phases and "Ready" in phases[phases.index("Scrubbing") :]

    # Watched, not polled: a poll reads the pool's files, and an open file is a holder, which
    # keeps Always from zeroing under it (its data would be the next tenancy's).
    wait_for("Scrubbing, then Ready again", scrubbed_then_ready, timeout=60)
    stop.set()
    assert all_zero(pool_dir)
    assert (pool_dir / "manifest.json").exists()


def test_a_compat_name_replaced_by_a_link_is_reported_and_relinked_at_a_heartbeat(
    env: dict[str, Any],
) -> None:
    """A Ready stock-vLLM compat pool held by an engine; a pod replaces vLLM's name
    (``mnt/vllm_offload_<id>.mmap``) with a symlink to a host file. At its next heartbeat the
    agent posts an ``EntryChanged`` Warning naming the entry and links the name to its segment
    again, in place: the pool stays Ready (never another phase), the memory (mount, segment
    inode, the engine's bytes) stays, the host file is untouched (issue 36, finding 1)."""
    pool, node = "agent-compat", "node-v"
    spec = {
        "capacity": "16Mi",
        "medium": "Memory",
        "compat": {"vllm": {"engineId": "e0", "numSegments": 1}},
    }
    create(env, pool, node, spec)
    name = f"{pool}.{node}"
    start_agent(env, pool, node)
    wait_for("Ready", lambda: status(env, name).get("phase") == "Ready", timeout=90)
    pool_dir = env["root"] / pool
    ((rel, _),) = compat_files("e0")
    compat = pool_dir / rel
    segment = pool_dir / manifests.load(pool_dir).regions[0].segments[0].file
    inode = os.stat(segment).st_ino
    assert os.lstat(compat).st_ino == inode
    engine = hold_lease(env, pool_dir)
    wait_for("enginesAttached 1", lambda: status(env, name).get("enginesAttached") == 1, timeout=30)
    write_pattern(pool_dir)
    mounts = mounts_under(pool_dir / "mnt")
    host_file = env["work"] / "host" / "a-host-file"
    host_file.parent.mkdir()
    host_file.write_bytes(b"HOST-FILE" * 100)
    seen, stop = phases_seen(env, name)
    core = client.CoreV1Api(env["custom"].api_client)

    os.unlink(compat)  # what a root consumer does through its own mount of the pool directory
    os.symlink(host_file, compat)

    def entry_changed() -> Any:
        events = core.list_namespaced_event("default", field_selector=f"involvedObject.name={name}").items
        return next((e for e in events if e.reason == "EntryChanged"), None)

    event = wait_for("an EntryChanged Event", entry_changed, timeout=30)
    assert event.type == "Warning", event
    assert str(compat) in event.message and "symbolic link" in event.message, event

    def relinked() -> bool:
        st = os.lstat(compat)
        return (st.st_mode & 0o170000) == 0o100000 and st.st_ino == inode

    wait_for("vLLM's name a link of its segment again", relinked, timeout=30)
    st = wait_for(
        "the repair reported",
        lambda: "repaired what a pod changed" in (s := status(env, name)).get("message", "") and s,
        timeout=30,
    )
    stop.set()
    assert st["phase"] == "Ready" and st["enginesAttached"] == 1, st
    assert {p for p, _, _ in seen} <= {"Ready"}, f"the pool left Ready for the repair: {seen}"
    assert os.stat(segment).st_ino == inode and mounts_under(pool_dir / "mnt") == mounts
    with open(compat, "rb") as fh:
        assert fh.read(8) == b"TENANT-A", "the engine's bytes did not stay"
    assert host_file.read_bytes() == b"HOST-FILE" * 100
    engine.kill()
    engine.wait(10)


def test_a_growth_the_node_cannot_fit_waits_under_a_holder_and_never_fails_the_node(
    env: dict[str, Any],
) -> None:
    """capacity 64Mi -> 64Ti while an engine holds the pool: the agent reports the old region
    Ready with LeaseHeld (pendingGeneration 2), never Failed, though the growth fits neither the
    node nor (in a pod) the agent's limits: the holders are looked at first. Only once the engine
    is gone does the node say what the growth lacks (InsufficientMemory); the old region is
    still there and Ready again when the spec goes back."""
    pool, node = "agent-grow", "node-g"
    create(env, pool, node, {"capacity": "64Mi", "medium": "Memory", "segments": {"minSize": "16Mi"}})
    name = f"{pool}.{node}"
    start_agent(env, pool, node)
    wait_for("Ready", lambda: status(env, name).get("phase") == "Ready", timeout=90)
    engine = hold_lease(env, env["root"] / pool)
    seen, stop = phases_seen(env, name)

    env["custom"].patch_cluster_custom_object(
        GROUP, VERSION, "offloadpools", pool, {"spec": {"capacity": "64Ti"}}
    )
    st = wait_for(
        "LeaseHeld", lambda: (s := status(env, name)).get("reason") == "LeaseHeld" and s, timeout=30
    )
    assert (st["phase"], st["observedGeneration"], st["pendingGeneration"]) == ("Ready", 1, 2), st
    assert st["bytesTotal"] == 64 * MiB and "held by 1 attached engine" in st["message"], st
    time.sleep(3)  # several retries of the agent (RETRY 1 s): still held, still Ready
    assert status(env, name)["phase"] == "Ready"
    assert "Failed" not in [phase for phase, _, _ in seen], seen

    engine.kill()
    engine.wait(10)
    st = wait_for(
        "Failed once nothing holds it",
        lambda: (s := status(env, name)).get("phase") == "Failed" and s,
        timeout=30,
    )
    stop.set()
    assert st["reason"] == "InsufficientMemory" and "short by" in st["message"], st
    env["custom"].patch_cluster_custom_object(
        GROUP, VERSION, "offloadpools", pool, {"spec": {"capacity": "64Mi"}}
    )
    st = wait_for(
        "Ready again on the old region",
        lambda: (s := status(env, name)).get("phase") == "Ready" and s.get("observedGeneration") == 3 and s,
        timeout=30,
    )
    assert st["reason"] == "Reused", st


def test_an_agent_made_for_a_smaller_pool_waits_for_its_replacement_never_failing(
    env: dict[str, Any],
) -> None:
    """The operator's DaemonSet says what an agent pod's limits were made for
    (``SIZED_FOR_ENV``). Grown 64Mi -> 128Mi, the old pod's agent applies nothing under them:
    Ready on the old region with LeaseHeld while an engine holds it, then (the engine gone)
    AgentReplacementPending with enginesAttached 0, the state in which the operator replaces
    the pod; never Failed, where a real limit would have failed the growth. The agent of the
    new pod (played by hand here, as the DaemonSet controller makes it) applies the growth."""
    pool, node = "agent-sized", "node-q"
    create(env, pool, node, {"capacity": "64Mi", "medium": "Memory", "segments": {"minSize": "16Mi"}})
    name = f"{pool}.{node}"
    made_for = {agent_env.SIZED_FOR_ENV: agent_env.sized_for("Memory", 64 * MiB)}
    old_agent = start_agent(env, pool, node, **made_for)
    wait_for("Ready", lambda: status(env, name).get("phase") == "Ready", timeout=90)
    engine = hold_lease(env, env["root"] / pool)
    seen, stop = phases_seen(env, name)

    env["custom"].patch_cluster_custom_object(
        GROUP, VERSION, "offloadpools", pool, {"spec": {"capacity": "128Mi"}}
    )
    st = wait_for(
        "LeaseHeld", lambda: (s := status(env, name)).get("reason") == "LeaseHeld" and s, timeout=30
    )
    assert (st["phase"], st["observedGeneration"], st["pendingGeneration"]) == ("Ready", 1, 2), st
    assert "held by 1 attached engine" in st["message"], st
    engine.kill()
    engine.wait(10)
    st = wait_for(
        "AgentReplacementPending",
        lambda: (s := status(env, name)).get("reason") == "AgentReplacementPending" and s,
        timeout=30,
    )
    assert (st["phase"], st["observedGeneration"], st["pendingGeneration"]) == ("Ready", 1, 2), st
    assert st["enginesAttached"] == 0 and st["bytesTotal"] == 64 * MiB, st
    assert "Memory/67108864" in st["message"], st
    time.sleep(3)  # several retries (RETRY 1 s): the old pod still applies nothing
    assert status(env, name)["observedGeneration"] == 1
    assert json.loads((env["root"] / pool / "manifest.json").read_text())["total_bytes"] == 64 * MiB

    old_agent.kill()
    start_agent(env, pool, node, **{agent_env.SIZED_FOR_ENV: agent_env.sized_for("Memory", 128 * MiB)})
    st = wait_for(
        "Ready at generation 2",
        lambda: (s := status(env, name)).get("phase") == "Ready" and s.get("observedGeneration") == 2 and s,
        timeout=60,
    )
    stop.set()
    assert st["bytesTotal"] == 128 * MiB and st.get("pendingGeneration") is None, st
    assert "Failed" not in [phase for phase, _, _ in seen], seen
