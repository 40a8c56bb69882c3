"""kill -9 in the middle of a pre-fault, then provision again: it finishes what is missing,
leaves exactly the planned files, and never zeroes what was already there."""

from __future__ import annotations

import json
import mmap
import os
import signal
from pathlib import Path

import pytest

from fixtures.host import cli, cli_argv, hugepage_totals
from fixtures.wait import wait_for
from offloadpool.region.files.journal import JOURNAL_NAME, units
from offloadpool.region.files.manifest import load as load_manifest
from offloadpool.region.files.places import state_dir
from offloadpool.region.files.planner import plan
from offloadpool.region.lifecycle.status import pool_state
from offloadpool.region.memory import mounts
from offloadpool.region.request import PoolRequest

MiB = 1 << 20


def journal_bytes(pool_dir: Path) -> bytes:
    try:
        return (state_dir(pool_dir) / JOURNAL_NAME).read_bytes()
    except FileNotFoundError:
        return b""


@pytest.mark.parametrize(
    "medium, mode",
    [
        ("HugePages-2Mi", "auto"),
        ("HugePages-2Mi", "madvise"),
        ("MemoryTHP", "auto"),
        ("Memory", "auto"),
        ("Memory", "touch"),
    ],
)
def test_kill9_mid_populate_then_finish_without_zeroing(
    region_root, hugepage_baseline, processes, medium, mode
):
    name = "resume"
    flags = [
        "--root",
        str(region_root),
        "--name",
        name,
        "--capacity",
        "256Mi",
        "--medium",
        medium,
        "--min-size",
        "64Mi",
        "--workers",
        "2",
    ]
    env = {**os.environ, "OFFLOADPOOL_POPULATE_MODE": mode}
    # throttled so the test can see it half done (a real node has no reason to throttle)
    proc = processes(cli_argv("provision", *flags, "--rate-limit", "24Mi"), env=env)
    pool_dir = region_root / name
    count = len(
        units(
            plan(PoolRequest(name=name, capacity=256 * MiB, medium=medium, min_segment=64 * MiB)).segments,
            2 * MiB if medium != "Memory" else 4096,
        )
    )

    wait_for(
        "partial progress",
        lambda: journal_bytes(pool_dir).count(1) >= 8 or proc.poll() is not None,
        60,
        interval=0.01,
    )
    assert proc.poll() is None, f"provision ended before it could be killed: {proc.communicate()}"
    assert pool_state(region_root, name).phase == "Populating"

    # an engine's data in a part that is already populated
    req = PoolRequest(name=name, capacity=256 * MiB, medium=medium, min_segment=64 * MiB)
    p = plan(req)
    all_units = units(p.segments, p.page_size)
    done = journal_bytes(pool_dir)
    unit = next(u for u in all_units if done[u.index])
    seg = p.segments[unit.segment]
    payload = os.urandom(unit.bytes)
    fd = os.open(pool_dir / seg.file, os.O_RDWR)
    m = mmap.mmap(fd, seg.bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    m[unit.offset : unit.offset + unit.bytes] = payload
    m.close()
    os.close(fd)

    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    partial = journal_bytes(pool_dir).count(1)
    assert 0 < partial < count, f"killed at {partial}/{count} units"
    state = pool_state(region_root, name)
    assert state.phase == "Populating" and not state.in_progress and "interrupted" in state.message
    assert 0 < state.populated_bytes < 256 * MiB

    out = cli("provision", *flags, "--json")
    result = json.loads(out.stdout)
    assert result["reused"] is False
    assert result["skipped_bytes"] > 0
    assert result["skipped_bytes"] + result["populated_bytes"] == 256 * MiB
    assert journal_bytes(pool_dir).count(1) == count

    manifest = load_manifest(pool_dir)
    assert manifest.regions == p.regions
    assert sorted(f.name for f in (pool_dir / "mnt").iterdir()) == sorted(
        Path(s.file).name for s in p.segments
    )
    for s in p.segments:
        assert os.stat(pool_dir / s.file).st_size == s.bytes
    fd = os.open(pool_dir / seg.file, os.O_RDONLY)
    m = mmap.mmap(fd, seg.bytes, mmap.MAP_SHARED, mmap.PROT_READ)
    assert m[unit.offset : unit.offset + unit.bytes] == payload, "resumed populate changed existing data"
    m.close()
    os.close(fd)
    assert pool_state(region_root, name).phase == "Ready"

    cli("release", name, "--root", str(region_root))
    assert not pool_dir.exists() and mounts.mounts_under(region_root) == []
    assert hugepage_totals() == hugepage_baseline, "huge pages added by the killed run were not given back"
