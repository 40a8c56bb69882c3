"""``OffloadPoolOffloadingSpec``: vLLM's CPU offloading, its CPU tier an offloadpool pool.

Loaded by vLLM's ``OffloadingSpecFactory`` through ``spec_module_path``/``spec_name`` (see
``offloadpool.vllm``). Imports vLLM: only vLLM imports this module.

It is vLLM's ``CPUOffloadingSpec`` — same scheduler-side manager, same worker, same
transfers — with two differences: the tier's size defaults to as many of vLLM's rows as the
pool holds (``cpu_bytes_to_use`` may be left out), and ``create_worker`` hands vLLM's worker a
``PoolRegion`` (the worker's region of the pool, pinned by offloadpool on exactly its own
bytes) instead of building a ``SharedOffloadRegion`` in /dev/shm. The geometry is vLLM's own
(``offloadpool.vllm.geometry``): the pool contributes only its bytes and, PerRank, its rank
count. Whether the pool holds the tier is checked when the spec is built, on the scheduler and
on every worker, before anything is mapped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.logger import init_logger
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu import spec as cpu_spec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from offloadpool.region.files.manifest import Manifest
from offloadpool.region.files.manifest import load as load_manifest
from offloadpool.region.holding import shares
from offloadpool.vllm import geometry
from offloadpool.vllm.region import PoolRegion, worker_gpu_numa_node

logger = init_logger(__name__)


def _with_cpu_bytes(config: OffloadingConfig, cpu_bytes: int) -> OffloadingConfig:
    return dataclasses.replace(config, extra_config={**config.extra_config, "cpu_bytes_to_use": cpu_bytes})


def _tier_manifest(head: Manifest) -> Manifest:
    """What one engine gets of the pool: a partitioned pool's engine attaches one share (every
    share alike, ``region.holding.shares``), so its tier is a share's regions, not the whole pool's."""
    return shares.share_manifest(head, 0) if head.shares > 1 else head


class OffloadPoolOffloadingSpec(CPUOffloadingSpec):
    """CPUOffloadingSpec whose workers attach an offloadpool pool (module docstring)."""

    def __init__(self, config: OffloadingConfig):
        self.pool_dir = geometry.pool_dir_of(config.extra_config, config.parallel.data_parallel_index)
        self.manifest = _tier_manifest(load_manifest(self.pool_dir))
        geometry.check_ranks(self.manifest, self.pool_dir, config.parallel.world_size)
        explicit = bool(config.extra_config.get("cpu_bytes_to_use"))
        if not explicit:
            # The tier is the pool: derive its size instead of making the user restate it.
            config = _with_cpu_bytes(config, geometry.pool_bytes(self.manifest))
        super().__init__(config)
        self.pin_backend = str(self.extra_config.get("pin_backend", "auto"))
        self.tier: geometry.EngineTier | None = None
        if self.kv_bytes_per_chunk <= 0:
            return  # a scheduler that does not know the KV size yet: nothing to lay out
        fits = geometry.rows_that_fit(self.manifest, self._tier())
        if not explicit and 0 < fits != self.num_chunks:
            # A PerRank pool keeps each worker's slots in its own region: as many rows as the
            # smallest region has slots, which vLLM's bytes // row cannot say. Same arithmetic
            # as vLLM's, with the byte count that gives exactly those rows.
            super().__init__(_with_cpu_bytes(config, fits * self.kv_bytes_per_chunk))
        self.tier = self._tier()
        geometry.check(self.manifest, self.pool_dir, self.tier, explicit=explicit)
        logger.info(
            "offloadpool: CPU KV tier of %d rows of %d bytes (%d per worker) in pool %s (%s, %s)",
            self.num_chunks,
            self.kv_bytes_per_chunk,
            self.cpu_page_size_per_worker,
            self.manifest.pool,
            self.manifest.layout.type,
            self.pool_dir,
        )

    def _tier(self) -> geometry.EngineTier:
        return geometry.EngineTier(
            world_size=self.config.parallel.world_size,
            row_bytes=self.kv_bytes_per_chunk,
            slot_bytes=self.cpu_page_size_per_worker,
            num_chunks=self.num_chunks,
            replicated=self.replicated_layout,
        )

    def create_worker(self, kv_caches: Any) -> Any:
        # Where vLLM would not use a shared region (no CUDA/XPU) it keeps private tensors: so
        # does this spec.
        if not self._uses_shared_region() or self.num_chunks <= 0 or self.tier is None:
            return super().create_worker(kv_caches)
        worker_index = self.config.parallel.rank
        where = geometry.placement(self.manifest, self.tier, worker_index)
        region = PoolRegion(
            self.pool_dir,
            attach_rank=where.attach_rank,
            rank=where.view_rank,
            num_chunks=self.num_chunks,
            kv_bytes_per_chunk=where.row_bytes,
            cpu_page_size=self.cpu_page_size_per_worker,
            pin_geometry=where.pin,
            worker=worker_index,
            pin_backend=self.pin_backend,
            gpu_numa_node=worker_gpu_numa_node(),
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
