"""One pass over one pool: read the current state, compute what should be, write the difference.

A pass never relies on what an earlier pass (or an earlier operator process) did: it reads the
pool fresh from the API server, takes Nodes and the pool's OffloadPoolNodes from the watch-fed
indexes (``watched``: what the API server said, plus the answers to the operator's own writes,
so a pass sees what the pass before it wrote), and derives the DaemonSet, the OffloadPoolNode
set, the rollout step, the pool status, the Node labels and resources (and a DRA pool's
DeviceClass) from them. Every write is
idempotent and skipped when nothing changed. So passes can be repeated at will (every event,
every resync, after a kill -9) and converge; and a repeated pass after convergence writes
nothing. A pass costs O(nodes) in memory only: no list of the pool's objects per pass.

Agents' heartbeat Leases are listed, not watched (renewals are the one steady stream of writes,
and nobody should wake for them). A renewTime only ever moves forward, so a list can only err
one way as it ages: it may take a live agent for a silent one, never the reverse. So a pass
reuses the last list for as long as no node is stale by it, and lists again when one is — at
most every ``heartbeat_list_max_age`` (short next to the heartbeat timeout, so a stale verdict is never
more than that late). With agents renewing every heartbeat that is a list per pool about every
heartbeat-timeout rather than every few seconds: at 1,000 nodes each list was ~1 MB of JSON.

The pool's agent pods are listed only while a node's agent is not at work (no report, silent
past the timeout, or a deletion waiting for it) for longer than ``agent_pods_period``, and then
at most that often (``agentpods``): the scheduler's reason for a pod it cannot place goes into the
pool's status, and a pod whose token predates its ServiceAccount is replaced.

Passes for one pool are serialised by a per-pool lock held in the worker thread itself, so a
deletion pass never interleaves with a normal pass that is still finishing in its thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import partial
from typing import Any, NamedTuple, TypeVar

from kubernetes.client.exceptions import ApiException

from offloadpool.api import dra
from offloadpool.api.base import now as utcnow
from offloadpool.api.constants import node_object_name
from offloadpool.api.node import new_object
from offloadpool.region.vocabulary import RELEASED

from . import agentpods, daemonset, deviceclass, nodes, rollout
from .aggregate import aggregate
from .config import OperatorConfig
from .events import Event, transitions
from .kube import Kube
from .pool_node_report import PoolNodeReport, stale_cutoff
from .selection import SelectableNode, Selection
from .watched import WatchedKind
from .writes import Batch, ParallelWrites

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Posts one Event about a pool (kopf.event in the operator; a list in tests).
EventSink = Callable[[Mapping[str, Any], Event], None]


@dataclass
class PassResult:
    """What one pass saw and did (for logs, tests and the deletion handler)."""

    pool: str
    deleting: bool = False
    status: dict[str, Any] = field(default_factory=dict)
    #: Nodes a deletion still waits for (empty when not deleting or when done).
    unreleased: tuple[str, ...] = ()
    #: Human-readable list of the writes made ("created OffloadPoolNode p.n1", ...).
    writes: list[str] = field(default_factory=list)
    #: CPU the pass took (in its thread, and in the threads that sent its writes several at a
    #: time: ``writes``), and the part of it spent writing. The daemon paces passes by the
    #: difference: reading the indexes and aggregating is O(nodes) per pass, whereas each write
    #: is one change that must be made once, however the passes fall.
    cpu_seconds: float = 0.0
    write_cpu_seconds: float = 0.0

    @property
    def paced_cpu_seconds(self) -> float:
        return max(0.0, self.cpu_seconds - self.write_cpu_seconds)


class Renewed(NamedTuple):
    """A node's view and the same view with its agent's heartbeat from the last Lease list."""

    view: PoolNodeReport
    renewed: PoolNodeReport


class AppliedDaemonSet(NamedTuple):
    """The DaemonSet rendering this process last applied for a pool."""

    rendering: str
    generation: int
    at: float  # monotonic


class Marked(NamedTuple):
    """A Node whose marks a pass found as they should be, and the pool's verdict then."""

    info: SelectableNode
    ready: bool
    #: the extended resource's count then (the pool's ``spec.partitions``)
    advertised: int = 1


