"""Parallel, resumable pre-fault of a pool's segment files.

W worker threads each take a contiguous share of the logical region (all segments of all
regions back to back), so with k >= W equal files every worker starts in a different file and
no two workers contend for one file's page-cache lock. Each worker walks its share in chunks of
at most ``chunk_bytes`` within one file, calls ``madvise(MADV_POPULATE_WRITE)`` through ctypes
(the GIL is released for the call, so workers run on separate cores), then records the chunk in
the journal and reports progress. Shares are cut on journal units (max(page, 2 MiB)), so they
are page aligned for every medium.

Population writes no data: present pages keep their contents. That is what makes a resumed
provision safe for memory that may already hold an engine's data.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from offloadpool.region import beneath, numa, places, vm
from offloadpool.region.errors import CapacityError, RegionError, fmt_bytes
from offloadpool.region.journal import Journal, Unit, units
from offloadpool.region.manifest import Segment
from offloadpool.region.planner import Plan
from offloadpool.region.vocabulary import NUMA_NONE

Progress = Callable[[int, int], None]
DEFAULT_CHUNK = 64 << 20
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


def default_workers(plan: Plan) -> int:
    """The cores this process may run on, at most four per file, at least one."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores, 4 * len(plan.segments)))


def shares(all_units: list[Unit], workers: int) -> list[list[Unit]]:
    """Cut the unit list into ``workers`` contiguous runs of nearly equal bytes."""
    total = sum(u.bytes for u in all_units)
    out: list[list[Unit]] = [[] for _ in range(workers)]
    acc = 0
    for u in all_units:
        w = min(workers - 1, acc * workers // total) if total else 0
        out[w].append(u)
        acc += u.bytes
    return out


def _chunks(share: list[Unit], done: bytearray, chunk_bytes: int) -> list[list[Unit]]:
    """Group the not-yet-populated units of a share into runs within one file."""
    runs: list[list[Unit]] = []
    cur: list[Unit] = []
    size = 0
    for u in share:
        contiguous = cur and cur[-1].segment == u.segment and cur[-1].offset + cur[-1].bytes == u.offset
        if done[u.index] or not contiguous or size + u.bytes > chunk_bytes:
            if cur:
                runs.append(cur)
            cur, size = [], 0
        if not done[u.index]:
            cur.append(u)
            size += u.bytes
    if cur:
        runs.append(cur)
    return runs


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
    counters, the first error) and what each of them does with its share."""

    def __init__(
        self,
        plan: Plan,
        maps: list[tuple[int, int]],
        journal: Journal,
        done: bytearray,
        *,
        mode: str,
        chunk_bytes: int,
        rate_limit: float | None,
        progress: Progress | None,
        total: int,
        skipped: int,
    ) -> None:
        self.plan, self.maps, self.journal, self.done = plan, maps, journal, done
        self.chunk_bytes, self.rate_limit, self.progress, self.total = (
            chunk_bytes,
            rate_limit,
            progress,
            total,
        )
        #: ``auto`` may fall back from madvise to touching pages once, for every worker.
        self.fallback = mode == "auto"
        self.mode = "touch" if mode == "touch" else "madvise"
        self.done_bytes = skipped  # journalled, by anyone (for progress)
        self.new_bytes = 0  # populated by this call
        self.lock = threading.Lock()
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.t0 = time.perf_counter()

    def run(self, all_units: list[Unit], workers: int) -> float:
        """Populate every share in its own thread; the seconds it took. Re-raises the first error.

        One share is populated in the calling thread: a small pool (one unit) paid a thread's
        start and join for nothing; placement is per mapping (mbind), not per thread.
        """
        parts = shares(all_units, workers)
        if len(parts) == 1:
            self.work(parts[0])
        else:
            threads = [
                threading.Thread(target=self.work, args=(s,), name=f"populate-{i}", daemon=True)
                for i, s in enumerate(parts)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        seconds = time.perf_counter() - self.t0
        if self.errors:
            raise self.errors[0]
        return seconds

    def work(self, share: list[Unit]) -> None:
        """One worker: fault each missing run of its share, journal it, report it, keep pace."""
        try:
            for run in _chunks(share, self.done, self.chunk_bytes):
                if self.stop.is_set():
                    return
                first = run[0]
                length = sum(u.bytes for u in run)
                self.fault(self.maps[first.segment][0] + first.offset, length)
                self.journal.mark(first.index, len(run))
                self.report(length)
                self.pace()
        except BaseException as exc:
            self.errors.append(exc)
            self.stop.set()

    def fault(self, addr: int, length: int) -> None:
        """Populate ``length`` bytes at ``addr``: MADV_POPULATE_WRITE, or touch every page."""
        if self.mode == "madvise":
            try:
                vm.populate_write(addr, length)
                return
            except vm.VMError as exc:
                if exc.errno == errno.EINVAL and self.fallback:
                    self.mode = "touch"  # kernel < 5.14: no MADV_POPULATE_WRITE
                elif exc.errno in (errno.ENOMEM, errno.EFAULT):
                    raise CapacityError(
                        f"pre-fault ran out of memory at {fmt_bytes(length)} chunk of "
                        f"{self.plan.medium.name} pool: {exc.strerror}"
                    ) from exc
                else:
                    raise
        vm.touch_pages(addr, length, self.plan.page_size)

    def report(self, n: int) -> None:
        with self.lock:
            self.done_bytes += n
            self.new_bytes += n
            now_done = self.done_bytes
        if self.progress is not None:
            self.progress(now_done, self.total)

    def pace(self) -> None:
        """Sleep while this call is ahead of ``rate_limit`` (all workers together)."""
        if self.rate_limit:
            ahead = self.new_bytes / self.rate_limit - (time.perf_counter() - self.t0)
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
    workers = workers or default_workers(plan)
    workers = max(1, min(workers, len(all_units)))
    policy = numa.parse_policy(numa_policy)
    journal = Journal(pool_dir, len(all_units))
    fds: list[int] = []
    maps: list[tuple[int, int]] = []
    try:
        map_segments(pool_dir, plan, policy, fds, maps)
        done = journal.done()
        skipped = sum(u.bytes for u in all_units if done[u.index])
        if rate_limit:
            chunk_bytes = max(1, min(chunk_bytes, int(rate_limit / 8)))
        job = _Prefault(
            plan,
            maps,
            journal,
            done,
            mode=mode,
            chunk_bytes=chunk_bytes,
            rate_limit=rate_limit,
            progress=progress,
            total=total,
            skipped=skipped,
        )
        seconds = job.run(all_units, workers)
        # Only a huge= tmpfs can hold PMD-sized pages; reading /proc/self/smaps is O(every
        # mapping of the process), so it is not done for the media that cannot.
        thp = _thp_bytes(maps) if plan.medium.huge not in (None, "never") else 0
        return PopulateStats(total, job.new_bytes, skipped, seconds, workers, job.mode, thp)
    finally:
        for addr, length in maps:
            vm.unmap(addr, length)
        for fd in fds:
            os.close(fd)
        journal.close()


def map_segments(
    pool_dir: Path, plan: Plan, policy: numa.Policy, fds: list[int], maps: list[tuple[int, int]]
) -> None:
    """Open and map every segment, bound to its region's NUMA placement; each fd and mapping is
    appended as soon as it exists, so the caller's cleanup releases what a failure left."""
    region_of = [r.index for r in plan.regions for _ in r.segments]
    with places.pool_fd(pool_dir) as pool_fd:
        for i, seg in enumerate(plan.segments):
            _map_one(pool_dir, pool_fd, seg, fds, maps)
            nmode, nodes = numa.placement(policy, region_of[i])
            numa.mbind(maps[-1][0], seg.bytes, nmode, nodes)


def _map_one(pool_dir: Path, pool_fd: int, seg: Segment, fds: list[int], maps: list[tuple[int, int]]) -> None:
    """Open one segment beneath the pool directory (a plain file, its own link and at most
    vLLM's: never through a link a pod put there) and map it shared."""
    try:
        fd = beneath.open_file(pool_fd, seg.file, os.O_RDWR, links=2)
    except beneath.WrongEntry as exc:
        raise places.UnsafeEntry(pool_dir, exc) from None
    fds.append(fd)
    maps.append((vm.map_shared(fd, seg.bytes), seg.bytes))
