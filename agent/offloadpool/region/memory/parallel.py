"""Worker threads over a pool's memory: what pre-fault (``populate``) and scrub share.

W threads each take a contiguous share of the logical region (all segments of all regions back
to back), so with k >= W equal files every worker starts in a different file and no two workers
contend for one file's page-cache lock. Shares are cut on journal units (max(page, 2 MiB)), so
they are page aligned for every medium. A worker walks its share in runs of at most
``chunk_bytes`` within one file; the call it makes for a run goes through ctypes, which
releases the GIL, so workers run on separate cores. The first error stops every worker at its
next run and is raised to the caller.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from offloadpool.region.errors import CapacityError, fmt_bytes
from offloadpool.region.files import beneath, places
from offloadpool.region.files.handle import PoolHandle
from offloadpool.region.files.journal import Unit
from offloadpool.region.files.manifest import Segment
from offloadpool.region.files.planner import Plan
from offloadpool.region.memory import numa, vm

#: ``progress(done_bytes, total_bytes)``, called by any worker thread as runs complete.
Progress = Callable[[int, int], None]
DEFAULT_CHUNK = 64 << 20
#: One mapping: its address and length.
Mapping = tuple[int, int]


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


def byte_shares(
    segments: Sequence[Segment], page_size: int, workers: int, chunk_bytes: int
) -> list[list[Unit]]:
    """``workers`` contiguous shares of the segments' bytes (all back to back), cut on pages,
    each as its runs: pieces within one file of at most ``chunk_bytes`` (rounded down to whole
    pages, at least one). The whole of a pool with no journal to consult (a scrub zeroes every
    byte), made in a step per file and run: a unit list (``journal.units``) is a Python object
    per unit, ~2 ms for 4 GiB of 2 MiB pages, which on huge pages zeroing at tens of GiB/s is
    a measurable share of the work. A run's ``index`` is its number in the share."""
    total = sum(seg.bytes for seg in segments)
    chunk = max(page_size, chunk_bytes // page_size * page_size)
    bounds = [min(total, -(-total * w // workers // page_size) * page_size) for w in range(workers + 1)]
    out: list[list[Unit]] = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        share: list[Unit] = []
        start = 0
        for i, seg in enumerate(segments):
            a, b = max(lo, start), min(hi, start + seg.bytes)
            for off in range(a - start, b - start, chunk):
                share.append(Unit(len(share), i, off, min(chunk, b - start - off)))
            start += seg.bytes
        out.append(share)
    return out


def runs(share: list[Unit], chunk_bytes: int, done: bytearray | None = None) -> list[list[Unit]]:
    """Group the units of a share that ``done`` (a byte per unit index) lacks into runs of
    contiguous units within one file, each at most ``chunk_bytes`` (or one unit)."""
    out: list[list[Unit]] = []
    cur: list[Unit] = []
    size = 0
    for u in share:
        skip = done is not None and done[u.index]
        contiguous = cur and cur[-1].segment == u.segment and cur[-1].offset + cur[-1].bytes == u.offset
        if skip or not contiguous or size + u.bytes > chunk_bytes:
            if cur:
                out.append(cur)
            cur, size = [], 0
        if not skip:
            cur.append(u)
            size += u.bytes
    if cur:
        out.append(cur)
    return out


def run_shares(
    parts: list[list[Unit]],
    runs_of: Callable[[list[Unit]], list[list[Unit]]],
    each: Callable[[list[Unit]], None],
    name: str,
) -> None:
    """Call ``each`` on every run (``runs_of``) of every share, a thread per share, and wait.

    One share is worked in the calling thread: a small pool (one unit) would pay a thread's
    start and join for nothing, and NUMA placement is per mapping (mbind), not per thread.
    After the first error no worker starts another run; that error is raised here.
    """
    errors: list[BaseException] = []
    stop = threading.Event()

    def work(share: list[Unit]) -> None:
        try:
            for run in runs_of(share):
                if stop.is_set():
                    return
                each(run)
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    if len(parts) == 1:
        work(parts[0])
    else:
        threads = [
            threading.Thread(target=work, args=(p,), name=f"{name}-{i}", daemon=True)
            for i, p in enumerate(parts)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]


class Tally:
    """Bytes done by all workers together, reported to ``progress`` as they grow.

    ``done`` starts at what an earlier run left done (``start``, counted for progress);
    ``added`` is what this call did.
    """

    def __init__(self, total: int, progress: Progress | None, start: int = 0) -> None:
        self.total, self.progress, self.start = total, progress, start
        self.done = start
        self.lock = threading.Lock()

    @property
    def added(self) -> int:
        return self.done - self.start

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            now_done = self.done
        if self.progress is not None:
            self.progress(now_done, self.total)


def fault_in(addr: int, length: int, page_size: int, out_of_memory: str, *, fallback: bool = True) -> bool:
    """Make ``length`` bytes at ``addr`` present (``MADV_POPULATE_WRITE``); False when the
    kernel lacks it (< 5.14: EINVAL) and every page was touched instead (``fallback``).

    Running out of memory (ENOMEM, EFAULT) is a ``CapacityError``: ``out_of_memory`` and the
    kernel's reason. Present pages keep their contents either way.
    """
    try:
        vm.populate_write(addr, length)
        return True
    except vm.VMError as exc:
        if exc.errno == errno.EINVAL and fallback:
            vm.touch_pages(addr, length, page_size)
            return False
        if exc.errno in (errno.ENOMEM, errno.EFAULT):
            raise CapacityError(f"{out_of_memory}: {exc.strerror}") from exc
        raise


@contextmanager
def mapped(
    pool: PoolHandle, plan: Plan, policy: numa.Policy, *, map_memory: bool = True
) -> Iterator[tuple[list[int], list[Mapping]]]:
    """Every segment of ``plan`` open and mapped shared (``map_segments``), as (fds, mappings)
    in plan order; unmapped and closed on the way out, also after a failure part way.

    ``map_memory=False``: the files only, no mapping (work done on the files themselves, such
    as ``fallocate``; a hugetlbfs mapping would also reserve pages it never uses)."""
    fds: list[int] = []
    maps: list[Mapping] = []
    try:
        if map_memory:
            map_segments(pool, plan, policy, fds, maps)
        else:
            for seg in plan.segments:
                fds.append(_open_one(pool, seg))
        yield fds, maps
    finally:
        for addr, length in maps:
            vm.unmap(addr, length)
        for fd in fds:
            os.close(fd)


def map_segments(
    pool: PoolHandle, plan: Plan, policy: numa.Policy, fds: list[int], maps: list[Mapping]
) -> None:
    """Open and map every segment, bound to its region's NUMA placement; each fd and mapping is
    appended as soon as it exists, so the caller's cleanup releases what a failure left."""
    region_of = [r.index for r in plan.regions for _ in r.segments]
    policy = numa.resolve(policy, len(plan.regions))  # GPU: the node's GPUs read once
    for i, seg in enumerate(plan.segments):
        _map_one(pool, seg, fds, maps)
        nmode, nodes = numa.placement(policy, region_of[i])
        numa.mbind(maps[-1][0], seg.bytes, nmode, nodes)


def _open_one(pool: PoolHandle, seg: Segment) -> int:
    """Open one segment beneath the pool directory (a plain file, its own link and at most
    vLLM's: never through a link a pod put there)."""
    try:
        return beneath.open_file(pool.fd, seg.file, os.O_RDWR, links=2)
    except beneath.WrongEntry as exc:
        raise places.UnsafeEntry(pool.path, exc) from None


def _map_one(pool: PoolHandle, seg: Segment, fds: list[int], maps: list[Mapping]) -> None:
    """Open one segment (:func:`_open_one`) and map it shared. A shared hugetlbfs mapping
    reserves its pages at mmap, so too few pages show here: a ``CapacityError``."""
    fd = _open_one(pool, seg)
    fds.append(fd)
    try:
        maps.append((vm.map_shared(fd, seg.bytes), seg.bytes))
    except vm.VMError as exc:
        if exc.errno != errno.ENOMEM:
            raise
        raise CapacityError(
            f"mapping {pool.rel(seg.file)} ({fmt_bytes(seg.bytes)}) to pre-fault it: {exc.strerror} "
            f"(on hugetlbfs: too few free huge pages for the mapping's reservation)"
        ) from exc
