"""The engine's NUMA check at attach: where a mapped region's pages are, against where the node
placed them (the manifest) and where the engine runs (its GPU's node, else its CPUs' nodes).

A region far from its GPU still works, only slower (every copy crosses the socket link), so a
mismatch is a logged warning, never a refusal. It catches what the node cannot see: a pod given
other GPUs than the ones its pool was placed by (``numa: GPU`` follows the node's GPU order),
a per-rank list that names the wrong sockets, pages that were not placed as recorded.

Where the pages are is asked of the kernel, not of the manifest: ``get_mempolicy(2)`` with
``MPOL_F_NODE | MPOL_F_ADDR`` gives the node of the page at an address (mapping it into this
process with a read fault if needed, which a populated pool satisfies from its page cache).
A sample of pages spread over the region is asked, so a check costs microseconds.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections import Counter
from pathlib import Path
from typing import Any

from offloadpool.region.files.manifest import Manifest, Region
from offloadpool.region.memory import gpus
from offloadpool.region.memory.libc import LIBC
from offloadpool.region.memory.numa import MAX_NODE

log = logging.getLogger(__name__)

MPOL_F_NODE = 1 << 0
MPOL_F_ADDR = 1 << 1
_SYS_GET_MEMPOLICY = {"x86_64": 239, "aarch64": 236, "ppc64le": 260, "s390x": 269}
#: Pages asked per region (evenly spread; all of them when the region has fewer)
DEFAULT_SAMPLES = 64


def page_node(addr: int) -> int:
    """The NUMA node of the page at ``addr`` in this process (raises OSError)."""
    number = _SYS_GET_MEMPOLICY.get(platform.machine())
    if number is None:
        raise OSError(0, f"get_mempolicy is not known on {platform.machine()}")
    node = ctypes.c_int(-1)
    rc = LIBC.syscall(
        ctypes.c_long(number),
        ctypes.byref(node),
        ctypes.c_void_p(0),
        ctypes.c_ulong(0),
        ctypes.c_void_p(addr),
        ctypes.c_ulong(MPOL_F_NODE | MPOL_F_ADDR),
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"get_mempolicy at 0x{addr:x}: {os.strerror(err)}")
    return node.value


def page_nodes(addr: int, length: int, page_size: int, samples: int = DEFAULT_SAMPLES) -> Counter[int]:
    """How many of ``samples`` pages spread over [addr, addr+length) are on each node."""
    pages = max(1, length // page_size)
    take = max(1, min(pages, samples))
    return Counter(page_node(addr + (i * pages // take) * page_size) for i in range(take))


def _cpus(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def cpu_nodes(sysfs: str | Path = gpus.SYSFS) -> set[int]:
    """The nodes whose CPUs this process may run on (its affinity); empty when sysfs has none."""
    allowed = os.sched_getaffinity(0)
    nodes: set[int] = set()
    base = Path(sysfs) / "devices" / "system" / "node"
    try:
        entries = list(base.glob("node[0-9]*"))
    except OSError:
        return nodes
    for entry in entries:
        try:
            if _cpus((entry / "cpulist").read_text()) & allowed:
                nodes.add(int(entry.name[4:]))
        except (OSError, ValueError):
            continue
    return nodes


def recorded_nodes(manifest: Manifest, region: Region) -> list[int] | None:
    """The nodes the node placed ``region`` on (empty: none chosen), or None when the manifest
    records nothing usable (it is a pod-writable file: anything else is ignored)."""
    value: Any = (manifest.extra or {}).get("numa_nodes")
    if not isinstance(value, list) or not 0 <= region.index < len(value):
        return None
    nodes = value[region.index]
    if not isinstance(nodes, list) or len(nodes) > MAX_NODE + 1:
        return None
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_NODE for n in nodes):
        return None
    return nodes


def _where(counts: Counter[int]) -> str:
    total = sum(counts.values())
    return ", ".join(f"{n} of {total} sampled pages on node {node}" for node, n in sorted(counts.items()))


def mismatches(
    what: str,
    recorded: list[int] | None,
    actual: Counter[int],
    *,
    gpu_node: int | None = None,
    cpus_on: set[int] | None = None,
) -> list[str]:
    """What is wrong with a region's placement, one sentence each (empty: nothing).

    ``recorded`` the node's placement, ``actual`` the sampled pages per node, ``gpu_node`` the
    node of the caller's GPU (when it says; not judged for a region spread over several nodes
    on purpose, ``Interleave``), ``cpus_on`` the nodes its CPUs may run on (judged only when no
    GPU is given and the pool was placed on purpose: an unpinned process may run anywhere, and
    a pool left to the kernel made no promise)."""
    found: list[str] = []
    if recorded and not set(actual) <= set(recorded):
        found.append(
            f"{what} was placed on NUMA node(s) {sorted(recorded)}, but {_where(actual)}: the "
            f"placement did not hold; the node re-provisions it when its shape changes"
        )
    if gpu_node is not None:
        if set(actual) != {gpu_node} and not (recorded and len(recorded) > 1):  # interleaved by choice
            found.append(
                f"{what} is not local to this process's GPU (NUMA node {gpu_node}): {_where(actual)}; "
                f"copies cross the socket link. A pool placed by its GPUs (numa: GPU) follows the "
                f"node's GPU order, so a pod given other GPUs than ranks 0..n-1 of the node sees "
                f"this: list the nodes per rank (spec.prefault.numaNodes) for the GPUs pods get"
            )
    elif recorded and cpus_on and not set(actual) & cpus_on:
        found.append(
            f"{what} is on NUMA node(s) {sorted(actual)}, but this process runs on CPUs of "
            f"node(s) {sorted(cpus_on)} only: copies cross the socket link"
        )
    return found


def check(
    manifest: Manifest,
    region: Region,
    addr: int,
    *,
    gpu_node: int | None = None,
    samples: int = DEFAULT_SAMPLES,
    sysfs: str | Path = gpus.SYSFS,
) -> list[str]:
    """Compare where ``region`` (mapped at ``addr``) is with where it should be; log each
    mismatch as a warning and return them. Never raises: a check that cannot run says so at
    debug level and finds nothing."""
    what = f"pool {manifest.pool!r} region {region.index}"
    try:
        actual = page_nodes(addr, region.bytes, manifest.page_size, samples)
        cpus_on = cpu_nodes(sysfs) if gpu_node is None else None
    except (OSError, ValueError) as exc:
        log.debug("NUMA check of %s skipped: %s", what, exc)
        return []
    found = mismatches(what, recorded_nodes(manifest, region), actual, gpu_node=gpu_node, cpus_on=cpus_on)
    for message in found:
        log.warning("%s", message)
    return found
