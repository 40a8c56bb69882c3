"""Capacity check: does this node have the memory or huge pages a plan needs?

Run before anything is created, so a node that is too small fails with a reason that names
the shortfall instead of failing late (SIGBUS during pre-fault, ENOMEM at mount) and leaving
half a pool behind. The check is conservative but not a guarantee (other tenants allocate
concurrently); the huge page reservation itself (:mod:`offloadpool.region.reserve`) re-checks
what the kernel really granted.
"""

from __future__ import annotations

from dataclasses import dataclass

from offloadpool.region.errors import CapacityError, fmt_bytes
from offloadpool.region.files.planner import Plan
from offloadpool.region.memory import cgroup_limits, hugepages

GiB = 1 << 30


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (the file reports kB)."""
    out: dict[str, int] = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def headroom(mem_total: int) -> int:
    """Memory left to the rest of the node: 5% of RAM, at most 1 GiB."""
    return min(GiB, mem_total // 20)


@dataclass(frozen=True)
class CapacityReport:
    """What the check saw; the numbers end up in status and in error messages."""

    needed_bytes: int
    mem_available: int
    headroom: int
    hugepages_needed: int = 0
    hugepages_available: int = 0
    hugepages_to_add: int = 0


def check(plan: Plan, *, credit_bytes: int = 0, credit_pages: int = 0) -> CapacityReport:
    """Raise CapacityError unless ``plan`` fits; ``credit_bytes``/``credit_pages`` are memory
    and huge pages about to be freed (an existing pool this one replaces).

    The limits of this process's own cgroup are checked first: in a pod they are tighter
    than the node, and past them the kernel fails the build late (mmap ENOMEM, SIGBUS, OOM
    kill) instead of with a reason. The one limit not checked here is the mount count
    (``fs.mount-max``): mount(2) refuses past it and ``mounts.mount`` names it."""
    med = plan.medium
    cgroup_credit = credit_pages * med.page_size if med.hugetlb else credit_bytes
    cgroup_limits.check(med, plan.total_bytes, credit=cgroup_credit)
    info = meminfo()
    avail = info.get("MemAvailable", info.get("MemFree", 0)) + credit_bytes
    room = headroom(info.get("MemTotal", avail))
    need = plan.total_bytes
    if not med.hugetlb:
        if need > avail - room:
            raise CapacityError(
                f"{med.name} pool needs {fmt_bytes(need)} of memory; the node has "
                f"{fmt_bytes(avail)} available and keeps {fmt_bytes(room)} for itself: short by "
                f"{fmt_bytes(need - (avail - room))}"
            )
        return CapacityReport(need, avail, room)
    page = med.page_size
    if not hugepages.supported(page):
        raise CapacityError(
            f"{med.name} pool needs {need // page} huge pages of {fmt_bytes(page)}, but this kernel "
            f"has no {page // 1024} kB huge page pool ({hugepages.sysfs_dir(page)} is missing)"
        )
    pages = need // page
    c = hugepages.counters(page)
    to_add = max(0, pages - c.available - credit_pages)
    if to_add * page > avail - room:
        raise CapacityError(
            f"{med.name} pool needs {pages} huge pages of {fmt_bytes(page)} ({fmt_bytes(need)}); "
            f"{c.available} are free and unreserved (pool {c.total}, free {c.free}, reserved "
            f"{c.reserved}); reserving the other {to_add} needs {fmt_bytes(to_add * page)} but the "
            f"node has {fmt_bytes(avail)} available and keeps {fmt_bytes(room)}: short by "
            f"{fmt_bytes(to_add * page - (avail - room))}"
        )
    return CapacityReport(need, avail, room, pages, c.available, to_add)
