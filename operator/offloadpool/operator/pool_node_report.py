"""The operator's reading of one OffloadPoolNode: what its agent reported, and the rollout
bookkeeping the operator keeps on it.

``aggregate`` and ``rollout`` take these instead of raw dicts so both read a status the same
way (for example: a missing status means "the agent has not reported yet", a heartbeat older
than the timeout means "unresponsive", whatever the phase says).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from offloadpool.api.base import parse_time
from offloadpool.api.constants import split_node_object_name

#: Set by the operator on an OffloadPoolNode it moved from Ready to a new generation, so the
#: rollout knows (after any restart) which node is "in flight" and must finish first.
ROLLOUT_ANNOTATION = "offloadpool.io/rollout-generation"
#: Reasons an agent gives when an attached engine keeps it from applying a generation.
HELD_REASONS = frozenset({"LeaseHeld", "InUse"})


def stale_cutoff(now: datetime, timeout_seconds: float) -> datetime | None:
    """The heartbeat before which an agent is stale at ``now`` (None: no timeout)."""
    return now - timedelta(seconds=timeout_seconds) if timeout_seconds > 0 else None


@dataclass(frozen=True)
class PoolNodeReport:
    node: str
    #: Generation the node may apply (spec.targetGeneration); None = the pool's current one.
    target_generation: int | None = None
    #: Generation a Ready node was advanced to by the rollout (annotation), else None.
    rollout_generation: int | None = None
    phase: str | None = None
    reason: str | None = None
    message: str | None = None
    progress: int | None = None
    bytes_total: int = 0
    observed_generation: int | None = None
    pending_generation: int | None = None
    engines_attached: int = 0
    heartbeat: datetime | None = None

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PoolNodeReport:
        meta = body.get("metadata") or {}
        spec = body.get("spec") or {}
        status = body.get("status") or {}
        annotation = (meta.get("annotations") or {}).get(ROLLOUT_ANNOTATION)
        return cls(
            node=spec.get("nodeName") or split_node_object_name(meta["name"])[1],
            target_generation=spec.get("targetGeneration"),
            rollout_generation=int(annotation) if annotation and annotation.isdigit() else None,
            phase=status.get("phase"),
            reason=status.get("reason"),
            message=status.get("message"),
            progress=status.get("progress"),
            bytes_total=int(status.get("bytesTotal") or 0),
            observed_generation=status.get("observedGeneration"),
            pending_generation=status.get("pendingGeneration"),
            engines_attached=int(status.get("enginesAttached") or 0),
            heartbeat=parse_time(status.get("heartbeat")),
        )

    def renewed(self, renew_time: datetime | None) -> PoolNodeReport:
        """This view with its agent's heartbeat Lease taken into account.

        Agents renew a Lease for liveness and write their status only on change, so the last
        sign of life is the later of the Lease's renewTime and the status' own timestamp (an
        agent busy populating writes progress but renews nothing)."""
        if renew_time is None or (self.heartbeat is not None and self.heartbeat >= renew_time):
            return self
        return replace(self, heartbeat=renew_time)

    def silent_before(self, cutoff: datetime | None) -> bool:
        """The agent reported once but has not written a heartbeat since ``cutoff``
        (``stale_cutoff``: worked out once for a whole pass, so one comparison per node instead
        of a subtraction and a conversion, several per node per pass)."""
        return (
            cutoff is not None
            and self.phase is not None
            and self.heartbeat is not None
            and self.heartbeat < cutoff
        )

    @property
    def held(self) -> bool:
        """A newer generation is waiting because an engine holds the lease (not merely for its
        turn in the rollout: agents report pendingGeneration in both cases, with different reasons)."""
        return self.pending_generation is not None and self.reason in HELD_REASONS
