"""OffloadPool status: the pool's state over its nodes. Written by the operator only.

The shape answers "is it ready, where not, why": counts for the printer columns, standard
conditions (Ready, Progressing, Degraded) for tools, and a short list of failing nodes with
their reasons for people.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from .base import StatusModel, Timestamp, now

MAX_FAILING_NODES = 20
CONDITION_TYPES = ("Ready", "Progressing", "Degraded")


ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(StatusModel):
    """The metav1.Condition shape."""

    type: str
    status: ConditionStatus
    last_transition_time: Timestamp = Field(default_factory=now)
    reason: str
    message: str = ""
    observed_generation: int | None = Field(default=None, ge=0)


def transition(
    previous: Condition | None,
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str = "",
    observed_generation: int | None = None,
    at: datetime | None = None,
) -> Condition:
    """The condition as it reads now: ``lastTransitionTime`` is ``previous``'s while the status
    stays the same (reason and message may change), ``at`` (default: now) when it flips.

    The one rule for every writer of conditions (the operator's aggregate, ``set_condition``)."""
    if previous is not None and previous.status == status:
        since = previous.last_transition_time
    else:
        since = at or now()
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        observed_generation=observed_generation,
        last_transition_time=since,
    )


class FailingNode(StatusModel):
    """A node where the pool is not Ready, and why."""

    node: str
    reason: str | None = None
    message: str | None = None


class OffloadPoolStatus(StatusModel):
    """Aggregated state of the pool on its nodes."""

    observed_generation: int | None = Field(default=None, ge=0)
    phase: str | None = Field(default=None, max_length=64)
    desired_nodes: int | None = Field(default=None, ge=0)
    ready_nodes: int | None = Field(default=None, ge=0)
    failed_nodes: int | None = Field(default=None, ge=0)
    pending_nodes: int | None = Field(default=None, ge=0)
    total_bytes: int | None = Field(default=None, ge=0)
    failing_nodes: list[FailingNode] | None = Field(default=None, max_length=MAX_FAILING_NODES)
    conditions: list[Condition] | None = None

    def condition(self, type_: str) -> Condition | None:
        """The condition of that type, if set."""
        for cond in self.conditions or ():
            if cond.type == type_:
                return cond
        return None

    def set_condition(
        self,
        type_: str,
        status: ConditionStatus,
        reason: str,
        message: str = "",
        observed_generation: int | None = None,
    ) -> bool:
        """Set a condition, keeping lastTransitionTime unless the status flips; True if changed."""
        old = self.condition(type_)
        new = transition(old, type_, status, reason, message, observed_generation)
        if old is not None and old.model_dump() == new.model_dump():
            return False
        self.conditions = [c for c in self.conditions or () if c.type != type_] + [new]
        return True
