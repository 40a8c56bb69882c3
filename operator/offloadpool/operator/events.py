"""Kubernetes Events on a pool's transitions, derived by comparing two statuses.

Events are computed from (status before, status after) of one pass, not emitted where things
happen, so an operator restarted mid-way neither repeats the story nor loses the ending: if the
status it writes equals what is stored, there is no transition and no Event.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from offloadpool.api.status import DEGRADED, ROLLOUT_HALTED, ROLLOUT_PENDING, WAITING_FOR_RELEASE
from offloadpool.region.vocabulary import READY

#: Condition states that are bad news (posted as Warning).
_WARNING = {(READY, "False"), (DEGRADED, "True")}
_WARNING_REASONS = {ROLLOUT_HALTED, ROLLOUT_PENDING, WAITING_FOR_RELEASE}


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


def _conditions(status: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    return {c["type"]: c for c in (status or {}).get("conditions") or () if "type" in c}


def transitions(
    before: Mapping[str, Any] | None, after: Mapping[str, Any], failed_nodes: Collection[str] = ()
) -> list[Event]:
    """Events for every condition whose (status, reason) changed, and every newly failed node.

    ``failed_nodes``: nodes whose agent reports Failed now (a per-node Warning names the reason
    when a node enters that list or its reason changes; progress never makes an Event).
    """
    events: list[Event] = []
    old = _conditions(before)
    for ctype, cond in _conditions(after).items():
        prev = old.get(ctype)
        if prev is not None and (prev.get("status"), prev.get("reason")) == (cond["status"], cond["reason"]):
            continue
        if prev is None and ctype == DEGRADED and cond["status"] == "False":
            continue  # "not degraded" is not news on a new pool
        bad = (ctype, cond["status"]) in _WARNING or cond["reason"] in _WARNING_REASONS
        events.append(
            Event(
                "Warning" if bad else "Normal", cond["reason"], f"{ctype}={cond['status']}: {cond['message']}"
            )
        )
    old_failing = {f["node"]: f.get("reason") for f in (before or {}).get("failingNodes") or ()}
    for entry in after.get("failingNodes") or ():
        node, reason = entry["node"], entry.get("reason")
        if node in failed_nodes and old_failing.get(node) != reason:
            events.append(Event("Warning", "NodeFailed", f"{node}: {reason}: {entry.get('message', '')}"))
    return events
