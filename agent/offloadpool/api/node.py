"""OffloadPoolNode: one pool's state on one node.

The node's agent creates it when it starts (spec: pool and node, immutable, name
``<pool>.<node>``), as node-feature-discovery's workers create their NodeFeature objects; the
operator creates it for a selected node whose agent has not within a grace period (so a node
whose agent never starts still shows, Pending). Either way the body is ``new_object``'s, and a
409 tells the other side it is there. The agent writes its status through the status
subresource.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field

from offloadpool.region.holding.shares import OWNER_LIMIT, ShareState
from offloadpool.region.request import MAX_PARTITIONS
from offloadpool.region.vocabulary import ShareViaName

from .base import SpecModel, StatusModel, Timestamp
from .constants import API_VERSION, NODE_KIND, POOL_KIND, POOL_NAME_LABEL, node_object_name
from .media import NodePhase
from .spec import MAX_NUMA_NODE, MAX_RANKS


class OffloadPoolNodeSpec(SpecModel):
    """Which pool on which node."""

    pool: str = Field(min_length=1, max_length=40, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    node_name: str = Field(min_length=1, max_length=253)
    #: The pool generation this node may apply now; the operator advances it node by node.
    #: None means apply the pool's current generation.
    target_generation: int | None = Field(default=None, ge=0)


#: most pods a share's status names (CRD ``maxItems``)
MAX_SHARE_PODS = 8


class NodeShare(StatusModel):
    """One share of a partitioned pool on the node (``spec.partitions`` > 1)."""

    index: int = Field(ge=0, lt=MAX_PARTITIONS)
    claimed: bool
    #: How it is claimed: a csi volume reserved it for a pod, a DRA claim was given it, or an
    #: engine holds its lease.
    via: ShareViaName | None = None
    #: Who holds it: the pod a csi volume gave it to, else the owner its engine wrote (the
    #: pod's uid, or a process's pid namespace). Written by a pod: clipped, printable text.
    holder: str | None = Field(default=None, max_length=OWNER_LIMIT)
    #: Processes holding the share's lease on the node (an engine's workers).
    engines: int = Field(default=0, ge=0)
    #: The pods those processes run in, by their cgroups (the node's evidence); more than one:
    #: an engine joined another pod's share. At most ``MAX_SHARE_PODS`` are shown.
    pods: list[Annotated[str, Field(max_length=36)]] | None = Field(default=None, max_length=MAX_SHARE_PODS)

    @classmethod
    def of(cls, state: ShareState) -> NodeShare:
        return cls(
            index=state.index,
            claimed=state.claimed,
            via=state.via,
            holder=state.holder or None,
            engines=len(state.holders),
            pods=list(state.pods[:MAX_SHARE_PODS]) or None,
        )


class OffloadPoolNodeStatus(StatusModel):
    """Written only by the node's agent."""

    phase: NodePhase | None = None
    progress: int | None = Field(default=None, ge=0, le=100)
    bytes_total: int | None = Field(default=None, ge=0)
    bytes_populated: int | None = Field(default=None, ge=0)
    populate_gib_per_second: float | None = Field(default=None, ge=0, alias="populateGiBPerSecond")
    huge_page_coverage: float | None = Field(default=None, ge=0, le=100)
    numa_nodes: list[int] | None = None
    #: Per region (PerRank: per rank), the NUMA nodes its pages are bound to ([]: kernel default).
    numa_placement: list[list[Annotated[int, Field(ge=0, le=MAX_NUMA_NODE)]]] | None = Field(
        default=None, max_length=MAX_RANKS
    )
    engines_attached: int | None = Field(default=None, ge=0)
    #: Partitioned pools: each share, claimed or free, and by whom.
    shares: list[NodeShare] | None = Field(default=None, max_length=MAX_PARTITIONS)
    #: Partitioned pools: shares claimed of the node's shares, "1/4" (the Shares column).
    shares_claimed: str | None = Field(default=None, pattern=r"^[0-9]{1,2}/[0-9]{1,2}$")
    #: Compat pools: a process given the pool maps a vLLM region of its own (another engine id).
    engine_id_mismatch: str | None = Field(default=None, max_length=4096)
    agent_version: str | None = Field(default=None, max_length=64)
    heartbeat: Timestamp | None = None
    #: The OffloadPool generation the region on this node was built from.
    observed_generation: int | None = Field(default=None, ge=0)
    #: A newer pool generation held back because an engine holds the lease.
    pending_generation: int | None = Field(default=None, ge=0)
    reason: str | None = Field(default=None, max_length=128)
    message: str | None = Field(default=None, max_length=4096)


class OffloadPoolNode(StatusModel):
    """The whole object, as the API server returns it."""

    api_version: str = API_VERSION
    kind: str = NODE_KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: OffloadPoolNodeSpec
    status: OffloadPoolNodeStatus | None = None


def status_patch(**fields: Any) -> dict[str, Any]:
    """``fields``, named as ``OffloadPoolNodeStatus`` names them (snake_case), as the camelCase
    status the API server stores; the model checks every value.

    The agent writes its status only through this: the API server silently prunes a field its
    schema lacks, so a misspelt raw key would vanish without an error, where an unknown name
    here raises TypeError (and a value out of the model's range pydantic's ValidationError).
    A field given as None stays in the patch as null: a merge patch removes it.
    """
    unknown = sorted(set(fields) - set(OffloadPoolNodeStatus.model_fields))
    if unknown:
        raise TypeError(f"OffloadPoolNodeStatus has no field {', '.join(unknown)}")
    return OffloadPoolNodeStatus.model_validate(fields).model_dump(by_alias=True, exclude_unset=True)


def pool_owner_reference(pool_body: Mapping[str, Any]) -> dict[str, Any]:
    """The pool as controlling owner, so garbage collection removes the object with the pool.

    Without ``blockOwnerDeletion``: setting it needs ``update`` on the pool's finalizers where
    the OwnerReferencesPermissionEnforcement admission plugin runs, which an agent must not
    have; the pool's own finalizer already holds it until every node has released.
    """
    meta = pool_body["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": POOL_KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
    }


def new_object(pool_body: Mapping[str, Any], node: str, generation: int) -> dict[str, Any]:
    """A new OffloadPoolNode for ``node``, allowed to apply ``generation`` (the pool's current
    one: a node without a region has nothing to roll out from)."""
    pool = pool_body["metadata"]["name"]
    obj = OffloadPoolNode(
        metadata={
            "name": node_object_name(pool, node),
            "labels": {POOL_NAME_LABEL: pool},
            "ownerReferences": [pool_owner_reference(pool_body)],
        },
        spec=OffloadPoolNodeSpec(pool=pool, node_name=node, target_generation=generation),
    )
    return obj.model_dump(by_alias=True, exclude_none=True)
