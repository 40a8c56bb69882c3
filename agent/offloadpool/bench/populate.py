"""``offloadpool bench populate``: how fast can a node make offload memory ready?

Strategies, all for the same capacity C, in one run (see docs/bench-populate.md):

* ``engine_baseline`` - what engines did before vLLM's seed changes: one tmpfs file (4 KiB
  pages), each of R ranks maps it and pre-faults the *whole* region, all at once;
* ``sharded`` - one file, rank i pre-faults only share i;
* ``segmented`` - the region in k = min(32, C / 1 GiB) files, ranks sharded across them;
* ``per_rank`` - one file of C/R per rank, each rank pre-faults its own;
* ``vllm_0_33`` - what vLLM 0.33.0's ``SharedOffloadRegion`` does at start (non-replicated
  layout): its split (``region.files.vllm_compat``: k = min(32, C / 1 GiB) files on whole rows of R
  slots of ``VLLM_SLOT``), and each rank pre-faults only its own slot of every row, one
  ``madvise`` per slot, starting at a different file per rank, 4 KiB pages;
* ``offloadpool_<medium>`` - :func:`offloadpool.region.lifecycle.provision.provision` (reserve, mount,
  create, populate with the default worker count, manifest), for every medium this node has;
* ``kernel_<medium>_<option>`` - the kernel's own rate of clearing that medium's pages: the
  medium mounted as a provision mounts it, the same files, W threads over the same shares, and
  nothing timed but the calls of one pre-fault option (``OPTIONS``: ``fallocate`` on hugetlbfs,
  ``madvise``, ``fallocate+madvise``, ``touch``); the medium's best option is its
  *kernel rate*, the limit its ``offloadpool_<medium>`` is measured against;
* ``memset_limit`` - W threads ``memset`` over memory that is already mapped and populated, in
  2 MiB calls (page by page, as the kernel zeroes what it faults in): the zeroing bandwidth every
  pre-fault ultimately pays; ``memset_bulk`` - the same in one call per thread: a single
  gigabyte-long ``rep stosb`` lets the CPU stream (cache-bypassing) stores, which no fault path
  can do, since the kernel clears each page separately (context, not a target).

Ranks and workers are threads calling ``madvise(MADV_POPULATE_WRITE)`` through ctypes (no GIL
held), each rank with its own mapping, as separate engine processes would have. Each case runs
once untimed immediately before its timed run (the VM backs memory lazily: docs/bench-populate.md) and
the cases are interleaved for ``reps`` rounds in the orders of :func:`round_orders`, where a case
follows a different case in every round (what the one before it left in memory, freed pages to
clear or huge pages to compact, lands on every case in turn); figures are medians with min/max.
GiB/s is always C / seconds (the region's bytes, not bytes touched).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

from offloadpool.bench import report
from offloadpool.bench.stats import machine, summarize
from offloadpool.region.errors import CapacityError, RegionError
from offloadpool.region.files import vllm_compat
from offloadpool.region.files.journal import units
from offloadpool.region.files.manifest import MOUNT_NAME
from offloadpool.region.files.planner import plan as make_plan
from offloadpool.region.lifecycle.provision import mount_options, provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.memory import hugepages, mounts, parallel, vm
from offloadpool.region.memory import populate as prefault
from offloadpool.region.memory.media import medium as lookup_medium
from offloadpool.region.request import PoolRequest
from offloadpool.region.vocabulary import HUGEPAGES_1GI, HUGEPAGES_2MI, MEMORY, MEMORY_THP

GiB = 1 << 30
MEDIA = (HUGEPAGES_2MI, HUGEPAGES_1GI, MEMORY_THP, MEMORY)
#: The pre-fault options measured per file system (``fallocate`` alone does not clear tmpfs pages).
ENGINE_CASES = ("engine_baseline", "sharded", "segmented", "per_rank", "vllm_0_33")
OPTIONS = {
    "hugetlbfs": (prefault.FALLOCATE, prefault.MADVISE),
    "tmpfs": (prefault.MADVISE, prefault.FALLOCATE_MADVISE, prefault.TOUCH),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--capacity", default="4Gi", help="region size for every strategy (default 4Gi)")
    p.add_argument("--ranks", type=int, default=4, help="engine ranks R (default 4)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per case (default 3, >= 3)")
    p.add_argument("--workers", type=int, default=0, help="offloadpool/memset threads (0 = cores)")
    p.add_argument("--media", default=",".join(MEDIA), help="offloadpool media to try")
    p.add_argument(
        "--no-engines",
        dest="engines",
        action="store_false",
        help="leave out the engine-style cases (engine_baseline ... vllm_0_33): only the media "
        "against the kernel's rate",
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=7,
        help="after the rounds, offloadpool against each medium's kernel rate in this many pairs of "
        "back-to-back runs (default 7; 0 = none)",
    )
    p.add_argument("--json", action="store_true", help="print the JSON result on stdout")
    p.add_argument("--markdown", help="write a markdown table to this file")
    p.add_argument("--png", help="write a bar chart to this file (needs matplotlib)")


def round_orders(n: int, reps: int) -> list[list[int]]:
    """The order of ``n`` cases in each of ``reps`` rounds: round r walks them with a stride
    coprime to ``n`` (1, then the next, ...), starting r cases on.

    Rotating one order (A B C, B C A, ...) changes which case opens a round but never which
    case comes before another, and the case before leaves the memory in its own state: pages
    just freed or still backed by the host, huge pages to compact. With stride s, the case
    before case i is i - s, so a case has a new predecessor in every round, as long as there
    are strides left (Euler's phi(n) of them; then they repeat).
    """
    strides = [s for s in range(1, n) if math.gcd(s, n) == 1] or [1]
    return [[(r + i * strides[r % len(strides)]) % n for i in range(n)] for r in range(reps)]


def _threads(jobs: list[Callable[[], None]]) -> float:
    """Run every job on its own thread at once; seconds until the last finishes."""
    errors: list[BaseException] = []

    def wrap(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(j,)) for j in jobs]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return seconds


class Scratch:
    """A private tmpfs (4 KiB pages, like /dev/shm) for the engine-style strategies."""

    def __init__(self, base: Path, size: int) -> None:
        self.dir = base / "scratch"
        self.dir.mkdir()
        mounts.mount("tmpfs", self.dir, f"size={size},huge=never,mode=0700")

    def files(self, sizes: list[int]) -> list[tuple[int, int]]:
        out = []
        for i, size in enumerate(sizes):
            fd = os.open(self.dir / f"f{i}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            os.ftruncate(fd, size)
            out.append((fd, size))
        return out

    def clear(self, files: list[tuple[int, int]]) -> None:
        for fd, _ in files:
            os.close(fd)
        for f in self.dir.iterdir():
            f.unlink()

    def close(self) -> None:
        mounts.umount(self.dir)


def _populate_ranges(fd: int, size: int, ranges: list[tuple[int, int]]) -> Callable[[], None]:
    """A rank: map the whole file (its own mapping) and pre-fault the given (offset, length)s."""

    def job() -> None:
        addr = vm.map_shared(fd, size)
        try:
            for off, length in ranges:
                if length:
                    vm.populate_write(addr + off, length)
        finally:
            vm.unmap(addr, size)

    return job


def _shares(total: int, n: int, page: int = 4096) -> list[tuple[int, int]]:
    """n contiguous shares rounded up to pages; the last may be short or empty."""
    step = -(-total // n)
    step = -(-step // page) * page
    return [(min(i * step, total), max(0, min(step, total - i * step))) for i in range(n)]


#: One rank's slot per row in ``vllm_0_33`` (Llama-3-70B at TP4 keeps 1.25 MiB per block per rank).
VLLM_SLOT = 1 << 20


def _populate_files(files: list[tuple[int, int]], ranges: list[tuple[int, int, int]]) -> Callable[[], None]:
    """A rank mapping every file (its own mappings) and pre-faulting (file, offset, length)s in order."""

    def job() -> None:
        addrs = [vm.map_shared(fd, size) for fd, size in files]
        try:
            for f, off, length in ranges:
                vm.populate_write(addrs[f] + off, length)
        finally:
            # strict=False: after a failed mapping, addrs holds only the files mapped so far
            for addr, (_, size) in zip(addrs, files, strict=False):
                vm.unmap(addr, size)

    return job


def vllm_jobs(
    scratch: Scratch, cap: int, ranks: int
) -> tuple[list[tuple[int, int]], list[Callable[[], None]]]:
    """vLLM 0.33.0's start: its file split, every rank its own slots (``iter_worker_slot_ranges``)."""
    row = ranks * VLLM_SLOT
    total = cap - cap % row
    sizes = vllm_compat.segment_sizes(total, row, vllm_compat.CPU_OFFLOADING_SEGMENTS)
    files = scratch.files(sizes)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    chunks = total // row
    jobs = []
    for rank in range(ranks):
        first = rank * chunks // ranks if len(sizes) > 1 else 0  # each rank starts in another file
        ranges = []
        for i in range(chunks):
            offset = ((first + i) % chunks) * row + rank * VLLM_SLOT
            f = max(j for j, start in enumerate(starts) if start <= offset)
            ranges.append((f, offset - starts[f], VLLM_SLOT))
        jobs.append(_populate_files(files, ranges))
    return files, jobs


def engine_case(kind: str, scratch: Scratch, cap: int, ranks: int) -> float:
    if kind == "vllm_0_33":
        files, jobs = vllm_jobs(scratch, cap, ranks)
    elif kind == "per_rank":
        files = scratch.files([cap // ranks] * ranks)
        jobs = [_populate_ranges(fd, size, [(0, size)]) for fd, size in files]
    elif kind == "segmented":
        k = max(1, min(32, cap // GiB))
        files = scratch.files([cap // k] * k)
        seg = cap // k
        jobs = []
        for off, length in _shares(cap, ranks):
            # rank's logical share, cut at file boundaries; each file mapped by the rank
            parts: dict[int, list[tuple[int, int]]] = {}
            pos, end = off, off + length
            while pos < end:
                f, within = divmod(pos, seg)
                n = min(end - pos, seg - within)
                parts.setdefault(f, []).append((within, n))
                pos += n
            for f, ranges in parts.items():
                jobs.append(_populate_ranges(files[f][0], seg, ranges))
    else:
        files = scratch.files([cap])
        fd = files[0][0]
        if kind == "engine_baseline":
            jobs = [_populate_ranges(fd, cap, [(0, cap)]) for _ in range(ranks)]
        else:  # sharded
            jobs = [_populate_ranges(fd, cap, [s]) for s in _shares(cap, ranks)]
    try:
        return _threads(jobs)
    finally:
        scratch.clear(files)


ZERO_UNIT = 2 << 20


def memset_case(scratch: Scratch, cap: int, workers: int, unit: int | None) -> float:
    """W threads zero already-mapped, already-populated memory: nothing but the stores.

    ``unit`` = 2 MiB: memset called per 2 MiB, the way the kernel zeroes a page it faults in
    (one page at a time, ordinary cached stores): the zeroing limit a pre-fault can approach.
    ``unit`` = None: one call per thread share; one huge ``rep stosb`` lets the CPU switch to
    streaming stores, which no page fault path can use - reported for context.
    """
    files = scratch.files([cap])
    fd = files[0][0]
    addr = vm.map_shared(fd, cap)

    def job(off: int, n: int) -> None:
        step = unit or n
        for o in range(off, off + n, step):
            vm.memset(addr + o, 0, min(step, off + n - o))

    try:
        vm.populate_write(addr, cap)  # already mapped and populated: only the zeroing is timed
        jobs: list[Callable[[], None]] = [functools.partial(job, o, n) for o, n in _shares(cap, workers)]
        _threads(jobs)  # warm
        return _threads(jobs)
    finally:
        vm.unmap(addr, cap)
        scratch.clear(files)


@contextmanager
def reserved_pages(medium: str, cap: int) -> Iterator[None]:
    """Hold ``cap`` bytes of huge pages in the kernel pool around a hugetlbfs case.

    A Kubernetes node pre-allocates its huge pages (kubelet advertises only those), so the
    agent's provision finds them in the pool; this does the same for the warm and the timed
    run of one case, and gives the pages back right after. 1 GiB pages need physically
    contiguous gigabytes, which a busy machine may not have again later: they are taken once
    for the whole run instead.
    """
    from offloadpool.region.memory.media import medium as lookup

    med = lookup(medium)
    if not med.hugetlb:
        yield
        return
    with hugepages.reservation_lock():
        added = hugepages.grow(med.page_size, cap // med.page_size)
    try:
        yield
    finally:
        with hugepages.reservation_lock():
            hugepages.shrink(med.page_size, added)


def offloadpool_case(
    root: Path,
    medium: str,
    cap: int,
    workers: int,
    populate_rates: list[float] | None = None,
    outside: list[float] | None = None,
) -> float:
    """One provision end to end (released untimed); its pre-fault's own rate (its calls and
    their mapping's teardown, ``PopulateStats.seconds``) to ``populate_rates``, and the seconds
    it spent outside the pre-fault (capacity check, mount, files, records, manifest: a cost per
    provision, not per byte, which the kernel's rate leaves untimed) to ``outside``."""
    req = PoolRequest(name=f"bench-{medium.lower()}", capacity=cap, medium=medium, workers=workers)
    try:
        result = provision(req, root)
    finally:
        release(root, req.name, force=True)
    if populate_rates is not None:
        populate_rates.append(result.gib_per_s)
    if outside is not None and result.gib_per_s > 0:
        outside.append(result.seconds - result.populated_bytes / GiB / result.gib_per_s)
    return result.seconds


def _option_job(option: str, fd: int, addr: int, offset: int, length: int, page: int) -> None:
    """One run of a share made present by ``option`` (the calls ``region.memory.populate`` makes)."""
    if option in (prefault.FALLOCATE, prefault.FALLOCATE_MADVISE):
        vm.allocate(fd, offset, length)
    if option in (prefault.MADVISE, prefault.FALLOCATE_MADVISE):
        vm.populate_write(addr + offset, length)
    elif option == prefault.TOUCH:
        vm.touch_pages(addr + offset, length, page)


def kernel_case(base: Path, medium: str, cap: int, workers: int, option: str) -> float:
    """The kernel's own rate for ``medium`` with ``option``: the medium mounted as a provision
    mounts it (untimed), the plan's files (untimed), then W threads over the pre-fault's shares
    in its runs and the unmapping of what they mapped, timed (a pre-fault through a mapping
    must tear it down again, as ``region.memory.populate`` does); unmounted afterwards, untimed, which
    gives every page back."""
    req = PoolRequest(name=f"kernel-{medium.lower()}", capacity=cap, medium=medium, workers=workers)
    plan = make_plan(req)
    pool_dir = base / req.name
    mnt = pool_dir / MOUNT_NAME
    mnt.mkdir(parents=True, exist_ok=True)
    mounts.mount(plan.medium.fstype, mnt, mount_options(plan, req))
    fds: list[int] = []
    maps: list[tuple[int, int]] = []
    try:
        for seg in plan.segments:
            fds.append(os.open(pool_dir / seg.file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
            os.ftruncate(fds[-1], seg.bytes)
            if option != prefault.FALLOCATE:
                maps.append((vm.map_shared(fds[-1], seg.bytes), seg.bytes))
        all_units = units(plan.segments, plan.page_size)
        shares = parallel.shares(all_units, max(1, min(workers, len(all_units))))

        def share_job(share: list) -> None:
            for run in parallel.runs(share, parallel.DEFAULT_CHUNK):
                first = run[0]
                addr = maps[first.segment][0] if maps else 0
                _option_job(
                    option, fds[first.segment], addr, first.offset, sum(u.bytes for u in run), plan.page_size
                )

        t0 = time.perf_counter()
        _threads([functools.partial(share_job, sh) for sh in shares if sh])
        while maps:
            vm.unmap(*maps.pop())
        return time.perf_counter() - t0
    finally:
        for addr, length in maps:
            vm.unmap(addr, length)
        for fd in fds:
            os.close(fd)
        mounts.umount(mnt)
        shutil.rmtree(pool_dir, ignore_errors=True)


def _fastest_option(medium: str, samples: dict[str, list[float]]) -> str | None:
    """The kernel option of ``medium`` with the shortest median time in the rounds, if any."""
    prefix = f"kernel_{medium}_"
    times = {k[len(prefix) :]: summarize(v).median for k, v in samples.items() if k.startswith(prefix)}
    return min(times, key=lambda o: times[o]) if times else None


def paired_times(
    kernel: Callable[[], float],
    ours: Callable[[], float],
    prepared: Callable[[], AbstractContextManager[Any]],
    pairs: int,
) -> list[tuple[float, float]]:
    """``pairs`` (kernel seconds, offloadpool seconds), each pair two runs back to back.

    Why pairs, after the rounds: the rounds pick the kernel rate as the best of a medium's
    options, and the best of several noisy medians is biased upwards (on a machine whose runs
    spread 2x, the maximum of three equal options beats any one of them). Measuring the
    picked option again, fresh, removes that bias; putting each of its runs right next to one
    of offloadpool's (kernel first in even pairs, offloadpool first in odd ones) cancels what
    drifts over a run (the host's load, the memory's state) instead of averaging it. Each run
    is warmed as in the rounds. A pair's ratio is the kernel's seconds over offloadpool's.
    """
    times = []
    for i in range(pairs):
        timed: dict[str, float] = {}
        for name, case in (("kernel", kernel), ("ours", ours))[:: 1 if i % 2 == 0 else -1]:
            with prepared():
                case()  # warm, untimed
                timed[name] = case()
        times.append((timed["kernel"], timed["ours"]))
    return times


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@contextmanager
def _workspace() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="offloadpool-bench-"))
    try:
        yield base
    finally:
        for m in reversed(mounts.mounts_under(base)):
            mounts.umount(m.target, lazy=True)
        shutil.rmtree(base, ignore_errors=True)


def run(
    cap: int,
    ranks: int,
    reps: int,
    workers: int,
    media: list[str],
    log: Callable[[str], None] = lambda s: None,
    engines: bool = True,
    pairs: int = 0,
) -> dict:
    """Run every case, interleaved, then ``pairs`` paired runs per medium
    (:func:`paired_times`), and return the JSON-ready result."""
    if reps < 1:
        raise ValueError("reps must be >= 1")
    if pairs < 0:
        raise ValueError("pairs must be >= 0")
    workers = workers or len(os.sched_getaffinity(0))
    samples: dict[str, list[float]] = {}
    populate_rates: dict[str, list[float]] = {}  # per medium: provision's own pre-fault rate
    outside: dict[str, list[float]] = {}  # per medium: provision's seconds outside the pre-fault
    paired: dict[str, dict[str, Any]] = {}  # per medium: the paired runs against its kernel rate
    unavailable: dict[str, str] = {}
    before = {p: hugepages.counters(p).total for p in (2 << 20, GiB) if hugepages.supported(p)}
    with _workspace() as base:
        scratch = Scratch(base, cap)
        root = base / "root"
        cases: dict[str, tuple[Callable[[], float], Callable[[], AbstractContextManager[Any]]]] = {
            k: (functools.partial(engine_case, k, scratch, cap, ranks), _nothing)
            for k in ENGINE_CASES
            if engines
        }
        held = ExitStack()  # 1 GiB pages: taken once for the whole run (see run_wide)
        for medium in media:
            name = f"offloadpool_{medium}"
            run_wide = medium == HUGEPAGES_1GI
            try:  # is the medium available here at this size?
                if run_wide:
                    held.enter_context(reserved_pages(medium, cap))
                with _nothing() if run_wide else reserved_pages(medium, cap):
                    offloadpool_case(root, medium, cap, workers)
            except (CapacityError, RegionError, ValueError) as exc:
                unavailable[name] = str(exc)
                continue
            prepared: Callable[[], AbstractContextManager[Any]] = (
                _nothing if run_wide else functools.partial(reserved_pages, medium, cap)
            )
            for option in OPTIONS[lookup_medium(medium).fstype]:
                cases[f"kernel_{medium}_{option}"] = (
                    functools.partial(kernel_case, base, medium, cap, workers, option),
                    prepared,
                )
            cases[name] = (
                functools.partial(
                    offloadpool_case,
                    root,
                    medium,
                    cap,
                    workers,
                    populate_rates.setdefault(medium, []),
                    outside.setdefault(medium, []),
                ),
                prepared,
            )
        cases["memset_limit"] = ((lambda: memset_case(scratch, cap, workers, ZERO_UNIT)), _nothing)
        cases["memset_bulk"] = ((lambda: memset_case(scratch, cap, workers, None)), _nothing)
        try:
            for rep in range(reps):
                listed = list(cases.items())
                for name, (case, prepared) in (listed[i] for i in round_orders(len(listed), reps)[rep]):
                    try:
                        with prepared():
                            case()  # warm, untimed, immediately before the timed run
                            seconds = case()
                    except (CapacityError, RegionError) as exc:
                        # e.g. huge pages taken by another tenant mid-run: drop the case, say why
                        unavailable[name] = f"failed in rep {rep + 1}: {exc}"
                        del cases[name]
                        samples.pop(name, None)
                        continue
                    samples.setdefault(name, []).append(seconds)
                    log(f"rep {rep + 1}/{reps} {name}: {cap / GiB / seconds:.2f} GiB/s ({seconds:.3f} s)")
            for medium in media if pairs else ():
                our_case = cases.get(f"offloadpool_{medium}")
                fastest = _fastest_option(medium, samples)
                if our_case is None or fastest is None:
                    continue
                kernel, prepared = cases[f"kernel_{medium}_{fastest}"]
                prefault_rates: list[float] = []  # the pre-fault's own rates
                mine = functools.partial(
                    offloadpool_case, root, medium, cap, workers, prefault_rates, outside[medium]
                )
                try:
                    pair_times = paired_times(kernel, mine, prepared, pairs)
                except (CapacityError, RegionError) as exc:
                    unavailable[f"paired_{medium}"] = str(exc)
                    continue
                ratios = [k / o for k, o in pair_times]
                timed_rates = prefault_rates[1::2]  # each timed run follows its warm run
                populate_ratios = [
                    r * k / (cap / GiB) for r, (k, _) in zip(timed_rates, pair_times, strict=True)
                ]
                paired[medium] = {
                    "option": fastest,
                    "ratios": [round(r, 3) for r in ratios],
                    "populate_ratios": [round(r, 3) for r in populate_ratios],
                }
                log(f"paired {medium} vs {fastest}: " + " ".join(f"{r:.2f}" for r in ratios))
                log("  its pre-fault alone: " + " ".join(f"{r:.2f}" for r in populate_ratios))
        finally:
            held.close()
            scratch.close()
    after = {p: hugepages.counters(p).total for p in before}
    strategies: dict[str, dict[str, Any]] = {}
    for name, secs in samples.items():
        rates = summarize([cap / GiB / s for s in secs])
        t = summarize(secs)
        strategies[name] = {
            "gib_per_s": round(rates.median, 3),
            "gib_per_s_min": round(rates.minimum, 3),
            "gib_per_s_max": round(rates.maximum, 3),
            "seconds": round(t.median, 4),
            "spread_percent": round(rates.spread_percent, 1),
            "samples_s": [round(s, 4) for s in secs],
        }
    media_result = _per_medium(strategies, populate_rates, paired, outside)
    ours = {k: v for k, v in strategies.items() if k.startswith("offloadpool_")}
    best = max(ours, key=lambda k: ours[k]["gib_per_s"]) if ours else None
    base_rate = strategies["engine_baseline"]["gib_per_s"] if engines else None
    limit = strategies["memset_limit"]["gib_per_s"]
    bulk = strategies["memset_bulk"]["gib_per_s"]
    return {
        "strategies": strategies,
        "best_offloadpool": best,
        "ratio_vs_engine_baseline": round(ours[best]["gib_per_s"] / base_rate, 2)
        if best and base_rate
        else None,
        "ratio_vs_memset_limit": round(ours[best]["gib_per_s"] / limit, 2) if best else None,
        "ratio_vs_memset_bulk": round(ours[best]["gib_per_s"] / bulk, 2) if best else None,
        "media": media_result,
        "unavailable": unavailable,
        "params": {"capacity_bytes": cap, "ranks": ranks, "reps": reps, "workers": workers, "pairs": pairs},
        "machine": machine(),
        "hugepages_restored": before == after,
    }


def _per_medium(
    strategies: dict[str, dict[str, Any]],
    populate_rates: dict[str, list[float]],
    paired: dict[str, dict[str, Any]] | None = None,
    outside: dict[str, list[float]] | None = None,
) -> dict:
    """Per medium measured: its options' rates, its kernel rate (the best option's median), the
    strategy ``region.memory.populate`` takes there and offloadpool's ratio to the kernel rate; with
    pairs, their ratios and median (``paired_ratio_vs_kernel``, the figure to quote); the
    median time a timed provision spent outside its pre-fault (``outside_prefault_ms``)."""
    out: dict[str, dict[str, Any]] = {}
    for medium in MEDIA:
        ours = strategies.get(f"offloadpool_{medium}")
        prefix = f"kernel_{medium}_"
        options = {k[len(prefix) :]: v["gib_per_s"] for k, v in strategies.items() if k.startswith(prefix)}
        if ours is None or not options:
            continue
        best = max(options, key=lambda o: options[o])
        rates = populate_rates.get(medium, [])[1::2]  # each timed run follows its warm-up run
        pre = summarize(rates).median if rates else 0.0
        out[medium] = {
            "options_gib_per_s": options,
            "kernel_option": best,
            "kernel_gib_per_s": options[best],
            "chosen": prefault.STRATEGY_FOR[medium],
            "offloadpool_gib_per_s": ours["gib_per_s"],
            "ratio_vs_kernel": round(ours["gib_per_s"] / options[best], 3),
            "populate_gib_per_s": round(pre, 3),
            "populate_ratio_vs_kernel": round(pre / options[best], 3),
        }
        # rounds and pairs both append a warm run, then its timed run
        timed_outside = (outside or {}).get(medium, [])[1::2]
        if timed_outside:
            out[medium]["outside_prefault_ms"] = round(summarize(timed_outside).median * 1000, 1)
        if paired and medium in paired:
            ratios = paired[medium]["ratios"]
            out[medium]["paired"] = {
                **paired[medium],
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
            }
            out[medium]["paired_ratio_vs_kernel"] = round(summarize(ratios).median, 3)
            out[medium]["paired_populate_ratio_vs_kernel"] = round(
                summarize(paired[medium]["populate_ratios"]).median, 3
            )
    return out


def markdown(result: dict, command: str) -> str:
    p = result["params"]
    lines = report.head(
        command,
        f"Capacity {p['capacity_bytes'] / GiB:g} GiB, {p['ranks']} ranks, {p['workers']} offloadpool/memset "
        f"threads, {p['reps']} timed reps per case (medians; min-max in brackets).",
        result["machine"],
        ["strategy"],
        ["GiB/s (median)", "min-max GiB/s", "seconds (median)", "vs engine_baseline"],
    )
    base = result["strategies"].get("engine_baseline", {}).get("gib_per_s")
    for name, s in sorted(result["strategies"].items(), key=lambda kv: kv[1]["gib_per_s"]):
        versus = f"{s['gib_per_s'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {name} | {s['gib_per_s']:.2f} | {s['gib_per_s_min']:.2f}-{s['gib_per_s_max']:.2f} "
            f"| {s['seconds']:.3f} | {versus} |"
        )
    lines += [
        "",
        f"ratio_vs_engine_baseline = **{result['ratio_vs_engine_baseline']}**, "
        f"ratio_vs_memset_limit = **{result['ratio_vs_memset_limit']}** "
        f"(vs memset_bulk {result['ratio_vs_memset_bulk']}) "
        f"(best: {result['best_offloadpool']})",
        "",
        "Per medium: every pre-fault option the kernel offers (bare calls, W threads), the kernel rate "
        "(its best option) and offloadpool's provision against it; **chosen** = `region.memory.populate`'s "
        "strategy for the medium (`STRATEGY_FOR`).",
        "",
        "| medium | strategy | GiB/s (median) | min-max GiB/s | vs kernel rate |",
        "|---|---|---:|---:|---:|",
    ]
    strategies = result["strategies"]
    for medium, m in result.get("media", {}).items():
        rows = [(f"kernel_{medium}_{o}", o) for o in m["options_gib_per_s"]]
        rows.append((f"offloadpool_{medium}", f"offloadpool (provision, {m['chosen']})"))
        for key, label in rows:
            s = strategies[key]
            marks = []
            if label == m["kernel_option"]:
                marks.append("kernel rate")
            if label == m["chosen"]:
                marks.append("chosen")
            text = f"{label} **({', '.join(marks)})**" if marks else label
            spread = f"{s['gib_per_s_min']:.2f}-{s['gib_per_s_max']:.2f}"
            lines.append(
                f"| {medium} | {text} | {s['gib_per_s']:.2f} | {spread} "
                f"| {s['gib_per_s'] / m['kernel_gib_per_s']:.2f} |"
            )
    lines.append("")
    lines += [
        f"{medium}: offloadpool / kernel rate = **{m['ratio_vs_kernel']}** "
        f"(its pre-fault alone: {m['populate_gib_per_s']:.2f} GiB/s, {m['populate_ratio_vs_kernel']})"
        + (
            f"; paired against `{m['paired']['option']}`, {len(m['paired']['ratios'])} pairs: "
            f"**{m['paired_ratio_vs_kernel']}** "
            f"({m['paired']['ratio_min']:.2f}-{m['paired']['ratio_max']:.2f}), "
            f"its pre-fault alone **{m['paired_populate_ratio_vs_kernel']}**"
            if "paired" in m
            else ""
        )
        + (
            f"; outside its pre-fault a provision took {m['outside_prefault_ms']} ms"
            if "outside_prefault_ms" in m
            else ""
        )
        + "  "
        for medium, m in result.get("media", {}).items()
    ]
    return report.tail(lines, result["unavailable"])


def chart(result: dict, path: str, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = sorted(result["strategies"].items(), key=lambda kv: kv[1]["gib_per_s"])
    names = [k for k, _ in items]
    med = [v["gib_per_s"] for _, v in items]
    lo = [v["gib_per_s"] - v["gib_per_s_min"] for _, v in items]
    hi = [v["gib_per_s_max"] - v["gib_per_s"] for _, v in items]
    colors = [
        "tab:green" if n.startswith("offloadpool_") else "tab:gray" if n.startswith("memset") else "tab:red"
        for n in names
    ]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(names) + 1.8))
    ax.barh(names, med, xerr=[lo, hi], color=colors, capsize=3)
    for y, v in enumerate(med):
        ax.text(v, y, f" {v:.2f}", va="center")
    p = result["params"]
    ax.set_xlabel("GiB/s (median, min-max whiskers)")
    ax.set_title(
        f"populate {p['capacity_bytes'] / GiB:g} GiB, {p['ranks']} ranks, {p['reps']} reps\n{command}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_cli(args: argparse.Namespace) -> int:
    from offloadpool.api.quantity import parse_quantity as parse_size

    cap = parse_size(args.capacity)
    report.note_reps(args.reps)
    result = run(
        cap,
        args.ranks,
        args.reps,
        args.workers,
        [m for m in args.media.split(",") if m],
        log=report.log,
        engines=args.engines,
        pairs=args.pairs,
    )
    command = (
        f"offloadpool bench populate --capacity {args.capacity} --ranks {args.ranks} --reps {args.reps}"
        + report.flag("--workers", args.workers, 0)
        + report.flag("--media", args.media, ",".join(MEDIA))
        + ("" if args.engines else " --no-engines")
        + report.flag("--pairs", args.pairs, 7)
    )
    text = markdown(result, command)
    if args.png:
        chart(result, args.png, command)
    report.publish(args, result, text)
    return 0
