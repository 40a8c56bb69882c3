"""``offloadpool bench scrub``: how fast does a node zero a pool, against its pre-fault?

For each medium, one pool of capacity C is provisioned (as the agent does) and kept for the
whole run; the cases, interleaved (A B C D A B C D ...) for ``reps`` rounds, each run once
untimed right before its timed run (docs/bench-populate.md says why), are:

* ``prefault`` - the pool's own pre-fault (``region.memory.populate``) of empty files: every page is
  punched out of the files and the journal dropped first (untimed), so the kernel allocates and
  zeroes every page again, as in a fresh provision;
* ``scrub_memset`` / ``scrub_punch`` / ``scrub_remove`` - ``region.lifecycle.scrub.zero`` of the full pool
  with each method: zeros written through the mapping; ``fallocate(PUNCH_HOLE)`` then
  ``MADV_POPULATE_WRITE``; ``MADV_REMOVE`` then ``MADV_POPULATE_WRITE``;
* ``bare_write`` - the limit a scrub is held to: the same worker count of plain threads, each
  ``memset``-ing zeros over one contiguous share of the pool's files, mapped shared (mapping
  and unmapping counted, as the scrub's are), none of the project's machinery (no units,
  runs, tally or progress). ``fastest_scrub_vs_bare_write`` is the chosen method's median rate
  over it: the scrub's cost for doing what the node must around the writes.

With ``--pairs N``, after the rounds, each medium's chosen method and the bare write run N
times more as pairs, back to back (bare first in even pairs, the scrub first in odd ones), each
warmed as in the rounds (``bench.populate.paired_times``, which says why pairs answer a 10 %
question on a VM whose single runs spread 2x): ``paired_scrub_vs_bare_write`` is the median of
the pairs' ratios (the bare write's seconds over the scrub's), the figure to quote.

Every case uses the same worker count (the pre-fault's default: the cores, at most 4 per file)
and must leave the pool fully populated (the mount's used blocks are checked after every timed
run). GiB/s is C / seconds. The fastest scrub method per file system is what
``region.lifecycle.scrub.METHOD_FOR`` uses.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from offloadpool.bench import report
from offloadpool.bench.populate import _nothing, _workspace, paired_times, reserved_pages
from offloadpool.bench.stats import machine, summarize
from offloadpool.region.errors import CapacityError, RegionError
from offloadpool.region.files import places
from offloadpool.region.files.handle import open_pool
from offloadpool.region.files.journal import JOURNAL_NAME
from offloadpool.region.files.manifest import MOUNT_NAME
from offloadpool.region.files.planner import Plan
from offloadpool.region.files.planner import plan as make_plan
from offloadpool.region.lifecycle import scrub
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.memory import parallel, vm
from offloadpool.region.memory.parallel import default_workers
from offloadpool.region.memory.populate import populate
from offloadpool.region.request import PoolRequest
from offloadpool.region.vocabulary import HUGEPAGES_2MI, MEMORY, MEMORY_THP

GiB = 1 << 30
MEDIA = (HUGEPAGES_2MI, MEMORY_THP, MEMORY)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--capacity", default="4Gi", help="pool size per medium (default 4Gi)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per case (default 5, >= 3)")
    p.add_argument("--workers", type=int, default=0, help="threads (0 = the pre-fault's default)")
    p.add_argument("--media", default=",".join(MEDIA), help="media to measure")
    p.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="after the rounds, the chosen scrub against the bare write in this many pairs per medium",
    )
    p.add_argument("--json", action="store_true", help="print the JSON result on stdout")
    p.add_argument("--markdown", help="write a markdown table to this file")


def _used(mnt: Path) -> int:
    st = os.statvfs(mnt)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _empty(pool_dir: Path, plan: Plan) -> None:
    """Free every page of the pool's files and forget the journal: a pre-fault starts afresh."""
    for seg in plan.segments:
        fd = os.open(pool_dir / seg.file, os.O_RDWR | os.O_CLOEXEC)
        try:
            vm.punch_hole(fd, 0, seg.bytes)
        finally:
            os.close(fd)
    # The journal is the node's, in the pool's state directory (not the pool directory).
    with open_pool(pool_dir) as pool:
        sfd = pool.state()
        if sfd is not None:
            places.remove_entry(sfd, JOURNAL_NAME)


