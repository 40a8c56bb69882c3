"""NUMA placement of a pool's pages, via mbind(2) on the populating mapping (ctypes syscall).

An oversized region on one NUMA node made registration fail for vLLM users; placing memory
deliberately avoids that. ``mbind`` on a shared tmpfs mapping sets the file's shared policy
(it sticks to the file, so later mappings by engines see pages already placed); on hugetlbfs
it steers the faults of the pre-fault itself, which is where every page gets allocated.

Policies (``PoolRequest.numa``): ``None`` (kernel default: local to the faulting thread),
``Interleave`` (round-robin over all online nodes), ``Spread`` (region i bound to the i-th
online node, for PerRank layouts whose ranks sit on different sockets), or an explicit node
list ``"0"``, ``"0,2"``, ``"0-1"`` (bind to those nodes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from offloadpool.region.errors import RegionError, RequestError
from offloadpool.region.vocabulary import NUMA_INTERLEAVE, NUMA_NONE, NUMA_SPREAD

MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND, MPOL_INTERLEAVE = 0, 1, 2, 3
#: ``Policy.kind`` of an explicit node list (not a policy name of the API)
BIND = "Bind"
_SYS_MBIND = {"x86_64": 237, "aarch64": 235, "ppc64le": 259, "s390x": 268}

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long


@dataclass(frozen=True)
class Policy:
    kind: str  # a name of ``vocabulary.NUMA_POLICIES``, or ``BIND`` for a node list
    nodes: tuple[int, ...] = ()


def parse_policy(text: str) -> Policy:
    """Parse the policy syntax (node existence is checked by :func:`placement`)."""
    if text in (None, "", NUMA_NONE, "none"):
        return Policy(NUMA_NONE)
    if text in (NUMA_INTERLEAVE, NUMA_SPREAD):
        return Policy(text)
    nodes: set[int] = set()
    try:
        for part in str(text).split(","):
            lo, _, hi = part.strip().partition("-")
            nodes.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise RequestError(
            f"numa policy {text!r} is not None, Interleave, Spread or a node list like '0' or '0-1'"
        ) from None
    if not nodes or min(nodes) < 0:
        raise RequestError(f"numa policy {text!r} names no valid node")
    return Policy(BIND, tuple(sorted(nodes)))


def online_nodes() -> list[int]:
    """Online NUMA nodes (``[0]`` on kernels without NUMA support)."""
    try:
        return parse_policy(Path("/sys/devices/system/node/online").read_text().strip()).nodes or (0,)  # type: ignore[return-value]
    except (OSError, RequestError):
        return [0]


def placement(policy: Policy, region_index: int) -> tuple[int, tuple[int, ...]]:
    """(mempolicy mode, nodes) for one region; raises RequestError for offline nodes."""
    online = list(online_nodes())
    if policy.kind == NUMA_NONE:
        return MPOL_DEFAULT, ()
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


def describe(policy: Policy, regions: int) -> list[list[int]]:
    """Nodes each region is placed on (empty list: kernel default), for status reporting."""
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
