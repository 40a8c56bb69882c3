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

Conditions: ``Ready`` (every selected node Ready), ``Progressing`` (True while nodes are
provisioning, a spec change is rolling out, or it waits with RolloutPending on nodes held by
engines (their old region Ready); False with reason Complete only when every selected node is
Ready at the pool's generation, RolloutHalted when a node failed at the new generation,
NodesFailed when failed nodes are all that is left, Stalled when the only nodes left have no
agent at work: its pod cannot be scheduled, or it went silent), ``Degraded``
(a node failed, its agent pod cannot be scheduled, or its agent stopped reporting). ``phase``
sums it up for ``kubectl get``.

A node whose agent is not reporting is named by the cause the reconciler found, most telling
first: the scheduler's reason its agent pod is not placed (``unschedulable``, read from the
pod's ``PodScheduled`` condition), then silence past the heartbeat timeout (neither a Lease
renewal nor a status write: frozen or gone, whatever phase it last wrote), then no report yet.

A deletion waits for every existing node not Released, except the nodes where no agent of the
pool ever ran (``never_ran``, decided by the reconciler from its agent pods and Leases):
nothing of the pool can be there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from offloadpool.api.constants import MAX_REASON_LENGTH, clip_message
from offloadpool.api.status import (
    DEGRADED,
    DELETING,
    MAX_FAILING_NODES,
    NO_NODES,
    PROGRESSING,
    ROLLOUT_HALTED,
    ROLLOUT_PENDING,
    WAITING_FOR_RELEASE,
    Condition,
    ConditionStatus,
    FailingNode,
    OffloadPoolStatus,
    transition,
)
from offloadpool.region.vocabulary import (
    DRAINING,
    FAILED,
    POPULATING,
    PROVISIONING,
    READY,
    RELEASED,
    SCRUBBING,
)

from .pool_node_report import PoolNodeReport, stale_cutoff

MAX_NAMES_IN_MESSAGE = 5

# Order of "how bad" a node's problem is, for the failingNodes list (worst first).
_SEVERITY = {FAILED: 0, "Unschedulable": 1, "Unresponsive": 2, "NotReporting": 3, DRAINING: 4}
UNSCHEDULABLE_PREFIX = "the agent pod cannot be scheduled: "
#: Severities of a node whose agent is not at work (nothing there makes progress).
_STALLED = frozenset({"Unschedulable", "Unresponsive"})


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


def _problem(
    view: PoolNodeReport | None, node: str, now: datetime, cutoff: datetime | None, unscheduled: str | None
) -> tuple[str, str, str]:
    """(severity key, reason, message) for a node that is not Ready. ``unscheduled``: the
    scheduler's reason the node's agent pod is not placed, if it is not."""
    silent = view is None or view.phase is None or view.silent_before(cutoff)
    if unscheduled is not None and silent:
        return "Unschedulable", "AgentUnschedulable", UNSCHEDULABLE_PREFIX + unscheduled
    if view is None or view.phase is None:
        return "NotReporting", "AgentNotReporting", f"no status from the agent on {node} yet"
    if view.silent_before(cutoff):
        age = int((now - view.heartbeat).total_seconds()) if view.heartbeat else 0
        return (
            "Unresponsive",
            "AgentUnresponsive",
            f"agent silent for {age}s (no Lease renewal, no status write; it last said {view.phase}): "
            "frozen, or its pod is gone",
        )
    reason = view.reason or view.phase
    message = view.message or view.phase
    if view.phase in (POPULATING, SCRUBBING) and view.progress is not None:
        if not view.message or view.phase == SCRUBBING:
            message = f"{view.phase} {view.progress}%"
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


