"""Chaos, cluster side: kill -9 of the operator mid-pass and mid-rollout; the API server and
etcd stopped mid-rollout and started again.

One world for the module: the session's real control plane, three simulated nodes whose agents
are real processes (started by the simulated kubelet from the pods the real DaemonSet controller
made), the operator as a real process under its own RBAC, and one Memory pool Ready on all
three. Every seeded run is a rollout: the pool's spec changes (``prefault.workers`` 1 <-> 2, a
new generation that reshapes nothing, so every node applies it in place, one node at a time),
and while it rolls out the operator is killed — at a named point of its pass
(``fixtures/crash_at.py``: right after a DaemonSet apply, an advance, a status patch, ...),
after a random delay, or right after its k-th Event — or the control plane goes away for 10 s.
Then the rollout must complete, and nothing may have been done twice: the same DaemonSet and
OffloadPoolNodes (uids), the same agent processes (no restart), the same memory (mount device
unchanged, never re-populated), and no Event posted twice. See docs/chaos.md.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fixtures.chaos import Run, seeds
from fixtures.cluster import SimCluster, SimNode, mounts_under
from fixtures.cluster_client import ClusterClient
from fixtures.operator_process import NAMESPACE, OperatorProcess
from fixtures.wait import wait_for
from offloadpool.api.agent_env import POOL_NAME_ENV
from offloadpool.region.files import places
from offloadpool.region.files.journal import JOURNAL_NAME

pytestmark = pytest.mark.controlplane

GROUP, VERSION = "offloadpool.io", "v1alpha1"
HOST_ROOT = "/var/lib/offloadpool"
CRASH_AT = str(Path(__file__).parent / "fixtures" / "crash_at.py")
NODES = 3
OUTAGE_SECONDS = 10.0
OPERATOR_POINTS = (
    "operator:rollout-advanced",
    "operator:status-patched",
    "operator:pass-rolling-out",
    "operator:daemonset-applied",
    "operator:node-marks-synced",
    "event",
    "operator:rollout-advanced",
)
#: Events the operator posts per node or per rollout step: each exactly once per generation
PER_NODE_REASONS = ("RolloutAdvanced",)


@dataclass
class World:
    cluster: SimCluster
    operator: OperatorProcess
    kube: ClusterClient
    pool: str
    nodes: list[SimNode]
    workers: int = 1

    # -- reading ------------------------------------------------------------------------------
    def pool_body(self) -> dict[str, Any]:
        return self.kube.custom.get_cluster_custom_object(GROUP, VERSION, "offloadpools", self.pool)

    def node_objects(self) -> dict[str, dict[str, Any]]:
        return self.kube.pool_nodes(self.pool)

    def daemonset_uid(self) -> str:
        return self.cluster.apps.read_namespaced_daemon_set(
            f"offloadpool-agent-{self.pool}", NAMESPACE
        ).metadata.uid

    def mount_dev(self, node: SimNode) -> int:
        return os.stat(node.host_path(HOST_ROOT) / self.pool / "mnt").st_dev

    def agents(self) -> dict[str, tuple[int, int]]:
        """Pod uid -> (pid, restarts) of this pool's agents."""
        return {
            uid: (a.pid, a.restarts)
            for uid, a in list(self.cluster.agents.items())
            if a.env.get(POOL_NAME_ENV) == self.pool
        }

    def events(self) -> list[Any]:
        return self.cluster.core.list_namespaced_event(
            "default", field_selector=f"involvedObject.name={self.pool}"
        ).items

    def converged(self, generation: int) -> bool:
        st = self.pool_body().get("status") or {}
        ready = {c["type"]: c for c in st.get("conditions") or []}.get("Ready", {})
        nodes = self.node_objects()
        return (
            st.get("observedGeneration") == generation
            and st.get("readyNodes") == NODES
            and st.get("desiredNodes") == NODES
            and ready.get("status") == "True"
            and len(nodes) == NODES
            and all(
                (o.get("status") or {}).get("phase") == "Ready"
                and (o.get("status") or {}).get("observedGeneration") == generation
                for o in nodes.values()
            )
        )

    def diagnose(self) -> str:
        out = [f"pool status: {self.pool_body().get('status')}"]
        out += [f"{n}: spec {o.get('spec')} status {o.get('status')}" for n, o in self.node_objects().items()]
        out += [
            f"--- agent on {a.node.name} (restarts {a.restarts}):\n{a.log(1500)}"
            for a in self.cluster.agents.values()
        ]
        out.append(f"--- operator:\n{self.operator.log(4000)}")
        return "\n".join(out)

    def wait_converged(self, generation: int, timeout: float = 180) -> None:
        try:
            wait_for(
                f"pool {self.pool} Ready {NODES}/{NODES} at generation {generation}",
                lambda: self.converged(generation),
                timeout,
                interval=0.2,
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.diagnose()}") from None

    # -- acting -------------------------------------------------------------------------------
    def bump(self) -> int:
        """A spec change every node applies in place (no new shape): returns the new generation."""
        self.workers = 3 - self.workers
        body = self.kube.custom.patch_cluster_custom_object(
            GROUP, VERSION, "offloadpools", self.pool, {"spec": {"prefault": {"workers": self.workers}}}
        )
        return int(body["metadata"]["generation"])


