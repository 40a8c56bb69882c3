"""Every refusal: a clear error, before anything is mapped, and nothing left behind after it."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from fixtures.pinning_pools import MiB, PoolFactory, run_python, traces_of
from offloadpool.pinning import AttachError, ManifestError, PinError, attach
from offloadpool.region.files.manifest import MANIFEST_NAME, load
from offloadpool.region.holding.lease import Lease, count_holders, lease_path


def assert_untouched(pool: Path) -> None:
    assert traces_of(pool) == [], "something of the pool is still mapped or open"
    assert count_holders(lease_path(pool)) == 0


def edit_manifest(pool: Path, **changes: object) -> None:
    path = pool / MANIFEST_NAME
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_no_pool_at_all(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="not provisioned"):
        attach(tmp_path / "nothing-here")
    assert not (tmp_path / "nothing-here").exists()  # not even a lease file was created


def test_unknown_manifest_version(make_pool: PoolFactory) -> None:
    pool = make_pool("kv")
    edit_manifest(pool, version=2)
    with pytest.raises(ManifestError, match="version 2 is not understood"):
        attach(pool)
    assert_untouched(pool)


def test_not_a_manifest(make_pool: PoolFactory) -> None:
    pool = make_pool("kv")
    (pool / MANIFEST_NAME).write_text("{ half a manifest")
    with pytest.raises(ManifestError, match="not valid JSON"):
        attach(pool)
    assert_untouched(pool)


def test_pool_not_ready(make_pool: PoolFactory) -> None:
    pool = make_pool("kv")
    dataclasses.replace(load(pool), state="Draining").write(pool)
    with pytest.raises(AttachError, match="Draining, not Ready"):
        attach(pool)
    assert_untouched(pool)


@pytest.mark.parametrize("rank", [-1, 2, 7])
def test_rank_out_of_range(make_pool: PoolFactory, rank: int) -> None:
    pool = make_pool("kv", layout_type="PerRank", ranks=2)
    with pytest.raises(AttachError, match=f"rank {rank} is out of range.*PerRank for 2 ranks"):
        attach(pool, rank=rank)
    assert_untouched(pool)


def test_missing_segment(make_pool: PoolFactory) -> None:
    pool = make_pool("kv")
    last = load(pool).regions[0].segments[-1]
    os.unlink(pool / last.file)
    with pytest.raises(AttachError, match=f"segment {last.file} listed in the manifest is missing"):
        attach(pool)
    assert_untouched(pool)


def test_segment_size_mismatch(make_pool: PoolFactory) -> None:
    pool = make_pool("kv")
    seg = load(pool).regions[0].segments[1]
    os.truncate(pool / seg.file, seg.bytes - 4096)
    with pytest.raises(
        AttachError, match=f"{seg.bytes - 4096} bytes on disk but the manifest says {seg.bytes}"
    ):
        attach(pool)
    assert_untouched(pool)


def test_node_holding_the_pool_exclusively(make_pool: PoolFactory) -> None:
    pool = make_pool("kv")
    with Lease.exclusive(pool):
        with pytest.raises(AttachError, match="exclusively"):
            attach(pool, lease_timeout=0.3)
    assert_untouched(pool)


def test_unknown_backend_and_double_pin(make_pool: PoolFactory, locked: Callable[[], int]) -> None:
    pool = make_pool("kv")
    with attach(pool) as att:
        with pytest.raises(ValueError, match="unknown pinning backend 'gpu'"):
            att.pin("gpu")
        assert not att.pinned and locked() == 0
        att.pin("mlock")
        with pytest.raises(PinError, match="already pinned"):
            att.pin("mlock")
    assert_untouched(pool)


def test_bad_pin_limits_are_refused_before_pinning(make_pool: PoolFactory, locked: Callable[[], int]) -> None:
    pool = make_pool("kv", layout_type="Interleaved", ranks=2, slot_bytes=1 * MiB)
    with attach(pool) as att:
        with pytest.raises(ValueError, match="exceeds max_chunk"):
            att.pin("mlock", max_chunk=1 * MiB, max_ranges=1)  # 2 MiB rows cannot fit 1 MiB calls
        assert not att.pinned and locked() == 0
    assert_untouched(pool)


def test_closed_attachment_refuses_pins_and_views(make_pool: PoolFactory) -> None:
    pool = make_pool("kv")
    att = attach(pool)
    att.close()
    with pytest.raises(PinError, match="closed"):
        att.pin("mlock")
    with pytest.raises(AttachError, match="closed"):
        att.memoryview()
    assert_untouched(pool)


NOBODY = """
import json, os, sys
from offloadpool.pinning import AttachError, attach
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
try:
    attach(sys.argv[1])
    print(json.dumps("attached?!"))
except AttachError as exc:
    print(json.dumps(str(exc)))
"""


def test_pod_without_the_pools_uid_gid_mode(make_pool: PoolFactory) -> None:
    """An engine running as a uid the pool does not admit (files root:root 0660) gets a clear
    refusal naming the fix, not a bare PermissionError. The lease is root's 0644 (any engine
    may flock it), so the refusal is at the first segment."""
    pool = make_pool("kv", mode=0o660)
    message = json.loads(run_python(NOBODY, str(pool)).stdout)
    assert "no permission to open segment" in message and "uid/gid/mode" in message, message
    assert "uid 65534" in message
    assert_untouched(pool)