@dataclass
class _Tally:
    """Where each selected node stands in one pass (one node is counted once; see the module
    docstring). Lists keep the order of ``selected``, which is sorted by node name."""

    generation: int
    selected: list[str]
    ready: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    #: not Ready at the pool's generation: every other selected node, plus Ready nodes behind
    pending: list[str] = field(default_factory=list)
    #: Ready at an older generation because an engine holds the lease
    held: list[str] = field(default_factory=list)
    #: Failed at the generation the rollout moved them to: the rollout stops
    halted: list[str] = field(default_factory=list)
    #: neither Ready nor Failed, with an agent at work (or about to be): provisioning,
    #: populating, not reporting yet
    busy: list[str] = field(default_factory=list)
    #: neither Ready nor Failed, with no agent at work: unschedulable or unresponsive
    stalled: list[str] = field(default_factory=list)
    #: (severity, node, reason, message) of every node not Ready
    problems: list[tuple[str, str, str, str]] = field(default_factory=list)
    total_bytes: int = 0

    @property
    def unresponsive(self) -> list[str]:
        return [node for severity, node, _, _ in self.problems if severity == "Unresponsive"]

    @property
    def unschedulable(self) -> list[tuple[str, str]]:
        """(node, message) of each node whose agent pod the scheduler cannot place."""
        return [(node, msg) for severity, node, _, msg in self.problems if severity == "Unschedulable"]

    def explained(self, nodes: Sequence[str]) -> str:
        """``_names`` with each node's reason: "n1 (AgentUnresponsive), n2 (AgentUnschedulable)"."""
        reasons = {node: reason for _, node, reason, _ in self.problems}
        return _names([f"{node} ({reasons.get(node, '?')})" for node in nodes])


def _tally(
    generation: int,
    selected: list[str],
    views: Mapping[str, PoolNodeReport],
    now: datetime,
    timeout: float,
    unschedulable: Mapping[str, str],
) -> _Tally:
    tally, cutoff = _Tally(generation, selected), stale_cutoff(now, timeout)
    for node in selected:
        view = views.get(node)
        if view is not None and view.phase == READY and not view.silent_before(cutoff):
            tally.ready.append(node)
            tally.total_bytes += view.bytes_total
            if view.observed_generation != generation:
                tally.pending.append(node)
                if view.held and view.pending_generation == generation:
                    tally.held.append(node)
            continue
        severity, reason, message = _problem(view, node, now, cutoff, unschedulable.get(node))
        tally.problems.append((severity, node, reason, message))
        if view is not None and view.phase == FAILED and not view.silent_before(cutoff):
            tally.failed.append(node)
            if view.observed_generation == generation and view.rollout_generation == generation:
                tally.halted.append(node)
        else:
            tally.pending.append(node)
            (tally.stalled if severity in _STALLED else tally.busy).append(node)
    return tally


def _unreleased(
    views: Mapping[str, PoolNodeReport], existing_nodes: Iterable[str] | None, never_ran: Iterable[str]
) -> list[str]:
    """Nodes a deletion waits for: every node of the pool that may hold memory, unless the Node
    itself is gone or no agent of the pool ever ran there (nothing can be there)."""
    alive = set(existing_nodes) if existing_nodes is not None else None
    nothing_there = set(never_ran)
    return [
        node
        for node, view in sorted(views.items())
        if (alive is None or node in alive) and view.phase != RELEASED and node not in nothing_there
    ]


