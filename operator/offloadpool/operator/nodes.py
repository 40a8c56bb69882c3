"""OffloadPoolNode objects and what the operator writes on Nodes.

Both are rendered here as plain bodies and patches (pure); ``kube`` sends them. Writes are
idempotent: creating an OffloadPoolNode that exists, deleting one that is gone, or setting a
label that is already set all end in the same state, which is what lets a restarted operator
redo a pass without harm.

On a Node, while the pool is Ready there, the operator keeps:

- the label ``pool.offloadpool.io/<pool>: ready`` (for nodeSelectors and for humans), with
  ``node.offloadpool.io/pools: "true"`` while any pool is Ready there (``POOL_NODE_LABEL``: the
  chart's operator affinity keeps the operator off such nodes), and
- the extended resource ``offloadpool.io/<pool>`` with capacity and allocatable ``1`` in node
  status: one engine per node per pool, so the scheduler never puts two consumers of the same
  region on one node. Allocatable is written too because no kubelet fills it in for a resource
  it does not manage.

Both are removed (a merge patch with ``null``) as soon as the pool is not Ready there. A DRA
pool (``spec.consumers.delivery: DRA``) gets the label and never the resource (its ``count`` is
0): the scheduler satisfies ``offloadpool.io/<pool>`` with a device of the pool's DeviceClass
only on a node whose allocatable does not have it (``deviceclass``).

Both go in one merge patch of the Node's status subresource (``marks_patch``): the API server
keeps metadata changes made through a Node's status (tests/test_operator_lifecycle.py checks
both marks land), so a pool costs the operator one write per node, not two, while it
converges (the operator's writes per node: docs/scale.md), and every consumer of Node events
sees one watch event.
"""

from __future__ import annotations

from typing import Any

from offloadpool.api.constants import (
    POOL_LABEL_PREFIX,
    POOL_LABEL_READY,
    POOL_NODE_LABEL,
    POOL_NODE_VALUE,
    extended_resource_name,
    pool_label_key,
)

from .pool_node_report import ROLLOUT_ANNOTATION
from .selection import SelectableNode

#: Capacity advertised per node for a pool without shares: one engine per node per pool (a pool
#: of ``spec.partitions`` N advertises N, one per share).
EXTENDED_RESOURCE_CAPACITY = "1"


def advance_patch(generation: int, serving: bool) -> dict[str, Any]:
    """Move a node's target to ``generation``; mark it in flight when it was serving."""
    patch: dict[str, Any] = {"spec": {"targetGeneration": generation}}
    patch["metadata"] = {"annotations": {ROLLOUT_ANNOTATION: str(generation) if serving else None}}
    return patch


def label_patch(pool: str, node: SelectableNode, ready: bool) -> dict[str, Any] | None:
    """The metadata patch that makes the node's pool label match ``ready``, and its
    ``POOL_NODE_LABEL`` say some pool is Ready there; None if they do. The fixed label goes with
    the last pool label this removes (a pass that races another pool's only ever leaves it)."""
    key = pool_label_key(pool)
    labels: dict[str, str | None] = {}
    has = node.labels.get(key) == POOL_LABEL_READY
    if ready != has or (not ready and key in node.labels):
        labels[key] = POOL_LABEL_READY if ready else None
    if ready and node.labels.get(POOL_NODE_LABEL) != POOL_NODE_VALUE:
        labels[POOL_NODE_LABEL] = POOL_NODE_VALUE
    others = [k for k in node.labels if k.startswith(POOL_LABEL_PREFIX) and k != key]
    if not ready and key in labels and POOL_NODE_LABEL in node.labels and not others:
        labels[POOL_NODE_LABEL] = None
    return {"metadata": {"labels": labels}} if labels else None


def resource_patch(pool: str, node: SelectableNode, ready: bool, count: int = 1) -> dict[str, Any] | None:
    """The status patch that makes the node advertise the pool's resource iff ``ready``, as
    ``count`` (the pool's shares: each pod requests one)."""
    name = extended_resource_name(pool)
    value = str(count) if count != 1 else EXTENDED_RESOURCE_CAPACITY
    if ready and name in node.resources and node.resource_counts.get(name) == value:
        return None
    if not ready and name not in node.resource_keys:
        return None
    wanted = value if ready else None
    return {"status": {"capacity": {name: wanted}, "allocatable": {name: wanted}}}


def marks_patch(pool: str, node: SelectableNode, ready: bool, count: int = 1) -> dict[str, Any] | None:
    """The one patch (for the status subresource) that makes both marks match ``ready``; with
    ``count`` 0 (a DRA pool) the resource is never advertised, and removed where it is."""
    patch: dict[str, Any] = {}
    advertised = resource_patch(pool, node, ready and count > 0, count)
    for part in (label_patch(pool, node, ready), advertised):
        patch.update(part or {})
    return patch or None


def carries_pool(pool: str, node: SelectableNode) -> bool:
    """The node has the pool's label or resource (so a pass must look at it)."""
    return pool_label_key(pool) in node.labels or extended_resource_name(pool) in node.resource_keys
