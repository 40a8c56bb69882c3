"""Parallel, resumable pre-fault of a pool's segment files.

Worker threads (``region.memory.parallel``) each take a contiguous share of the logical region and
walk it in runs of at most ``chunk_bytes`` within one file; each run is made present, then
recorded in the journal and reported as progress, so a pre-fault killed part way is resumed
where it stopped. How a run is made present is the medium's strategy (:data:`STRATEGY_FOR`,
chosen by ``offloadpool bench populate``, docs/bench-populate.md):

* ``fallocate`` (hugetlbfs): ``fallocate(2)`` on the file. The kernel takes each huge page
  from the pool and clears it, which is all a write fault does too, minus the page table
  entries of a mapping the pre-fault would only tear down again; the pages sit in the file's
  page cache, where every engine's mapping finds them. No mapping is made at all.
* ``madvise`` (huge-page tmpfs): ``madvise(MADV_POPULATE_WRITE)`` through a shared mapping of
  the file.
* ``fallocate+madvise`` (4 KiB tmpfs): the file's pages allocated first, then faulted in
  through a shared mapping, where each fault only clears and maps a page already in the page
  cache (``fallocate`` alone leaves tmpfs pages uncleared until their first fault, so it is
  never enough there).
* ``touch``: every page write-faulted from Python (kernels without ``MADV_POPULATE_WRITE``).

Population writes no data: present pages keep their contents, whatever the strategy. That is
what makes a resumed provision safe for memory that may already hold an engine's data.
"""

from __future__ import annotations

import errno
import os
import re
import time
from dataclasses import dataclass

from offloadpool.region.errors import CapacityError, RegionError, fmt_bytes
from offloadpool.region.files.handle import Pool, given
from offloadpool.region.files.journal import Journal, Unit, units
from offloadpool.region.files.planner import Plan
from offloadpool.region.memory import numa, parallel, vm
from offloadpool.region.memory.parallel import DEFAULT_CHUNK, Progress
from offloadpool.region.vocabulary import HUGEPAGES_1GI, HUGEPAGES_2MI, MEMORY, MEMORY_THP, NUMA_NONE

AUTO, MADVISE, TOUCH, FALLOCATE, FALLOCATE_MADVISE = (
    "auto",
    "madvise",
    "touch",
    "fallocate",
    "fallocate+madvise",
)
MODES = (AUTO, MADVISE, TOUCH, FALLOCATE, FALLOCATE_MADVISE)
#: The pre-fault of each medium, by measurement (docs/bench-populate.md): on hugetlbfs the
#: kernel's own clearing allocation; on huge-page tmpfs faulting through the mapping; on 4 KiB
#: tmpfs allocating the file's pages first, then faulting them in.
STRATEGY_FOR: dict[str, str] = {
    HUGEPAGES_2MI: FALLOCATE,
    HUGEPAGES_1GI: FALLOCATE,
    MEMORY_THP: MADVISE,
    MEMORY: FALLOCATE_MADVISE,
}


def strategy(plan: Plan, mode: str, numa_policy: str, workers: int) -> str:
    """The strategy a pre-fault of ``plan`` uses: ``mode``, or for ``auto`` the medium's.

    ``auto`` only faults through the mapping (``madvise``) where a ``fallocate`` first would be
    wrong or slow: under a NUMA policy (``mbind`` steers the faults of the populating mapping;
    an allocation by ``fallocate`` need not follow it: on hugetlbfs it takes the populating
    thread's policy), and where two workers would share a file (``fallocate`` holds the file's
    inode lock for the whole call, so they would take turns). Refused before any memory is
    touched: ``fallocate`` alone on tmpfs (its pages would stay uncleared until the engine's
    first fault).
    """
    if mode not in MODES:
        raise RegionError(f"populate mode {mode!r} is not one of {MODES}")
    if mode == FALLOCATE and not plan.medium.hugetlb:
        raise RegionError(
            f"populate mode {FALLOCATE!r} does not clear {plan.medium.name} (tmpfs) pages; "
            f"use {FALLOCATE_MADVISE!r} or {MADVISE!r}"
        )
    if mode != AUTO:
        return mode
    chosen = STRATEGY_FOR[plan.medium.name]
    if chosen in (FALLOCATE, FALLOCATE_MADVISE) and (
        numa.parse_policy(numa_policy).kind != NUMA_NONE or len(plan.segments) < workers
    ):
        return MADVISE
    return chosen


