"""The kernel's persistent huge page pools (``/sys/kernel/mm/hugepages/hugepages-<size>kB``).

A hugetlbfs mount with ``min_size=`` reserves its pages at mount time and fails with ENOMEM
unless that many pages are free and unreserved, so the engine first grows the pool by exactly
the missing number (``nr_hugepages``) and records how many it added; release gives back that
many. Changes are relative (read, add, write under one lock), so pools of other pools and
other users stay intact.

Growing can fail on a node with plenty of free memory: a huge page needs physically contiguous
memory, and after hours of work unmovable kernel pages sit in every GiB. So growing compacts
memory once before giving up, and a shortfall is explained as fragmentation or as memory
taken, from ``/proc/meminfo`` and ``/proc/buddyinfo``, because the remedies differ (reserve at
boot vs. free memory).

Each change of ``nr_hugepages`` made for a pool is announced first in the huge page intent
(``hugepage_intent``), under :func:`reservation_lock`, and every take of that lock with a root settles
an intent a killed process left (:func:`reconcile`), so no kill between changing the kernel's
pool and recording it leaks pages or gives them back twice.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from offloadpool.region.files import record as records
from offloadpool.region.memory import hugepage_intent, locks

LOCK_PATH = "/run/lock/offloadpool-hugepages.lock"
ROOT_LOCK_NAME = ".hugepages.lock"
COMPACT_PATH = "/proc/sys/vm/compact_memory"
BUDDYINFO_PATH = "/proc/buddyinfo"
BASE_PAGE = 4096

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolCounters:
    """One huge page size's counters, in pages."""

    page_size: int
    total: int  # nr_hugepages (persistent pool size)
    free: int
    reserved: int  # promised to mappings/mounts but not yet faulted
    surplus: int

    @property
    def available(self) -> int:
        """Pages a new ``min_size=`` mount can reserve without growing the pool."""
        return max(0, self.free - self.reserved)


def sysfs_dir(page_size: int) -> Path:
    return Path(f"/sys/kernel/mm/hugepages/hugepages-{page_size // 1024}kB")


def supported(page_size: int) -> bool:
    return sysfs_dir(page_size).is_dir()


def counters(page_size: int) -> PoolCounters:
    d = sysfs_dir(page_size)

    def read(name: str) -> int:
        return int((d / name).read_text())

    return PoolCounters(
        page_size,
        read("nr_hugepages"),
        read("free_hugepages"),
        read("resv_hugepages"),
        read("surplus_hugepages"),
    )