@pytest.fixture(scope="module")
def world(
    control_plane: Any, crds_installed: Any, operator_rbac: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    workdir = tmp_path_factory.mktemp("chaos-cluster")
    cluster = SimCluster(control_plane, workdir).start()
    tag = uuid.uuid4().hex[:6]
    (workdir / "operator").mkdir()
    operator = OperatorProcess(control_plane, operator_rbac, workdir / "operator").start()
    kube = ClusterClient(cluster.api, tag, node_selector={"chaos.offloadpool.io/run": tag})
    pool = kube.name("chaos")
    w = World(cluster, operator, kube, pool, [])
    try:
        w.nodes = [cluster.add_node(f"c{i}-{tag}", {"chaos.offloadpool.io/run": tag}) for i in range(NODES)]
        kube.create_pool("chaos", {"capacity": "16Mi", "medium": "Memory", "prefault": {"workers": 1}})
        w.wait_converged(1)
        yield w
    finally:
        if not operator.alive():
            operator.launcher = ()
            operator.start()
        try:
            kube.custom.delete_cluster_custom_object(GROUP, VERSION, "offloadpools", pool)
            wait_for("pool deleted", lambda: kube.pool(pool) is None, 90)
        finally:
            operator.stop()
            names = list(cluster.nodes)
            cluster.stop()
            for name in names:
                try:
                    cluster.core.delete_node(name)
                except Exception:  # teardown goes on
                    pass
            leftover = mounts_under(workdir)
            shutil.rmtree(workdir, ignore_errors=True)
            assert not leftover, f"mounts left under the simulated nodes: {leftover}"


@dataclass
class Before:
    daemonset: str
    node_objects: dict[str, str]
    agents: dict[str, tuple[int, int]]
    mounts: dict[str, int]
    events: set[str]


def snapshot(w: World) -> Before:
    return Before(
        w.daemonset_uid(),
        {n: o["metadata"]["uid"] for n, o in w.node_objects().items()},
        w.agents(),
        {n.name: w.mount_dev(n) for n in w.nodes},
        {e.metadata.uid for e in w.events()},
    )


def check_no_duplicate_work(run: Run, w: World, before: Before, generation: int) -> None:
    """The invariants after a converged rollout (see the module docstring)."""
    run.check("DaemonSet not re-created", w.daemonset_uid() == before.daemonset)
    now = {n: o["metadata"]["uid"] for n, o in w.node_objects().items()}
    run.check(
        "OffloadPoolNodes not re-created", now == before.node_objects, f"{now} != {before.node_objects}"
    )
    run.check(
        "no agent restarted or replaced", w.agents() == before.agents, f"{w.agents()} != {before.agents}"
    )
    mounts = {n.name: w.mount_dev(n) for n in w.nodes}
    run.check("no region rebuilt (same mount on every node)", mounts == before.mounts)
    for node in w.nodes:
        journal = (places.state_dir(node.host_path(HOST_ROOT) / w.pool) / JOURNAL_NAME).read_bytes()
        run.check("region complete", len(journal) > 0 and all(journal))
    new = settled_events(w, before.events)
    counts = Counter((e.reason, e.message) for e in new)
    run.say("events: " + "; ".join(f"{r}: {m}" for (r, m) in sorted(counts)))
    dupes = {k: n for k, n in counts.items() if n > 1}
    run.check("no duplicate Event (same reason and message twice)", not dupes, str(dupes))
    for node in w.nodes:
        advanced = [
            e
            for e in new
            if e.reason == "RolloutAdvanced"
            and e.message == f"generation {generation} released to node {node.name}"
        ]
        run.check(
            "RolloutAdvanced at most once per node and generation", len(advanced) <= 1, str(len(advanced))
        )
        if not advanced:
            run.observe("RolloutAdvanced of a node not posted (lost with the operator or the API)")
    for reason in ("RollingOut", "Complete"):
        if not any(e.reason == reason for e in new):
            run.observe(f"Progressing {reason} Event not posted (lost with the operator or the API)")


def kill9(operator: OperatorProcess) -> None:
    """kill -9 of the operator's process group, if it still runs."""
    if operator.alive():
        operator.kill9()


def settled_events(w: World, before: set[str], quiet: float = 1.5, timeout: float = 30.0) -> list[Any]:
    """The pool's Events created since ``before``, once no new one came for ``quiet`` seconds.

    kopf posts Events from a background queue, after the status write a convergence check sees,
    so reading them at once would miss the last ones (and with them a late duplicate)."""
    deadline = time.monotonic() + timeout
    seen: list[Any] = []
    last_change = time.monotonic()
    while time.monotonic() < deadline:
        now = [e for e in w.events() if e.metadata.uid not in before]
        if len(now) != len(seen):
            seen, last_change = now, time.monotonic()
        elif time.monotonic() - last_change >= quiet:
            break
        time.sleep(0.25)
    return seen


def kill_after_events(w: World, before_events: set[str], k: int, timeout: float) -> bool:
    """Kill -9 the operator as soon as the k-th new Event about the pool exists; False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and w.operator.alive():
        if len([e for e in w.events() if e.metadata.uid not in before_events]) >= k:
            kill9(w.operator)
            return True
        time.sleep(0.02)
    return False


@pytest.mark.chaos
@pytest.mark.parametrize("seed", seeds(3))
def test_kill9_operator_mid_pass_and_rollout(seed: int, chaos_run: Run, world: World) -> None:
    run, rng, w = chaos_run, random.Random(seed), world
    point = OPERATOR_POINTS[seed % len(OPERATOR_POINTS)] if seed % 4 != 3 else "delay"
    before = snapshot(w)
    if point not in ("delay", "event"):  # a fresh operator that dies at the point
        nth = (
            rng.randint(1, NODES)
            if point in ("operator:rollout-advanced", "operator:pass-rolling-out")
            else rng.randint(1, 2)
        )
        kill9(w.operator)  # idle and converged: a kill here changes nothing (and is quicker than SIGTERM)
        w.operator.launcher = (sys.executable, CRASH_AT, point, str(nth), "offloadpool.operator.main")
        w.operator.start()
        time.sleep(rng.uniform(0.0, 1.0))  # the operator may or may not have finished starting
    else:  # the one running since the last run
        nth = rng.randint(1, 3)
        if not w.operator.alive():
            w.operator.launcher = ()
            w.operator.start()
    generation = w.bump()
    run.say(f"generation {generation}: kill at {point} #{nth}")
    if point == "delay":
        time.sleep(rng.uniform(0.0, 6.0))
        alive = w.operator.alive()
        kill9(w.operator)
        progress = sum(
            (o.get("spec") or {}).get("targetGeneration") == generation for o in w.node_objects().values()
        )
        run.hit(
            f"delay: {progress}/{NODES} nodes advanced" if alive else "delay: operator had died by itself"
        )
        run.check("the operator was running until killed", alive, w.operator.log())
    elif point == "event":
        killed = kill_after_events(w, before.events, nth, 60)
        run.hit(f"after Event #{nth}" if killed else f"after Event #{nth} (fewer Events: killed at the end)")
        if not killed:
            kill9(w.operator)
    else:
        try:
            wait_for(f"the operator to reach {point}", lambda: not w.operator.alive(), 45, interval=0.05)
            died = True
        except AssertionError:
            died = False
        if died:
            log = w.operator.log()
            run.check(
                "the operator died at the point it was sent to",
                f"CRASH-POINT {point} #{nth}" in log,
                log[-3000:],
            )
            run.hit(f"{point} #{nth}")
        else:
            kill9(w.operator)
            run.hit(f"{point} #{nth} (not reached in 45 s: killed then)")
    w.operator.launcher = ()
    w.operator.start()
    w.wait_converged(generation)
    check_no_duplicate_work(run, w, before, generation)


@pytest.mark.chaos
@pytest.mark.parametrize("seed", seeds(4, ci_runs=int(os.environ.get("OFFLOADPOOL_CHAOS_OUTAGE_RUNS", 3))))
def test_apiserver_and_etcd_down_mid_rollout(
    seed: int, chaos_run: Run, world: World, control_plane: Any
) -> None:
    run, w = chaos_run, world  # the seed only names the run: an outage has nothing to draw
    if not w.operator.alive() or w.operator.launcher:
        w.operator.stop()
        w.operator.launcher = ()
        w.operator.start()
    before = snapshot(w)
    operator_pid = w.operator.pid
    generation = w.bump()
    # mid-rollout: the control plane goes away once `wanted` nodes have been released the new
    # generation (0: the operator may not even have seen the change yet)
    wanted = seed % NODES

    def advanced() -> int:
        return sum(
            (o.get("spec") or {}).get("targetGeneration") == generation for o in w.node_objects().values()
        )

    deadline = time.monotonic() + 60
    while advanced() < wanted and time.monotonic() < deadline:
        time.sleep(0.02)
    progress = advanced()
    run.hit(f"outage with {progress}/{NODES} nodes advanced")
    down = control_plane.outage(OUTAGE_SECONDS)
    t0 = time.monotonic()
    w.wait_converged(generation)
    run.say(
        f"API unreachable for {down:.1f} s; rollout complete {time.monotonic() - t0:.1f} s after it came back"
    )
    run.check(
        "the operator survived the outage (same process)",
        w.operator.alive() and w.operator.pid == operator_pid,
        w.operator.log(),
    )
    check_no_duplicate_work(run, w, before, generation)