def aggregate(
    *,
    generation: int,
    selected: Iterable[str],
    views: Mapping[str, PoolNodeReport],
    previous_conditions: Iterable[Mapping[str, Any]] = (),
    now: datetime,
    heartbeat_timeout: float = 0.0,
    deleting: bool = False,
    existing_nodes: Iterable[str] | None = None,
    unschedulable: Mapping[str, str] | None = None,
    never_ran: Iterable[str] = (),
) -> Aggregate:
    """Compute the pool status.

    ``selected``: names of the Nodes the pool selects now. ``views``: the pool's
    OffloadPoolNodes by node name (may include nodes no longer selected; they are ignored unless
    deleting). ``existing_nodes``: Nodes that exist (deletion waits only for those).
    ``unschedulable``: node -> the scheduler's reason its agent pod is not placed
    (``agentpods.unschedulable``). ``never_ran``: nodes where no agent of the pool ever ran
    (``Reconciler._agents_never_ran``): a deletion does not wait for them.
    """
    tally = _tally(generation, sorted(set(selected)), views, now, heartbeat_timeout, unschedulable or {})
    skipped = sorted(set(never_ran)) if deleting else []
    unreleased = _unreleased(views, existing_nodes, skipped) if deleting else []
    conditions = _Conditions(_previous(previous_conditions), generation, now)
    if deleting:
        condition_list = conditions.deleting(unreleased, views, skipped)
    else:
        condition_list = conditions.serving(tally)
    problems = sorted(tally.problems, key=lambda p: (_SEVERITY.get(p[0], 9), p[1]))
    failing = [
        FailingNode(node=n, reason=r[:MAX_REASON_LENGTH], message=clip_message(m))
        for _, n, r, m in problems[:MAX_FAILING_NODES]
    ]
    if deleting:
        failing = [
            FailingNode(node=n, reason="NotReleased", message=_release_message(views[n]))
            for n in unreleased[:MAX_FAILING_NODES]
        ]
    status = OffloadPoolStatus(
        observed_generation=generation,
        phase=_phase(tally, deleting),
        desired_nodes=len(tally.selected),
        ready_nodes=0 if deleting else len(tally.ready),
        failed_nodes=len(tally.failed),
        pending_nodes=len(tally.pending),
        total_bytes=0 if deleting else tally.total_bytes,
        failing_nodes=failing,
        conditions=condition_list,
    )
    return Aggregate(
        status=status.model_dump(by_alias=True),
        ready_nodes=frozenset() if deleting else frozenset(tally.ready),
        failed_nodes=frozenset(tally.failed),
        unreleased_nodes=tuple(unreleased),
    )


def _release_message(view: PoolNodeReport) -> str:
    if view.phase is None:
        # the agent may have run there without reporting yet (or its pod has not said it never ran)
        return "no status from its agent yet; it may hold memory there until the agent reports Released"
    phase = view.phase
    detail = f": {view.reason}" if view.reason else ""
    engines = f", {view.engines_attached} engine(s) attached" if view.engines_attached else ""
    # the node's own words name what holds the memory (a process, a CSI volume's pod)
    said = f"; {view.message}" if view.message and view.reason else ""
    return clip_message(f"{phase}{detail}{engines}{said}")


def _phase(tally: _Tally, deleting: bool) -> str:
    if deleting:
        return DELETING
    if not tally.selected:
        return NO_NODES
    if tally.failed or tally.stalled:
        return DEGRADED
    if len(tally.ready) == len(tally.selected):
        return READY
    return PROGRESSING


