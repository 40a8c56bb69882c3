"""The CLI's output: a live populate progress bar and summary tables (rich), or JSON."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from offloadpool.region.errors import fmt_bytes
from offloadpool.region.lifecycle.provision import ProvisionResult
from offloadpool.region.lifecycle.status import PoolState
from offloadpool.region.vocabulary import READY, SCRUBBING


def dump(obj: Any) -> None:
    """Print ``obj`` as indented JSON (``--json``), anything not JSON as its string."""
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


def print_whole(console: Console, renderable: RenderableType) -> None:
    """Print ``renderable`` on ``console``; off a terminal (a pipe, a file, ``kubectl exec``
    without ``-t``) as wide as it needs to be, so no column is cut or dropped at rich's default
    80 columns. On a terminal it fits the terminal, wrapping the message column."""
    if console.is_terminal:
        console.print(renderable)
        return
    needed = Measurement.get(console, console.options.update_width(1 << 16), renderable).maximum
    console.width = max(needed, console.width)  # print(width=) caps at the console's own width
    console.print(renderable)


def gib(n: int | float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


@contextmanager
def populate_bar(console: Console, label: str) -> Iterator[tuple]:
    """Yield (progress_callback, phase_callback) that drive one rich progress bar.

    The progress callback is called from the populating threads; rich's Progress is
    thread-safe, the lock only keeps ``completed`` monotonic when workers race.
    """
    lock = threading.Lock()
    best = [0]
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task(label, total=None)

        def progress(done: int, total: int) -> None:
            with lock:
                if done > best[0]:
                    best[0] = done
                    bar.update(task, completed=done, total=total)

        def phase(name: str) -> None:
            if name == SCRUBBING:  # counts again from 0: the bytes zeroed
                with lock:
                    best[0] = 0
                    bar.update(task, completed=0)
            bar.update(task, description=f"{label}: {name}")

        yield progress, phase


def placement(per_region: object) -> str:
    """Where each region's pages are bound, region by region: ``r0:0 r1:0 r2:1 r3:1`` (``-``:
    the kernel's default everywhere; ``*`` for a region left to it among placed ones)."""
    if not isinstance(per_region, list | tuple) or not any(per_region):
        return "-"
    return " ".join(
        f"r{i}:{','.join(str(n) for n in nodes) if nodes else '*'}" for i, nodes in enumerate(per_region)
    )


def summary(result: ProvisionResult, node: str | None = None) -> Table:
    m = result.manifest
    table = Table(title=f"pool {m.pool}" + (f" on node {node}" if node else ""), show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    files = sum(len(r.segments) for r in m.regions)
    rows = [
        ("state", f"{READY} (kept: validated, not re-populated)" if result.reused else READY),
        ("medium", f"{m.medium} (page {fmt_bytes(m.page_size)})"),
        ("layout", f"{m.layout.type}, {m.layout.ranks} rank(s), {len(m.regions)} region(s)"),
        ("capacity", gib(m.total_bytes)),
        ("segment files", f"{files} ({', '.join(str(len(r.segments)) for r in m.regions)} per region)"),
        ("populated now", gib(result.populated_bytes)),
        ("already populated", gib(result.skipped_bytes) if result.skipped_bytes else "-"),
        (
            "populate rate",
            f"{result.gib_per_s:.2f} GiB/s with {result.workers} worker(s)" if not result.reused else "-",
        ),
        ("wall time", f"{result.seconds:.3f} s"),
        ("huge page coverage", f"{result.hugepage_coverage_percent:.1f} %"),
        ("huge pages reserved", str(result.hugepages_added) if result.hugepages_added else "-"),
        ("NUMA placement", placement(m.extra.get("numa_nodes"))),
        ("pool directory", str(result.pool_dir)),
    ]
    if m.compat_file:
        rows.append(("stock vLLM file", str(result.pool_dir / m.compat_file)))
    for k, v in rows:
        table.add_row(k, v)
    return table


def status_table(states: list[PoolState]) -> Table:
    table = Table(title="offloadpool pools on this node")
    for col in ("pool", "phase", "medium", "size", "done", "huge", "numa", "engines", "shares"):
        table.add_column(col, no_wrap=True)
    table.add_column("message")
    for s in states:
        table.add_row(
            s.name,
            s.phase,
            s.medium,
            gib(s.total_bytes),
            f"{100 * s.progress:.0f}%",
            f"{s.hugepage_coverage_percent:.0f}%",
            placement(s.numa_nodes),
            str(s.engines_attached),
            s.shares_claimed or "-",
            s.message,
        )
    return table


def shares_table(states: list[PoolState]) -> Table | None:
    """Each share of the partitioned pools: claimed or free, how, by whom (None: no shares)."""
    rows = [(s.name, share) for s in states for share in s.shares]
    if not rows:
        return None
    table = Table(title="shares")
    for col in ("pool", "share", "claimed", "via", "holder", "engines"):
        table.add_column(col, no_wrap=col != "holder")
    for name, share in rows:
        table.add_row(
            name,
            str(share.index),
            "yes" if share.claimed else "free",
            share.via or "-",
            Text(share.holder or "-"),  # written by a pod: plain text, never markup
            str(len(share.holders)),
        )
    return table