def _pieces(plan: Plan, workers: int) -> list[list[tuple[int, int, int]]]:
    """``workers`` contiguous shares of the pool's bytes (page-rounded), each as (segment,
    offset, length) pieces, one per file it spans: the scrub's split (``parallel.byte_shares``)
    without its chunks, so the bare write makes one call per file and share."""
    whole = parallel.byte_shares(plan.segments, plan.page_size, workers, plan.total_bytes)
    return [[(u.segment, u.offset, u.bytes) for u in share] for share in whole]


def _bare_write(pool_dir: Path, plan: Plan, workers: int) -> float:
    """Seconds for ``workers`` plain threads to zero the pool through shared mappings."""
    fds = [os.open(pool_dir / seg.file, os.O_RDWR | os.O_CLOEXEC) for seg in plan.segments]
    try:
        t0 = time.perf_counter()
        addrs = [vm.map_shared(fd, seg.bytes) for fd, seg in zip(fds, plan.segments, strict=True)]
        try:

            def write(share: list[tuple[int, int, int]]) -> None:
                for segment, offset, length in share:
                    vm.memset(addrs[segment] + offset, 0, length)

            threads = [threading.Thread(target=write, args=(s,)) for s in _pieces(plan, workers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for addr, seg in zip(addrs, plan.segments, strict=True):
                vm.unmap(addr, seg.bytes)
        return time.perf_counter() - t0
    finally:
        for fd in fds:
            os.close(fd)


def _cases(pool_dir: Path, plan: Plan, workers: int) -> dict[str, Callable[[], float]]:
    def prefault() -> float:
        _empty(pool_dir, plan)
        t0 = time.perf_counter()
        populate(pool_dir, plan, workers=workers)
        return time.perf_counter() - t0

    def scrubbing(method: str) -> Callable[[], float]:
        return lambda: scrub.zero(pool_dir, plan, workers=workers, method=method).seconds

    return {
        "prefault": prefault,
        **{f"scrub_{m}": scrubbing(m) for m in scrub.METHODS},
        "bare_write": lambda: _bare_write(pool_dir, plan, workers),
    }


def run(
    cap: int,
    reps: int,
    workers: int,
    media: list[str],
    log: Callable[[str], None] = lambda s: None,
    pairs: int = 0,
) -> dict:
    """Every case of every medium, interleaved, then ``pairs`` pairs per medium of its fastest
    scrub against the bare write; the JSON-ready result."""
    if pairs < 0:
        raise ValueError("pairs must be >= 0")
    samples: dict[str, dict[str, list[float]]] = {}
    paired: dict[str, dict[str, Any]] = {}
    unavailable: dict[str, str] = {}
    with _workspace() as root, ExitStack() as held:
        pools: dict[str, dict[str, Callable[[], float]]] = {}
        mounts: dict[str, Path] = {}
        used_workers: dict[str, int] = {}
        for medium in media:
            req = PoolRequest(name=f"bench-scrub-{medium.lower()}", capacity=cap, medium=medium)
            try:
                held.enter_context(reserved_pages(medium, cap))
                provision(req, root)
            except (CapacityError, RegionError, ValueError) as exc:
                unavailable[medium] = str(exc)
                continue
            held.callback(release, root, req.name, force=True)
            plan = make_plan(req)
            used_workers[medium] = workers or default_workers(plan)
            pools[medium] = _cases(root / req.name, plan, used_workers[medium])
            mounts[medium] = root / req.name / MOUNT_NAME
        for rep in range(reps):
            for medium, cases in pools.items():
                for name, case in cases.items():
                    case()  # warm, untimed, immediately before the timed run
                    seconds = case()
                    if _used(mounts[medium]) < cap:
                        raise RegionError(f"{medium} {name} left pages unpopulated")
                    samples.setdefault(medium, {}).setdefault(name, []).append(seconds)
                    log(f"rep {rep + 1}/{reps} {medium} {name}: {cap / GiB / seconds:.2f} GiB/s")
        for medium, cases in pools.items() if pairs else ():
            scrub_s = {k: summarize(v).median for k, v in samples[medium].items() if k.startswith("scrub_")}
            chosen = min(scrub_s, key=lambda k: scrub_s[k])
            times = paired_times(cases["bare_write"], cases[chosen], _nothing, pairs)
            if _used(mounts[medium]) < cap:
                raise RegionError(f"{medium} paired runs left pages unpopulated")
            ratios = [round(bare / ours, 3) for bare, ours in times]
            paired[medium] = {"method": chosen.removeprefix("scrub_"), "ratios": ratios}
            log(f"paired {medium} {chosen} vs bare_write: " + " ".join(f"{r:.2f}" for r in ratios))
    result: dict[str, Any] = {}
    for medium, cases_s in samples.items():
        rows: dict[str, dict[str, Any]] = {}
        for name, secs in cases_s.items():
            rates = summarize([cap / GiB / s for s in secs])
            rows[name] = {
                "gib_per_s": round(rates.median, 3),
                "gib_per_s_min": round(rates.minimum, 3),
                "gib_per_s_max": round(rates.maximum, 3),
                "seconds": round(summarize(secs).median, 4),
                "samples_s": [round(s, 4) for s in secs],
            }
        scrubs = {k: v for k, v in rows.items() if k.startswith("scrub_")}
        best = max(scrubs, key=lambda k: scrubs[k]["gib_per_s"])
        result[medium] = {
            "cases": rows,
            "workers": used_workers[medium],
            "fastest_scrub": best.removeprefix("scrub_"),
            "fastest_scrub_vs_prefault": round(scrubs[best]["gib_per_s"] / rows["prefault"]["gib_per_s"], 2),
            "fastest_scrub_vs_bare_write": round(
                scrubs[best]["gib_per_s"] / rows["bare_write"]["gib_per_s"], 2
            ),
        }
        if medium in paired:
            ratios = paired[medium]["ratios"]
            result[medium]["paired"] = {**paired[medium], "ratio_min": min(ratios), "ratio_max": max(ratios)}
            result[medium]["paired_scrub_vs_bare_write"] = round(summarize(ratios).median, 3)
    return {
        "media": result,
        "unavailable": unavailable,
        "params": {"capacity_bytes": cap, "reps": reps, "workers": workers, "pairs": pairs},
        "machine": machine(),
    }


def markdown(result: dict, command: str) -> str:
    p = result["params"]
    lines = report.head(
        command,
        f"Capacity {p['capacity_bytes'] / GiB:g} GiB per medium, {p['reps']} timed reps per case, "
        "interleaved (medians; min-max).",
        result["machine"],
        ["medium", "case"],
        ["GiB/s (median)", "min-max GiB/s", "seconds (median)", "vs prefault", "vs bare write"],
    )
    for medium, m in result["media"].items():
        base = m["cases"]["prefault"]["gib_per_s"]
        bare = m["cases"]["bare_write"]["gib_per_s"]
        for name, s in m["cases"].items():
            mark = " **(chosen)**" if name == f"scrub_{m['fastest_scrub']}" else ""
            lines.append(
                f"| {medium} ({m['workers']} threads) | {name}{mark} | {s['gib_per_s']:.2f} "
                f"| {s['gib_per_s_min']:.2f}-{s['gib_per_s_max']:.2f} | {s['seconds']:.3f} "
                f"| {s['gib_per_s'] / base:.2f}x | {s['gib_per_s'] / bare:.2f}x |"
            )
    lines += [
        f"{medium}: `{m['paired']['method']}` against the bare write in {len(m['paired']['ratios'])} pairs: "
        f"**{m['paired_scrub_vs_bare_write']}** "
        f"({m['paired']['ratio_min']:.2f}-{m['paired']['ratio_max']:.2f})  "
        for medium, m in result["media"].items()
        if "paired" in m
    ]
    return report.tail(lines, result["unavailable"])


def run_cli(args: argparse.Namespace) -> int:
    from offloadpool.api.quantity import parse_quantity

    cap = parse_quantity(args.capacity)
    report.note_reps(args.reps)
    result = run(
        cap,
        max(1, args.reps),
        args.workers,
        [m for m in args.media.split(",") if m],
        log=report.log,
        pairs=args.pairs,
    )
    command = (
        f"offloadpool bench scrub --capacity {args.capacity} --reps {args.reps}"
        + report.flag("--workers", args.workers, 0)
        + report.flag("--media", args.media, ",".join(MEDIA))
        + report.flag("--pairs", args.pairs, 0)
    )
    report.publish(args, result, markdown(result, command))
    return 0
