"""OffloadPool status: the pool's state over its nodes. Written by the operator only.

The shape answers "is it ready, where not, why": counts for the printer columns, standard
conditions (Ready, Progressing, Degraded) for tools, and a short list of failing nodes with
their reasons for people.
"""

from __future__ import annotations

from datetime import datetime
from typing import Final, Literal

from pydantic import Field

from offloadpool.region.vocabulary import READY

from .base import StatusModel, Timestamp, now

MAX_FAILING_NODES = 20

#: Nodes are provisioning or a spec change is rolling out (a condition type and a phase).
PROGRESSING: Final = "Progressing"
#: A node failed, or its agent is not at work (a condition type and a phase).
DEGRADED: Final = "Degraded"
#: The pool is being deleted; the finalizer waits for its nodes to release the memory (a
#: phase and a condition reason).
DELETING: Final = "Deleting"
#: No Node matches the pool (a phase).
NO_NODES: Final = "NoNodes"
#: The pool's conditions: ``Ready`` (the node phase's word: Ready on every selected node),
#: ``Progressing``, ``Degraded``.
CONDITION_TYPES: Final = (READY, PROGRESSING, DEGRADED)
#: ``status.phase``: the conditions summed up for ``kubectl get``.
POOL_PHASES: Final = (READY, PROGRESSING, DEGRADED, DELETING, NO_NODES)

#: Condition reasons the operator's Events post as Warnings whatever the status.
#: A node failed at the generation the rollout moved it to: the rollout stops.
ROLLOUT_HALTED: Final = "RolloutHalted"
#: The new generation waits on nodes where an engine holds the lease.
ROLLOUT_PENDING: Final = "RolloutPending"
#: A node's new generation waits for its agent pod to be replaced with the DaemonSet's current
#: requests and limits (an OffloadPoolNode's reason; the operator replaces the pod).
AGENT_REPLACEMENT_PENDING: Final = "AgentReplacementPending"
#: A deletion waits for nodes to release the memory.
WAITING_FOR_RELEASE: Final = "WaitingForRelease"


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
