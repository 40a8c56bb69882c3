"""The pre-fault's work split and its exclusivity."""

from __future__ import annotations

import fcntl
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fixtures.host import cli_argv
from fixtures.wait import wait_for
from offloadpool.region.journal import JOURNAL_NAME, units
from offloadpool.region.lease import lease_path
from offloadpool.region.manifest import Segment
from offloadpool.region.parallel import shares
from offloadpool.region.places import state_dir

MiB = 1 << 20


@settings(max_examples=300, deadline=None)
@given(
    files=st.integers(1, 32),
    file_units=st.integers(1, 64),
    workers=st.integers(1, 16),
    page=st.sampled_from([4096, 2 * MiB, 1 << 30]),
)
def test_shares_are_contiguous_balanced_and_start_in_different_files(files, file_units, workers, page):
    unit = max(page, 2 * MiB)
    segs = [Segment(f"mnt/r0-s{i:03d}", i * file_units * unit, file_units * unit) for i in range(files)]
    all_units = units(segs, page)
    parts = shares(all_units, workers)
    assert len(parts) == workers
    assert [u for p in parts for u in p] == all_units  # contiguous, in order, complete
    sizes = [sum(u.bytes for u in p) for p in parts]
    total = sum(sizes)
    assert max(sizes) - min(sizes) <= 2 * unit or total < workers * unit
    if files >= workers and all(parts):
        starts = [p[0].segment for p in parts]
        assert len(set(starts)) == len(starts), "two workers start in the same file"


def test_no_engine_can_attach_while_populating(region_root, processes):
    """The provision holds the lease exclusively for the whole pre-fault: a shared lease (what
    an engine takes on attach) cannot be had until the pool is Ready."""
    proc = processes(
        cli_argv(
            "provision",
            "--root",
            str(region_root),
            "--name",
            "busy",
            "--capacity",
            "128Mi",
            "--medium",
            "HugePages-2Mi",
            "--rate-limit",
            "32Mi",
        )
    )
    pool_dir = region_root / "busy"
    wait_for(
        "the pre-fault to start",
        lambda: (
            (state_dir(pool_dir) / JOURNAL_NAME).exists()
            and 1 in (state_dir(pool_dir) / JOURNAL_NAME).read_bytes()
        ),
        60,
        interval=0.01,
    )
    fd = os.open(lease_path(pool_dir), os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        assert not (pool_dir / "manifest.json").exists()
        assert proc.wait(timeout=120) == 0, proc.communicate()
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # Ready: attach is possible
        assert (pool_dir / "manifest.json").exists()
    finally:
        os.close(fd)
