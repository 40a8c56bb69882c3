"""The kernel's persistent huge page pools (``/sys/kernel/mm/hugepages/hugepages-<size>kB``).

A hugetlbfs mount with ``min_size=`` reserves its pages at mount time and fails with ENOMEM
unless that many pages are free and unreserved, so the engine first grows the pool by exactly
the missing number (``nr_hugepages``) and records how many it added; release gives back that
many. Changes are relative (read, add, write under one lock), so pools of other pools and
other users stay intact.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from offloadpool.region import locks

LOCK_PATH = "/run/lock/offloadpool-hugepages.lock"


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

    return PoolCounters(page_size, read("nr_hugepages"), read("free_hugepages"),
                        read("resv_hugepages"), read("surplus_hugepages"))


@contextmanager
def pool_lock() -> Iterator[None]:
    """Serialise read-modify-write of nr_hugepages among offloadpool processes on this host."""
    os.makedirs(os.path.dirname(LOCK_PATH), exist_ok=True)
    with locks.exclusive(LOCK_PATH):
        yield


def _write_total(page_size: int, value: int) -> None:
    (sysfs_dir(page_size) / "nr_hugepages").write_text(f"{value}\n")


def grow(page_size: int, pages: int) -> int:
    """Add ``pages`` to the pool; return how many the kernel actually added (maybe fewer).

    The caller must hold :func:`pool_lock` and gives the pages back with :func:`shrink` if it
    cannot use them.
    """
    if pages <= 0:
        return 0
    before = counters(page_size).total
    try:
        _write_total(page_size, before + pages)
    except OSError:
        pass  # the kernel may refuse outright; what it added is read back below
    return max(0, counters(page_size).total - before)


def shrink(page_size: int, pages: int) -> None:
    """Give back ``pages`` previously added with :func:`grow` (never below zero)."""
    if pages <= 0:
        return
    current = counters(page_size).total
    _write_total(page_size, max(0, current - pages))