@dataclass(frozen=True)
class PopulateStats:
    total_bytes: int
    populated_bytes: int  # newly populated by this call
    skipped_bytes: int  # already recorded as populated by an earlier run
    seconds: float  # the calls and the unmapping, not the coverage read between them
    workers: int
    mode: str  # the strategy that made the pages present (one of MODES but "auto")
    thp_bytes: int  # bytes mapped with PMD-sized pages at the end (tmpfs THP coverage)

    @property
    def gib_per_s(self) -> float:
        return self.populated_bytes / (1 << 30) / self.seconds if self.seconds > 0 else 0.0


#: One mapping's PMD-mapped shmem or file bytes in ``/proc/self/smaps``.
_PMD_MAPPED = re.compile(r"^(?:ShmemPmdMapped|FilePmdMapped):\s+(\d+) kB", re.MULTILINE)


def _thp_bytes(addrs: list[tuple[int, int]]) -> int:
    """Bytes of our mappings mapped by huge pages (huge-page-backed tmpfs bytes): asked of the
    page tables (``vm.pmd_mapped_bytes``), else the sum of ShmemPmdMapped/FilePmdMapped in
    ``/proc/self/smaps``.

    That file lists every mapping of the process; only our mappings' sections are searched
    (found by their start address), since parsing it all line by line costs more than a
    percent of a gigabyte's pre-fault."""
    counted = [vm.pmd_mapped_bytes(addr, length) for addr, length in addrs]
    if all(c is not None for c in counted):
        return sum(c for c in counted if c is not None)
    try:
        with open("/proc/self/smaps") as fh:
            text = fh.read()
    except OSError:
        return 0
    total = 0
    for addr, _ in addrs:
        head = f"{addr:x}-"
        if text.startswith(head):
            start = 0
        else:
            start = text.find("\n" + head) + 1
            if start == 0:  # not mapped (any more)
                continue
        end = text.find("\nVmFlags:", start)
        section = text[start : end if end >= 0 else len(text)]
        total += sum(int(kb) * 1024 for kb in _PMD_MAPPED.findall(section))
    return total


class _Prefault:
    """One pre-fault in progress: what its worker threads share (the files, the mappings, the
    journal, the byte count) and what each of them does with one run of its share."""

    def __init__(
        self,
        plan: Plan,
        fds: list[int],
        maps: list[parallel.Mapping],
        journal: Journal,
        *,
        mode: str,
        fallback: bool,
        rate_limit: float | None,
        tally: parallel.Tally,
    ) -> None:
        self.plan, self.fds, self.maps, self.journal = plan, fds, maps, journal
        self.rate_limit, self.tally = rate_limit, tally
        #: ``auto`` may fall back from madvise to touching pages once, for every worker.
        self.fallback = fallback
        self.mode = mode
        self.t0 = time.perf_counter()

    def each(self, run: list[Unit]) -> None:
        """Make one run present, journal it, report it, keep pace."""
        first = run[0]
        length = sum(u.bytes for u in run)
        if self.mode in (FALLOCATE, FALLOCATE_MADVISE):
            self.allocate(first.segment, first.offset, length)
        if self.mode != FALLOCATE:
            self.fault(self.maps[first.segment][0] + first.offset, length)
        self.journal.mark(first.index, len(run))
        self.tally.add(length)
        self.pace()

    def out_of_memory(self, length: int) -> str:
        return f"pre-fault ran out of memory at {fmt_bytes(length)} chunk of {self.plan.medium.name} pool"

    def allocate(self, segment: int, offset: int, length: int) -> None:
        """``fallocate`` a run of one file; a shortfall of pages is a ``CapacityError``."""
        try:
            vm.allocate(self.fds[segment], offset, length)
        except vm.VMError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                seg = self.plan.segments[segment]
                raise CapacityError(
                    f"{self.out_of_memory(length)} (fallocate of {seg.file} at offset "
                    f"{fmt_bytes(offset)}): {exc.strerror}"
                ) from exc
            if exc.errno == errno.EOPNOTSUPP:
                raise RegionError(
                    f"{self.plan.medium.name} here cannot fallocate: pre-fault with "
                    f"OFFLOADPOOL_POPULATE_MODE={MADVISE}"
                ) from exc
            raise

    def fault(self, addr: int, length: int) -> None:
        """Populate ``length`` bytes at ``addr``: MADV_POPULATE_WRITE, or touch every page."""
        if self.mode == TOUCH:
            vm.touch_pages(addr, length, self.plan.page_size)
        elif not parallel.fault_in(
            addr, length, self.plan.page_size, self.out_of_memory(length), fallback=self.fallback
        ):
            self.mode = TOUCH  # kernel < 5.14: no MADV_POPULATE_WRITE

    def pace(self) -> None:
        """Sleep while this call is ahead of ``rate_limit`` (all workers together)."""
        if self.rate_limit:
            ahead = self.tally.added / self.rate_limit - (time.perf_counter() - self.t0)
            if ahead > 0:
                time.sleep(ahead)


