"""The agent makes its own OffloadPoolNode when a new pool's object is missing.

As node-feature-discovery's workers create their NodeFeature objects: the operator would
otherwise make one per selected node in its passes, a large share of its CPU while a new pool
converges over many nodes. The operator still makes the object of every selected node whose
agent has not within ``--node-object-grace``, and removes a deselected node's: so an agent
makes its object only while the pool is live and only when this process has never seen it (one
that disappeared after it was seen is the operator's to make again).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.rest import ApiException

from offloadpool.agent import kube
from offloadpool.agent.metrics import AgentMetrics
from offloadpool.agent.observation import Observation
from offloadpool.agent.retry_soon import RetrySoon

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class PoolNodeCreation:
    """Whether and when this process creates its OffloadPoolNode; the create itself."""

    access: kube.KubeAccess
    metrics: AgentMetrics
    #: where the created object is kept, as if a read had brought it
    observation: Observation
    soon: RetrySoon
    #: this process has seen its OffloadPoolNode (so a missing one was removed: not ours to
    #: make again)
    seen: bool = field(default=False, init=False)
    #: the create was refused by RBAC (an older release's, where only the operator makes it)
    refused: bool = field(default=False, init=False)
    #: creates refused in a row
    _failures: int = field(default=0, init=False)

    def saw(self, pool_node: dict[str, Any] | None) -> None:
        """What a step found of the object: once seen, a missing one is not ours to make."""
        self.seen = self.seen or pool_node is not None

    def may_create(self, pool: dict[str, Any] | None) -> bool:
        """Whether a step creates our OffloadPoolNode if it is missing (``create``)."""
        if pool is None or self.seen or self.refused:
            return False
        meta = pool.get("metadata") or {}
        return not meta.get("deletionTimestamp") and bool(meta.get("uid"))

    def create(self, pool: dict[str, Any]) -> dict[str, Any] | None:
        """Create this node's OffloadPoolNode when ``may_create``; None when not made.

        Refused by RBAC: logged once, the operator makes it. Refused otherwise (a new pool's
        agents all start at once, and the API server's priority and fairness answers 429 to
        many): tried again soon (``RetrySoon``), not a retry period later.
        """
        if not self.may_create(pool):
            return None
        try:
            made = self.access.create_pool_node(pool)
        except ApiException as exc:
            log.warning("cannot create the OffloadPoolNode: %s %s", exc.status, exc.reason)
            self.metrics.error("CreatePoolNode")
            self.refused = exc.status == 403
            self._failures += 1
            self.soon.after(exc, self._failures)
            return None
        self._failures = 0
        self.observation.created(made)
        return made
