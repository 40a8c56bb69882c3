"""Per-process state of the operator, shared by the handlers through kopf's ``memo``.

Holds the configuration, the API access, the reconciler, the watched Nodes and
OffloadPoolNodes (``watched``), and one wake-up Event per pool. The state is disposable: it
caches nothing that a restarted operator could not rebuild from the cluster (the indexes are
listed afresh, the triggers only say "look again").

The watches run in threads; what they decide wakes a pool's daemon through the event loop
(``call_soon_threadsafe``), and only when that pool is not already due for a pass, so a
burst of a thousand agents' updates costs a handful of loop wake-ups, not a thousand.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import kopf

from offloadpool.api.constants import GROUP, clip_message, split_node_object_name

from .config import OperatorConfig
from .events import Event
from .kube import Kube, load_client
from .pool_node_report import PoolNodeReport
from .reconcile import Reconciler
from .selection import SelectableNode
from .watched import WatchedKind

#: Extended resources of pools on Nodes are named ``offloadpool.io/<pool>``.
RESOURCE_PREFIX = f"{GROUP}/"


def node_key(body: Mapping[str, Any]) -> tuple[str, str]:
    return "", body["metadata"]["name"]


def node_object_key(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """(pool, node) of an OffloadPoolNode; None for one without a pool."""
    spec = body.get("spec") or {}
    if not spec.get("pool"):
        return None
    return spec["pool"], spec.get("nodeName") or split_node_object_name(body["metadata"]["name"])[1]


def node_info(body: Mapping[str, Any]) -> SelectableNode:
    return SelectableNode.from_body(body, RESOURCE_PREFIX)


def node_change_matters(before: SelectableNode | None, after: SelectableNode | None) -> bool:
    """True when a Node changed in a way a pass must see at once.

    That is: the Node came or went, its selection (labels, taints) changed, or it lost a pool
    mark (a label or resource removed by someone else, e.g. a re-registering kubelet). The
    operator's own marks are no news (they reach the index with the write's answer, before
    their event): waking every pool for each label it wrote itself made passes beget passes
    while a pool converged.
    """
    if before is None or after is None:
        return before is not after
    if before == after:
        return False
    return before.selection_key() != after.selection_key() or bool(before.marks() - after.marks())


def _differ_beyond_heartbeat(before: PoolNodeReport | None, after: PoolNodeReport | None) -> bool:
    if before is None or after is None:
        return before is not after
    return replace(before, heartbeat=after.heartbeat) != after


def post_event(pool: Mapping[str, Any], event: Event) -> None:
    """Post through kopf's event queue (thread-safe; kopf retries and batches posting)."""
    kopf.event(dict(pool), type=event.type, reason=event.reason, message=clip_message(event.message))


class Runtime:
    def __init__(self, config: OperatorConfig) -> None:
        self.config = config
        self.reconciler: Reconciler | None = None
        self.nodes: WatchedKind[SelectableNode] | None = None
        self.node_objects: WatchedKind[PoolNodeReport] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._triggers: dict[str, asyncio.Event] = {}
        self._pool_seen: dict[str, tuple[Any, ...]] = {}

    def connect(self, loop: asyncio.AbstractEventLoop) -> None:
        """Load credentials (in-cluster or kubeconfig), start the watches of Nodes and
        OffloadPoolNodes, and build the reconciler over them."""
        if self.reconciler is not None:
            return
        self._loop = loop
        kube = Kube(load_client())
        timeout = self.config.watch_timeout_seconds
        self.nodes = WatchedKind(
            "nodes", kube.core.list_node, node_info, node_key, self._node_event, timeout_seconds=timeout
        ).start()
        self.node_objects = WatchedKind(
            "offloadpoolnodes",
            kube.list_all_node_objects,
            PoolNodeReport.from_body,
            node_object_key,
            self._view_event,
            timeout_seconds=timeout,
        ).start()
        self.reconciler = Reconciler(kube, self.config, post_event, self.nodes, self.node_objects)

    def stop(self) -> None:
        for watched in (self.nodes, self.node_objects):
            if watched is not None:
                watched.stop()

    async def synced(self) -> None:
        """Wait until both watches have listed everything once (the first pass after a
        restart must not take "not listed yet" for "gone")."""
        while not all(w is not None and w.synced.is_set() for w in (self.nodes, self.node_objects)):
            await asyncio.sleep(0.05)

    def connected(self) -> Reconciler:
        """The reconciler; ``connect`` builds it in the startup handler, before any other runs."""
        if self.reconciler is None:
            raise RuntimeError("the operator is not connected: its startup handler has not run")
        return self.reconciler

    def trigger(self, pool: str | None) -> asyncio.Event:
        """The wake-up Event of ``pool`` (created on first use), set."""
        event = self._triggers.setdefault(pool or "", asyncio.Event())
        event.set()
        return event

    def trigger_all(self) -> None:
        for event in self._triggers.values():
            event.set()

    def _wake(self, pool: str | None) -> None:
        """Wake one pool (None: every pool) from a watch thread."""
        if self._loop is None:
            return
        if pool is not None:
            due = self._triggers.get(pool)
            # no daemon yet (its first pass comes anyway) or gone; or a pass is due already
            # and reads the index when it runs
            if due is None or due.is_set():
                return
            self._loop.call_soon_threadsafe(due.set)
        else:
            self._loop.call_soon_threadsafe(self.trigger_all)

    def _node_event(
        self, _group: str, _name: str, before: SelectableNode | None, after: SelectableNode | None
    ) -> None:
        if node_change_matters(before, after):
            self._wake(None)

    def _view_event(
        self, pool: str, _node: str, before: PoolNodeReport | None, after: PoolNodeReport | None
    ) -> None:
        """An OffloadPoolNode changed. Its heartbeat alone is no news (liveness is the Lease's,
        and the pass reads the heartbeat from the index when it runs anyway) — unless it
        brings back an agent that had been silent long enough to be taken for unresponsive."""
        if _differ_beyond_heartbeat(before, after) or self._revived(before, after):
            self._wake(pool)

    def _revived(self, before: PoolNodeReport | None, after: PoolNodeReport | None) -> bool:
        timeout = self.config.heartbeat_timeout_seconds
        if before is None or after is None or timeout <= 0 or before.heartbeat == after.heartbeat:
            return False
        if before.heartbeat is None or after.heartbeat is None:
            return True
        return (after.heartbeat - before.heartbeat).total_seconds() > timeout / 2

    def forget(self, pool: str) -> None:
        """Drop what this process keeps for a pool whose deletion is done (its passes' memory
        too: a thousand nodes' worth of it stayed behind each deleted pool)."""
        self._triggers.pop(pool, None)
        self._pool_seen.pop(pool, None)
        if self.reconciler is not None:
            self.reconciler.forget(pool)

    def pool_changed(self, name: str, body: Mapping[str, Any]) -> bool:
        """True when a pool event carries something a pass acts on: a new spec (generation),
        deletion, finalizers. Its status — written by the operator's own passes — is not."""
        meta = body.get("metadata") or {}
        key = (meta.get("generation"), meta.get("deletionTimestamp"), tuple(meta.get("finalizers") or ()))
        if self._pool_seen.get(name) == key:
            return False
        self._pool_seen[name] = key
        return True
