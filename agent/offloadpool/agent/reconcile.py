"""What the agent should do on its node, decided from what it observes — no side effects here.

Inputs: the OffloadPool (spec, generation, deletion), this node's OffloadPoolNode (whether it
exists, which generation the operator lets this node apply now) and the generation of the
region already on the node (from its manifest). Output: one Decision. Keeping this pure makes
every lifecycle rule of docs/agent.md ("The loop") a unit test. The spec becomes the engine's request through
``offloadpool.api.conversion.pool_request``, the conversion the CLI uses too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from offloadpool.api.conversion import pool_request
from offloadpool.api.spec import DEFAULT_RECLAIM
from offloadpool.api.status import ROLLOUT_PENDING
from offloadpool.region.request import PoolRequest
from offloadpool.region.vocabulary import RECLAIM_RETAIN


class Action(enum.Enum):
    WAIT = "wait"  # nothing to act on yet (no OffloadPoolNode): check again later
    PROVISION = "provision"  # make the region match this request (a no-op when it already does)
    KEEP = "keep"  # leave the region as it is; a newer generation waits for the operator
    RELEASE = "release"  # pool deleted, reclaimPolicy Delete: give the memory back
    RETAIN = "retain"  # pool deleted, reclaimPolicy Retain: leave memory, report Released
    IDLE = "idle"  # the pool is gone: nothing to report to


@dataclass(frozen=True)
class Decision:
    action: Action
    request: PoolRequest | None = None
    reason: str = ""
    message: str = ""
    #: a newer generation this step tries to apply (reported as pending if an engine holds the lease)
    pending_generation: int | None = None


def _get(d: dict[str, Any] | None, *path: str, default: Any = None) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d or d[key] is None:
            return default
        d = d[key]
    return d


def decide(
    pool: dict[str, Any] | None,
    pool_node: dict[str, Any] | None,
    local_generation: int | None,
    workers_override: int = 0,
) -> Decision:
    """One step of the agent's control loop.

    ``local_generation`` is the generation recorded in the region manifest on this node (None
    when no complete region exists). Rules:
    - no pool: IDLE (the operator's finalizer normally keeps the pool until we report Released);
    - pool being deleted: RELEASE (Delete) or RETAIN (Retain) — the lease is checked when acting;
    - no OffloadPoolNode: WAIT (the loop creates it before deciding; missing still, it is the
      operator's to make);
    - nothing on the node yet, or the region is at the pool's generation: PROVISION (validates
      and reuses a region that matches, so a restarted agent does not re-populate);
    - region at an older generation: PROVISION when the operator's ``targetGeneration`` allows
      (the lease is checked when acting: held means pending), else KEEP and report pending.
    """
    if pool is None:
        return Decision(Action.IDLE, reason="PoolGone", message="the OffloadPool no longer exists")
    meta = pool.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        policy = _get(pool, "spec", "reclaimPolicy", default=DEFAULT_RECLAIM)
        if policy == RECLAIM_RETAIN:
            return Decision(
                Action.RETAIN,
                reason="Retained",
                message="pool deleted with reclaimPolicy Retain: memory left on the node for inspection",
            )
        return Decision(Action.RELEASE, reason="PoolDeleted", message="pool deleted: releasing the region")
    if pool_node is None:
        return Decision(
            Action.WAIT,
            reason="NoPoolNode",
            message="waiting for this node's OffloadPoolNode (the operator makes it when the agent may not)",
        )
    request = pool_request(pool, workers_override)
    desired = request.generation
    target = _get(pool_node, "spec", "targetGeneration")
    if local_generation is None or local_generation == desired:
        return Decision(Action.PROVISION, request)
    if target is None or int(target) >= desired:
        return Decision(Action.PROVISION, request, pending_generation=desired)
    # not "pending" in the contract's sense (that means: held by an engine); the operator knows
    # it has not advanced this node yet, the reason only tells a human
    return Decision(
        Action.KEEP,
        request,
        reason=ROLLOUT_PENDING,
        message=f"generation {desired} waits for the operator's rollout (this node may apply {target})",
    )
