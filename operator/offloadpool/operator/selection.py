"""Which Nodes a pool selects: its nodeSelector, and taints its tolerations accept.

The DaemonSet controller decides where agent pods run; this module decides which Nodes get an
OffloadPoolNode and count as "desired". The two must agree, or a pool would wait forever for a
node no agent can reach. So a node is selected when every nodeSelector label matches and every
NoSchedule/NoExecute taint is tolerated, as the DaemonSet controller checks.

One deliberate difference: taints under ``node.kubernetes.io/`` are ignored. The node
lifecycle controller sets them for passing conditions (not-ready, unreachable, memory-pressure,
unschedulable, ...); the DaemonSet controller tolerates most of them itself, and a node that is
briefly NotReady must not lose its OffloadPoolNode (and with it the pool's bookkeeping of memory
that is still there). Pure functions, no cluster access; ``Selection`` remembers their answers
between passes.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from offloadpool.api.constants import POOL_LABEL_PREFIX

#: Taints managed by Kubernetes for node conditions; never change pool membership.
SYSTEM_TAINT_PREFIX = "node.kubernetes.io/"
#: Only these effects keep a DaemonSet pod off a node.
BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})


@dataclass(frozen=True)
class SelectableNode:
    """What the operator needs to know about a Node (kept in a kopf index)."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Mapping[str, Any], ...] = ()
    #: offloadpool.io/ extended resources advertised as the same positive count in both
    #: capacity and allocatable (the count: ``resource_counts``).
    resources: frozenset[str] = frozenset()
    #: the capacity each of ``resources`` advertises (a pool's ``spec.partitions``)
    resource_counts: Mapping[str, str] = field(default_factory=dict)
    #: offloadpool.io/ extended resources present at all (a kubelet that re-registers a node
    #: zeroes extended resources it does not manage: present but "0" must be re-advertised).
    resource_keys: frozenset[str] = frozenset()

    def selection_key(self) -> tuple[Any, ...]:
        """What decides which pools select this node: labels (the pools' own marks left out)
        and taints (the node lifecycle controller's own ``node.kubernetes.io/`` taints left
        out: they never change selection, and a cluster's nodes going NotReady and back must
        not wake every pool)."""
        labels = tuple(sorted((k, v) for k, v in self.labels.items() if not k.startswith(POOL_LABEL_PREFIX)))
        taints = tuple(
            tuple(sorted(t.items()))
            for t in self.taints
            if not str(t.get("key", "")).startswith(SYSTEM_TAINT_PREFIX)
        )
        return labels, taints

    def marks(self) -> frozenset[str]:
        """The pool marks the node carries: ready labels and fully advertised resources."""
        return frozenset(k for k in self.labels if k.startswith(POOL_LABEL_PREFIX)) | self.resources

    @classmethod
    def from_body(cls, body: Mapping[str, Any], resource_prefix: str) -> SelectableNode:
        meta = body.get("metadata") or {}
        spec = body.get("spec") or {}
        status = body.get("status") or {}
        capacity = status.get("capacity") or {}
        allocatable = status.get("allocatable") or {}
        keys = {k for k in (*capacity, *allocatable) if k.startswith(resource_prefix)}
        full = {
            k
            for k in keys
            if str(capacity.get(k)) == str(allocatable.get(k))
            and str(capacity.get(k)).isdigit()
            and int(str(capacity.get(k))) > 0
        }
        return cls(
            name=meta["name"],
            labels=dict(meta.get("labels") or {}),
            taints=tuple(dict(t) for t in spec.get("taints") or ()),
            resources=frozenset(full),
            resource_counts={k: str(capacity[k]) for k in full},
            resource_keys=frozenset(keys),
        )


def labels_match(node_labels: Mapping[str, str], selector: Mapping[str, str] | None) -> bool:
    """A Pod-style nodeSelector: every key present with exactly that value (empty selects all)."""
    return all(node_labels.get(k) == v for k, v in (selector or {}).items())


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """core/v1 Toleration.ToleratesTaint: effect, key and (for Equal) value must match."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return not key or key == taint.get("key")
    return key == taint.get("key") and (toleration.get("value") or "") == (taint.get("value") or "")


def taints_tolerated(
    taints: Sequence[Mapping[str, Any]], tolerations: Sequence[Mapping[str, Any]] | None
) -> bool:
    """True when no blocking, non-system taint is left untolerated."""
    for taint in taints:
        if taint.get("effect") not in BLOCKING_EFFECTS:
            continue
        if str(taint.get("key", "")).startswith(SYSTEM_TAINT_PREFIX):
            continue
        if not any(tolerates(t, taint) for t in tolerations or ()):
            return False
    return True


def selects(spec: Mapping[str, Any], node: SelectableNode) -> bool:
    """Does the pool with this spec select this node?"""
    return labels_match(node.labels, spec.get("nodeSelector")) and taints_tolerated(
        node.taints, spec.get("tolerations")
    )


def selected_nodes(spec: Mapping[str, Any], nodes: Sequence[SelectableNode]) -> list[str]:
    """Names of the selected nodes, sorted (stable order for rollout and status)."""
    return sorted(n.name for n in nodes if selects(spec, n))


def selection_spec(spec: Mapping[str, Any]) -> str:
    """What of a pool's spec decides its nodes (nodeSelector, tolerations), as one comparable
    string."""
    return json.dumps([spec.get("nodeSelector") or {}, spec.get("tolerations") or []], sort_keys=True)


class Selection:
    """``selected_nodes`` for one pool, pass after pass, deciding again only for the Nodes that
    changed.

    A pass over a pool of a thousand nodes decided a thousand times which nodes the pool
    selects, two passes a second while it converged, though nodes are selected or not by their
    labels and taints, which seldom change. The index hands out the same ``SelectableNode`` until a
    Node changes (frozen: a changed Node is a new value), so an answer is reused while its node
    is the same object and the pool's selection the same string; anything else is decided
    afresh. A cache of pure answers, so never a source of truth: a new process starts empty.
    """

    def __init__(self) -> None:
        self._spec = ""
        #: node name -> (the SelectableNode decided for, selected?)
        self._answers: dict[str, tuple[SelectableNode, bool]] = {}

    def selected(self, spec: Mapping[str, Any], nodes: Collection[SelectableNode]) -> list[str]:
        """Names of the selected nodes, sorted: ``selected_nodes(spec, nodes)``."""
        key = selection_spec(spec)
        if key != self._spec:
            self._spec, self._answers = key, {}
        answers, chosen = self._answers, []
        for node in nodes:
            hit = answers.get(node.name)
            if hit is None or hit[0] is not node:
                hit = answers[node.name] = (node, selects(spec, node))
            if hit[1]:
                chosen.append(node.name)
        if len(answers) > len(nodes):  # Nodes deleted since: forget them
            alive = {node.name for node in nodes}
            self._answers = {name: hit for name, hit in answers.items() if name in alive}
        chosen.sort()
        return chosen
