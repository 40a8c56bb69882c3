"""offloadpool.vllm.geometry: which pool serves which vLLM CPU tier (plain numbers, no vLLM).

The same checks run inside vLLM in tests/test_vllm_native.py; here each refusal's wording and
the pool-directory rules are pinned down without starting an engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from offloadpool.region.files.manifest import Manifest
from offloadpool.region.files.planner import plan
from offloadpool.region.request import PoolRequest
from offloadpool.vllm import geometry
from offloadpool.vllm.geometry import EngineTier, PoolMismatch

KiB, MiB = 1 << 10, 1 << 20
SLOT = 256 * KiB


def manifest(capacity: int, layout: str = "Interleaved", ranks: int = 2, slot: int | None = SLOT) -> Manifest:
    p = plan(
        PoolRequest(
            name="kv", capacity=capacity, medium="Memory", layout_type=layout, ranks=ranks, slot_bytes=slot
        )
    )
    return Manifest(
        pool="kv",
        generation=1,
        medium="Memory",
        page_size=4096,
        layout=p.layout,
        regions=p.regions,
        total_bytes=p.total_bytes,
        alignment=4096,
    )


def tier(world: int = 2, chunks: int = 32, replicated: bool = False) -> EngineTier:
    row = SLOT if replicated else world * SLOT
    return EngineTier(
        world_size=world, row_bytes=row, slot_bytes=SLOT, num_chunks=chunks, replicated=replicated
    )


@pytest.mark.parametrize(
    "pool",
    [
        dict(capacity=64 * SLOT),  # Interleaved, 2 ranks of vLLM's slot
        dict(capacity=64 * SLOT, ranks=4, slot=SLOT // 2),  # another model's rows
        dict(capacity=64 * SLOT, ranks=8, slot=None),
        dict(capacity=64 * SLOT, layout="Replicated", ranks=1, slot=None),
        dict(capacity=200 * SLOT + 12 * KiB, layout="Replicated", ranks=1, slot=None),  # not whole rows
    ],
)
@pytest.mark.parametrize("engine", [tier(), tier(world=4, chunks=16), tier(replicated=True), tier(world=1)])
def test_a_one_region_pool_serves_any_engine_whose_rows_fit_by_the_engines_numbers(pool, engine) -> None:
    m = manifest(**pool)
    geometry.check(m, Path("/p"), engine)
    for w in range(engine.world_size):
        where = geometry.placement(m, engine, w)
        assert (where.attach_rank, where.row_bytes) == (0, engine.row_bytes)
        assert where.pin.total_bytes == engine.num_chunks * engine.row_bytes
        if engine.replicated:
            assert (where.view_rank, where.pin.slot_offset, where.pin.slot_bytes) == (0, 0, engine.row_bytes)
        else:
            assert (where.view_rank, where.pin.slot_offset, where.pin.slot_bytes) == (w, w * SLOT, SLOT)


def test_the_tier_is_as_many_of_vllms_rows_as_the_pool_holds() -> None:
    m = manifest(200 * SLOT + 12 * KiB, "Replicated", 1, None)
    assert geometry.rows_that_fit(m, tier(world=2)) == 100  # 2 × SLOT rows
    assert geometry.rows_that_fit(m, tier(world=8)) == 25
    assert geometry.rows_that_fit(manifest(64 * SLOT, "PerRank", 4, None), tier(world=4)) == 16


def test_a_per_rank_pool_gives_each_worker_its_own_region_as_rows_of_its_slot() -> None:
    m = manifest(4 * 16 * SLOT, "PerRank", 4, None)
    engine = tier(world=4, chunks=16)
    geometry.check(m, Path("/p"), engine)
    for w in range(4):
        where = geometry.placement(m, engine, w)
        assert (where.attach_rank, where.view_rank, where.row_bytes) == (w, 0, SLOT)
        assert (where.pin.total_bytes, where.pin.row_bytes, where.pin.slot_offset) == (16 * SLOT, SLOT, 0)
        assert where.pin.plan(4096) == [(0, 16 * SLOT)]  # its region, contiguously


@pytest.mark.parametrize(
    "pool, engine, explicit, words",
    [
        (
            dict(capacity=64 * SLOT, layout="PerRank", ranks=4, slot=None),
            tier(),
            False,
            "is laid out PerRank for 4 ranks (one region per worker), the engine has 2 workers",
        ),
        (
            dict(capacity=SLOT, layout="Replicated", ranks=1, slot=None),
            tier(chunks=0),
            False,
            f"holds {SLOT} bytes, less than one of vLLM's {2 * SLOT}-byte rows: give the pool a "
            f"capacity of at least {2 * SLOT} bytes",
        ),
        (
            dict(capacity=32 * SLOT),
            tier(),
            True,
            f"holds {32 * SLOT} bytes (16 of vLLM's {2 * SLOT}-byte rows), cpu_bytes_to_use asks for "
            f"32 ({64 * SLOT} bytes): lower cpu_bytes_to_use, or leave it out and the tier is the pool",
        ),
        (
            dict(capacity=4 * 8 * SLOT, layout="PerRank", ranks=4, slot=None),
            tier(world=4, chunks=16),
            True,
            f"the smallest of its 4 regions holds {8 * SLOT} bytes (8 of vLLM's {SLOT}-byte slots)",
        ),
    ],
)
def test_a_pool_that_cannot_serve_the_engine_says_both_numbers_in_one_message(
    pool, engine, explicit, words
) -> None:
    with pytest.raises(PoolMismatch) as err:
        geometry.check(manifest(**pool), Path("/offloadpool/kv"), engine, explicit=explicit)
    assert "pool 'kv' at /offloadpool/kv " in str(err.value) and words in str(err.value)


def test_the_pool_directory_comes_from_extra_config_then_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(geometry.ENV_POOL_DIR, "/offloadpool/from-env")
    assert geometry.pool_dir_of({}) == Path("/offloadpool/from-env")
    assert geometry.pool_dir_of({"pool_dir": "/offloadpool/kv-dp{dp}"}, 3) == Path("/offloadpool/kv-dp3")
    monkeypatch.delenv(geometry.ENV_POOL_DIR)
    with pytest.raises(PoolMismatch, match="OFFLOADPOOL_POOL_DIR"):
        geometry.pool_dir_of({})


def test_the_native_package_imports_no_vllm() -> None:
    import subprocess
    import sys

    code = (
        "import sys, offloadpool.vllm, offloadpool.vllm.geometry; "
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
