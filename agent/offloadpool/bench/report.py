"""What every benchmark prints the same way: the head and tail of its Markdown report, its
command line, and where the report goes (stdout as Markdown or JSON, a Markdown file)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def log(line: str) -> None:
    """Progress for the person running the benchmark: stderr, so stdout stays the report."""
    print(line, file=sys.stderr, flush=True)


def note_reps(reps: int) -> None:
    """Say so when there are too few timed repetitions for a median to mean anything."""
    if reps < 3:
        print("note: fewer than 3 reps; medians are not meaningful", file=sys.stderr)


def flag(name: str, value: object, default: object) -> str:
    """`` --name value`` for the command line a report quotes, or nothing at its default."""
    return f" {name} {value}" if value != default else ""


def head(command: str, setup: str, machine: dict[str, Any], left: list[str], right: list[str]) -> list[str]:
    """The report's first lines: the command, what was measured (``setup``), the machine, and
    the head of the table, its ``left`` columns aligned left, its ``right`` (figures) right."""
    return [
        f"Command: `{command}`  ",
        f"{setup}  ",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()),
        "",
        "| " + " | ".join(left + right) + " |",
        "|" + "---|" * len(left) + "---:|" * len(right),
    ]


def tail(lines: list[str], unavailable: dict[str, str]) -> str:
    """The report as one text: ``lines``, then why each case that was not measured was not."""
    for name, why in unavailable.items():
        lines.append(f"\n{name} not measured: {why}")
    return "\n".join(lines) + "\n"


def publish(args: argparse.Namespace, result: dict[str, Any], text: str) -> None:
    """Write the Markdown report to ``--markdown`` if given; print it, or the JSON (``--json``)."""
    if args.markdown:
        Path(args.markdown).write_text(text)
    print(json.dumps(result, indent=2) if args.json else text)
