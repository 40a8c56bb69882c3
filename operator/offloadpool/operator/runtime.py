"""Per-process state of the operator, shared by the handlers through kopf's ``memo``.

Holds the configuration, the API access, the reconciler, and one wake-up Event per pool. The
state is disposable: it caches nothing that a restarted operator could not rebuild from the
cluster (the triggers only say "look again").
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import kopf

from .config import OperatorConfig
from .events import Event
from .kube import Kube, load_client
from .reconcile import Reconciler
from .selection import NodeInfo


def post_event(pool: Mapping[str, Any], event: Event) -> None:
    """Post through kopf's event queue (thread-safe; kopf retries and batches posting)."""
    kopf.event(dict(pool), type=event.type, reason=event.reason, message=event.message[:1024])


class Runtime:
    def __init__(self, config: OperatorConfig) -> None:
        self.config = config
        self.reconciler: Reconciler | None = None
        self._triggers: dict[str, asyncio.Event] = {}
        self._node_seen: dict[str, NodeInfo] = {}
        self._pool_seen: dict[str, tuple[Any, ...]] = {}

    def connect(self) -> None:
        """Load credentials (in-cluster or kubeconfig) and build the reconciler."""
        if self.reconciler is None:
            self.reconciler = Reconciler(Kube(load_client()), self.config, post_event)

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

    def forget(self, pool: str) -> None:
        self._triggers.pop(pool, None)
        self._pool_seen.pop(pool, None)

    def node_changed(self, info: NodeInfo | None, name: str) -> bool:
        """Record a Node's state; True when it changed in a way a pass must see at once.

        That is: the Node came or went, its selection (labels, taints) changed, or it lost a
        pool mark (a label or resource removed by someone else, e.g. a re-registering kubelet).
        The operator's own marks appearing are no news: waking every pool for each label it
        wrote itself made passes beget passes while a pool converged.
        """
        if info is None:
            return self._node_seen.pop(name, None) is not None
        before = self._node_seen.get(name)
        self._node_seen[name] = info
        if before is None or before == info:
            return before is None
        return before.selection_key() != info.selection_key() or bool(before.marks() - info.marks())

    def pool_changed(self, name: str, body: Mapping[str, Any]) -> bool:
        """True when a pool event carries something a pass acts on: a new spec (generation),
        deletion, finalizers. Its status — written by the operator's own passes — is not."""
        meta = body.get("metadata") or {}
        key = (meta.get("generation"), meta.get("deletionTimestamp"), tuple(meta.get("finalizers") or ()))
        if self._pool_seen.get(name) == key:
            return False
        self._pool_seen[name] = key
        return True