class AppliedDeviceClass(NamedTuple):
    """A DRA pool's DeviceClass as this process last left it: the rendering applied, or None
    for none there (deleted, or found gone)."""

    rendering: str | None
    at: float  # monotonic


class MarkWrite(NamedTuple):
    """A Node's marks to write: the pool Ready there or not, and the status patch."""

    node: str
    ready: bool
    patch: dict[str, Any]


@dataclass
class PoolMemory:
    """What one pool's passes keep for the next in this process (all of it derived from the
    cluster, so a restarted operator starts without it): a cache, never a source of truth."""

    #: the last list of the pool's heartbeats (Lease name -> renewTime) and when it was made
    heartbeats: dict[str, datetime] | None = None
    heartbeats_listed_at: float = float("-inf")
    #: node -> its view with the heartbeat from ``heartbeats``: see ``Reconciler._renewed``
    renewed: dict[str, Renewed] = field(default_factory=dict)
    #: the DaemonSet last applied: see ``Reconciler._apply_daemonset``
    daemonset: AppliedDaemonSet | None = None
    #: the pool's DeviceClass as last applied or removed: see ``Reconciler._sync_device_class``
    device_class: AppliedDeviceClass | None = None
    #: node -> when a pass first found it selected without an OffloadPoolNode
    unclaimed: dict[str, float] = field(default_factory=dict)
    #: which nodes the pool selects, decided again only for Nodes that changed
    selection: Selection = field(default_factory=Selection)
    #: node -> the Node for which a pass found its marks as they should be: see
    #: ``Reconciler._sync_node_marks``
    marked: dict[str, Marked] = field(default_factory=dict)
    #: since when (monotonic) passes find a node whose agent is not at work; None: none is
    stuck_since: float | None = None
    #: when the agent pods were last looked at, and what the scheduler said then (node -> why
    #: its agent pod is not placed): see ``Reconciler._look_at_agent_pods``
    pods_checked_at: float = float("-inf")
    unschedulable: dict[str, str] = field(default_factory=dict)


#: Names listed in one NodeSelected Event at most (the rest are counted).
EVENT_NODE_NAMES = 10


def heartbeat_list_max_age(config: OperatorConfig) -> float:
    """How long a pass may reuse the last list of the pool's heartbeats even when a node is stale
    by it (the longest a revived agent is taken for silent)."""
    age = config.resync_seconds / 2
    if config.heartbeat_timeout_seconds > 0:
        age = min(age, config.heartbeat_timeout_seconds / 4)
    return age


def agent_pods_period(config: OperatorConfig) -> float:
    """How long a node must have had no agent at work before a pass looks at the pool's agent
    pods, and how often at most while that lasts: at least ``--node-object-grace`` (a pool over
    a thousand new nodes lists no thousand pods while its agents start), at least
    ``heartbeat_list_max_age``."""
    return max(heartbeat_list_max_age(config), config.node_object_grace_seconds)


def named(nodes: Sequence[str]) -> str:
    """``a, b, c`` — or the first EVENT_NODE_NAMES and how many more."""
    shown = ", ".join(nodes[:EVENT_NODE_NAMES])
    more = len(nodes) - EVENT_NODE_NAMES
    return f"{shown} and {more} more" if more > 0 else shown


#: how many of a pass's writes its log line names one by one
WRITES_NAMED = 5


