#!/usr/bin/env python3
"""Scale benchmark: one pool over 200, 500 and 1,000 simulated nodes, in one run.

Runs tests/test_scale.py (real control plane, real operator process, in-process agents with
real 64 KiB tmpfs regions and heartbeat Leases) for each node count against one operator, and
prints per count: seconds to converge, operator CPU-ms and API writes (all clients) per node to
converge, steady-state operator CPU % and API writes per second, operator peak RSS; the ratio
of each cost between consecutive counts (doubling the nodes should at most double each cost);
and where the machine's CPU went while each pool converged (CPU-ms per node of the agents, the
API server, etcd, the controller manager and the operator). Then the slices' change: the pool
deleted after its steady state, seconds until every node's ResourceSlice is gone, slice writes
and requests per node, operator and API server CPU-ms per node, and the growth of their totals
between counts.

With ``--rounds R`` the counts run R times over (200, 500, 1,000, 200, 500, 1,000, ...) against
the same operator, and every figure is the median of a count's R runs (the machine is shared
and noisy: a 1,000-node run takes 22.5-27 s on the same code); each run's time to converge and
operator CPU per node are listed too.

    .venv/bin/python bench/scale.py [--nodes 200,500,1000] [--rounds 3] [--steady-seconds 30]
                                    [--json FILE] [--png FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = [
    ("nodes", "nodes"),
    ("seconds_to_converge", "s to converge"),
    ("seconds_to_last_agent_pod", "s to the last agent pod"),
    ("operator_seconds_after_last_agent", "operator s after the last agent's Ready"),
    ("operator_cpu_ms_per_node_to_converge", "operator CPU-ms / node to converge"),
    ("api_writes_per_node_to_converge", "API writes / node to converge"),
    ("api_requests_refused_per_node_to_converge", "requests refused 429 / node"),
    ("operator_cpu_percent_steady", "operator CPU % steady"),
    ("api_writes_per_second_steady", "API writes/s steady (all clients)"),
    ("operator_peak_rss_mib", "operator peak RSS MiB"),
    ("operator_rss_mib_before", "operator RSS MiB before the pool"),
    ("offloadpoolnodes_created_by_operator", "OffloadPoolNodes the operator made"),
]
#: The slices' change (the pool deleted after its steady state; tests/test_scale.py's
#: ``slices_gone_with_the_pool``): until every node's ResourceSlice is gone.
SLICE_COLUMNS = [
    ("nodes", "nodes"),
    ("seconds_to_slices_gone", "s until every slice is gone"),
    ("slice_writes_per_node_gone", "slice writes / node"),
    ("slice_requests_per_node_gone", "slice requests / node (any verb)"),
    ("operator_cpu_ms_per_node_slices_gone", "operator CPU-ms / node"),
    ("apiserver_cpu_ms_per_node_slices_gone", "API server CPU-ms / node"),
]


def slice_table(reports: list[dict[str, Any]]) -> str:
    """The slices' change per count, and its costs' growth between consecutive counts."""
    reports = [r for r in reports if "seconds_to_slices_gone" in r]
    if not reports:
        return ""
    lines = [
        "The slices' change: the pool deleted, until every node's ResourceSlice is gone (its agent "
        "deletes it as it drains):",
        "",
        "| " + " | ".join(title for _, title in SLICE_COLUMNS) + " |",
        "|" + "---:|" * len(SLICE_COLUMNS),
    ]
    lines += ["| " + " | ".join(str(r[key]) for key, _ in SLICE_COLUMNS) + " |" for r in reports]
    if len(reports) > 1:
        lines += [
            "",
            "| from → to | nodes × | slice writes total × | operator CPU total × | API server CPU total × |",
            "|---|---:|---:|---:|---:|",
        ]
        for a, b in zip(reports, reports[1:], strict=False):  # consecutive pairs

            def total(key: str, a: dict[str, Any] = a, b: dict[str, Any] = b) -> str:
                ta, tb = a[key] * a["nodes"], b[key] * b["nodes"]
                return f"{tb / ta:.2f}" if ta else "n/a"

            lines.append(
                f"| {a['nodes']} → {b['nodes']} | {b['nodes'] / a['nodes']:.1f} | "
                f"{total('slice_writes_per_node_gone')} | "
                f"{total('operator_cpu_ms_per_node_slices_gone')} | "
                f"{total('apiserver_cpu_ms_per_node_slices_gone')} |"
            )
    return "\n".join(lines)


def table(reports: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---:|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[key]) for key, _ in COLUMNS) + " |" for r in reports]
    if len(reports) > 1:
        lines += [
            "",
            "Growth between consecutive counts (each cost's ratio; linear or better means at most the "
            "node-count ratio):",
            "",
        ]
        lines += [
            "| from → to | nodes × | converge s × | operator CPU total × | steady CPU × | writes/s × "
            "| peak RSS × |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for a, b in zip(reports, reports[1:], strict=False):  # consecutive pairs
            k = b["nodes"] / a["nodes"]

            def ratio(key: str, a: dict[str, Any] = a, b: dict[str, Any] = b) -> str:
                return f"{b[key] / a[key]:.2f}" if a[key] else "n/a"

            total_a = a["operator_cpu_seconds_to_converge"]
            total_b = b["operator_cpu_seconds_to_converge"]
            lines.append(
                f"| {a['nodes']} → {b['nodes']} | {k:.1f} | {ratio('seconds_to_converge')} | "
                f"{total_b / total_a if total_a else float('nan'):.2f} | "
                f"{ratio('operator_cpu_percent_steady')} | {ratio('api_writes_per_second_steady')} | "
                f"{ratio('operator_peak_rss_mib')} |"
            )
    lines += [
        "",
        "Where the machine's CPU went from the pool's creation to its Ready N/N (CPU-ms per node, "
        "by process; busy: all of them over the machine's cores):",
        "",
    ]
    names = list(reports[0]["cpu_ms_per_node_to_converge_by_process"])
    lines += ["| nodes | " + " | ".join(names) + " | machine busy % |", "|" + "---:|" * (len(names) + 2)]
    for r in reports:
        by = r["cpu_ms_per_node_to_converge_by_process"]
        cells = " | ".join(str(by.get(name, "")) for name in names)
        lines.append(f"| {r['nodes']} | {cells} | {r['machine_cpu_busy_percent_to_converge']} |")
    return "\n".join(lines)


def medians(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One report per node count (in first-run order), each number the median of that count's
    runs (and of each process's CPU); ``runs`` keeps each run's time and operator CPU."""
    counts = list(dict.fromkeys(r["nodes"] for r in reports))
    out = []
    for n in counts:
        runs = [r for r in reports if r["nodes"] == n]
        merged: dict[str, Any] = {}
        for key, value in runs[0].items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                if isinstance(value, dict) and all(isinstance(v, int | float) for v in value.values()):
                    keys = list(dict.fromkeys(k for r in runs for k in r[key]))
                    merged[key] = {k: _median([r[key].get(k, 0) for r in runs]) for k in keys}
                else:
                    merged[key] = value
                continue
            merged[key] = _median([r[key] for r in runs])
        merged["runs"] = [
            {k: r[k] for k in ("seconds_to_converge", "operator_cpu_ms_per_node_to_converge")} for r in runs
        ]
        out.append(merged)
    return out


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def runs_table(merged: list[dict[str, Any]]) -> str:
    """Each run of each count: seconds to converge / operator CPU-ms per node."""
    lines = ["| nodes | runs: s to converge / operator CPU-ms per node |", "|---:|---|"]
    for m in merged:
        cells = ", ".join(
            f"{r['seconds_to_converge']} / {r['operator_cpu_ms_per_node_to_converge']}" for r in m["runs"]
        )
        lines.append(f"| {m['nodes']} | {cells} |")
    return "\n".join(lines)


