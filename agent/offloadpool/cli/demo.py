"""``offloadpool demo``: the README's main job, on this machine, no cluster needed.

Provisions a pool with a sensible default medium (2 MiB huge pages when the kernel can reserve
them, otherwise tmpfs with transparent huge pages), shows the pre-fault as it runs and a
summary, shows that a second provision keeps the region (what an agent restart does), then
releases it and checks nothing is left, unless ``--keep``.
"""

from __future__ import annotations

import argparse

from rich.console import Console

from offloadpool.api.quantity import parse_quantity
from offloadpool.cli.render import populate_bar, status_table, summary
from offloadpool.region.errors import CapacityError, RequestError
from offloadpool.region.files.planner import plan
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.lifecycle.status import pool_state
from offloadpool.region.memory import capacity, mounts
from offloadpool.region.request import PoolRequest
from offloadpool.region.vocabulary import HUGEPAGES_2MI, MEMORY_THP


def choose_medium(size: int) -> tuple[str, str]:
    """(medium, why): huge pages when they fit, else MemoryTHP."""
    try:
        capacity.check(plan(PoolRequest(name="probe", capacity=size, medium=HUGEPAGES_2MI)))
        return HUGEPAGES_2MI, "2 MiB huge pages can be reserved here"
    except (CapacityError, RequestError) as exc:
        return MEMORY_THP, f"huge pages unavailable ({exc})"


def demo_cmd(args: argparse.Namespace) -> int:
    console = Console()
    size = parse_quantity(args.capacity)
    medium, why = (args.medium, "chosen on the command line") if args.medium else choose_medium(size)
    req = PoolRequest(name=args.name, capacity=size, medium=medium)
    p = plan(req)
    console.print(
        f"[bold]offloadpool demo[/]: pool [cyan]{req.name}[/], {size / (1 << 30):.2f} GiB on "
        f"[cyan]{medium}[/] ({why}), {len(p.segments)} segment file(s), root {args.root}"
    )
    try:
        with populate_bar(console, req.name) as (progress, phase):
            result = provision(req, args.root, progress=progress, on_phase=phase)
    except CapacityError as exc:
        if args.medium or medium == MEMORY_THP:
            raise
        console.print(f"[yellow]{exc}[/]\nfalling back to MemoryTHP")
        req = PoolRequest(name=args.name, capacity=size, medium=MEMORY_THP)
        with populate_bar(console, req.name) as (progress, phase):
            result = provision(req, args.root, progress=progress, on_phase=phase)
    console.print(summary(result))

    again = provision(req, args.root)
    console.print(
        f"second provision of the same spec (an agent restart): kept the region, validated in "
        f"{again.seconds * 1000:.1f} ms, re-populated {again.populated_bytes} bytes"
    )
    console.print(status_table([pool_state(args.root, req.name)]))
    if args.keep:
        console.print(f"kept: release it with [bold]offloadpool release {req.name} --root {args.root}[/]")
        return 0
    rel = release(args.root, req.name)
    left = mounts.mounts_under(result.pool_dir)
    console.print(
        f"released: {rel.freed_bytes / (1 << 30):.2f} GiB freed, {rel.hugepages_returned} huge "
        f"page(s) given back; mounts left: {len(left)}, pool directory left: {result.pool_dir.exists()}"
    )
    return 0 if not left and not result.pool_dir.exists() else 1
