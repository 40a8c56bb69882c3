"""OffloadPoolNode statuses -> the pool's status. A pure function of current state.

The pool status is recomputed from scratch on every pass from what the agents report now, never
accumulated from events, so an operator restarted at any moment writes the same status again
(and nothing at all when it is unchanged). The previous conditions are only consulted to keep
``lastTransitionTime`` when a condition's status did not change.

Counting rules (one node is counted once):

- **ready**: phase Ready with a fresh heartbeat (at any generation: an older generation held
  back by an attached engine is still usable memory);
- **failed**: phase Failed;
- **pending**: every other selected node, plus Ready nodes not yet at the pool's generation
  (held by an engine, or waiting for their turn in the rollout).

Conditions: ``Ready`` (every selected node Ready), ``Progressing`` (nodes are provisioning or a
spec change is rolling out; False with reason Complete, RolloutPending when only nodes held by
engines remain, RolloutHalted when a node failed at the new generation), ``Degraded`` (a node
failed or its agent stopped reporting). ``phase`` sums it up for ``kubectl get``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from offloadpool.api.status import MAX_FAILING_NODES, Condition, transition

from .nodeview import NodeView

MAX_NAMES_IN_MESSAGE = 5

# Order of "how bad" a node's problem is, for the failingNodes list (worst first).
_SEVERITY = {"Failed": 0, "Unresponsive": 1, "NotReporting": 2, "Draining": 3}


@dataclass(frozen=True)
class Aggregate:
    """The computed status plus the node sets the reconciler acts on."""

    status: dict[str, Any]
    ready_nodes: frozenset[str] = frozenset()
    failed_nodes: frozenset[str] = frozenset()
    #: Nodes still holding memory that a deletion waits for (empty unless deleting).
    unreleased_nodes: tuple[str, ...] = ()


def _names(nodes: Sequence[str]) -> str:
    shown = ", ".join(nodes[:MAX_NAMES_IN_MESSAGE])
    more = len(nodes) - MAX_NAMES_IN_MESSAGE
    return shown + (f" and {more} more" if more > 0 else "")


def _problem(view: NodeView | None, node: str, now: datetime, timeout: float) -> tuple[str, str, str]:
    """(severity key, reason, message) for a node that is not Ready."""
    if view is None or view.phase is None:
        return "NotReporting", "AgentNotReporting", f"no status from the agent on {node} yet"
    if view.stale(now, timeout):
        age = int((now - view.heartbeat).total_seconds()) if view.heartbeat else 0
        return "Unresponsive", "AgentUnresponsive", f"last heartbeat {age}s ago (phase {view.phase})"
    reason = view.reason or view.phase
    message = view.message or view.phase
    if view.phase == "Populating" and view.progress is not None and not view.message:
        message = f"Populating {view.progress}%"
    return (view.phase if view.phase in _SEVERITY else "Other"), reason, message


def _previous(conditions: Iterable[Mapping[str, Any]]) -> dict[str, Condition]:
    """The pool's current conditions by type; one the models cannot read (edited by hand) is
    left out, so it is written anew with this pass as its transition."""
    found: dict[str, Condition] = {}
    for body in conditions:
        try:
            cond = Condition.model_validate(body)
        except ValidationError:
            continue
        found[cond.type] = cond
    return found


def _condition(
    ctype: str, status: bool, reason: str, message: str, generation: int, previous: Mapping[str, Condition], now: datetime
) -> dict[str, Any]:
    cond = transition(previous.get(ctype), ctype, "True" if status else "False", reason, message, generation, now)
    return cond.model_dump(by_alias=True)


def aggregate(
    *,
    generation: int,
    selected: Iterable[str],
    views: Mapping[str, NodeView],
    previous_conditions: Iterable[Mapping[str, Any]] = (),
    now: datetime,
    heartbeat_timeout: float = 0.0,
    deleting: bool = False,
    existing_nodes: Iterable[str] | None = None,
) -> Aggregate:
    """Compute the pool status.

    ``selected``: names of the Nodes the pool selects now. ``views``: the pool's
    OffloadPoolNodes by node name (may include nodes no longer selected; they are ignored unless
    deleting). ``existing_nodes``: Nodes that exist (deletion waits only for those).
    """
    selected = sorted(set(selected))
    previous = _previous(previous_conditions)
    ready, failed, pending, held, halted, busy = [], [], [], [], [], []
    problems: list[tuple[str, str, str, str]] = []
    total = 0
    for node in selected:
        view = views.get(node)
        if view is not None and view.phase == "Ready" and not view.stale(now, heartbeat_timeout):
            ready.append(node)
            total += view.bytes_total
            if view.observed_generation != generation:
                pending.append(node)
                if view.held and view.pending_generation == generation:
                    held.append(node)
            continue
        severity, reason, message = _problem(view, node, now, heartbeat_timeout)
        problems.append((severity, node, reason, message))
        if view is not None and view.phase == "Failed" and not view.stale(now, heartbeat_timeout):
            failed.append(node)
            if view.observed_generation == generation and view.rollout_generation == generation:
                halted.append(node)
        else:
            pending.append(node)
            busy.append(node)
    unresponsive = [node for sev, node, _, _ in problems if sev == "Unresponsive"]

    unreleased: list[str] = []
    if deleting:
        alive = set(existing_nodes) if existing_nodes is not None else None
        for node, view in sorted(views.items()):
            if alive is not None and node not in alive:
                continue
            if view.phase != "Released":
                unreleased.append(node)

    conditions = _conditions(
        generation, selected, ready, failed, unresponsive, held, halted, busy, pending, previous, now, deleting, unreleased, views
    )
    problems.sort(key=lambda p: (_SEVERITY.get(p[0], 9), p[1]))
    failing = [{"node": n, "reason": r[:128], "message": m[:1024]} for _, n, r, m in problems[:MAX_FAILING_NODES]]
    if deleting:
        failing = [
            {"node": n, "reason": "NotReleased", "message": _release_message(views[n])}
            for n in unreleased[:MAX_FAILING_NODES]
        ]
    phase = _phase(selected, ready, failed, unresponsive, deleting)
    status = {
        "observedGeneration": generation,
        "phase": phase,
        "desiredNodes": len(selected),
        "readyNodes": 0 if deleting else len(ready),
        "failedNodes": len(failed),
        "pendingNodes": len(pending),
        "totalBytes": 0 if deleting else total,
        "failingNodes": failing,
        "conditions": conditions,
    }
    return Aggregate(
        status=status,
        ready_nodes=frozenset() if deleting else frozenset(ready),
        failed_nodes=frozenset(failed),
        unreleased_nodes=tuple(unreleased),
    )


def _release_message(view: NodeView) -> str:
    phase = view.phase or "no status"
    detail = f": {view.reason}" if view.reason else ""
    engines = f", {view.engines_attached} engine(s) attached" if view.engines_attached else ""
    return f"{phase}{detail}{engines}"[:1024]


def _phase(selected: Sequence[str], ready: Sequence[str], failed: Sequence[str], unresponsive: Sequence[str], deleting: bool) -> str:
    if deleting:
        return "Deleting"
    if not selected:
        return "NoNodes"
    if failed or unresponsive:
        return "Degraded"
    if len(ready) == len(selected):
        return "Ready"
    return "Progressing"


def _conditions(
    generation: int,
    selected: Sequence[str],
    ready: Sequence[str],
    failed: Sequence[str],
    unresponsive: Sequence[str],
    held: Sequence[str],
    halted: Sequence[str],
    busy: Sequence[str],
    pending: Sequence[str],
    previous: Mapping[str, Condition],
    now: datetime,
    deleting: bool,
    unreleased: Sequence[str],
    views: Mapping[str, NodeView],
) -> list[dict[str, Any]]:
    def cond(ctype: str, status: bool, reason: str, message: str) -> dict[str, Any]:
        return _condition(ctype, status, reason, message, generation, previous, now)

    if deleting:
        if unreleased:
            waiting = "; ".join(f"{n} ({_release_message(views[n])})" for n in unreleased[:MAX_NAMES_IN_MESSAGE])
            more = len(unreleased) - MAX_NAMES_IN_MESSAGE
            message = f"deletion waits for {len(unreleased)} node(s) to release the memory: {waiting}" + (
                f" and {more} more" if more > 0 else ""
            )
            return [
                cond("Ready", False, "Deleting", message),
                cond("Progressing", True, "WaitingForRelease", message),
                cond("Degraded", False, "Deleting", "the pool is being deleted"),
            ]
        message = "every node released the memory; removing the finalizer"
        return [
            cond("Ready", False, "Deleting", message),
            cond("Progressing", False, "Released", message),
            cond("Degraded", False, "Deleting", "the pool is being deleted"),
        ]

    n = len(selected)
    not_ready = [node for node in selected if node not in set(ready)]
    if not selected:
        ready_c = cond("Ready", False, "NoNodesSelected", "no Node matches the pool's nodeSelector and tolerations")
    elif not not_ready:
        ready_c = cond("Ready", True, "AllNodesReady", f"ready on {n}/{n} nodes")
    else:
        ready_c = cond("Ready", False, "NodesNotReady", f"ready on {len(ready)}/{n} nodes; not ready: {_names(not_ready)}")

    waiting_turn = [node for node in pending if node not in set(held) and node not in set(busy) and node in set(ready)]
    if halted:
        prog = cond("Progressing", False, "RolloutHalted", f"generation {generation} failed on {_names(halted)}; rollout stopped")
    elif busy:
        prog = cond("Progressing", True, "Provisioning", f"provisioning on {len(busy)} node(s): {_names(busy)}")
    elif waiting_turn:
        prog = cond("Progressing", True, "RollingOut", f"generation {generation} still to reach {len(waiting_turn)} node(s): {_names(waiting_turn)}")
    elif held:
        prog = cond(
            "Progressing", False, "RolloutPending",
            f"generation {generation} pending on {len(held)} node(s) where an engine holds the lease: {_names(held)}",
        )
    else:
        prog = cond("Progressing", False, "Complete", f"generation {generation} applied on every Ready node")

    if failed:
        degraded = cond("Degraded", True, "NodesFailed", f"failed on {len(failed)} node(s): {_names(failed)}")
    elif unresponsive:
        degraded = cond("Degraded", True, "AgentsUnresponsive", f"no heartbeat from {_names(unresponsive)}")
    else:
        degraded = cond("Degraded", False, "AsExpected", "no node failed")
    return [ready_c, prog, degraded]
