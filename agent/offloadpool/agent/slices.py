"""The pool's ResourceSlice on this node: what the scheduler allocates (docs/dra.md).

Each agent publishes one ResourceSlice, ``<pool>.<node>``, of driver ``offloadpool.io``: its own
DRA pool of the same name (one slice, so one writer: no other agent or node shares it), with
``spec.nodeName`` this node. It holds devices only while the pool is Ready here:

- a pool without shares is one device, ``pool``;
- a partitioned pool is one device per share, ``share-<i>``, each with the share's bytes: the
  scheduler allocates a share, the kubelet plugin gives exactly that share. A share an engine
  or a csi volume took at the node (outside the scheduler) is left out until it is free; a share
  a DRA claim holds stays (its allocation names it).

Every device says the pool (``pool``), ``medium``, ``pageSize``, ``layout``, ``ranks`` and its
``memory`` capacity, and ``resource.kubernetes.io/numaNode`` where all of its regions are known
to be on one NUMA node: the node's record says where each region's pages were bound (a
``spec.prefault.numa`` policy); a region left to the kernel's default placement is on the
host's NUMA node only when the host has one (its pages can be nowhere else), and on a host of
several its place is not known, so its device has no NUMA node (a claim matching one never gets
it). Everything is read from the node's own record (root-only), never from the pod-writable
manifest.

The slice is written only when what it should say changes (its ``spec.pool.generation`` goes
up each time), deleted when the pool is not Ready (provisioning, scrubbing, draining, failed,
released), and read back every ``reread_seconds`` so a slice someone else removed (the kubelet
wipes a driver's slices when its plugin goes) is made again. An agent's first slice is
created without a read first (a new pool has none: a 409 says one is there, which is then read
and compared), so a new pool's node makes one request for it, not two; a change is written over
the object this agent last wrote or read (its resourceVersion: a 409 if anyone changed it since,
then it is read again at the next step), so a change is one request too, not a read and a write.
It is owned by the pool's OffloadPoolNode, so the garbage collector removes it with the node's
object (the pool deleted, the Node gone) even if no agent is left to.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kubernetes.client.rest import ApiException

from offloadpool.agent.kube import KubeAccess
from offloadpool.agent.node_region import NodeRegion
from offloadpool.api import dra
from offloadpool.api.constants import API_VERSION, NODE_KIND, POOL_NAME_LABEL
from offloadpool.api.quantity import format_quantity, parse_quantity
from offloadpool.region.files import record as records
from offloadpool.region.files.planner import plan as make_plan
from offloadpool.region.holding.shares import ShareState
from offloadpool.region.memory import numa
from offloadpool.region.memory.media import medium
from offloadpool.region.request import PoolRequest
from offloadpool.region.vocabulary import READY

log = logging.getLogger(__name__)


def _attrs(pool: str, req: PoolRequest, numa: set[int] | None) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {
        dra.ATTR_POOL: {"string": pool},
        dra.ATTR_MEDIUM: {"string": req.medium},
        dra.ATTR_PAGE_SIZE: {"int": medium(req.medium).page_size},
        dra.ATTR_LAYOUT: {"string": req.layout_type},
        dra.ATTR_RANKS: {"int": req.ranks},
    }
    if numa is not None and len(numa) == 1:
        out[dra.ATTR_NUMA_NODE] = {"int": next(iter(numa))}
    return out


def sole_numa_node() -> int | None:
    """The host's NUMA node when it has exactly one online (where any page of it is); None on a
    host of several."""
    online = numa.online_nodes()
    return online[0] if len(online) == 1 else None


def devices(
    pool: str,
    req: PoolRequest,
    numa_nodes: list[list[int]],
    states: list[ShareState] | None,
    sole_node: int | None = None,
) -> list[dict[str, Any]]:
    """The pool's devices (see the module's docstring). ``numa_nodes``: per region of the plan,
    the NUMA nodes its pages are bound to (the record's; empty for the kernel's default
    placement); ``states``: each share, as ``shares.states`` read it (None for a pool without
    shares); ``sole_node``: the host's one NUMA node (``sole_numa_node``), where a region the
    kernel placed is; None: such a region's node is not known."""
    regions = len(make_plan(req).regions)
    placed = numa_nodes if len(numa_nodes) == regions else [[] for _ in range(regions)]

    def numa_of(first: int, count: int) -> set[int] | None:
        found: set[int] = set()
        for region in placed[first : first + count]:
            if region:
                found.update(region)
            elif sole_node is not None:
                found.add(sole_node)
            else:
                return None  # the kernel's placement on a host of several nodes: anywhere
        return found

    if req.partitions < 2:
        device = {
            "name": dra.POOL_DEVICE,
            "attributes": _attrs(pool, req, numa_of(0, regions)),
            "capacity": {dra.CAPACITY_MEMORY: {"value": format_quantity(req.capacity)}},
        }
        return [device]
    per = regions // req.partitions
    size = req.capacity // req.partitions
    taken = {s.index for s in states or [] if s.claimed and not s.by_claim}
    out = []
    for i in range(req.partitions):
        if i in taken:
            continue
        attrs = _attrs(pool, req, numa_of(i * per, per))
        attrs[dra.ATTR_SHARE] = {"int": i}
        out.append(
            {
                "name": dra.share_device(i),
                "attributes": attrs,
                "capacity": {dra.CAPACITY_MEMORY: {"value": format_quantity(size)}},
            }
        )
    return out


