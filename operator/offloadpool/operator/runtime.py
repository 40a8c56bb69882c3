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

    def connect(self) -> None:
        """Load credentials (in-cluster or kubeconfig) and build the reconciler."""
        if self.reconciler is None:
            self.reconciler = Reconciler(Kube(load_client()), self.config, post_event)

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

    def node_changed(self, info: NodeInfo | None, name: str) -> bool:
        """Record a Node's relevant state; True when it differs from what was seen last."""
        if info is None:
            return self._node_seen.pop(name, None) is not None
        if self._node_seen.get(name) == info:
            return False
        self._node_seen[name] = info
        return True