def populate(
    pool: Pool,
    plan: Plan,
    *,
    workers: int = 0,
    progress: Progress | None = None,
    numa_policy: str = NUMA_NONE,
    mode: str = AUTO,
    chunk_bytes: int = DEFAULT_CHUNK,
    rate_limit: float | None = None,
) -> PopulateStats:
    """Pre-fault every segment of ``plan`` in ``pool`` that the journal lacks.

    ``rate_limit`` (bytes/s, all workers together) keeps a pre-fault from saturating the
    memory bandwidth of a busy node. ``mode`` (also ``OFFLOADPOOL_POPULATE_MODE``): ``auto``
    takes the medium's strategy (:func:`strategy`) and falls back from MADV_POPULATE_WRITE to
    touching pages when the kernel lacks it; any other of :data:`MODES` is used as given.
    """
    mode = os.environ.get("OFFLOADPOOL_POPULATE_MODE", mode)
    all_units = units(plan.segments, plan.page_size)
    total = sum(u.bytes for u in all_units)
    workers = workers or parallel.default_workers(plan)
    workers = max(1, min(workers, len(all_units)))
    chosen = strategy(plan, mode, numa_policy, workers)  # a bad mode fails before anything
    policy = numa.parse_policy(numa_policy)
    with given(pool) as handle:
        journal = Journal(handle, len(all_units))
        try:
            with parallel.mapped(handle, plan, policy, map_memory=chosen != FALLOCATE) as (fds, maps):
                done = journal.done()
                skipped = sum(u.bytes for u in all_units if done[u.index])
                if rate_limit:
                    chunk_bytes = max(1, min(chunk_bytes, int(rate_limit / 8)))
                tally = parallel.Tally(total, progress, start=skipped)
                job = _Prefault(
                    plan,
                    fds,
                    maps,
                    journal,
                    mode=chosen,
                    fallback=mode == AUTO,
                    rate_limit=rate_limit,
                    tally=tally,
                )
                parallel.run_shares(
                    parallel.shares(all_units, workers),
                    lambda share: parallel.runs(share, chunk_bytes, done),
                    job.each,
                    "populate",
                )
                seconds = time.perf_counter() - job.t0
                # Only a huge= tmpfs can hold PMD-sized pages, so the coverage is not read for the
                # media that cannot.
                thp = _thp_bytes(maps) if maps and plan.medium.huge not in (None, "never") else 0
                torn_down = time.perf_counter()
            # Tearing the mapping down is part of a pre-fault made through one (for 4 KiB pages a
            # sizeable part: a page table entry per page), so the rate counts it, as the kernel's
            # rate in `bench populate` does.
            seconds += time.perf_counter() - torn_down
            return PopulateStats(total, tally.added, skipped, seconds, workers, job.mode, thp)
        finally:
            journal.close()
