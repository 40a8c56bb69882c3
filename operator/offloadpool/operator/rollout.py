"""Which OffloadPoolNodes may take the pool's new generation now. A pure function.

A spec change must never be forced under a running engine, and a bad change should not take
every node down at once. The operator therefore moves ``spec.targetGeneration`` forward:

- at once on nodes that are not Ready (no status, Pending, Provisioning, Populating, Failed,
  unresponsive): no engine can be using memory there, holding them back protects nothing;
- one at a time on Ready nodes: the next one only when the previous one is Ready at the new
  generation, or reports ``pendingGeneration`` (an engine holds the lease: the agent applies the
  change when it lets go; the rollout skips it and goes on, it never forces);
- never past a node that was Ready, was advanced, and then Failed at the new generation: the
  rollout halts there (``Progressing`` says RolloutHalted) until the node recovers or the spec
  changes again.

Which Ready node is "in flight" is read from the ``offloadpool.io/rollout-generation``
annotation the operator writes together with the target, so a restarted operator continues
exactly where the previous one stopped and never advances a second node early.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from offloadpool.region.vocabulary import FAILED, READY

from .pool_node_report import PoolNodeReport, stale_cutoff


@dataclass(frozen=True)
class Advance:
    """Set ``targetGeneration`` on ``node``; ``serving`` = it was Ready (mark it in flight)."""

    node: str
    serving: bool


@dataclass(frozen=True)
class RolloutPlan:
    advance: tuple[Advance, ...]
    in_flight: tuple[str, ...]
    halted: tuple[str, ...]


def _at_target(view: PoolNodeReport, generation: int) -> bool:
    return view.target_generation is None or view.target_generation >= generation


def plan(
    generation: int,
    views: Mapping[str, PoolNodeReport],
    selected: Iterable[str],
    *,
    now: datetime,
    heartbeat_timeout: float = 0.0,
) -> RolloutPlan:
    """The advances to make now for the pool at ``generation`` over the selected nodes."""
    names = sorted(n for n in set(selected) if n in views)
    cutoff = stale_cutoff(now, heartbeat_timeout)
    advance: list[Advance] = []
    in_flight: list[str] = []
    halted: list[str] = []
    waiting: list[str] = []
    for name in names:
        view = views[name]
        serving = view.phase == READY and not view.silent_before(cutoff)
        if view.rollout_generation == generation and _at_target(view, generation):
            done = serving and view.observed_generation == generation
            if view.held and view.pending_generation == generation and serving:
                done = True  # held by an engine: skipped, never forced
            if view.phase == FAILED and view.observed_generation == generation:
                halted.append(name)
            elif not done:
                in_flight.append(name)
            continue
        if _at_target(view, generation):
            continue
        if not serving:
            advance.append(Advance(name, serving=False))
        else:
            waiting.append(name)
    if waiting and not in_flight and not halted:
        advance.append(Advance(waiting[0], serving=True))
    return RolloutPlan(tuple(advance), tuple(in_flight), tuple(halted))
