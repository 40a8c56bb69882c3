"""``OffloadPoolOffloadingSpec``: vLLM's CPU offloading, its CPU tier an offloadpool pool.

Loaded by vLLM's ``OffloadingSpecFactory`` through ``spec_module_path``/``spec_name`` (see
``offloadpool.vllm``). Imports vLLM: only vLLM imports this module.

It is vLLM's ``CPUOffloadingSpec`` — same scheduler-side manager, same worker, same
transfers — with two differences: the tier's size defaults to the pool's (``cpu_bytes_to_use``
may be left out), and ``create_worker`` hands vLLM's worker a ``PoolRegion`` (the attached
pool, pinned by offloadpool) instead of building a ``SharedOffloadRegion`` in /dev/shm.
Whether the pool can serve the engine is checked when the spec is built, on the scheduler
and on every worker, before anything is mapped (``offloadpool.vllm.geometry``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.logger import init_logger
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu import spec as cpu_spec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from offloadpool.region.manifest import load as load_manifest
from offloadpool.vllm import geometry
from offloadpool.vllm.region import PoolRegion

logger = init_logger(__name__)


class OffloadPoolOffloadingSpec(CPUOffloadingSpec):
    """CPUOffloadingSpec whose workers attach an offloadpool pool (module docstring)."""

    def __init__(self, config: OffloadingConfig):
        extra = config.extra_config
        self.pool_dir = geometry.pool_dir_of(extra, config.parallel.data_parallel_index)
        manifest = load_manifest(self.pool_dir)
        if not extra.get("cpu_bytes_to_use"):
            # The tier is the pool: derive its size instead of making the user restate it.
            extra = {**extra, "cpu_bytes_to_use": geometry.tier_bytes(manifest)}
            config = dataclasses.replace(config, extra_config=extra)
        super().__init__(config)
        self.pin_backend = str(extra.get("pin_backend", "auto"))
        self._attach_rank: int | None = None  # None: each worker attaches as its own rank
        if self.num_chunks > 0:  # 0 on a scheduler that does not know the KV size yet
            tier = geometry.EngineTier(
                world_size=config.parallel.world_size,
                row_bytes=self.kv_bytes_per_chunk,
                slot_bytes=self.cpu_page_size_per_worker,
                num_chunks=self.num_chunks,
                replicated=self.replicated_layout,
            )
            self._attach_rank = geometry.check(manifest, self.pool_dir, tier)
            logger.info(
                "offloadpool: CPU KV tier of %d rows of %d bytes in pool %s (%s)",
                self.num_chunks,
                self.kv_bytes_per_chunk,
                manifest.pool,
                self.pool_dir,
            )

    def create_worker(self, kv_caches: Any) -> Any:
        # Where vLLM would not use a shared region (no CUDA/XPU) it keeps private tensors: so
        # does this spec.
        if not self._uses_shared_region() or self.num_chunks <= 0:
            return super().create_worker(kv_caches)
        worker_index = self.config.parallel.rank
        replicated = self.replicated_layout
        region = PoolRegion(
            self.pool_dir,
            attach_rank=worker_index if self._attach_rank is None else self._attach_rank,
            rank=0 if replicated else worker_index,
            num_chunks=self.num_chunks,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
            pin_backend=self.pin_backend,
        )
        try:
            region.pin()
            # Looked up in vLLM's module at call time: vLLM's own worker class.
            return cpu_spec.CPUOffloadingWorker(
                kv_caches=kv_caches,
                blocks_per_chunk=self.blocks_per_chunk,
                num_cpu_chunks=self.num_chunks,
                mmap_region=region,
            )
        except BaseException:
            region.cleanup()
            raise
