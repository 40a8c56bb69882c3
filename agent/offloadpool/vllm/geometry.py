"""Where a vLLM engine's CPU KV tier lies in a pool. Plain numbers, no vLLM, no torch.

vLLM's CPU tier (0.33.0, ``CPUOffloadingSpec``) is ``num_chunks`` rows of ``row_bytes``
(``kv_bytes_per_chunk``, rounded up to 4 KiB); in each row, worker ``r`` owns the
``slot_bytes`` (``cpu_page_size_per_worker``) at ``r * slot_bytes``. Under vLLM's replicated
(MLA) layout there is one copy: every worker uses rank 0's slot, which is the whole row.

The geometry is the engine's, never the pool's: a pool says how much memory, on which medium
and (PerRank) how many ranks. So

* a one-region pool (Interleaved of any ranks and slot, or Replicated) serves any engine whose
  rows fit in it: the tier is as many of vLLM's rows as fit (or ``cpu_bytes_to_use``), laid
  from the region's start; every worker attaches the region and page-locks exactly its own
  slots by vLLM's numbers (the #59544 rule, ``offloadpool.pinning.plan``), or whole rows
  under the replicated layout;
* a PerRank pool serves an engine with as many workers as it has ranks: worker ``r`` attaches
  region ``r`` only and lays vLLM's views over it with the row = its slot and itself rank 0
  (as vLLM #59547 does), so its region holds its slots back to back and it pins it
  contiguously. The tier is as many slots as the smallest region holds.

Anything else is refused before vLLM maps a byte, with one message naming both numbers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offloadpool.pinning.plan import PinGeometry
from offloadpool.region.files.manifest import Manifest
from offloadpool.region.vocabulary import ENV_POOL_DIR, PER_RANK


class PoolMismatch(ValueError):
    """The pool cannot serve this engine; the message names both numbers and what would fit."""


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


@dataclass(frozen=True)
class Placement:
    """One worker's part of the tier: the region it attaches, vLLM's view over it, its pins."""

    attach_rank: int  # the pool rank whose region the worker maps (0 for a one-region pool)
    view_rank: int  # the rank vLLM's views use inside that region
    row_bytes: int  # vLLM's row stride inside that region
    pin: PinGeometry  # exactly this worker's bytes, by vLLM's numbers


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


def per_rank(manifest: Manifest) -> bool:
    return manifest.layout.type == PER_RANK


def pool_bytes(manifest: Manifest) -> int:
    """Every byte the pool offers an engine: its one region, or all of a PerRank pool's."""
    return sum(r.bytes for r in manifest.regions)


def rows_that_fit(manifest: Manifest, tier: EngineTier) -> int:
    """How many of vLLM's rows the pool holds: whole rows of its one region, or (PerRank) as
    many slots as the smallest region holds (each worker keeps its slots in its own region)."""
    if per_rank(manifest):
        return min(r.bytes for r in manifest.regions) // tier.slot_bytes
    return manifest.regions[0].bytes // tier.row_bytes


def check_ranks(manifest: Manifest, pool_dir: Path, world_size: int) -> None:
    """A PerRank pool serves only an engine with one worker per region."""
    if per_rank(manifest) and manifest.layout.ranks != world_size:
        raise PoolMismatch(
            f"pool {manifest.pool!r} at {pool_dir} is laid out PerRank for {manifest.layout.ranks} "
            f"ranks (one region per worker), the engine has {world_size} workers: use a PerRank pool "
            f"of {world_size} ranks, or an Interleaved or Replicated pool (any engine fits those)"
        )


def check(manifest: Manifest, pool_dir: Path, tier: EngineTier, *, explicit: bool = False) -> None:
    """Raise PoolMismatch unless the pool holds ``tier``. ``explicit``: the engine set
    ``cpu_bytes_to_use`` (so a tier larger than the pool is the user's number, said so)."""
    check_ranks(manifest, pool_dir, tier.world_size)
    name = f"pool {manifest.pool!r} at {pool_dir}"
    fits = rows_that_fit(manifest, tier)
    if per_rank(manifest):
        unit, where = tier.slot_bytes, f"the smallest of its {len(manifest.regions)} regions holds"
        held = min(r.bytes for r in manifest.regions)
    else:
        unit, where, held = tier.row_bytes, "holds", manifest.regions[0].bytes
    if fits < 1:
        raise PoolMismatch(
            f"{name} {where} {held} bytes, less than one of vLLM's {unit}-byte "
            f"{'slots' if per_rank(manifest) else 'rows'}: give the pool a capacity of at least "
            f"{unit * (len(manifest.regions) if per_rank(manifest) else 1)} bytes"
        )
    if tier.num_chunks > fits:
        source = "cpu_bytes_to_use asks for" if explicit else "vLLM's CPU tier needs"
        raise PoolMismatch(
            f"{name} {where} {held} bytes ({fits} of vLLM's {unit}-byte "
            f"{'slots' if per_rank(manifest) else 'rows'}), {source} {tier.num_chunks} "
            f"({tier.bytes} bytes): lower cpu_bytes_to_use, or leave it out and the tier is the pool"
        )


def placement(manifest: Manifest, tier: EngineTier, worker: int) -> Placement:
    """Where worker ``worker``'s data lies and what it pins (``check`` passed)."""
    if per_rank(manifest):
        # The region holds this worker's slots back to back: vLLM's row is the slot, rank 0.
        whole = PinGeometry(tier.num_chunks * tier.slot_bytes, tier.slot_bytes, 0, tier.slot_bytes)
        return Placement(attach_rank=worker, view_rank=0, row_bytes=tier.slot_bytes, pin=whole)
    if tier.replicated:
        rows = PinGeometry(tier.bytes, tier.row_bytes, 0, tier.row_bytes)
        return Placement(attach_rank=0, view_rank=0, row_bytes=tier.row_bytes, pin=rows)
    slots = PinGeometry(tier.bytes, tier.row_bytes, worker * tier.slot_bytes, tier.slot_bytes)
    return Placement(attach_rank=0, view_rank=worker, row_bytes=tier.row_bytes, pin=slots)
