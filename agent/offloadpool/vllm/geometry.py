"""Does a pool fit a vLLM engine's CPU KV tier? Plain numbers, no vLLM, no torch.

vLLM's CPU tier (0.33.0, ``CPUOffloadingSpec``) is ``num_chunks`` rows of ``row_bytes``
(``kv_bytes_per_chunk``, rounded up to 4 KiB); in each row, worker ``r`` owns the
``slot_bytes`` (``cpu_page_size_per_worker``) at ``r * slot_bytes``. Under vLLM's replicated
(MLA) layout there is one copy: every worker uses rank 0's slot, which is the whole row.

An offloadpool pool serves that tier when its rows are vLLM's rows: an Interleaved pool with
one rank per worker and vLLM's slot (so each worker pins only its slots), or a Replicated
pool (whole rows; the layout for the replicated MLA tier). The tier's size is derived from
the pool when the engine does not set ``cpu_bytes_to_use``. Anything else is refused before
vLLM maps a byte, with both numbers and the pool spec that would fit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offloadpool.region.manifest import Manifest
from offloadpool.region.vocabulary import ENV_POOL_DIR, INTERLEAVED, PER_RANK, REPLICATED


class PoolMismatch(ValueError):
    """The pool cannot serve this engine; the message names both numbers and a fitting spec."""


@dataclass(frozen=True)
class EngineTier:
    """What vLLM computed for its CPU tier (CPUOffloadingSpec's own numbers)."""

    world_size: int
    row_bytes: int  # kv_bytes_per_chunk (4 KiB aligned)
    slot_bytes: int  # cpu_page_size_per_worker
    num_chunks: int
    replicated: bool  # vLLM's single-copy (MLA) layout: every worker uses rank 0's slot

    @property
    def bytes(self) -> int:
        return self.num_chunks * self.row_bytes

    def fitting_spec(self) -> str:
        """The OffloadPool spec (capacity and layout) that serves this tier exactly."""
        if self.replicated or self.world_size == 1:
            return f"capacity: {self.bytes}, layout: {{type: Replicated}}"
        return (
            f"capacity: {self.bytes}, layout: {{type: Interleaved, ranks: {self.world_size}, "
            f"slotSize: {self.slot_bytes}}}"
        )


def pool_dir_of(extra_config: Mapping[str, Any], data_parallel_index: int = 0) -> Path:
    """``pool_dir`` from the connector's extra config, else ``$OFFLOADPOOL_POOL_DIR``.

    ``{dp}`` in the path is replaced by the engine's data-parallel index, so DP replicas on a
    node can each name their own pool (``/offloadpool/kv-dp{dp}``)."""
    raw = extra_config.get("pool_dir") or os.environ.get(ENV_POOL_DIR)
    if not raw:
        raise PoolMismatch(
            f"no offloadpool pool given: set kv_connector_extra_config.pool_dir, or "
            f"{ENV_POOL_DIR} (the admission webhook sets it in pods labelled offloadpool.io/pool)"
        )
    return Path(str(raw).replace("{dp}", str(data_parallel_index)))


def pool_row_bytes(manifest: Manifest) -> int | None:
    """The pool's row, if it records one."""
    return manifest.layout.row_bytes


def tier_bytes(manifest: Manifest) -> int:
    """The CPU tier a pool offers: its (one) region."""
    return manifest.regions[0].bytes


def check(manifest: Manifest, pool_dir: Path, tier: EngineTier) -> int | None:
    """Raise PoolMismatch unless the pool serves ``tier``; return the rank every worker attaches
    the pool as (0: a Replicated pool has one rank), or None: each worker as its own rank."""
    name = f"pool {manifest.pool!r} at {pool_dir}"
    lay = manifest.layout
    fit = f"a pool that fits: spec: {{{tier.fitting_spec()}}}"
    if tier.num_chunks < 1:
        raise PoolMismatch(
            f"{name} holds {tier_bytes(manifest)} bytes, less than one of vLLM's "
            f"{tier.row_bytes}-byte rows; {fit}"
        )
    if lay.type == PER_RANK:
        raise PoolMismatch(
            f"{name} is laid out PerRank (one region per rank), but vLLM's CPU tier is one "
            f"region of rows shared by its {tier.world_size} workers; {fit}"
        )
    if lay.type == INTERLEAVED:
        if tier.replicated:
            raise PoolMismatch(
                f"{name} is Interleaved for {lay.ranks} ranks, but vLLM keeps one replicated "
                f"copy per row (MLA); {fit}"
            )
        if lay.ranks != tier.world_size:
            raise PoolMismatch(
                f"{name} is laid out for {lay.ranks} ranks, the engine has {tier.world_size} workers; {fit}"
            )
        if lay.slot_bytes != tier.slot_bytes or lay.row_bytes != tier.row_bytes:
            raise PoolMismatch(
                f"{name} has slots of {lay.slot_bytes} bytes in rows of {lay.row_bytes}, vLLM's "
                f"are {tier.slot_bytes} in rows of {tier.row_bytes}; {fit}"
            )
    elif lay.row_bytes is not None and lay.row_bytes != tier.row_bytes:
        raise PoolMismatch(f"{name} has rows of {lay.row_bytes} bytes, vLLM's are {tier.row_bytes}; {fit}")
    if tier.bytes > tier_bytes(manifest):
        raise PoolMismatch(
            f"{name} holds {tier_bytes(manifest)} bytes, vLLM's CPU tier needs {tier.bytes} "
            f"({tier.num_chunks} rows of {tier.row_bytes}); lower cpu_bytes_to_use or use {fit}"
        )
    return 0 if lay.type == REPLICATED else None
