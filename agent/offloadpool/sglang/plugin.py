"""The SGLang plugin (see the package docstring). Imports SGLang and torch."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offloadpool.pinning import Attachment, attach
from offloadpool.region.vocabulary import ENV_POOL_DIR, PER_RANK

ALLOC_TARGET = "sglang.srt.mem_cache.pool_host.common.alloc_with_host_register"
BUDGET_TARGET = "sglang.srt.mem_cache.pool_host.base.host_memory_budget_bytes"
ALIGN = 4096


def pod_pool(environ: Mapping[str, str] | None = None) -> Path | None:
    """The pool the pod was given, ``$OFFLOADPOOL_POOL_DIR`` (the webhook injects it into every
    container of a pod labelled for a pool), or None: the plugin then registers nothing.

    That is all the plugin reads of its environment. The layout, ranks and sizes come from the
    pool's manifest, the TP rank and size from SGLang; a pool of several shares is claimed for
    the pod's uid, ``$OFFLOADPOOL_POD_UID``, which the webhook injects for such a pool and
    ``attach`` reads (``offloadpool.region.holding.shares.default_owner``)."""
    value = (os.environ if environ is None else environ).get(ENV_POOL_DIR, "")
    return Path(value) if value else None


class PoolTooSmall(SystemExit):
    """A host pool the rank's part of the pool cannot hold (stops the rank)."""


def tp_rank_and_size() -> tuple[int, int]:
    """This scheduler's TP rank and size: SGLang's TP group once it is set up, else
    torch.distributed's world, else rank 0 of 1."""
    try:
        from sglang.srt.distributed import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    except ImportError:
        pass
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


@dataclass
class RankPool:
    """The rank's part of the pool: ``[start, start + size)`` of its attachment, carved in order."""

    pool_dir: Path
    attachment: Attachment
    rank: int
    start: int
    size: int
    used: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def left(self) -> int:
        return self.size - self.used

    def refuse(self, asked: int) -> PoolTooSmall:
        return PoolTooSmall(
            f"offloadpool: pool {self.attachment.manifest.pool!r} at {self.pool_dir} holds "
            f"{self.size} bytes for TP rank {self.rank} ({self.left} left), SGLang's host pool asks "
            f"for {asked} bytes: lower --hicache-size / --hicache-ratio, or provision a larger pool"
        )

    def carve(self, nbytes: int) -> int:
        """Offset in the attachment of ``nbytes`` fresh bytes (4 KiB aligned), or refuse."""
        with self.lock:
            take = -(-nbytes // ALIGN) * ALIGN
            if take > self.left:
                raise self.refuse(nbytes)
            offset = self.start + self.used
            self.used += take
            return offset


_POOL: RankPool | None = None
_POOL_LOCK = threading.Lock()


def rank_pool() -> RankPool:
    """Attach the pool once per process: PerRank region r for TP rank r; one region split
    evenly between the TP ranks, rank r taking part r."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            return _POOL
        pool_dir = pod_pool()
        if pool_dir is None:
            raise SystemExit(
                f"offloadpool: SGLang's host pool asked for the pool, but {ENV_POOL_DIR} is unset"
            )
        rank, size = tp_rank_and_size()
        try:
            from offloadpool.region.files.manifest import load

            manifest = load(pool_dir)
            per_rank = manifest.layout.type == PER_RANK
            if per_rank and len(manifest.regions) != size:
                raise SystemExit(
                    f"offloadpool: pool {manifest.pool!r} at {pool_dir} is PerRank for "
                    f"{len(manifest.regions)} ranks, SGLang runs {size} TP ranks: use a PerRank pool of "
                    f"{size} ranks, or a Replicated pool (any TP size fits it)"
                )
            attachment = attach(pool_dir, rank if per_rank else 0)
        except SystemExit:
            raise
        except Exception as exc:  # attach's ManifestError/AttachError, LeaseHeld, OSError
            raise SystemExit(f"offloadpool: cannot attach pool at {pool_dir}: {exc}") from exc
        if per_rank:
            start, part = 0, attachment.size
        else:
            part = attachment.size // size // ALIGN * ALIGN
            start = rank * part
        _POOL = RankPool(pool_dir, attachment, rank, start, part)
        return _POOL


def alloc_from_pool(
    dims: tuple[int, ...],
    dtype: Any,
    device: str,
    pin_memory: bool,
    allocator: Any,
    registration_granularity_bytes: int | None = None,
) -> Any:
    """SGLang's ``alloc_with_host_register``, its memory carved from the pool."""
    import math

    import torch
    from sglang.srt.mem_cache.pool_host import common

    if device != "cpu":
        raise SystemExit(f"offloadpool: SGLang asked for a host pool on {device!r}, not the CPU")
    if type(allocator) is not common.HostTensorAllocator:
        raise SystemExit(
            f"offloadpool: SGLang's host pool uses the {type(allocator).__name__} of a storage "
            "backend, which owns its memory: run without --hicache-storage-backend's allocator, "
            f"or without {ENV_POOL_DIR}"
        )
    nbytes = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
    pool = rank_pool()
    offset = pool.carve(nbytes)
    buffer = pool.attachment._frombuffer(offset, nbytes, dtype).view(dims)
    allocator.dtype, allocator.dims = dtype, dims
    if pin_memory:
        common._cuda_host_register(buffer, registration_granularity_bytes)  # SGLang pins, not us
    return buffer


def pool_budget_bytes(requested_bytes: int = 0, *, auto_size: bool = False) -> int:
    """SGLang's ``host_memory_budget_bytes``: what is left of the rank's part of the pool.
    A request larger than that stops the rank here, naming both numbers."""
    pool = rank_pool()
    if requested_bytes > pool.left:
        raise pool.refuse(requested_bytes)
    return pool.left


def register() -> None:
    """The entry point SGLang's ``load_plugins`` calls in every scheduler process."""
    if pod_pool() is None:
        return
    try:
        import pkgutil

        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        for target in (ALLOC_TARGET, BUDGET_TARGET):
            module, name = target.rsplit(".", 1)
            getattr(pkgutil.resolve_name(module), name)  # a renamed target must stop the rank
        HookRegistry.register(ALLOC_TARGET, alloc_from_pool, HookType.REPLACE)
        HookRegistry.register(BUDGET_TARGET, pool_budget_bytes, HookType.REPLACE)
    except Exception as exc:
        raise SystemExit(f"offloadpool: the SGLang plugin could not register its hooks: {exc}") from exc
