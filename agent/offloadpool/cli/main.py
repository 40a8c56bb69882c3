"""``offloadpool``: the node-side engine from a shell.

    offloadpool provision -f POOL.yaml [--root DIR] [--node NAME] [--capacity 4Gi ...]
    offloadpool status [NAME] [--root DIR] [--json]
    offloadpool release NAME [--root DIR] [--force]
    offloadpool demo [--capacity SIZE] [--keep]
    offloadpool bench populate [--capacity SIZE] [--ranks R] [--reps N] [--json]
    offloadpool bench startup [--capacity SIZE] [--reps N] [--backend B] [--json]
    offloadpool bench scrub [--capacity SIZE] [--reps N] [--media M,...] [--json]
    offloadpool hold-lease POOL_DIR [--ready-file PATH]   (the webhook's lease sidecar)
    offloadpool version                                    (also: offloadpool --version)

Exit codes: 0 done, 1 error (message on stderr), 2 bad usage/input (a NAME that cannot name a
pool included: it is refused before any path is made of it), 3 the pool is held by an engine (the
change is pending; nothing was touched).
"""

from __future__ import annotations

import argparse
import sys

EXIT_ERROR, EXIT_USAGE, EXIT_HELD = 1, 2, 3


def _node_list(text: str) -> list[int]:
    """``0,0,1,1`` as a list of node numbers (their range is the spec's to check)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of NUMA nodes") from None


def _add_pool_flags(p: argparse.ArgumentParser) -> None:
    from offloadpool.api.media import LAYOUTS, MEDIA, SCRUB_POLICIES

    g = p.add_argument_group("pool fields (override the file)")
    g.add_argument("--name")
    g.add_argument("--capacity", help="bytes per node, e.g. 4Gi")
    g.add_argument("--medium", choices=MEDIA)
    g.add_argument("--layout", choices=LAYOUTS)
    g.add_argument("--ranks", type=int)
    g.add_argument("--slot-size", help="Interleaved: bytes per rank per row, e.g. 1Mi")
    g.add_argument(
        "--row-size", help="Replicated/PerRank: the engine's row, files split on whole rows, e.g. 1Mi"
    )
    g.add_argument("--max-files", type=int)
    g.add_argument("--min-size", help="smallest segment file, e.g. 1Gi")
    g.add_argument("--workers", type=int, help="pre-fault threads (0 = cores available)")
    g.add_argument("--numa", help="None, Interleave, Spread, GPU")
    g.add_argument(
        "--numa-nodes",
        type=_node_list,
        help="PerRank: the NUMA node of each rank's region, e.g. 0,0,1,1 (spec.prefault.numaNodes)",
    )
    g.add_argument("--uid", type=int)
    g.add_argument("--gid", type=int)
    g.add_argument("--mode", help='file mode, e.g. "0660"')
    g.add_argument(
        "--scrub",
        choices=SCRUB_POLICIES,
        help="when to zero the memory before another consumer gets it (default OnConsumerChange)",
    )
    g.add_argument("--engine-id", help="also expose vllm_offload_<ID>.mmap for stock vLLM")


def build_parser() -> argparse.ArgumentParser:
    from offloadpool.cli.config import CliConfig

    settings = CliConfig.from_environment()
    root = settings.root
    from offloadpool import __version__

    parser = argparse.ArgumentParser(prog="offloadpool", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"offloadpool {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the version that runs (the agent's and operator's too)")

    p = sub.add_parser("provision", help="provision (or validate, or finish) a pool on this node")
    p.add_argument("-f", "--file", help="OffloadPool YAML")
    p.add_argument("--root", default=root, help=f"host root for pools (default {root})")
    p.add_argument("--node", help="node name to show (informational)")
    p.add_argument("--rate-limit", help="cap the pre-fault at this many bytes/s, e.g. 2Gi")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    _add_pool_flags(p)

    s = sub.add_parser("status", help="show the pools on this node")
    s.add_argument("name", nargs="?", help="only this pool")
    s.add_argument("--root", default=root)
    s.add_argument("--json", action="store_true")

    r = sub.add_parser("release", help="unmount and free a pool (refuses while an engine holds it)")
    r.add_argument("name")
    r.add_argument("--root", default=root)
    r.add_argument(
        "--force",
        action="store_true",
        help="release even while engines are attached: they keep memory no pool accounts "
        "for until they exit, and their next start finds no pool",
    )
    r.add_argument("--json", action="store_true")

    d = sub.add_parser("demo", help="the main job: provision a pool here, show it, release it")
    d.add_argument("--capacity", default=settings.demo_capacity)
    d.add_argument("--medium", help="default: HugePages-2Mi if the pages can be reserved, else MemoryTHP")
    d.add_argument("--root", default=root)
    d.add_argument("--name", default=settings.demo_name)
    d.add_argument("--keep", action="store_true", help="leave the pool provisioned")

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    bp = bsub.add_parser("populate", help="populate strategies side by side")
    from offloadpool.bench.populate import add_arguments

    add_arguments(bp)
    bs = bsub.add_parser("startup", help="engine start-up: build the region vs attach a provisioned one")
    from offloadpool.bench.startup import add_arguments as add_startup_arguments

    add_startup_arguments(bs)
    bz = bsub.add_parser("scrub", help="zeroing a pool (each scrub method) against its pre-fault")
    from offloadpool.bench.scrub import add_arguments as add_scrub_arguments

    add_scrub_arguments(bz)

    h = sub.add_parser(
        "hold-lease", help="hold a pool's shared lease until SIGTERM (the pod's lease sidecar)"
    )
    from offloadpool.region.holding.hold import add_arguments as add_hold_arguments

    add_hold_arguments(h)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["hold-lease"]:
        # The lease sidecar of every inference pod: standard library only, nothing else imported.
        from offloadpool.region.holding.hold import main as hold_main

        return hold_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "version":
        from offloadpool import __version__

        print(f"offloadpool {__version__}")
        return 0
    from rich.console import Console

    err = Console(stderr=True)
    from offloadpool.region.errors import CapacityError, RegionError
    from offloadpool.region.files.manifest import ManifestError
    from offloadpool.region.holding.lease import LeaseHeld

    try:
        if args.command == "provision":
            from offloadpool.cli.commands import provision_cmd

            return provision_cmd(args)
        if args.command == "status":
            from offloadpool.cli.commands import status_cmd

            return status_cmd(args)
        if args.command == "release":
            from offloadpool.cli.commands import release_cmd

            return release_cmd(args)
        if args.command == "demo":
            from offloadpool.cli.demo import demo_cmd

            return demo_cmd(args)
        if args.command == "bench" and args.bench == "startup":
            from offloadpool.bench.startup import run_cli as startup_cli

            return startup_cli(args)
        if args.command == "bench" and args.bench == "scrub":
            from offloadpool.bench.scrub import run_cli as scrub_cli

            return scrub_cli(args)
        if args.command == "bench":
            from offloadpool.bench.populate import run_cli

            return run_cli(args)
    except LeaseHeld as exc:
        err.print(f"[yellow]in use:[/] {exc}; nothing was changed (pending until the engines detach)")
        return EXIT_HELD
    except CapacityError as exc:
        err.print(f"[red]insufficient capacity:[/] {exc}")
        return EXIT_ERROR
    except (ValueError, ManifestError) as exc:
        err.print(f"[red]invalid:[/] {exc}")
        return EXIT_USAGE
    except RegionError as exc:
        err.print(f"[red]error:[/] {exc}")
        return EXIT_ERROR
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
