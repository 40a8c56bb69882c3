"""vLLM's ``SharedOffloadRegion``, backed by an attached offloadpool pool. Imports vLLM.

vLLM's worker (``CPUOffloadingWorker``) takes its CPU tensors from the region's own view
methods (``create_next_worker_view`` …) and releases it with ``cleanup()``. This subclass keeps
those methods — vLLM's code computes every view — and replaces only where the memory comes
from and what happens to it:

* the memory is ``offloadpool.pinning.attach``: the pool's segments mapped into one range,
  the pool's lease held until ``cleanup()``; nothing is created, truncated, populated or
  unlinked (the node provisioned and pre-faulted it, and keeps it);
* pinning is offloadpool's, once, through its planner and backends, of exactly this worker's
  bytes by vLLM's numbers (``pin_geometry``: its slots of vLLM's rows, whole rows under the
  replicated layout, its whole region of a PerRank pool), whatever the pool's layout; chunks
  of at most 64 GiB, per-file lock, all-or-nothing. vLLM's worker
  still calls its ``pin_mmap_region`` on a GPU machine; the region tells it there is nothing
  left to register (no slot ranges, no unregistered bytes), so no range is registered twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm.logger import init_logger
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from offloadpool.pinning import Attachment, PinGeometry, PinStats, attach
from offloadpool.region.memory import gpus

logger = init_logger(__name__)


def worker_gpu_numa_node() -> int | None:
    """The NUMA node of this worker's GPU (torch's current device, by its PCI address, so a
    pod's renumbered devices do not matter), for attach's placement check; None without CUDA
    or when sysfs gives none (attach then checks against the CPUs this process may run on)."""
    import torch

    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return gpus.gpu_numa_node(gpus.pci_address(p.pci_domain_id, p.pci_bus_id, p.pci_device_id))


class PoolRegion(SharedOffloadRegion):
    """A SharedOffloadRegion whose bytes are an offloadpool pool (see the module docstring)."""

    def __init__(
        self,
        pool_dir: Path,
        *,
        attach_rank: int,
        rank: int | None,
        num_chunks: int,
        kv_bytes_per_chunk: int,
        cpu_page_size: int,
        pin_geometry: PinGeometry,
        worker: int,
        pin_backend: str = "auto",
        lease_timeout: float | None = 60.0,
        gpu_numa_node: int | None = None,
    ) -> None:
        # Not SharedOffloadRegion.__init__: that creates or joins a /dev/shm file. These are the
        # attributes its view methods and vLLM's worker read, set from the attachment.
        self.attachment: Attachment = attach(
            pool_dir, attach_rank, lease_timeout=lease_timeout, gpu_numa_node=gpu_numa_node
        )
        try:
            self.page_size = self.attachment.page_size
            self.num_chunks = num_chunks
            self._row_stride = kv_bytes_per_chunk
            self._bytes = num_chunks * kv_bytes_per_chunk
            self.cpu_page_size = cpu_page_size
            self.mmap_path = str(pool_dir)
            self._segments = [
                (str(pool_dir / s.file), s.offset, s.bytes) for s in self.attachment.region.segments
            ]
            self._creator = False  # never unlinks
            self.mmap_obj = None
            self.fd = None
            self.rank = rank
            if rank is not None:
                self._worker_offset = rank * cpu_page_size
                self._worker_area_end = (rank + 1) * cpu_page_size
            import torch

            # The tier's rows only (a pool may be larger): vLLM's create_kv_memoryview reshapes it.
            self._base = self.attachment.tensor(torch.int8)[: self._bytes]
            self._views: list[Any] = []
            self._canonical_offset = 0
            self.is_pinned = False
            self.pinned_addresses: list[int] = []
            self.pin_stats: PinStats | None = None
            self._pin_backend = pin_backend
            self._pin_geometry = pin_geometry
            self._worker = worker
        except BaseException:
            self.attachment.close()
            raise

    # -- pinning: offloadpool's, once ------------------------------------------------------
    def pin(self) -> PinStats:
        """Register this worker's ranges through offloadpool (all-or-nothing), once."""
        import torch

        device = torch.cuda.current_device() if torch.cuda.is_available() else 0
        stats = self.attachment.pin(
            backend=self._pin_backend, device=device, geometry=self._pin_geometry, worker=self._worker
        )
        assert isinstance(stats, PinStats)
        self.pin_stats = stats
        self.is_pinned = True
        logger.info(
            "offloadpool pinned %d bytes of %s in %d call(s), %.3f s (%s)",
            stats.bytes_registered,
            self.mmap_path,
            stats.calls,
            stats.seconds,
            stats.backend,
        )
        return stats

    @property
    def total_size_bytes(self) -> int:
        """Bytes vLLM's ``pin_mmap_region`` would still register: none once offloadpool pinned.

        vLLM reads this only to plan its own registration (the views use rows and chunks)."""
        return 0 if self.is_pinned else self._bytes

    def iter_worker_slot_ranges(self) -> Iterator[tuple[int, int]]:
        """This worker's slots vLLM would register or populate: none (registered, and the node
        pre-faulted them)."""
        return iter(())

    # -- lifetime ------------------------------------------------------------------------------
    def cleanup(self) -> None:
        """Drop vLLM's views, then unpin, unmap and release the lease. Never unlinks."""
        if self._views is not None:
            self._views.clear()
        self._base = None
        self.is_pinned = False
        self.pinned_addresses.clear()
        if not self.attachment.closed:
            self.attachment.close()
