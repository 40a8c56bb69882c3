"""vLLM's own ``OffloadingConfig`` for a test engine, as ``build_offloading_config`` fills it:
the worker scripts differ only in the spec they name (``extra_config``), their engine id and
their data-parallel place. Imported by the scripts beside it (their folder is ``sys.path[0]``)."""

from __future__ import annotations

from typing import Any


def offloading_config(
    cfg: dict[str, Any],
    rank: int,
    *,
    extra_config: dict[str, Any],
    engine_id: str,
    dp_index: int = 0,
    dp_size: int = 1,
):
    """``cfg["world_size"]`` ranks of one tensor-parallel group, ``rank`` among them."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    world = cfg["world_size"]
    return OffloadingConfig(
        groups=(),
        worker_kv_bytes_per_block=cfg["worker_kv_bytes_per_block"],
        enable_kv_cache_events=False,
        extra_config=extra_config,
        engine_id=engine_id,
        model=OffloadingModelConfig(name="test-model", dtype=cfg.get("dtype", "float16")),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=cfg.get("blocks_per_chunk", 1)),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world,
            tp_size=world,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=dp_index,
            data_parallel_size=dp_size,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
        replicated_layout=cfg.get("replicated_layout", False),
    )
