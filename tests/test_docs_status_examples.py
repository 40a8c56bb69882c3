"""The docs' `kubectl get op`/`opn` examples show the tables kubectl prints: their headers are
the CRDs' printer columns (crds/), in order, with the wide ones under `-o wide`, and every cell
of their rows starts under a header, as kubectl aligns them.

The printed tables themselves are checked through the real `kubectl get` in
tests/test_crd_printer.py; this keeps what the docs show a reader in step with them.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = (REPO / "docs" / "user-guide.md", REPO / "docs" / "api.md")
CRDS = REPO / "crds"
CONSOLE = re.compile(r"```console\n(?P<body>.*?)\n\s*```", re.DOTALL)


def printer_columns() -> dict[str, tuple[list[str], list[str]]]:
    """Every name a `kubectl get` may call a kind by -> (its default header, its wide header)."""
    kinds: dict[str, tuple[list[str], list[str]]] = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        names = crd["spec"]["names"]
        (version,) = [v for v in crd["spec"]["versions"] if v.get("served")]
        columns = version["additionalPrinterColumns"]
        default = ["NAME"] + [c["name"].upper() for c in columns if not c.get("priority")]
        wide = ["NAME"] + [c["name"].upper() for c in columns]
        for name in (names["plural"], names["singular"], names["kind"].lower(), *names.get("shortNames", ())):
            kinds[name] = (default, wide)
    return kinds


def examples() -> list[tuple[str, str, list[str]]]:
    """(where, the `kubectl get` line, the table the docs show after it) for every example that
    shows one."""
    found = []
    for doc in DOCS:
        for block in CONSOLE.finditer(doc.read_text()):
            lines = block["body"].splitlines()
            for i, line in enumerate(lines):
                if not line.startswith("$ kubectl get ") or i + 1 >= len(lines):
                    continue
                if not lines[i + 1].startswith("NAME "):
                    continue
                table = []
                for row in lines[i + 1 :]:
                    if row.startswith("$ ") or not row.strip():
                        break
                    table.append(row)
                found.append((f"{doc.relative_to(REPO)}: {line}", line[2:], table))
    return found


def expected_header(command: str, kinds: dict[str, tuple[list[str], list[str]]]) -> list[str]:
    args = shlex.split(command.split("#", 1)[0])
    kind = args[2]
    assert kind in kinds, f"`{command}` gets {kind!r}, which no CRD in crds/ names"
    wide = any(a == "wide" and args[j - 1] == "-o" or a == "-owide" for j, a in enumerate(args))
    return kinds[kind][1 if wide else 0]


def test_the_docs_show_kubectl_get_examples() -> None:
    """The scan below finds the examples it checks (a change of their shape fails here)."""
    shown = {command.split()[2] for _, command, _ in examples()}
    assert {"op", "opn", "offloadpools"} <= shown, shown


@pytest.mark.parametrize(("where", "command", "table"), [pytest.param(*e, id=e[0]) for e in examples()])
def test_a_status_example_has_the_crds_printer_columns(where: str, command: str, table: list[str]) -> None:
    printed = expected_header(command, printer_columns())
    assert table[0].split() == printed, (
        f"{where}: the docs show\n{table[0]}\nkubectl prints {' '.join(printed)}"
    )
    starts = [m.start() for m in re.finditer(r"\S+", table[0])]
    for row in table[1:]:
        cells = [m.start() for m in re.finditer(r"\S+", row)]
        assert set(cells) <= set(starts), f"{where}: a cell not under its header:\n{table[0]}\n{row}"