def plot(reports: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["nodes"] for r in reports]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, title in zip(
        axes,
        ("seconds_to_converge", "operator_cpu_ms_per_node_to_converge", "operator_cpu_percent_steady"),
        ("seconds to converge", "operator CPU-ms per node", "operator CPU % steady"),
        strict=True,
    ):
        ax.plot(n, [r[key] for r in reports], marker="o")
        ax.set_title(title)
        ax.set_xlabel("nodes")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.suptitle("offloadpool operator at scale (bench/scale.py, 2-core VM)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="200,500,1000", help="comma-separated node counts, run in order")
    p.add_argument("--rounds", type=int, default=1, help="run the counts this many times over (medians)")
    p.add_argument("--steady-seconds", type=float, default=30.0)
    p.add_argument("--json", help="also write the reports as JSON to this file")
    p.add_argument("--png", help="write a plot to this file (needs matplotlib)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        env = {
            **os.environ,
            "OFFLOADPOOL_SCALE_REPORT": str(report),
            "OFFLOADPOOL_SCALE_NODES": ",".join([args.nodes] * max(1, args.rounds)),
            "OFFLOADPOOL_SCALE_STEADY_SECONDS": str(args.steady_seconds),
        }
        # no per-test timeout: 1,000 in-process agents on a small machine take their time
        rc = subprocess.call(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-s",
                "-p",
                "no:cacheprovider",
                "--timeout=0",
                "tests/test_scale.py",
            ],
            cwd=ROOT,
            env=env,
            stdout=sys.stderr,
        )
        if not report.exists():
            print(f"scale test failed (rc={rc})", file=sys.stderr)
            return rc or 1
        reports = json.loads(report.read_text())
        if rc != 0:
            print(
                f"scale test failed (rc={rc}) after {len(reports)} of the counts; reporting those",
                file=sys.stderr,
            )
    merged = medians(reports)
    if args.json:
        Path(args.json).write_text(json.dumps({"medians": merged, "runs": reports}, indent=2) + "\n")
    if args.png:
        plot(merged, args.png)
    print(table(merged))
    if slices := slice_table(merged):
        print("\n" + slices)
    if any(len(m["runs"]) > 1 for m in merged):
        print("\nMedians of each count's runs above; the runs:\n")
        print(runs_table(merged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
