"""Attach, pin with real ``mlock``, write, read back from a second process, close: every medium
and every layout, on pools the real node engine provisioned (real tmpfs/hugetlbfs mounts)."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from fixtures.pinning_pools import GiB, MiB, PoolFactory, run_python, traces_of, vm_locked_bytes
from offloadpool.pinning import Attachment, attach
from offloadpool.region.files.manifest import load
from offloadpool.region.holding.lease import count_holders, lease_path
from offloadpool.region.memory.media import is_hugetlbfs
from offloadpool.region.vocabulary import LAYOUTS, MEDIA

SLOT = 1 * MiB  # one rank's slot in an interleaved row (rows of 2 MiB with 2 ranks)


def pool_args(medium: str, layout: str) -> dict[str, object]:
    big = medium == "HugePages-1Gi"
    args: dict[str, object] = dict(
        capacity=2 * GiB if big else 96 * MiB,
        medium=medium,
        layout_type=layout,
        ranks=1 if layout == "Replicated" else 2,
        min_segment=1 * GiB if big else 16 * MiB,
    )
    if layout == "Interleaved":
        args["slot_bytes"] = SLOT
    return args


def fill(att: Attachment, seed: int) -> None:
    """Write random bytes into this rank's part (sparse 1 MiB blocks on the 2 GiB pools)."""
    rng = random.Random(seed)
    if att.manifest.layout.type == "Interleaved":
        rows, stride, slot_off, slot = att.row_geometry()
        units = [(row * stride + slot_off, slot) for row in range(rows)]
    else:
        units = [(0, att.size)]
    sparse = att.size > 256 * MiB
    if sparse:
        units = units[:: max(1, len(units) // 32)]  # a few dozen spots spread over 2 GiB
    mv = att.memoryview()
    for start, length in units:
        step = 64 * MiB if sparse else 8 * MiB
        for off in range(start, start + length, step):
            n = min(1 * MiB if sparse else step, start + length - off)
            mv[off : off + n] = rng.randbytes(n)
    mv.release()


def digest(att: Attachment) -> str:
    mv = att.memoryview()
    try:
        return hashlib.sha256(mv).hexdigest()
    finally:
        mv.release()


CHILD_DIGEST = """
import hashlib, json, sys
from offloadpool.pinning import attach
with attach(sys.argv[1], rank=int(sys.argv[2])) as region:
    stats = region.pin("mlock")
    mv = region.memoryview()
    print(json.dumps({"sha256": hashlib.sha256(mv).hexdigest(), "bytes": stats.bytes_registered}))
    mv.release()
"""


def expected_pinned_bytes(att: Attachment) -> int:
    return sum(r.length for r in att.plan())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("medium", MEDIA)
def test_attach_pin_write_and_read_back_in_another_process(
    make_pool: PoolFactory, medium: str, layout: str
) -> None:
    pool = make_pool("kv", **pool_args(medium, layout))
    manifest = load(pool)
    hugetlb = is_hugetlbfs(medium)
    ranks = manifest.layout.ranks
    locked_before = vm_locked_bytes()
    digests: dict[int, str] = {}
    attachments = [attach(pool, rank=r) for r in range(ranks)]
    try:
        assert count_holders(lease_path(pool)) == 1  # one process, however many attachments
        for att in attachments:
            region = manifest.regions[att.rank if layout == "PerRank" else 0]
            assert len(att) == region.bytes
            assert att.address % manifest.page_size == 0
            stats = att.pin("mlock")
            assert stats.backend == "mlock"
            assert stats.bytes_registered == expected_pinned_bytes(att)
            assert stats.calls == stats.ranges == len(att.plan())
            assert stats.ranges >= len(region.segments)  # never one call across two files
            if layout == "Interleaved" and medium in ("Memory",):
                assert stats.bytes_registered == att.size // 2  # slot-selective: its half only
            if layout != "Interleaved":
                assert stats.bytes_registered == att.size
        locked = vm_locked_bytes() - locked_before
        total = sum(a.pin_stats.bytes_registered for a in attachments if a.pin_stats)
        if hugetlb:
            assert locked == 0  # the kernel never counts hugetlb pages as locked
        else:
            assert locked == total
        for att in attachments:
            fill(att, seed=1000 + att.rank)
        for att in attachments:
            digests[att.rank] = digest(att)
    finally:
        for att in attachments:
            att.close()
    assert vm_locked_bytes() == locked_before
    assert traces_of(pool) == []
    assert count_holders(lease_path(pool)) == 0

    for rank in range(ranks):
        out = json.loads(run_python(CHILD_DIGEST, str(pool), str(rank)).stdout)
        assert out["sha256"] == digests[rank], f"rank {rank} read back different bytes"
    assert count_holders(lease_path(pool)) == 0


def test_interleaved_slots_are_disjoint_and_strided(make_pool: PoolFactory) -> None:
    """Each rank's slot of row i sits at i*row + rank*slot; ranks never see each other's writes
    in their own slots."""
    pool = make_pool("kv", **pool_args("Memory", "Interleaved"))
    with attach(pool, rank=0) as r0, attach(pool, rank=1) as r1:
        rows, stride, off0, slot = r0.row_geometry()
        assert (stride, off0, slot) == (2 * SLOT, 0, SLOT)
        assert r1.row_geometry() == (rows, stride, SLOT, SLOT)
        assert r0.address != r1.address  # two mappings of the same files
        for row in range(rows):
            r0.slot_memoryview(row)[:] = bytes([row % 251]) * SLOT
            r1.slot_memoryview(row)[:] = bytes([(row + 7) % 251]) * SLOT
        whole = r0.memoryview()
        for row in range(rows):
            assert whole[row * stride] == row % 251
            assert whole[row * stride + SLOT] == (row + 7) % 251
            assert bytes(r1.slot_memoryview(row, rank=0)) == bytes([row % 251]) * SLOT
        whole.release()
        with pytest.raises(IndexError):
            r0.slot_memoryview(rows)


def test_close_releases_everything_and_is_idempotent(make_pool: PoolFactory) -> None:
    pool = make_pool("kv", capacity=64 * MiB)
    before = vm_locked_bytes()
    att = attach(pool)
    att.pin("mlock")
    assert traces_of(pool) and vm_locked_bytes() - before == 64 * MiB
    att.close()
    att.close()
    assert att.closed and not att.pinned
    assert traces_of(pool) == [] and vm_locked_bytes() == before
    assert count_holders(lease_path(pool)) == 0


def test_unpin_then_pin_again(make_pool: PoolFactory) -> None:
    pool = make_pool("kv", capacity=64 * MiB)
    before = vm_locked_bytes()
    with attach(pool) as att:
        att.pin("mlock")
        att.unpin()
        assert not att.pinned and vm_locked_bytes() == before
        stats = att.pin("mlock", max_chunk=4 * MiB)
        assert stats.calls == 16 and vm_locked_bytes() - before == 64 * MiB
    assert vm_locked_bytes() == before


def test_dropped_attachment_is_released_by_its_finalizer(make_pool: PoolFactory) -> None:
    pool = make_pool("kv", capacity=64 * MiB)
    before = vm_locked_bytes()
    att = attach(pool)
    att.pin("mlock")
    del att  # no close(): the weakref finalizer is the safety net
    import gc

    gc.collect()
    assert traces_of(pool) == [] and vm_locked_bytes() == before
    assert count_holders(lease_path(pool)) == 0


def test_views_keep_the_attachment_alive(make_pool: PoolFactory) -> None:
    pool = make_pool("kv", capacity=64 * MiB)
    view = attach(pool).memoryview()  # the attachment itself is not kept by the caller
    import gc

    gc.collect()
    view[:4] = b"kept"
    assert bytes(view[:4]) == b"kept" and traces_of(pool)
    view.release()
    del view
    gc.collect()
    assert traces_of(pool) == []


def test_close_with_live_views_fences_the_range(make_pool: PoolFactory) -> None:
    """Closing while a view is alive frees the pool anyway; the range stays reserved and
    inaccessible, so a stale view cannot read whatever gets mapped there next."""
    pool = make_pool("kv", capacity=64 * MiB)
    att = attach(pool)
    view = att.memoryview()
    with pytest.warns(ResourceWarning, match="views"):
        att.close()
    assert traces_of(pool) == []  # segment mappings and files are gone
    maps = Path("/proc/self/maps").read_text()
    start = f"{att.address:x}-"
    fenced = [line for line in maps.splitlines() if line.startswith(start)]
    assert fenced and " ---p " in fenced[0], fenced
    view.release()
    del view
    import gc

    gc.collect()
    maps = Path("/proc/self/maps").read_text()
    fence = f"{att.address:x}-{att.address + att.size:x} ---p "
    assert not [line for line in maps.splitlines() if line.startswith(fence)], "fence not lifted"