class _Conditions:
    """Writes the pool's three conditions for one pass; each keeps its lastTransitionTime while
    its status stays the same (``api.status.transition``)."""

    def __init__(self, previous: Mapping[str, Condition], generation: int, now: datetime) -> None:
        self.previous, self.generation, self.now = previous, generation, now

    def cond(self, ctype: str, status: bool, reason: str, message: str) -> Condition:
        text: ConditionStatus = "True" if status else "False"
        return transition(self.previous.get(ctype), ctype, text, reason, message, self.generation, self.now)

    def deleting(
        self, unreleased: Sequence[str], views: Mapping[str, PoolNodeReport], never_ran: Sequence[str] = ()
    ) -> list[Condition]:
        cond = self.cond
        nothing = (
            f"; nothing to release on {len(never_ran)} node(s) where no agent ever ran: {_names(never_ran)}"
            if never_ran
            else ""
        )
        if unreleased:
            waiting = "; ".join(
                f"{n} ({_release_message(views[n])})" for n in unreleased[:MAX_NAMES_IN_MESSAGE]
            )
            more = len(unreleased) - MAX_NAMES_IN_MESSAGE
            message = (
                f"deletion waits for {len(unreleased)} node(s) to release the memory: {waiting}"
                + (f" and {more} more" if more > 0 else "")
                + nothing
            )
            message = clip_message(message)
            return [
                cond(READY, False, DELETING, message),
                cond(PROGRESSING, True, WAITING_FOR_RELEASE, message),
                cond(DEGRADED, False, DELETING, "the pool is being deleted"),
            ]
        message = "every node released the memory; removing the finalizer" + nothing
        return [
            cond(READY, False, DELETING, message),
            cond(PROGRESSING, False, RELEASED, message),
            cond(DEGRADED, False, DELETING, "the pool is being deleted"),
        ]

    def serving(self, t: _Tally) -> list[Condition]:
        cond, generation = self.cond, self.generation
        n, ready = len(t.selected), set(t.ready)
        not_ready = [node for node in t.selected if node not in ready]
        if not t.selected:
            ready_c = cond(
                READY, False, "NoNodesSelected", "no Node matches the pool's nodeSelector and tolerations"
            )
        elif not not_ready:
            ready_c = cond(READY, True, "AllNodesReady", f"ready on {n}/{n} nodes")
        else:
            ready_c = cond(
                READY,
                False,
                "NodesNotReady",
                f"ready on {len(t.ready)}/{n} nodes; not ready: {_names(not_ready)}",
            )

        held, busy = set(t.held), set(t.busy)
        waiting_turn = [node for node in t.pending if node not in held and node not in busy and node in ready]
        if t.halted:
            prog = cond(
                PROGRESSING,
                False,
                ROLLOUT_HALTED,
                f"generation {generation} failed on {_names(t.halted)}; rollout stopped",
            )
        elif t.busy:
            stalled = f"; no agent at work on {t.explained(t.stalled)}" if t.stalled else ""
            prog = cond(
                PROGRESSING,
                True,
                PROVISIONING,
                f"provisioning on {len(t.busy)} node(s): {_names(t.busy)}{stalled}",
            )
        elif t.stalled:
            prog = cond(
                PROGRESSING,
                False,
                "Stalled",
                f"no agent at work on {len(t.stalled)} node(s): {t.explained(t.stalled)} (see failingNodes)",
            )
        elif waiting_turn:
            prog = cond(
                PROGRESSING,
                True,
                "RollingOut",
                f"generation {generation} still to reach {len(waiting_turn)} node(s): {_names(waiting_turn)}",
            )
        elif t.held:
            # a change still to be applied: True (the agent applies it once the engine lets go)
            prog = cond(
                PROGRESSING,
                True,
                ROLLOUT_PENDING,
                f"generation {generation} pending on {len(t.held)} node(s) where an engine holds the "
                f"lease: {_names(t.held)}",
            )
        elif t.failed:
            # never "Complete" while a node has not applied it: the failure is Degraded's to name
            prog = cond(
                PROGRESSING,
                False,
                "NodesFailed",
                f"generation {generation} not applied on {len(t.failed)} failed node(s): {_names(t.failed)}",
            )
        else:
            prog = cond(
                PROGRESSING, False, "Complete", f"generation {generation} applied on every Ready node"
            )

        unresponsive, unschedulable = t.unresponsive, t.unschedulable
        if t.failed:
            degraded = cond(
                DEGRADED, True, "NodesFailed", f"failed on {len(t.failed)} node(s): {_names(t.failed)}"
            )
        elif unschedulable:
            first = unschedulable[0][1]
            degraded = cond(
                DEGRADED,
                True,
                "AgentsUnschedulable",
                f"agent pod not scheduled on {_names([n for n, _ in unschedulable])}: "
                + first.removeprefix(UNSCHEDULABLE_PREFIX),
            )
        elif unresponsive:
            degraded = cond(DEGRADED, True, "AgentsUnresponsive", f"no heartbeat from {_names(unresponsive)}")
        else:
            degraded = cond(DEGRADED, False, "AsExpected", "no node failed")
        return [ready_c, prog, degraded]
