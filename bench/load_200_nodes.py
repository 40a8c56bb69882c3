#!/usr/bin/env python3
"""Load test entry: one pool over 200 simulated nodes; time to converge and operator cost.

Runs tests/test_load_200_nodes.py (real control plane, real operator process, 200 in-process
agents with real 4 MiB regions) and prints its report as JSON and as a markdown table.

    .venv/bin/python bench/load_200_nodes.py [--nodes N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=200)
    p.add_argument("--steady-seconds", type=float, default=30.0)
    p.add_argument("--json", action="store_true", help="print only the JSON report")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        env = {**os.environ, "OFFLOADPOOL_LOAD_REPORT": str(report), "OFFLOADPOOL_LOAD_NODES": str(args.nodes),
               "OFFLOADPOOL_LOAD_STEADY_SECONDS": str(args.steady_seconds)}
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "tests/test_load_200_nodes.py"], cwd=ROOT, env=env,
                             stdout=sys.stderr if args.json else None)
        if rc != 0 or not report.exists():
            print(f"load test failed (rc={rc})", file=sys.stderr)
            return rc or 1
        data = json.loads(report.read_text())
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print("| nodes | seconds to converge | operator peak RSS (MiB) | operator CPU s to converge | operator CPU % steady |")
    print("|---|---|---|---|---|")
    print(f"| {data['nodes']} | {data['seconds_to_converge']} | {data['operator_peak_rss_mib']} | "
          f"{data['operator_cpu_seconds_to_converge']} | {data['operator_cpu_percent_steady']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
