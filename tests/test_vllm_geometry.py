"""offloadpool.vllm.geometry: which pool serves which vLLM CPU tier (plain numbers, no vLLM).

The same checks run inside vLLM in tests/test_vllm_native.py; here each refusal's wording and
the pool-directory rules are pinned down without starting an engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from offloadpool.region.manifest import Manifest
from offloadpool.region.planner import plan
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


def test_a_matching_pool_is_attached_as_the_workers_own_rank_or_rank_0_when_replicated() -> None:
    assert geometry.check(manifest(64 * SLOT), Path("/p"), tier()) is None
    assert geometry.check(manifest(32 * SLOT, "Replicated", 1, SLOT), Path("/p"), tier(replicated=True)) == 0
    assert (
        geometry.check(manifest(128 * SLOT), Path("/p"), tier()) is None
    )  # a larger pool serves a smaller tier


@pytest.mark.parametrize(
    "pool, engine, words",
    [
        (dict(capacity=64 * SLOT, layout="PerRank"), tier(), "is laid out PerRank"),
        (dict(capacity=64 * SLOT, ranks=4), tier(), "is laid out for 4 ranks, the engine has 2 workers"),
        (
            dict(capacity=64 * SLOT, slot=SLOT // 2),
            tier(),
            f"slots of {SLOT // 2} bytes in rows of {SLOT}, vLLM's are {SLOT}",
        ),
        (dict(capacity=32 * SLOT), tier(), f"holds {32 * SLOT} bytes, vLLM's CPU tier needs {64 * SLOT}"),
        (dict(capacity=64 * SLOT), tier(replicated=True), "vLLM keeps one replicated copy per row"),
    ],
)
def test_a_pool_that_cannot_serve_the_engine_names_both_numbers_and_a_fitting_spec(
    pool, engine, words
) -> None:
    with pytest.raises(PoolMismatch) as err:
        geometry.check(manifest(**pool), Path("/offloadpool/kv"), engine)
    assert words in str(err.value)
    assert f"a pool that fits: spec: {{{engine.fitting_spec()}}}" in str(err.value)


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
