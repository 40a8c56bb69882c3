#!/usr/bin/env python3
"""The test suite's huge page reservation: taken first, kept on the machine, given back on request.

A 1 GiB huge page needs a physically contiguous, aligned GiB. Minutes after boot every GiB
of a machine is still whole; after a Go build and a few pip installs unmovable kernel pages
sit in every one of them, and not one 1 GiB page can be had even with 20 GiB free and memory
compacted. So the test command reserves the pages the suite needs *before* it builds or
installs anything, and leaves them in the kernel's persistent pool (``nr_hugepages``) when it
ends: the next run — hours of other work later — finds them free and reserves nothing.

The engine under test uses free pages before it grows the kernel pool, so tests draw on the
reservation without knowing it; tests that must see growth take the free pages away first.
What this tool added is recorded (with the boot id: a reboot empties the pools) so that
``release`` gives back exactly that and never pages someone else reserved.

    python3 hack/hugepages.py reserve     # idempotent; exit 1 with one message if impossible
    python3 hack/hugepages.py status      # what is reserved, free, and recorded
    python3 hack/hugepages.py release     # give the reservation back to the machine

Standard library only (it runs before the virtual environment exists); it uses the engine's own
``offloadpool.region.memory.hugepages`` from the source tree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))

from offloadpool.region.files.record import boot_id
from offloadpool.region.memory import hugepages
from offloadpool.region.memory.capacity import meminfo

MiB, GiB = 1 << 20, 1 << 30

#: Free pages the suite needs at once, per page size: HugePages-1Gi pools of 2 GiB
#: (provision, attach), and at most ~256 MiB of HugePages-2Mi pools at a time, doubled.
SUITE_NEEDS: dict[int, int] = {GiB: 2, 2 * MiB: 256}
ENV_OVERRIDE = {GiB: "OFFLOADPOOL_TEST_HUGEPAGES_1GI", 2 * MiB: "OFFLOADPOOL_TEST_HUGEPAGES_2MI"}


def record_path() -> Path:
    cache = Path(os.environ.get("OFFLOADPOOL_CACHE", "/var/cache/offloadpool"))
    return cache / "hugepages-reservation.json"


def needs() -> dict[int, int]:
    """The suite's needs, each overridable by its environment variable (a count of pages)."""
    return {size: int(os.environ.get(ENV_OVERRIDE[size], pages)) for size, pages in SUITE_NEEDS.items()}


def load_record() -> dict[int, int]:
    """Pages this tool added per page size, in this boot (an earlier boot's record is void)."""
    try:
        data = json.loads(record_path().read_text())
    except (OSError, ValueError):
        return {}
    if data.get("boot_id") != boot_id():
        return {}
    return {int(size): int(pages) for size, pages in data.get("added", {}).items()}


def save_record(added: dict[int, int]) -> None:
    path = record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps({"boot_id": boot_id(), "added": {str(s): n for s, n in added.items() if n}}, indent=1)
        + "\n"
    )
    os.replace(tmp, path)


def label(size: int) -> str:
    return f"HugePages-{size // GiB}Gi" if size >= GiB else f"HugePages-{size // MiB}Mi"


def reserve(wanted: dict[int, int] | None = None) -> list[str]:
    """Make at least ``wanted`` pages of each size free and unreserved; return the shortfalls.

    Idempotent: with the reservation in place it writes nothing. Pages the kernel did add are
    kept (and recorded) even when it could not add them all: a later run needs fewer.
    """
    wanted = needs() if wanted is None else wanted
    added = load_record()
    problems: list[str] = []
    with hugepages.reservation_lock():
        for size, pages in wanted.items():
            if pages <= 0:
                continue
            if not hugepages.supported(size):
                problems.append(
                    f"{label(size)}: this kernel has no {size // 1024} kB huge page pool "
                    f"({hugepages.sysfs_dir(size)} is missing)"
                )
                continue
            before = hugepages.counters(size)
            missing = pages - before.available
            if missing <= 0:
                continue
            avail = meminfo().get("MemAvailable", 0)
            # Asking for more than the node has would only squeeze its caches: say so untouched.
            try:
                got = hugepages.grow(size, missing) if missing * size <= avail else 0
            except hugepages.PoolFixed as exc:
                problems.append(
                    f"{label(size)}: asked for {pages} free pages; {before.available} are "
                    f"free and the pool cannot be changed here ({exc.strerror})"
                )
                continue
            added[size] = added.get(size, 0) + got
            if got < missing:
                problems.append(
                    f"{label(size)}: asked for {pages} free pages; {before.available} were free "
                    f"(pool {before.total}, free {before.free}, reserved {before.reserved}) and the "
                    f"kernel could add only {got} of the {missing} missing; "
                    + hugepages.shortfall_reason(size, missing - got, meminfo().get("MemAvailable", 0))
                )
        save_record(added)
    return problems


def release() -> dict[int, int]:
    """Give back what this tool added in this boot; return pages given back per size."""
    given: dict[int, int] = {}
    with hugepages.reservation_lock():
        for size, pages in load_record().items():
            if hugepages.supported(size):
                hugepages.shrink(size, pages)
                given[size] = pages
        save_record({})
    return given


def status() -> dict[str, Any]:
    recorded = load_record()
    sizes: dict[str, dict[str, int]] = {}
    out: dict[str, Any] = {"record": str(record_path()), "sizes": sizes}
    for size, pages in needs().items():
        if not hugepages.supported(size):
            continue
        c = hugepages.counters(size)
        sizes[label(size)] = {
            "suite_needs": pages,
            "pool": c.total,
            "free": c.free,
            "reserved": c.reserved,
            "available": c.available,
            "added_by_this_tool": recorded.get(size, 0),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["reserve", "release", "status"])
    args = parser.parse_args(argv)
    if args.command == "status":
        print(json.dumps(status(), indent=1))
        return 0
    if os.geteuid() != 0:
        print(f"hack/hugepages.py {args.command}: needs root (it writes nr_hugepages)", file=sys.stderr)
        return 1
    if args.command == "release":
        given = release()
        print(
            "gave back " + (", ".join(f"{n} x {label(s)}" for s, n in given.items() if n) or "nothing"),
            file=sys.stderr,
        )
        return 0
    problems = reserve()
    if problems:
        print(
            "FAIL: the test suite's huge pages cannot be reserved on this machine:\n  "
            + "\n  ".join(problems)
            + "\n  Remedy: reserve them at boot (kernel command line, e.g. 'hugepagesz=1G hugepages=2')"
            " or run the test command right after boot, before other work; the reservation is then"
            " kept for later runs. Override the counts with " + ", ".join(ENV_OVERRIDE.values()) + ".",
            file=sys.stderr,
        )
        return 1
    held = status()["sizes"]
    print(
        "huge pages for the suite: "
        + ", ".join(f"{name} {s['available']} free (needs {s['suite_needs']})" for name, s in held.items()),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