@contextmanager
def reservation_lock(root: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Serialise read-modify-write of nr_hugepages among offloadpool processes on this host.

    The lock file is host-wide (``/run/lock``). An agent in a container with a read-only root
    file system cannot create it there; it falls back to ``<root>/.hugepages.lock`` in the host
    root every agent of the node shares through its hostPath, which serialises them just as well.

    With a ``root``, an intent a killed process left under it is settled (:func:`reconcile`)
    before the block runs: whoever holds the lock sees a kernel pool that agrees with the records.
    """
    try:
        os.makedirs(os.path.dirname(LOCK_PATH), exist_ok=True)
        lock = locks.exclusive(LOCK_PATH)
        lock.__enter__()
    except OSError:
        if root is None:
            raise
        lock = locks.exclusive(os.path.join(root, ROOT_LOCK_NAME))
        lock.__enter__()
    try:
        settled = reconcile(root) if root is not None else None
        if settled:
            log.warning("huge page intent settled: %s", settled)
        yield
    finally:
        lock.__exit__(None, None, None)


def reconcile(root: str | os.PathLike[str]) -> str | None:
    """Settle the intent a killed process left under ``root``; say what was done (None: none).

    The caller holds :func:`reservation_lock` (which calls this itself). An intent of an earlier boot
    is dropped untouched (the kernel's pools were reset); otherwise ``nr_hugepages`` is brought
    to what the pool's record says (see ``hugepage_intent``), then the intent is removed.
    """
    intent = hugepage_intent.load(root)
    if intent is None:
        return None
    if intent.boot_id != records.boot_id() or not supported(intent.page_size):
        done = f"{intent.describe()}: written in an earlier boot, dropped"
    else:
        total = counters(intent.page_size).total
        change = intent.correction(total, records.load(os.path.join(root, intent.pool)))
        if change:
            _write_total(intent.page_size, max(0, total + change))
        done = f"{intent.describe()}: interrupted; nr_hugepages {total} -> {max(0, total + change)}"
    hugepage_intent.clear(root)
    return done


def _write_total(page_size: int, value: int) -> None:
    (sysfs_dir(page_size) / "nr_hugepages").write_text(f"{value}\n")


class PoolFixed(OSError):
    """The kernel's pool cannot be changed from here (read-only ``/sys``, no privilege): only
    pages reserved on the host or at boot can be used. Not fragmentation, not memory taken."""


def _try_grow(page_size: int, pages: int) -> int:
    before = counters(page_size).total
    try:
        _write_total(page_size, before + pages)
    except OSError as exc:
        # The kernel never fails a partial allocation (it adds fewer pages); an error means the
        # write itself was refused.
        raise PoolFixed(
            exc.errno, f"cannot grow {sysfs_dir(page_size) / 'nr_hugepages'}: {exc.strerror}"
        ) from exc
    return max(0, counters(page_size).total - before)


def compact() -> bool:
    """Ask the kernel to compact all memory now; False where ``/proc/sys`` is read-only.

    Only called when a grow came up short: compaction costs time on a big node, and the
    kernel's own per-page attempt is enough while memory is not fragmented.
    """
    try:
        with open(COMPACT_PATH, "w") as fh:
            fh.write("1\n")
        return True
    except OSError:
        return False


def grow(page_size: int, pages: int) -> int:
    """Add ``pages`` to the pool; return how many the kernel actually added (maybe fewer).

    When the kernel adds fewer, memory is compacted and the rest asked for once more. Raises
    :class:`PoolFixed` when the pool cannot be written at all. The caller must hold
    :func:`reservation_lock` and gives the pages back with :func:`shrink` if it cannot use them.
    """
    if pages <= 0:
        return 0
    added = _try_grow(page_size, pages)
    if added < pages and compact():
        added += _try_grow(page_size, pages - added)
    return added


def free_blocks_by_order(path: str = BUDDYINFO_PATH) -> list[int]:
    """Free blocks of 2^order base pages, summed over every zone (``/proc/buddyinfo``)."""
    totals: list[int] = []
    try:
        with open(path) as fh:
            for line in fh:
                counts = [int(x) for x in line.split()[4:]]
                totals += [0] * (len(counts) - len(totals))
                for order, n in enumerate(counts):
                    totals[order] += n
    except (OSError, ValueError):
        return []
    return totals


def shortfall_reason(page_size: int, missing: int, avail: int) -> str:
    """Why the kernel could not add ``missing`` pages: fragmentation or memory taken.

    Fragmentation when the memory is there but not contiguous (the fix is reserving the pages
    early, at boot or before other work, and keeping them); memory taken when it is not there
    at all (the fix is freeing memory). ``avail`` is MemAvailable (what the kernel can hand out,
    reclaiming caches). The buddy allocator's largest blocks are 4 MiB, so for 1 GiB pages
    "fragmented" is inferred from MemAvailable alone.
    """
    need = missing * page_size
    blocks = free_blocks_by_order()
    order = max(0, (page_size // BASE_PAGE).bit_length() - 1)
    fitting = sum(n << (o - order) for o, n in enumerate(blocks) if o >= order)
    largest = max((o for o, n in enumerate(blocks) if n), default=-1)
    buddy = (
        f"free blocks by order 0..{len(blocks) - 1} (/proc/buddyinfo): "
        f"{' '.join(str(n) for n in blocks)}; largest free block "
        f"{(BASE_PAGE << largest) // 1024 if largest >= 0 else 0} KiB"
    )
    if order < len(blocks):
        buddy += f"; {fitting} free blocks of {page_size // 1024} KiB or more"
    if avail >= need:
        return (
            f"memory too fragmented, not taken: {avail >> 20} MiB available but no "
            f"{missing} physically contiguous {page_size >> 20} MiB blocks even after "
            f"compaction ({buddy}); reserve these pages earlier (at boot) and keep them"
        )
    return f"memory taken: {avail >> 20} MiB available, {need >> 20} MiB needed ({buddy})"


def shrink(page_size: int, pages: int) -> None:
    """Give back ``pages`` previously added with :func:`grow` (never below zero)."""
    if pages <= 0:
        return
    current = counters(page_size).total
    _write_total(page_size, max(0, current - pages))
