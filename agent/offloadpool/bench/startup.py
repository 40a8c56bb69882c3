"""``offloadpool bench startup``: what an engine pays at start-up for its host KV tier.

Two cases, same capacity C, in one run (see docs/bench-startup.md), then the layouts: N
workers at once pinning their share of one pool, per-rank vs interleaved vs whole-region
(``offloadpool.bench.layouts``). With ``--sglang-python PY`` (the pinned SGLang's interpreter,
hack/vllm_env.py --engine sglang) also SGLang's host pool of the same capacity, its own
allocation vs its plugin attaching a pool, in that interpreter (``offloadpool.bench.sglang_path``).

* ``engine_built`` - an engine that builds its tier itself at start: create a file in a tmpfs
  mount (4 KiB pages, like ``/dev/shm``), size it, map it, pre-fault all of it from one thread
  (``MADV_POPULATE_WRITE``), then pin it in <= 64 GiB calls (vLLM 0.33.0 splits the pre-fault
  across its workers, each its own slots: ``vllm_0_33`` in ``bench populate``);
* ``attach_provisioned`` - with offloadpool: the node provisioned the pool before the engine
  started (untimed here, as on a node); the engine attaches it (manifest, lease, one mapping
  of every segment) and pins it with the same backend. Measured for every medium the node
  can provide (hugetlbfs 2 MiB / 1 GiB, tmpfs with THP, plain tmpfs).

Pinning uses ``mlock`` on a CPU machine and the CUDA driver (``cuMemHostRegister``) where a
GPU is usable (``--backend`` overrides). On a GPU the run holds a CUDA context for its whole
duration, as an engine has one before it pins, so context creation is not counted.

Method (docs/bench-startup.md, "The two cases"): one medium at a time (so at most two regions are in
memory), its cases interleaved (engine_built, attach_provisioned, engine_built, ...), each run
once untimed immediately before its timed run; medians with min-max over ``reps``. The ratio
is engine_built over attach_provisioned from the same block of runs.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from offloadpool.bench import layouts, report
from offloadpool.bench.stats import machine, summarize
from offloadpool.pinning import PinStats, attach, get_backend
from offloadpool.pinning.backends.base import PinBackend
from offloadpool.pinning.pin import unregister_all
from offloadpool.pinning.plan import DEFAULT_MAX_CHUNK, row_chunks
from offloadpool.region.errors import RegionError
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.memory import mounts, vm
from offloadpool.region.request import PoolRequest
from offloadpool.region.vocabulary import HUGEPAGES_1GI, HUGEPAGES_2MI, MEMORY, MEMORY_THP

GiB = 1 << 30
PAGE = os.sysconf("SC_PAGE_SIZE")
MEDIA = (HUGEPAGES_2MI, HUGEPAGES_1GI, MEMORY_THP, MEMORY)
TARGETS = {HUGEPAGES_2MI: 20.0, HUGEPAGES_1GI: 20.0, MEMORY: 3.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--capacity", default="2Gi", help="region size for every case (default 2Gi)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per case (default 3)")
    p.add_argument("--media", default=",".join(MEDIA), help="media to attach from (comma list)")
    p.add_argument(
        "--backend",
        default="auto",
        help="pinning backend: auto (cuda if usable, else torch, else mlock), cuda, torch, mlock",
    )
    p.add_argument(
        "--ranks", type=int, default=4, help="workers pinning at once in the layouts comparison (0: skip it)"
    )
    p.add_argument(
        "--slot",
        default="1280Ki",
        help="one worker's bytes per row in the interleaved layout (default 1280Ki: Llama-3.1-70B, TP4)",
    )
    p.add_argument(
        "--layout-medium", help="medium of the layouts comparison (default: the first of --media available)"
    )
    p.add_argument(
        "--sglang-python",
        help="the pinned SGLang's interpreter: also time SGLang's host pool, its own vs the pool's",
    )
    p.add_argument("--json", action="store_true", help="print the JSON result on stdout")
    p.add_argument("--markdown", help="also write the markdown table to this file")


# -- the two cases -------------------------------------------------------------------------------
def _pin_whole(backend: PinBackend, addr: int, size: int) -> list[tuple[int, int]]:
    done: list[tuple[int, int]] = []
    backend.activate()
    try:
        for off, length in row_chunks(size, PAGE, PAGE, DEFAULT_MAX_CHUNK):
            backend.register(addr + off, length)
            done.append((addr + off, length))
    except BaseException:
        backend.deactivate()
        unregister_all(backend, done)
        raise
    backend.deactivate()
    return done


def engine_built(scratch: Path, cap: int, backend_name: str) -> dict[str, float]:
    """Create, size, map, pre-fault (one thread) and pin a fresh tmpfs file; then clean up."""
    path = scratch / "vllm_offload_bench.mmap"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    addr = 0
    backend = None
    done: list[tuple[int, int]] = []
    try:
        os.ftruncate(fd, cap)
        addr = vm.map_shared(fd, cap)
        vm.populate_write(addr, cap)
        t1 = time.perf_counter()
        backend = get_backend(backend_name)
        done = _pin_whole(backend, addr, cap)
        t2 = time.perf_counter()
    finally:
        if backend is not None:
            unregister_all(backend, done)
            backend.close()
        if addr:
            vm.unmap(addr, cap)
        os.close(fd)
        path.unlink()
    return {"seconds": t2 - t0, "populate_s": t1 - t0, "pin_s": t2 - t1}


def attach_provisioned(pool_dir: Path, backend_name: str) -> dict[str, float]:
    """Attach a provisioned pool and pin it; then detach (not part of start-up)."""
    t0 = time.perf_counter()
    region = attach(pool_dir)
    try:
        t1 = time.perf_counter()
        stats = region.pin(backend_name)
        t2 = time.perf_counter()
    finally:
        region.close()
    assert isinstance(stats, PinStats)
    return {
        "seconds": t2 - t0,
        "attach_s": t1 - t0,
        "pin_s": t2 - t1,
        "bytes_registered": float(stats.bytes_registered),
    }


# -- workspace -----------------------------------------------------------------------------------
@contextmanager
def _workspace(cap: int) -> Iterator[tuple[Path, Path]]:
    """A private tmpfs (4 KiB pages, like /dev/shm) for engine_built and a root for pools."""
    base = Path(tempfile.mkdtemp(prefix="offloadpool-bench-startup-"))
    scratch = base / "shm"
    scratch.mkdir()
    try:
        mounts.mount("tmpfs", scratch, f"size={cap + (64 << 20)},huge=never,mode=0700")
        yield scratch, base / "root"
    finally:
        for m in reversed(mounts.mounts_under(base)):
            mounts.umount(m.target, lazy=True)
        shutil.rmtree(base, ignore_errors=True)


@contextmanager
def _cuda_context_held(backend_name: str) -> Iterator[str]:
    """Resolve "auto" and keep that backend (a retained CUDA context) alive for the run."""
    keeper = get_backend(backend_name)
    try:
        yield keeper.name
    finally:
        keeper.close()


# -- the run -------------------------------------------------------------------------------------
def run(
    cap: int,
    reps: int = 3,
    media: list[str] | None = None,
    backend: str = "auto",
    log: Callable[[str], None] = lambda s: None,
    *,
    ranks: int = 0,
    slot: int = 1280 << 10,
    layout_medium: str | None = None,
) -> dict[str, Any]:
    """Run both cases for every available medium, interleaved, then (``ranks`` > 0) the layouts
    comparison on ``layout_medium``; return the JSON-ready result."""
    if reps < 1:
        raise ValueError("reps must be >= 1")
    media = list(MEDIA if media is None else media)
    for m in media:
        if m not in MEDIA:
            raise ValueError(f"unknown medium {m!r}; known: {', '.join(MEDIA)}")
    pages_added = pages_returned = 0
    samples: dict[str, list[dict[str, float]]] = {}
    blocks: dict[str, dict[str, list[float]]] = {}
    unavailable: dict[str, str] = {}
    with ExitStack() as stack:
        backend_name = stack.enter_context(_cuda_context_held(backend))
        scratch, root = stack.enter_context(_workspace(cap))
        for medium in media:
            name = f"bench-startup-{medium.lower()}"
            try:
                provisioned = provision(PoolRequest(name=name, capacity=cap, medium=medium), root)
                pool = provisioned.pool_dir
                pages_added += provisioned.hugepages_added
            except (RegionError, ValueError, OSError) as exc:
                unavailable[medium] = str(exc)
                release(root, name, force=True)
                log(f"{medium}: not available here: {exc}")
                continue
            try:
                cases: dict[str, Callable[[], dict[str, float]]] = {
                    "engine_built": lambda: engine_built(scratch, cap, backend_name),
                    f"attach_provisioned[{medium}]": functools.partial(
                        attach_provisioned, pool, backend_name
                    ),
                }
                block: dict[str, list[float]] = {}
                for rep in range(reps):
                    for case_name, case in cases.items():
                        case()  # warm, untimed, immediately before the timed run
                        result = case()
                        samples.setdefault(case_name, []).append(result)
                        block.setdefault(case_name, []).append(result["seconds"])
                        log(f"{medium} rep {rep + 1}/{reps} {case_name}: {result['seconds']:.4f} s")
                blocks[medium] = block
            finally:
                pages_returned += release(root, name, force=True).hugepages_returned
        compared = None
        chosen = layout_medium or next((m for m in media if m not in unavailable), None)
        if ranks > 0 and chosen is not None:
            try:
                compared = layouts.run(
                    root, cap, chosen, ranks=ranks, slot=slot, reps=reps, backend=backend_name, log=log
                )
            except (RegionError, ValueError, OSError, RuntimeError) as exc:
                unavailable["layouts"] = f"{chosen}: {exc}"
                log(f"layouts on {chosen}: not available here: {exc}")
    # What this run added to the kernel's huge page pool it gave back (counted per pool, not
    # from the global counters, which other processes may change meanwhile).
    summary = _summarise(cap, reps, backend_name, samples, blocks, unavailable, pages_added == pages_returned)
    summary["layouts"] = compared
    return summary


def _summarise(
    cap: int,
    reps: int,
    backend_name: str,
    samples: dict[str, list[dict[str, float]]],
    blocks: dict[str, dict[str, list[float]]],
    unavailable: dict[str, str],
    restored: bool,
) -> dict[str, Any]:
    cases: dict[str, Any] = {}
    for case_name, runs in samples.items():
        secs = summarize([r["seconds"] for r in runs])
        pin = summarize([r["pin_s"] for r in runs])
        entry = {
            "seconds": round(secs.median, 5),
            "seconds_min": round(secs.minimum, 5),
            "seconds_max": round(secs.maximum, 5),
            "spread_percent": round(secs.spread_percent, 1),
            "pin_s": round(pin.median, 5),
            "registration_gib_per_s": round(cap / GiB / pin.median, 2) if pin.median else None,
            "samples_s": [round(r["seconds"], 5) for r in runs],
        }
        for phase in ("populate_s", "attach_s"):
            if phase in runs[0]:
                entry[phase] = round(summarize([r[phase] for r in runs]).median, 5)
        cases[case_name] = entry
    per_medium: dict[str, Any] = {}
    for medium, block in blocks.items():
        eng = summarize(block["engine_built"]).median
        att = summarize(block[f"attach_provisioned[{medium}]"]).median
        per_medium[medium] = {
            "engine_built_s": round(eng, 5),
            "attach_provisioned_s": round(att, 5),
            "ratio": round(eng / att, 1),
            "registration_gib_per_s": cases[f"attach_provisioned[{medium}]"]["registration_gib_per_s"],
            "target_ratio": TARGETS.get(medium),
        }
    best = min(per_medium, key=lambda m: per_medium[m]["attach_provisioned_s"]) if per_medium else None
    return {
        "cases": cases,
        "per_medium": per_medium,
        "best_medium": best,
        "ratio_engine_built_vs_attach": per_medium[best]["ratio"] if best else None,
        "backend": backend_name,
        "unavailable": unavailable,
        "params": {"capacity_bytes": cap, "reps": reps},
        "machine": machine(),
        "hugepages_restored": restored,
    }


def markdown(result: dict[str, Any], command: str) -> str:
    p = result["params"]
    lines = report.head(
        command,
        f"Capacity {p['capacity_bytes'] / GiB:g} GiB, pinning backend `{result['backend']}`, "
        f"{p['reps']} timed reps per case (medians; min-max in brackets).",
        result["machine"],
        ["medium"],
        ["engine_built s", "attach_provisioned s", "ratio", "attach s", "pin s", "registration GiB/s"],
    )
    for medium, m in result["per_medium"].items():
        a = result["cases"][f"attach_provisioned[{medium}]"]
        lines.append(
            f"| {medium} | {m['engine_built_s']:.3f} | {m['attach_provisioned_s']:.4f} "
            f"[{a['seconds_min']:.4f}-{a['seconds_max']:.4f}] | **{m['ratio']:g}x** "
            f"| {a['attach_s']:.4f} | {a['pin_s']:.4f} | {m['registration_gib_per_s']} |"
        )
    e = result["cases"].get("engine_built")
    if e:
        lines += [
            "",
            f"engine_built over all blocks: {e['seconds']:.3f} s "
            f"[{e['seconds_min']:.3f}-{e['seconds_max']:.3f}], of which pre-fault "
            f"{e['populate_s']:.3f} s and pin {e['pin_s']:.3f} s "
            f"({e['registration_gib_per_s']} GiB/s registration).",
        ]
    lines += [
        "",
        f"ratio_engine_built_vs_attach = **{result['ratio_engine_built_vs_attach']}** "
        f"(best medium: {result['best_medium']})",
    ]
    if result.get("layouts"):
        lines += layouts.markdown(result["layouts"])
    if result.get("sglang"):
        g = result["sglang"]
        lines += [
            "",
            f"SGLang host pool of the same capacity: its own allocation "
            f"{g['cases']['sglang_alloc']['median']:.3f} s, its plugin attaching the pool "
            f"{g['cases']['sglang_plugin']['median']:.4f} s: "
            f"ratio_sglang_alloc_vs_plugin = **{g['sglang_alloc_vs_plugin']:.1f}**",
        ]
    return report.tail(lines, result["unavailable"])


def sglang_case(python: str, cap: int, reps: int) -> dict[str, Any]:
    """``offloadpool.bench.sglang_path`` in SGLang's interpreter, this package on its path."""
    import json
    import subprocess

    agent = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [agent, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [python, "-m", "offloadpool.bench.sglang_path", "--capacity", str(cap), "--reps", str(reps)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"the SGLang case failed ({python}):\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def run_cli(args: argparse.Namespace) -> int:
    from offloadpool.api.quantity import parse_quantity as parse_size

    cap = parse_size(args.capacity)
    report.note_reps(args.reps)
    media = [m for m in args.media.split(",") if m]
    result = run(
        cap,
        args.reps,
        media,
        args.backend,
        log=report.log,
        ranks=args.ranks,
        slot=parse_size(args.slot),
        layout_medium=args.layout_medium,
    )
    if args.sglang_python:
        result["sglang"] = sglang_case(args.sglang_python, cap, args.reps)
        report.log(f"sglang: ratio_sglang_alloc_vs_plugin = {result['sglang']['sglang_alloc_vs_plugin']:.1f}")
    command = (
        f"offloadpool bench startup --capacity {args.capacity} --reps {args.reps}"
        + report.flag("--media", args.media, ",".join(MEDIA))
        + report.flag("--backend", args.backend, "auto")
        + report.flag("--ranks", args.ranks, 4)
        + report.flag("--slot", args.slot, "1280Ki")
        + report.flag("--layout-medium", args.layout_medium, None)
        + report.flag("--sglang-python", args.sglang_python, None)
    )
    report.publish(args, result, markdown(result, command))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point without the ``offloadpool`` CLI: ``python -m offloadpool.bench.startup``."""
    parser = argparse.ArgumentParser(prog="offloadpool bench startup", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
