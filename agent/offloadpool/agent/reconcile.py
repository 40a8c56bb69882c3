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

from offloadpool.api import agent_env
from offloadpool.api.conversion import pool_request
from offloadpool.api.spec import DEFAULT_RECLAIM
from offloadpool.api.status import AGENT_REPLACEMENT_PENDING, ROLLOUT_PENDING
from offloadpool.region.request import PoolRequest
from offloadpool.region.vocabulary import RECLAIM_RETAIN


class Action(enum.Enum):
    WAIT = "wait"  # nothing to act on yet (no OffloadPoolNode): check again later
    PROVISION = "provision"  # make the region match this request (a no-op when it already does)
    KEEP = "keep"  # leave the region as it is; a newer generation waits for the operator
    #: the pod's limits were made for another capacity: keep the region, wait for a new pod
    AWAIT_AGENT = "await-agent"
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
    sized_for: str = "",
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
      (the lease is checked when acting: held means pending), else KEEP and report pending;
    - ``sized_for`` (what the agent's pod was made for, ``agent_env.SIZED_FOR_ENV``) names
      another medium or capacity than the request: AWAIT_AGENT instead of PROVISION, since the
      pod's limits are not this request's (the operator replaces the pod once nothing holds the
      pool; a holder is reported as LeaseHeld when acting).
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
    outdated = bool(sized_for) and sized_for != agent_env.sized_for(request.medium, request.capacity)
    if local_generation is None or local_generation == desired:
        if outdated and local_generation is None:  # at the pool's generation: reuse, nothing to apply
            return _await_agent(request, sized_for)
        return Decision(Action.PROVISION, request)
    if target is None or int(target) >= desired:
        if outdated:
            return _await_agent(request, sized_for)
        return Decision(Action.PROVISION, request, pending_generation=desired)
    # not "pending" in the contract's sense (that means: held by an engine); the operator knows
    # it has not advanced this node yet, the reason only tells a human
    return Decision(
        Action.KEEP,
        request,
        reason=ROLLOUT_PENDING,
        message=f"generation {desired} waits for the operator's rollout (this node may apply {target})",
    )


def _await_agent(request: PoolRequest, sized_for: str) -> Decision:
    return Decision(
        Action.AWAIT_AGENT,
        request,
        reason=AGENT_REPLACEMENT_PENDING,
        message=(
            f"generation {request.generation} ({agent_env.sized_for(request.medium, request.capacity)}) "
            f"waits for a new agent pod: this one's requests and limits were made for {sized_for}; "
            "the operator replaces it once no engine holds the pool"
        ),
        pending_generation=request.generation,
    )
