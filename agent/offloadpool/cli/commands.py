"""The provision, status and release subcommands."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from rich.console import Console

from offloadpool.api.conversion import pool_request
from offloadpool.api.quantity import parse_quantity
from offloadpool.cli.pool_file import pool_from_flags, read_document
from offloadpool.cli.render import dump, populate_bar, print_whole, shares_table, status_table, summary
from offloadpool.region.files.places import checked_name
from offloadpool.region.lifecycle.provision import ProvisionResult, provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.lifecycle.status import list_pools, pool_state
from offloadpool.region.request import PoolRequest

POOL_FLAGS = (
    "name",
    "capacity",
    "medium",
    "layout",
    "ranks",
    "slot_size",
    "row_size",
    "max_files",
    "min_size",
    "workers",
    "numa",
    "numa_nodes",
    "uid",
    "gid",
    "mode",
    "scrub",
    "engine_id",
)


def request_from_args(args: argparse.Namespace) -> PoolRequest:
    base = read_document(args.file) if args.file else None
    name = args.name if args.name is not None else ((base or {}).get("metadata") or {}).get("name")
    if name is not None:
        checked_name(name)  # one message for a name that cannot name a pool, before anything else
    pool = pool_from_flags(base, **{k: getattr(args, k) for k in POOL_FLAGS})
    return pool_request(pool)


def result_dict(result: ProvisionResult) -> dict:
    d = asdict(result)
    d["pool_dir"] = str(result.pool_dir)
    d["manifest"] = result.manifest.to_dict()
    return d


def provision_cmd(args: argparse.Namespace) -> int:
    req = request_from_args(args)
    rate = parse_quantity(args.rate_limit) if args.rate_limit else None
    console = Console(stderr=args.json)
    with populate_bar(console, req.name) as (progress, phase):
        result = provision(req, args.root, progress=progress, on_phase=phase, rate_limit=rate)
    if args.json:
        dump(result_dict(result))
    else:
        print_whole(console, summary(result, args.node))
    return 0


def status_cmd(args: argparse.Namespace) -> int:
    if args.name is not None:
        states = [pool_state(args.root, checked_name(args.name))]
    else:
        states = list_pools(args.root)
    if args.json:
        dump({"root": args.root, "pools": [s.to_dict() for s in states]})
    else:
        console = Console()
        print_whole(console, status_table(states) if states else f"no pools under {args.root}")
        per_share = shares_table(states)
        if per_share is not None:
            print_whole(console, per_share)
    return 0


def release_cmd(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    result = release(args.root, checked_name(args.name), force=args.force)
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    if args.json:
        dump(asdict(result))
    elif not result.existed:
        Console().print(f"pool {args.name} does not exist under {args.root}: nothing to release")
    else:
        Console().print(
            f"released pool {args.name}: {result.freed_bytes / (1 << 30):.2f} GiB freed, "
            f"{result.hugepages_returned} huge page(s) given back to the kernel"
        )
    return 0
