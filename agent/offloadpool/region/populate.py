"""Parallel, resumable pre-fault of a pool's segment files.

Worker threads (``region.parallel``) each take a contiguous share of the logical region and
walk it in runs of at most ``chunk_bytes`` within one file; each run is made present with
``madvise(MADV_POPULATE_WRITE)``, then recorded in the journal and reported as progress, so a
pre-fault killed part way is resumed where it stopped.

Population writes no data: present pages keep their contents. That is what makes a resumed
provision safe for memory that may already hold an engine's data.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from offloadpool.region import numa, parallel, vm
from offloadpool.region.errors import RegionError, fmt_bytes
from offloadpool.region.journal import Journal, Unit, units
from offloadpool.region.parallel import DEFAULT_CHUNK, Progress
from offloadpool.region.planner import Plan
from offloadpool.region.vocabulary import NUMA_NONE

MODES = ("auto", "madvise", "touch")


@dataclass(frozen=True)
class PopulateStats:
    total_bytes: int
    populated_bytes: int  # newly populated by this call
    skipped_bytes: int  # already recorded as populated by an earlier run
    seconds: float
    workers: int
    mode: str  # "madvise" or "touch"
    thp_bytes: int  # bytes mapped with PMD-sized pages at the end (tmpfs THP coverage)

    @property
    def gib_per_s(self) -> float:
        return self.populated_bytes / (1 << 30) / self.seconds if self.seconds > 0 else 0.0


def _thp_bytes(addrs: list[tuple[int, int]]) -> int:
    """Sum of ShmemPmdMapped/FilePmdMapped over our mappings (huge-page-backed tmpfs bytes)."""
    starts = {a for a, _ in addrs}
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as fh:
            for line in fh:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    inside = int(head.split("-")[0], 16) in starts
                elif inside and head in ("ShmemPmdMapped:", "FilePmdMapped:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


class _Prefault:
    """One pre-fault in progress: what its worker threads share (the mappings, the journal, the
    byte count) and what each of them does with one run of its share."""

    def __init__(
        self,
        plan: Plan,
        maps: list[parallel.Mapping],
        journal: Journal,
        *,
        mode: str,
        rate_limit: float | None,
        tally: parallel.Tally,
    ) -> None:
        self.plan, self.maps, self.journal = plan, maps, journal
        self.rate_limit, self.tally = rate_limit, tally
        #: ``auto`` may fall back from madvise to touching pages once, for every worker.
        self.fallback = mode == "auto"
        self.mode = "touch" if mode == "touch" else "madvise"
        self.t0 = time.perf_counter()

    def each(self, run: list[Unit]) -> None:
        """Fault one run in, journal it, report it, keep pace."""
        first = run[0]
        length = sum(u.bytes for u in run)
        self.fault(self.maps[first.segment][0] + first.offset, length)
        self.journal.mark(first.index, len(run))
        self.tally.add(length)
        self.pace()

    def fault(self, addr: int, length: int) -> None:
        """Populate ``length`` bytes at ``addr``: MADV_POPULATE_WRITE, or touch every page."""
        if self.mode == "madvise":
            out_of_memory = (
                f"pre-fault ran out of memory at {fmt_bytes(length)} chunk of {self.plan.medium.name} pool"
            )
            if not parallel.fault_in(
                addr, length, self.plan.page_size, out_of_memory, fallback=self.fallback
            ):
                self.mode = "touch"  # kernel < 5.14: no MADV_POPULATE_WRITE
            return
        vm.touch_pages(addr, length, self.plan.page_size)

    def pace(self) -> None:
        """Sleep while this call is ahead of ``rate_limit`` (all workers together)."""
        if self.rate_limit:
            ahead = self.tally.added / self.rate_limit - (time.perf_counter() - self.t0)
            if ahead > 0:
                time.sleep(ahead)


def populate(
    pool_dir: str | os.PathLike[str],
    plan: Plan,
    *,
    workers: int = 0,
    progress: Progress | None = None,
    numa_policy: str = NUMA_NONE,
    mode: str = "auto",
    chunk_bytes: int = DEFAULT_CHUNK,
    rate_limit: float | None = None,
) -> PopulateStats:
    """Pre-fault every segment of ``plan`` under ``pool_dir`` that the journal lacks.

    ``rate_limit`` (bytes/s, all workers together) keeps a pre-fault from saturating the
    memory bandwidth of a busy node. ``mode``: ``auto`` uses MADV_POPULATE_WRITE and falls
    back to touching pages when the kernel lacks it (also ``OFFLOADPOOL_POPULATE_MODE``).
    """
    mode = os.environ.get("OFFLOADPOOL_POPULATE_MODE", mode)
    if mode not in MODES:
        raise RegionError(f"populate mode {mode!r} is not one of {MODES}")
    pool_dir = Path(pool_dir)
    all_units = units(plan.segments, plan.page_size)
    total = sum(u.bytes for u in all_units)
    workers = workers or parallel.default_workers(plan)
    workers = max(1, min(workers, len(all_units)))
    policy = numa.parse_policy(numa_policy)
    journal = Journal(pool_dir, len(all_units))
    try:
        with parallel.mapped(pool_dir, plan, policy) as (_fds, maps):
            done = journal.done()
            skipped = sum(u.bytes for u in all_units if done[u.index])
            if rate_limit:
                chunk_bytes = max(1, min(chunk_bytes, int(rate_limit / 8)))
            tally = parallel.Tally(total, progress, start=skipped)
            job = _Prefault(plan, maps, journal, mode=mode, rate_limit=rate_limit, tally=tally)
            parallel.run_shares(
                parallel.shares(all_units, workers),
                lambda share: parallel.runs(share, chunk_bytes, done),
                job.each,
                "populate",
            )
            seconds = time.perf_counter() - job.t0
            # Only a huge= tmpfs can hold PMD-sized pages; reading /proc/self/smaps is O(every
            # mapping of the process), so it is not done for the media that cannot.
            thp = _thp_bytes(maps) if plan.medium.huge not in (None, "never") else 0
            return PopulateStats(total, tally.added, skipped, seconds, workers, job.mode, thp)
    finally:
        journal.close()