def summary(writes: Sequence[str], named: int = WRITES_NAMED) -> str:
    """A pass's writes in one readable line: the first few, then how many more of each kind
    ("unmarked node" ×995) — a pass over a thousand nodes used to log a thousand names."""
    if len(writes) <= named:
        return "; ".join(writes)
    kinds = Counter(" ".join(w.split()[:2]) for w in writes[named:])
    more = ", ".join(f"{kind} ×{n}" for kind, n in kinds.most_common())
    return "; ".join(writes[:named]) + f"; and {len(writes) - named} more: {more}"


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        config: OperatorConfig,
        emit: EventSink,
        nodes: WatchedKind[SelectableNode],
        node_objects: WatchedKind[PoolNodeReport],
        clock: Callable[[], datetime] = utcnow,
    ):
        self.kube = kube
        self.config = config
        self.emit = emit
        self.nodes = nodes
        self.node_objects = node_objects
        self.clock = clock
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._memory: dict[str, PoolMemory] = {}
        self.writes = ParallelWrites(config.write_concurrency)
        #: the operator's RBAC does not let it read ServiceAccounts (an older release's)
        self._accounts_forbidden = False

    def _send(self, calls: Sequence[Callable[[], T]], result: PassResult) -> Batch[T]:
        """Writes of one step of a pass, several at once (``writes``); their CPU in other
        threads counts as the pass's writing."""
        batch = self.writes.send(calls)
        result.cpu_seconds += batch.offloaded_cpu_seconds
        result.write_cpu_seconds += batch.offloaded_cpu_seconds
        return batch

    def _views(self, pool: str, now: datetime) -> dict[str, PoolNodeReport]:
        """The pool's OffloadPoolNodes by node, each with its agent's last heartbeat.

        The last list of the pool's heartbeat Leases is reused unless a node is stale by it and the list
        is at least ``heartbeat_list_max_age`` old (see the module's docstring).
        """
        objects, memory = self.node_objects.group(pool), self._memory[pool]
        if memory.heartbeats is not None:
            views = self._renewed(pool, objects, memory)
            cutoff = stale_cutoff(now, self.config.heartbeat_timeout_seconds)
            recent = time.monotonic() - memory.heartbeats_listed_at < heartbeat_list_max_age(self.config)
            if recent or not any(view.silent_before(cutoff) for view in views.values()):
                return views
        memory.heartbeats_listed_at = time.monotonic()
        memory.heartbeats = self.kube.list_agent_heartbeats(self.config.namespace, pool)
        memory.renewed = {}
        return self._renewed(pool, objects, memory)

    @staticmethod
    def _renewed(
        pool: str, objects: Mapping[str, PoolNodeReport], memory: PoolMemory
    ) -> dict[str, PoolNodeReport]:
        """Each view with its heartbeat from the last Lease list (``PoolNodeReport.renewed``),
        remembered for as long as the view is the same object and the list the same: most of a
        pool's views and its list outlast many passes, and making each again was a tenth of a
        pass at 1,000 nodes."""
        renewals, memo, views = memory.heartbeats or {}, memory.renewed, {}
        for node, view in objects.items():
            hit = memo.get(node)
            if hit is None or hit.view is not view:  # memo holds the view: its id stays unique
                hit = Renewed(view, view.renewed(renewals.get(node_object_name(pool, node))))
                memo[node] = hit
            views[node] = hit.renewed
        return views

    def forget(self, pool: str) -> None:
        """Drop the memory of a deleted pool's passes (``PoolMemory``: its heartbeat list, its
        nodes' views, selection and marks — O(nodes)). A pool is gone for good once its
        deletion is done; one made again under the same name starts afresh. The lock stays: a
        pass still finishing holds it."""
        with self._lock(pool):
            self._memory.pop(pool, None)

    def _lock(self, pool: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(pool, threading.Lock())

    def run(self, name: str) -> PassResult | None:
        """One pass over pool ``name``; None when the pool no longer exists."""
        with self._lock(name):
            started, written = time.thread_time(), self.kube.write_cpu_seconds()
            pool = self.kube.get_pool(name)
            if pool is None:
                self._memory.pop(name, None)
                return None
            self._memory.setdefault(name, PoolMemory())
            result = self._pass(pool, self.nodes.values())
            result.cpu_seconds += time.thread_time() - started
            result.write_cpu_seconds += self.kube.write_cpu_seconds() - written
            if result.writes:
                writes = summary(result.writes)
                log.info(
                    "pool %s: %s (pass: %.0f CPU-ms, %.0f of them writing)",
                    name,
                    writes,
                    1000 * result.cpu_seconds,
                    1000 * result.write_cpu_seconds,
                )
            return result

    def _pass(self, pool: dict[str, Any], node_infos: Sequence[SelectableNode]) -> PassResult:
        meta, spec = pool["metadata"], pool.get("spec") or {}
        name, generation = meta["name"], int(meta.get("generation") or 1)
        deleting = bool(meta.get("deletionTimestamp"))
        result = PassResult(pool=name, deleting=deleting)
        now = self.clock()
        timeout = self.config.heartbeat_timeout_seconds
        existing = {n.name: n for n in node_infos}

        ds_generation: int | None = None
        if not deleting:
            outcome, ds_generation = self._apply_daemonset(pool)
            if outcome != "unchanged":
                result.writes.append(f"{outcome} DaemonSet {daemonset.daemonset_name(name)}")
                self.emit(
                    pool,
                    Event(
                        "Normal",
                        f"DaemonSet{outcome.capitalize()}",
                        f"agent DaemonSet {self.config.namespace}/{daemonset.daemonset_name(name)} {outcome}",
                    ),
                )

        self._sync_device_class(pool, result)
        selected = self._memory[name].selection.selected(spec, existing.values())
        views = self._views(name, now)

        if deleting:
            self._memory[name].unclaimed.clear()
        else:
            self._sync_node_objects(pool, generation, selected, views, existing, result)
            self._roll_out(pool, generation, selected, views, now, timeout, result)
            if ds_generation is not None:
                self._replace_outdated_agents(pool, generation, ds_generation, selected, views, result)

        unschedulable = self._look_at_agent_pods(pool, selected, views, now, result)
        never_ran = self._agents_never_ran(name, views, existing) if deleting else frozenset()
        agg = aggregate(
            generation=generation,
            selected=selected,
            views=views,
            previous_conditions=(pool.get("status") or {}).get("conditions") or (),
            now=now,
            heartbeat_timeout=timeout,
            deleting=deleting,
            existing_nodes=existing.keys(),
            unschedulable=unschedulable,
            never_ran=never_ran,
        )
        result.unreleased = agg.unreleased_nodes
        shares = spec.get("partitions")
        count = shares if isinstance(shares, int) and not isinstance(shares, bool) and shares > 0 else 1
        if deviceclass.is_dra(spec):
            count = 0  # its DeviceClass stands for the resource: no node may advertise it
        self._sync_node_marks(name, agg.ready_nodes, existing, result, count)

        before = pool.get("status") or {}
        result.status = agg.status
        if any(before.get(k) != v for k, v in agg.status.items()):
            self.kube.patch_pool_status(name, agg.status)
            result.writes.append("patched pool status")
            for event in transitions(before, agg.status, agg.failed_nodes):
                self.emit(pool, event)
        return result

    def _apply_daemonset(self, pool: Mapping[str, Any]) -> tuple[str, int | None]:
        """``Kube.apply_daemonset``, unless this process applied the same rendering less than a
        resync ago: then "unchanged" without reading the DaemonSet back (a read per pass, two a
        second while a large pool converges). One deleted by hand is so made again within two
        resyncs, as before by the next."""
        body = daemonset.render(pool, self.config)
        rendered = body["metadata"]["annotations"][daemonset.HASH_ANNOTATION]
        memory = self._memory[pool["metadata"]["name"]]
        last = memory.daemonset
        if (
            last is not None
            and last.rendering == rendered
            and time.monotonic() - last.at < self.config.resync_seconds
        ):
            return "unchanged", last.generation
        outcome, generation = self.kube.apply_daemonset(body)
        if generation is not None:
            memory.daemonset = AppliedDaemonSet(rendered, generation, time.monotonic())
        return outcome, generation

    def _sync_device_class(self, pool: Mapping[str, Any], result: PassResult) -> None:
        """A DRA pool's DeviceClass there and as rendered; none for any other pool, or one being
        deleted. Like the DaemonSet, not read back while this process applied the same
        rendering less than a resync ago; a pool found without one is not asked again."""
        name = pool["metadata"]["name"]
        memory = self._memory[name]
        last, now = memory.device_class, time.monotonic()
        class_name = dra.pool_device_class(name)
        if deviceclass.wanted(pool):
            body = deviceclass.render(pool)
            rendered = deviceclass.rendering(body)
            if last is not None and last.rendering == rendered and now - last.at < self.config.resync_seconds:
                return
            outcome = self.kube.apply_device_class(body)
            memory.device_class = AppliedDeviceClass(rendered, now)
        else:
            if last is not None and last.rendering is None:
                return
            try:
                outcome = "deleted" if self.kube.delete_device_class(class_name) else "unchanged"
            except ApiException as exc:
                # An operator without the right (RBAC of a release before DRA delivery) made no
                # class either: a pool that is no DRA pool must not fail its passes for it.
                if exc.status != 403:
                    raise
                log.warning("pool %s: may not delete DeviceClass %s (403); not asked again", name, class_name)
                outcome = "unchanged"
            memory.device_class = AppliedDeviceClass(None, now)
        if outcome != "unchanged":
            result.writes.append(f"{outcome} DeviceClass {class_name}")
            self.emit(
                pool,
                Event("Normal", f"DeviceClass{outcome.capitalize()}", f"DeviceClass {class_name} {outcome}"),
            )

    def _sync_node_objects(
        self,
        pool: Mapping[str, Any],
        generation: int,
        selected: Sequence[str],
        views: dict[str, PoolNodeReport],
        existing: Mapping[str, SelectableNode],
        result: PassResult,
    ) -> None:
        """One OffloadPoolNode per selected Node; none for Nodes gone or no longer selected.

        A selected node's agent creates its own when it starts; a pass creates the ones still
        missing ``node_object_grace_seconds`` after a pass first found them missing (so the
        passes of a pool converging over a thousand new nodes write nothing for them).
        """
        name = pool["metadata"]["name"]
        created: list[str] = []
        unclaimed = self._memory[name].unclaimed
        for node in set(unclaimed) - set(selected).difference(views):
            del unclaimed[node]
        clock = time.monotonic()
        due: list[str] = []
        for node in selected:
            if node in views:
                continue
            if clock - unclaimed.setdefault(node, clock) >= self.config.node_object_grace_seconds:
                due.append(node)
        batch = self._send(
            [partial(self.kube.create_node_object, new_object(pool, node, generation)) for node in due],
            result,
        )
        for node, made in batch.answered(due):  # a failed create stays unclaimed: tried next pass
            del unclaimed[node]
            if made is not None:
                self.node_objects.apply(made)
                created.append(node)
                result.writes.append(f"created OffloadPoolNode {node_object_name(name, node)}")
            views[node] = PoolNodeReport(node=node, target_generation=generation)
        if created:  # one Event per pass, not one per node (a new pool over 1,000 nodes)
            self.emit(
                pool,
                Event(
                    "Normal",
                    "NodeSelected",
                    f"{len(created)} node(s) selected, OffloadPoolNode created: {named(created)}",
                ),
            )
        for node in sorted(set(views) - set(selected)):
            deleted = self.kube.delete_node_object(node_object_name(name, node))
            self.node_objects.discard(node_object_name(name, node))
            if deleted:
                gone = node not in existing
                result.writes.append(f"deleted OffloadPoolNode {node_object_name(name, node)}")
                self.emit(
                    pool,
                    Event(
                        "Normal" if gone else "Warning",
                        "NodeRemoved" if gone else "NodeDeselected",
                        f"node {node} was deleted: its OffloadPoolNode is removed"
                        if gone
                        else f"node {node} no longer matches the pool's nodeSelector/tolerations: its "
                        "OffloadPoolNode is removed (the DaemonSet controller removes its agent; memory "
                        "already on the node stays there)",
                    ),
                )
            del views[node]
        batch.raise_first()

    def _roll_out(
        self,
        pool: Mapping[str, Any],
        generation: int,
        selected: Sequence[str],
        views: dict[str, PoolNodeReport],
        now: datetime,
        timeout: float,
        result: PassResult,
    ) -> None:
        """Advance targetGeneration where the rollout allows it now (see ``rollout``): at most
        one serving node, but every node not Ready at once, so several at a time (``writes``)."""
        name = pool["metadata"]["name"]
        step = rollout.plan(generation, views, selected, now=now, heartbeat_timeout=timeout)
        batch = self._send(
            [
                partial(
                    self.kube.patch_node_object,
                    node_object_name(name, adv.node),
                    nodes.advance_patch(generation, adv.serving),
                )
                for adv in step.advance
            ],
            result,
        )
        for adv, answer in batch.answered(step.advance):
            self.node_objects.apply(answer)
            view = views[adv.node]
            views[adv.node] = replace(
                view,
                target_generation=generation,
                rollout_generation=generation if adv.serving else view.rollout_generation,
            )
            result.writes.append(f"advanced {adv.node} to generation {generation}")
            if adv.serving:
                self.emit(
                    pool,
                    Event(
                        "Normal", "RolloutAdvanced", f"generation {generation} released to node {adv.node}"
                    ),
                )
        batch.raise_first()

    def _replace_outdated_agents(
        self,
        pool: Mapping[str, Any],
        generation: int,
        ds_generation: int,
        selected: Sequence[str],
        views: Mapping[str, PoolNodeReport],
        result: PassResult,
    ) -> None:
        """Give a node that is about to apply a new pool generation an agent pod with the
        matching resources.

        The DaemonSet is OnDelete, so its pods keep the requests/limits of the template they
        were made from. A capacity increase applied by such a pod would exceed its memory or
        huge-page limit. So when a node may apply the pool's generation (its target allows it)
        and has not yet, and no engine is attached there (an agent is never restarted under an
        engine), its pod is deleted if it is from an older template; the DaemonSet controller
        makes a new one. The region on the node is untouched: the agent exits on SIGTERM
        without touching memory and its successor resumes. Image-only template changes (same
        pool generation) never restart agents: they reach a node when its pod is next deleted.
        """
        if ds_generation <= 1:
            return  # one template ever: no pod can be from an older one
        name = pool["metadata"]["name"]
        candidates = {
            node
            for node in selected
            if node in views
            and (views[node].target_generation or generation) >= generation
            and views[node].observed_generation != generation
            and views[node].engines_attached == 0
        }
        if not candidates:
            return
        for pod in self.kube.list_agent_pods(self.config.namespace, daemonset.selector_labels(name)):
            node = daemonset.pod_node(pod)
            meta = pod["metadata"]
            if node not in candidates or meta.get("deletionTimestamp"):
                continue
            if (meta.get("labels") or {}).get("pod-template-generation") == str(ds_generation):
                continue
            if self.kube.delete_pod(self.config.namespace, meta["name"], meta["uid"]):
                result.writes.append(f"replaced agent pod {meta['name']} on {node}")
                self.emit(
                    pool,
                    Event(
                        "Normal",
                        "AgentReplaced",
                        f"agent pod {meta['name']} on node {node} replaced: generation {generation} "
                        "needs the DaemonSet's current requests and limits",
                    ),
                )

    def _agents_never_ran(
        self, pool: str, views: dict[str, PoolNodeReport], existing: Mapping[str, SelectableNode]
    ) -> frozenset[str]:
        """Nodes a deletion need not wait for, because no agent of the pool ever ran there, so
        nothing of the pool can be there to release: its OffloadPoolNode never got a status, its
        heartbeat Lease was never renewed, and every agent pod for the node is unplaced or has
        never started a container (``agentpods.never_ran``).

        Looked at only while a deletion waits for a node without a status, and then from lists
        made now (the pool's agent pods, its heartbeat Leases; ``views`` takes the new
        heartbeats), never the ones a pass keeps: what lets a finalizer go must be current. An
        agent that starts after this still finds the pool being deleted, and only releases.
        """
        silent = [n for n, v in views.items() if n in existing and v.phase is None and v.heartbeat is None]
        if not silent:
            return frozenset()
        pods = self.kube.list_agent_pods(self.config.namespace, daemonset.selector_labels(pool))
        memory = self._memory[pool]
        memory.heartbeats_listed_at = time.monotonic()
        memory.heartbeats = self.kube.list_agent_heartbeats(self.config.namespace, pool)
        memory.renewed = {}
        views.update(self._renewed(pool, self.node_objects.group(pool), memory))
        never = agentpods.never_ran(pods)
        return frozenset(
            n for n in silent if n in never and views[n].phase is None and views[n].heartbeat is None
        )

    def _look_at_agent_pods(
        self,
        pool: Mapping[str, Any],
        selected: Sequence[str],
        views: Mapping[str, PoolNodeReport],
        now: datetime,
        result: PassResult,
    ) -> dict[str, str]:
        """Why agents are not at work, from their pods: node -> the scheduler's reason its
        agent pod is not placed. Replaces every agent pod whose token predates its
        ServiceAccount (``agentpods.stale_credentials``): such an agent answers nothing but 401
        for as long as its pod lives, so neither its status nor a deletion would ever move.

        Looked at only while some node's agent has not been at work (no report, silent past the
        heartbeat timeout; when deleting, any node not yet Released) for ``agent_pods_period``,
        and then at most that often: a converged pool, or one whose agents are just starting,
        lists no pods.
        """
        meta = pool["metadata"]
        name, memory = meta["name"], self._memory[meta["name"]]
        if meta.get("deletionTimestamp"):
            stuck = any(view.phase != RELEASED for view in views.values())
        else:
            cutoff = stale_cutoff(now, self.config.heartbeat_timeout_seconds)
            stuck = any(
                (view := views.get(node)) is None or view.phase is None or view.silent_before(cutoff)
                for node in selected
            )
        clock, period = time.monotonic(), agent_pods_period(self.config)
        if not stuck:
            memory.stuck_since, memory.unschedulable = None, {}
            return {}
        if memory.stuck_since is None:
            memory.stuck_since = clock
        if clock - memory.stuck_since < period or clock - memory.pods_checked_at < period:
            return memory.unschedulable
        memory.pods_checked_at = clock
        namespace = self.config.namespace
        pods = self.kube.list_agent_pods(namespace, daemonset.selector_labels(name))
        memory.unschedulable = agentpods.unschedulable(pods)
        accounts = agentpods.service_accounts(pods)
        try:
            created = {sa: self.kube.service_account_created(namespace, sa) for sa in accounts}
        except ApiException as exc:
            if exc.status != 403:
                raise
            if not self._accounts_forbidden:  # RBAC from before this operator: say it once
                log.warning(
                    "cannot read ServiceAccounts in %s (403): agent pods whose token predates their "
                    "ServiceAccount are not replaced; apply this version's RBAC",
                    namespace,
                )
            self._accounts_forbidden, created = True, {}
        for pod in agentpods.stale_credentials(pods, created):
            pod_meta, node = pod["metadata"], daemonset.pod_node(pod)
            account = pod["spec"].get("serviceAccountName") or "default"
            if self.kube.delete_pod(namespace, pod_meta["name"], pod_meta["uid"]):
                result.writes.append(f"replaced agent pod {pod_meta['name']} on {node} (stale token)")
                self.emit(
                    pool,
                    Event(
                        "Warning",
                        "AgentReplaced",
                        f"agent pod {pod_meta['name']} on node {node} replaced: it was made before "
                        f"ServiceAccount {namespace}/{account} (deleted and made again since), so the "
                        "API server refuses its token",
                    ),
                )
        return memory.unschedulable

    def _sync_node_marks(
        self,
        pool: str,
        ready: frozenset[str],
        existing: Mapping[str, SelectableNode],
        result: PassResult,
        count: int = 1,
    ) -> None:
        """Label and extended resource on exactly the Nodes where the pool is Ready (several
        Nodes at once: a pass may find hundreds of agents newly Ready).

        A Node whose marks a pass found right is not looked at again while it is the same
        ``SelectableNode`` (the index hands out a new one when the Node changes, or when the answer
        to a mark comes back) and the pool's verdict on it the same: at a thousand nodes,
        looking at every Node every pass was a quarter of a pass.
        """
        marked = self._memory[pool].marked
        todo: list[MarkWrite] = []
        for info in existing.values():
            is_ready = info.name in ready
            hit = marked.get(info.name)
            if hit is not None and hit.info is info and hit.ready is is_ready and hit.advertised == count:
                continue
            patch = None
            if is_ready or nodes.carries_pool(pool, info):
                patch = nodes.marks_patch(pool, info, is_ready, count)
            if patch:
                todo.append(MarkWrite(info.name, is_ready, patch))
            else:
                marked[info.name] = Marked(info, is_ready, count)
        if len(marked) > len(existing):  # Nodes deleted since: forget them
            for node in set(marked).difference(existing):
                del marked[node]
        batch = self._send([partial(self.kube.patch_node_status, w.node, w.patch) for w in todo], result)
        for write, answer in batch.answered(todo):
            self.nodes.apply(answer)
            result.writes.append(f"{'marked' if write.ready else 'unmarked'} node {write.node}")
        batch.raise_first()
