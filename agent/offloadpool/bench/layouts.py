"""Part of ``offloadpool bench startup``: N workers pinning their share of one pool, per layout.

What a TP-N engine's workers pay to page-lock the CPU tier at start, all at once, as vLLM's
workers do (one process each):

* ``per_rank`` - a PerRank pool: worker r attaches region r only and pins it contiguously
  (vLLM #59547; the native spec's PerRank placement);
* ``interleaved`` - one region of rows of N slots: every worker pins only its own slots, by the
  engine's numbers (vLLM #59544; the native spec on a Replicated or Interleaved pool);
* ``whole_region`` - one region, every worker pins all of it (what a worker does that does not
  know its slots: the native spec before it took the geometry from vLLM, stock vLLM whenever its
  slot is not 3 MiB smaller than its row).

The workers are processes (fresh interpreters: no CUDA context is forked), each holding its
pinning backend (a retained CUDA context on a GPU) before the clock starts; each attaches
untimed and says so, and all pin when every worker has attached and the parent says go. A
run's time is from the first worker's start to the last worker's last registration. The three
layouts run interleaved, each once untimed right before its timed run; the ratios are medians
of the ratios of each block of runs made side by side.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from offloadpool.pinning import PinGeometry, PinStats, attach, get_backend
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.request import PoolRequest
from offloadpool.region.vocabulary import PER_RANK, REPLICATED

LAYOUTS = ("per_rank", "interleaved", "whole_region")

#: what each worker attaches and pins: (pool, rank to attach, the engine's geometry or None)
Job = tuple[str, int, PinGeometry | None]


def _worker(rank: int, backend: str) -> None:
    """One engine worker on stdin/stdout: hold the backend; per job attach, say ready, wait for
    go, pin, report, detach. One JSON line in, one out."""
    keeper = get_backend(backend)
    try:
        for line in sys.stdin:
            pool_dir, attach_rank, geometry = json.loads(line)
            try:
                with attach(pool_dir, attach_rank) as region:
                    print("ready", flush=True)
                    if sys.stdin.readline().strip() != "go":
                        return
                    t0 = time.monotonic()
                    stats = region.pin(
                        backend, geometry=None if geometry is None else PinGeometry(*geometry), worker=rank
                    )
                    t1 = time.monotonic()
                assert isinstance(stats, PinStats)
                print(json.dumps([t0, t1, stats.bytes_registered]), flush=True)
            except Exception as exc:
                print(json.dumps(f"worker {rank}: {type(exc).__name__}: {exc}"), flush=True)
    finally:
        keeper.close()


@contextmanager
def _workers(ranks: int, backend: str) -> Iterator[Callable[[list[Job]], tuple[float, list[int]]]]:
    """``ranks`` worker processes (fresh interpreters: no CUDA context is forked)."""
    code = "import sys; from offloadpool.bench.layouts import _worker; _worker(int(sys.argv[1]), sys.argv[2])"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r), backend],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        for r in range(ranks)
    ]

    def say(p: subprocess.Popen[str], line: str) -> None:
        assert p.stdin is not None
        p.stdin.write(line + "\n")
        p.stdin.flush()

    def hear(p: subprocess.Popen[str]) -> str:
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"a bench worker exited with {p.wait()}")
        return line.strip()

    def run(jobs: list[Job]) -> tuple[float, list[int]]:
        for p, (pool, rank, geometry) in zip(procs, jobs, strict=True):
            say(p, json.dumps([pool, rank, None if geometry is None else dataclasses.astuple(geometry)]))
        ready = [hear(p) for p in procs]  # every worker attached: the barrier
        errors = [json.loads(r) for r in ready if r != "ready"]
        for p, r in zip(procs, ready, strict=True):
            if r == "ready":
                say(p, "go" if not errors else "stop")
        if errors:
            raise RuntimeError("; ".join(errors))
        replies = [json.loads(hear(p)) for p in procs]
        errors = [r for r in replies if isinstance(r, str)]
        if errors:
            raise RuntimeError("; ".join(errors))
        return max(r[1] for r in replies) - min(r[0] for r in replies), [r[2] for r in replies]

    try:
        yield run
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run(
    root: Path,
    cap: int,
    medium: str,
    *,
    ranks: int,
    slot: int,
    reps: int,
    backend: str,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Provision a PerRank and a flat pool of ``cap`` on ``medium``; time the three layouts."""
    row = ranks * slot
    if cap < row:
        raise ValueError(f"capacity {cap} is less than one row of {ranks} x {slot} bytes")
    names = {
        "per_rank": f"bench-layout-perrank-{medium.lower()}",
        "flat": f"bench-layout-flat-{medium.lower()}",
    }
    with ExitStack() as stack:
        per_rank = provision(
            PoolRequest(
                name=names["per_rank"], capacity=cap, medium=medium, layout_type=PER_RANK, ranks=ranks
            ),
            root,
        ).pool_dir
        stack.callback(release, root, names["per_rank"], force=True)
        flat = provision(
            PoolRequest(name=names["flat"], capacity=cap, medium=medium, layout_type=REPLICATED), root
        ).pool_dir
        stack.callback(release, root, names["flat"], force=True)
        region = cap // ranks
        rows = cap // row
        jobs: dict[str, list[Job]] = {
            "per_rank": [(str(per_rank), r, None) for r in range(ranks)],
            "interleaved": [
                (str(flat), 0, PinGeometry(rows * row, row, r * slot, slot)) for r in range(ranks)
            ],
            "whole_region": [(str(flat), 0, None) for _ in range(ranks)],
        }
        samples: dict[str, list[float]] = {name: [] for name in LAYOUTS}
        pinned: dict[str, list[int]] = {}
        pool_run = stack.enter_context(_workers(ranks, backend))
        for rep in range(reps):
            for name in LAYOUTS:
                pool_run(jobs[name])  # warm, untimed
                seconds, per_worker = pool_run(jobs[name])
                samples[name].append(seconds)
                pinned[name] = per_worker
                log(f"layouts {medium} rep {rep + 1}/{reps} {name}: {seconds:.4f} s")
    out: dict[str, Any] = {
        "medium": medium,
        "ranks": ranks,
        "slot_bytes": slot,
        "region_bytes": region,
        "layouts": {},
        "ratios": {},
    }
    for name in LAYOUTS:
        s = samples[name]
        out["layouts"][name] = {
            "seconds": round(statistics.median(s), 5),
            "seconds_min": round(min(s), 5),
            "seconds_max": round(max(s), 5),
            "bytes_per_worker": pinned[name],
            "samples_s": [round(x, 5) for x in s],
        }
    for slow in ("whole_region", "interleaved"):
        out["ratios"][f"{slow}_vs_per_rank"] = round(
            statistics.median(a / b for a, b in zip(samples[slow], samples["per_rank"], strict=True)), 2
        )
    out["ratios"]["whole_region_vs_interleaved"] = round(
        statistics.median(
            a / b for a, b in zip(samples["whole_region"], samples["interleaved"], strict=True)
        ),
        2,
    )
    return out


def markdown(result: dict[str, Any]) -> list[str]:
    """The layouts table, for the start-up report."""
    lines = [
        "",
        f"{result['ranks']} workers at once pinning their share of one pool ({result['medium']}, "
        f"slot {result['slot_bytes']} bytes per worker and row; medians, min-max in brackets):",
        "",
        "| layout | wall s (barrier to last registration) | bytes pinned per worker |",
        "|---|---:|---:|",
    ]
    for name, m in result["layouts"].items():
        lines.append(
            f"| {name} | {m['seconds']:.4f} [{m['seconds_min']:.4f}-{m['seconds_max']:.4f}] "
            f"| {max(m['bytes_per_worker'])} |"
        )
    r = result["ratios"]
    lines += [
        "",
        f"whole_region / per_rank = **{r['whole_region_vs_per_rank']}x**, interleaved / per_rank = "
        f"**{r['interleaved_vs_per_rank']}x**, whole_region / interleaved = "
        f"**{r['whole_region_vs_interleaved']}x** (medians of per-block ratios)",
    ]
    return lines
