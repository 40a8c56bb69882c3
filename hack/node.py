"""The real node's command line: build it, or bring up a single-node cluster to try offloadpool on.

    python3 -m hack.node build [--check]   build what is missing into the cache (hack.node_build)
    python3 -m hack.node paths             print the cache layout as JSON
    python3 -m hack.node up                control plane + this machine as its node + the chart's
                                           image; returns to the shell, printing the lines to use
    python3 -m hack.node status            is it up? the same lines again
    python3 -m hack.node down              stop it and remove everything the node made

Run from the repository root, as root. ``up``/``down`` are :mod:`hack.devcluster`; the node is
:mod:`hack.node_run`, the same code the test fixture ``real_node`` runs. One node per machine:
``up`` refuses (naming the holder) while a test run's node holds the host lock.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from hack import controlplane_build as cp
from hack import devcluster
from hack.node_build import (
    BUSYBOX_IMAGE,
    CNI_PLUGINS_VERSION,
    CONTAINERD_VERSION,
    IMAGE_ARCHIVES,
    PAUSE_IMAGE,
    BuildError,
    ensure_built,
    layout,
)


def _log(msg: str) -> None:
    cp.log(msg, who="node")


def _cmd_build(args: argparse.Namespace) -> int:
    if args.check:
        lay = layout()
        print(json.dumps({"key_dir": str(lay.key_dir), "missing": lay.missing()}))
        return 1 if lay.missing() else 0
    started = time.monotonic()
    lay = ensure_built()
    _log(f"build step done in {time.monotonic() - started:.1f}s")
    print(lay.key_dir)
    return 0


def _cmd_paths(args: argparse.Namespace) -> int:
    lay = layout()
    print(
        json.dumps(
            {
                "key_dir": str(lay.key_dir),
                "bin_dir": str(lay.bin_dir),
                "cni_bin_dir": str(lay.cni_bin_dir),
                "images": {n: str(lay.image_archive(n)) for n in IMAGE_ARCHIVES},
                "missing": lay.missing(),
                "versions": {
                    "kubernetes": cp.KUBERNETES_VERSION,
                    "containerd": CONTAINERD_VERSION,
                    "cni-plugins": CNI_PLUGINS_VERSION,
                    "pause": PAUSE_IMAGE,
                    "busybox": BUSYBOX_IMAGE,
                },
            },
            indent=2,
        )
    )
    return 0


def _print_lines(cluster: devcluster.Cluster) -> None:
    """On stdout, so ``eval "$(python3 -m hack.node status | grep ^export)"`` works."""
    print("\n".join(cluster.shell_lines()), flush=True)


def _cmd_up(args: argparse.Namespace) -> int:
    _print_lines(devcluster.up())
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    cluster = devcluster.status()
    if cluster is None:
        print(f"no dev cluster is up ({devcluster.state_dir()})", file=sys.stderr)
        return 1
    _print_lines(cluster)
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    problems = devcluster.down()
    if problems:
        print("down left: " + "; ".join(problems), file=sys.stderr)
        return 1
    print("dev cluster down; nothing left", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m hack.node", description=(__doc__ or "").split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_build = sub.add_parser("build", help="build what is missing into the cache")
    p_build.add_argument("--check", action="store_true", help="build nothing; exit 1 if something is missing")
    p_build.set_defaults(func=_cmd_build)
    sub.add_parser("paths", help="print the cache layout as JSON").set_defaults(func=_cmd_paths)
    sub.add_parser("up", help="start the single-node dev cluster; returns to the shell").set_defaults(
        func=_cmd_up
    )
    sub.add_parser("status", help="is the dev cluster up? print its lines again").set_defaults(
        func=_cmd_status
    )
    sub.add_parser("down", help="stop the dev cluster; remove everything it made").set_defaults(
        func=_cmd_down
    )
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except BuildError as err:
        _log(f"error: {err}")
        return 2
    except devcluster.DevClusterError as err:
        print(f"hack.node {args.command}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
