"""NUMA placement of a pool's pages, via mbind(2) on the populating mapping (ctypes syscall).

An oversized region on one NUMA node made registration fail for vLLM users; placing memory
deliberately avoids that. ``mbind`` on a shared tmpfs mapping sets the file's shared policy
(it sticks to the file, so later mappings by engines see pages already placed); on hugetlbfs
it steers the faults of the pre-fault itself, which is where every page gets allocated.

Policies (``PoolRequest.numa``): ``None`` (kernel default: local to the faulting thread),
``Interleave`` (round-robin over all online nodes), ``Spread`` (region i bound to the i-th
online node, for PerRank layouts whose ranks sit on different sockets), ``GPU`` (region i bound
to the node of the node's i-th NVIDIA GPU, ``region.memory.gpus``), an explicit node list ``"0"``,
``"0,2"``, ``"0-1"`` (bind every region to those nodes), or one node per region
``"ranks:0,0,1,1"`` (region i bound to the i-th: ``spec.prefault.numaNodes``).

A ``GPU`` policy is resolved once per use (:func:`resolve`) into the per-region form, so the
pre-fault, the scrub and the record all place region i on the same node. Every node named is
checked against the online nodes before anything is created.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from offloadpool.region.errors import RegionError, RequestError
from offloadpool.region.memory import gpus
from offloadpool.region.vocabulary import NUMA_GPU, NUMA_INTERLEAVE, NUMA_NONE, NUMA_SPREAD

MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND, MPOL_INTERLEAVE = 0, 1, 2, 3
#: ``Policy.kind`` of an explicit node list (not a policy name of the API)
BIND = "Bind"
#: ``Policy.kind`` of one node per region (``"ranks:0,0,1,1"``; not a policy name of the API)
RANKS = "Ranks"
RANKS_PREFIX = "ranks:"
#: In a ``RANKS`` policy: no node known for this region (a GPU whose firmware gives none)
NO_NODE = -1
#: Highest node number accepted (the kernel's MAX_NUMNODES on the largest configurations)
MAX_NODE = 1023
_SYS_MBIND = {"x86_64": 237, "aarch64": 235, "ppc64le": 259, "s390x": 268}

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long


@dataclass(frozen=True)
class Policy:
    kind: str  # a name of ``vocabulary.NUMA_POLICIES``, or ``BIND`` for a node list
    nodes: tuple[int, ...] = ()


def per_rank_policy(nodes: list[int] | tuple[int, ...]) -> str:
    """The policy text placing region i on ``nodes[i]`` (``spec.prefault.numaNodes``)."""
    return RANKS_PREFIX + ",".join(str(n) for n in nodes)


def parse_policy(text: str) -> Policy:
    """Parse the policy syntax (node existence is checked by :func:`placement`)."""
    if text in (None, "", NUMA_NONE, "none"):
        return Policy(NUMA_NONE)
    if text in (NUMA_INTERLEAVE, NUMA_SPREAD, NUMA_GPU):
        return Policy(text)
    if str(text).startswith(RANKS_PREFIX):
        return _parse_ranks(str(text))
    spans: list[tuple[int, int]] = []
    try:
        for part in str(text).split(","):
            lo, _, hi = part.strip().partition("-")
            spans.append((int(lo), int(hi or lo)))
    except ValueError:
        raise RequestError(
            f"numa policy {text!r} is not None, Interleave, Spread, GPU, a node list like '0' or "
            f"'0-1' or one node per region like 'ranks:0,0,1,1'"
        ) from None
    nodes: set[int] = set()
    for first, last in spans:
        if not 0 <= first <= last <= MAX_NODE:  # checked before a range is made of it
            raise RequestError(f"numa policy {text!r}: {first}-{last} is not a range of nodes 0-{MAX_NODE}")
        nodes.update(range(first, last + 1))
    if not nodes:
        raise RequestError(f"numa policy {text!r} names no valid node")
    return Policy(BIND, tuple(sorted(nodes)))


def _parse_ranks(text: str) -> Policy:
    try:
        nodes = tuple(int(part) for part in text[len(RANKS_PREFIX) :].split(","))
    except ValueError:
        raise RequestError(
            f"numa policy {text!r}: one node number per region is expected, like 'ranks:0,0,1,1'"
        ) from None
    bad = [n for n in nodes if not 0 <= n <= MAX_NODE]
    if bad:
        raise RequestError(f"numa policy {text!r}: node(s) {bad} are not node numbers 0-{MAX_NODE}")
    return Policy(RANKS, nodes)


def check_regions(policy: Policy, regions: int) -> None:
    """Refuse a per-region list whose length is not the number of regions (PerRank: ranks)."""
    if policy.kind == RANKS and len(policy.nodes) != regions:
        raise RequestError(
            f"the NUMA placement lists {len(policy.nodes)} node(s), one per region, but the pool has "
            f"{regions} region(s) (a PerRank pool has one per rank; the others one)"
        )


def resolve(policy: Policy, regions: int, sysfs: str | Path = gpus.SYSFS) -> Policy:
    """``policy`` with ``GPU`` turned into one node per region (the others as they are).

    Raises RequestError when the node has fewer NVIDIA GPUs than the pool has regions."""
    if policy.kind != NUMA_GPU:
        return policy
    found = gpus.node_gpus(sysfs)
    if len(found) < regions:
        listed = ", ".join(g.bus_id for g in found) or "none"
        raise RequestError(
            f"numa GPU places region i on the NUMA node of the node's i-th NVIDIA GPU, but this "
            f"node has {len(found)} GPU(s) ({listed}) for {regions} region(s): select nodes with "
            f"enough GPUs, or list the nodes per rank in spec.prefault.numaNodes"
        )
    return Policy(RANKS, tuple(NO_NODE if g.numa_node is None else g.numa_node for g in found[:regions]))


def online_nodes() -> list[int]:
    """Online NUMA nodes (``[0]`` on kernels without NUMA support)."""
    try:
        return parse_policy(Path("/sys/devices/system/node/online").read_text().strip()).nodes or (0,)  # type: ignore[return-value]
    except (OSError, RequestError):
        return [0]


def placement(policy: Policy, region_index: int) -> tuple[int, tuple[int, ...]]:
    """(mempolicy mode, nodes) for one region; raises RequestError for offline nodes.

    A ``GPU`` policy is resolved here on each call: resolve it once first where it is used for
    many regions."""
    online = list(online_nodes())
    if policy.kind == NUMA_GPU:
        policy = resolve(policy, region_index + 1)
    if policy.kind == NUMA_NONE:
        return MPOL_DEFAULT, ()
    if policy.kind == RANKS:
        if not 0 <= region_index < len(policy.nodes):
            raise RequestError(f"the NUMA placement names no node for region {region_index}")
        node = policy.nodes[region_index]
        if node == NO_NODE:
            return MPOL_DEFAULT, ()
        if node not in online:
            raise RequestError(
                f"the NUMA placement puts region {region_index} on node {node}, which is not "
                f"online on this node; online nodes: {online}"
            )
        return MPOL_BIND, (node,)
    if policy.kind == NUMA_INTERLEAVE:
        return MPOL_INTERLEAVE, tuple(online)
    if policy.kind == NUMA_SPREAD:
        return MPOL_BIND, (online[region_index % len(online)],)
    missing = [n for n in policy.nodes if n not in online]
    if missing:
        raise RequestError(
            f"numa policy binds to node(s) {missing} that are not online; online nodes: {online}"
        )
    return MPOL_BIND, policy.nodes


def describe(policy: Policy, regions: int, sysfs: str | Path = gpus.SYSFS) -> list[list[int]]:
    """Nodes each region is placed on (empty list: kernel default), for status reporting;
    raises RequestError for a list of the wrong length, a missing GPU or an offline node."""
    check_regions(policy, regions)
    policy = resolve(policy, regions, sysfs)
    return [list(placement(policy, i)[1]) for i in range(regions)]


def mbind(addr: int, length: int, mode: int, nodes: tuple[int, ...]) -> None:
    """Apply ``mode`` over ``nodes`` to [addr, addr+length) before it is populated."""
    if mode == MPOL_DEFAULT:
        return
    number = _SYS_MBIND.get(platform.machine())
    if number is None:
        raise RegionError(f"NUMA binding is not supported on {platform.machine()}")
    words = max(nodes) // 64 + 1
    mask = (ctypes.c_ulong * words)()
    for n in nodes:
        mask[n // 64] |= 1 << (n % 64)
    rc = _libc.syscall(
        ctypes.c_long(number),
        ctypes.c_void_p(addr),
        ctypes.c_ulong(length),
        ctypes.c_int(mode),
        mask,
        ctypes.c_ulong(words * 64 + 1),
        ctypes.c_uint(0),
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise RegionError(f"mbind(mode={mode}, nodes={list(nodes)}) failed: {os.strerror(err)}")