def slice_spec(node: str, pool: str, found: list[dict[str, Any]]) -> dict[str, Any]:
    """The slice's spec, without its generation (set when written)."""
    name = dra.slice_name(pool, node)
    return {
        "driver": dra.DRA_DRIVER,
        "nodeName": node,
        "pool": {"name": name, "resourceSliceCount": 1},
        "devices": found,
    }


class Slices:
    """The one writer of this pool's ResourceSlice on this node."""

    def __init__(
        self,
        access: KubeAccess,
        region: NodeRegion,
        node: str,
        *,
        reread_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.access = access
        self.region = region
        self.node = node
        self.name = dra.slice_name(region.pool_name, node)
        self.reread_seconds = reread_seconds
        self.clock = clock
        #: the spec last written or read (None: no slice), and when it was last read
        self._spec: dict[str, Any] | None = None
        #: the slice as last written or read (None: no slice), whose resourceVersion a change
        #: replaces
        self._object: dict[str, Any] | None = None
        self._known = False
        self._read_at = float("-inf")

    def want(self, phase: str | None) -> dict[str, Any] | None:
        """The spec the slice should have now; None: no slice."""
        if phase != READY:
            return None
        rec = records.load(self.region.pool_dir)
        if rec is None:
            return None
        req = rec.pool_request()
        states = self.region.shares(req.partitions)
        found = devices(self.region.pool_name, req, rec.numa_nodes, states, sole_numa_node())
        return slice_spec(self.node, self.region.pool_name, found)

    def sync(self, phase: str | None, pool_node: dict[str, Any] | None) -> None:
        """Make the slice say what ``want`` says (a write only when it differs, a read every
        ``reread_seconds``); refusals are logged and tried again at the next step."""
        spec = self.want(phase) if pool_node is not None else None
        now = self.clock()
        try:
            current = None
            if not self._known and spec is not None:
                # what this agent first has to say: create it straight away, as the heartbeat
                # Lease is made (a new pool's slice is not there yet, and a read that finds
                # nothing is a request per node for nothing); one that is there answers 409
                # and is read, then compared below
                assert pool_node is not None
                written = self._create(spec, pool_node)
                if written is not None:
                    self._spec, self._object = _comparable(written), written
                    self._known, self._read_at = True, now
                    return
            if not self._known or now - self._read_at >= self.reread_seconds:
                current = self.access.get_slice(self.name)
                self._spec, self._object = _comparable(current), current
                self._known, self._read_at = True, now
            if spec == self._spec:
                return
            if spec is None:
                self.access.delete_slice(self.name)
                self._spec = self._object = None
                return
            if current is None and self._spec is not None:
                # this agent is the slice's one writer: what it last wrote is what is there (a
                # 409 says otherwise, and the slice is read again at the next step), so a change
                # is one write at every node, not a quorum read of etcd and a write
                current = self._object or self.access.get_slice(self.name)
            assert pool_node is not None
            written = self._write(spec, current, pool_node)
            self._spec, self._object = _comparable(written), written
        except ApiException as exc:
            self._known = False  # read it again next time: what is there is not known
            log.warning(
                "ResourceSlice %s: %s %s %s", self.name, exc.status, exc.reason, (exc.body or "")[:300]
            )

    def _create(self, spec: dict[str, Any], pool_node: dict[str, Any]) -> dict[str, Any] | None:
        """Create the slice; None when one is there already (409: read and compare it)."""
        try:
            return self._write(spec, None, pool_node)
        except ApiException as exc:
            if exc.status != 409:
                raise
        return None

    def _write(
        self, spec: dict[str, Any], current: dict[str, Any] | None, pool_node: dict[str, Any]
    ) -> dict[str, Any] | None:
        meta = pool_node.get("metadata") or {}
        owner = {
            "apiVersion": API_VERSION,
            "kind": NODE_KIND,
            "name": meta.get("name"),
            "uid": meta.get("uid"),
        }
        generation = int(((current or {}).get("spec") or {}).get("pool", {}).get("generation") or 0) + 1
        body: dict[str, Any] = {
            "apiVersion": dra.RESOURCE_API_VERSION,
            "kind": dra.SLICE_KIND,
            "metadata": {
                "name": self.name,
                "labels": {POOL_NAME_LABEL: self.region.pool_name},
                "ownerReferences": [owner],
            },
            "spec": {**spec, "pool": {**spec["pool"], "generation": generation}},
        }
        if current is None:
            return self.access.create_slice(body)
        body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        return self.access.replace_slice(self.name, body)


def _comparable(obj: dict[str, Any] | None) -> dict[str, Any] | None:
    """A slice's spec as ``want`` makes it: its generation left out, each capacity written as
    ``want`` writes it (the API server may answer a quantity in another form), the
    fields the API server defaults (``allowMultipleAllocations: false``...) as they come; None
    for no slice."""
    if obj is None:
        return None
    spec = {k: v for k, v in (obj.get("spec") or {}).items() if k in _SPEC_FIELDS}
    pool = dict(spec.get("pool") or {})
    pool.pop("generation", None)
    spec["pool"] = pool
    out = []
    for device in spec.get("devices") or []:
        device = {k: v for k, v in device.items() if k in _DEVICE_FIELDS}
        capacity = {}
        for key, cap in (device.get("capacity") or {}).items():
            try:
                capacity[key] = {"value": format_quantity(parse_quantity(cap.get("value", "")))}
            except (ValueError, TypeError, AttributeError):
                capacity[key] = cap
        device["capacity"] = capacity
        out.append(device)
    spec["devices"] = out
    return spec


#: what ``want`` writes, the only fields compared
_SPEC_FIELDS = ("driver", "nodeName", "pool", "devices")
_DEVICE_FIELDS = ("name", "attributes", "capacity")
