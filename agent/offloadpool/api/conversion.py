"""OffloadPool -> PoolRequest: the one conversion from the API to the node engine's numbers.

The agent (from the object the API server returns) and the CLI (from a YAML file and flags)
both call ``pool_request``, so a pool means the same memory wherever it is provisioned. It goes
through the models (``offloadpool.api.spec``): their defaults are the CRD's, their validation is
the CRD's, and the derived values (bytes, mode bits, rank count) are computed in one place.
The engine's own ``PoolRequest`` defaults are the same values (the models import them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from offloadpool.region.request import DEFAULT_VLLM_SEGMENTS, PoolRequest

from .pool import OffloadPool


class SpecError(ValueError):
    """The pool's spec cannot be turned into a request (the CRD's validation should prevent it)."""


def pool_request(pool: OffloadPool | Mapping[str, Any], workers_override: int = 0) -> PoolRequest:
    """The PoolRequest one node provisions for ``pool`` (capacity is per node), at the pool's
    current generation.

    ``pool`` is the model or the object as JSON (the API server's answer); a body the models
    refuse raises SpecError naming the pool and the field. ``workers_override`` (the agent's
    ``OFFLOADPOOL_WORKERS``) replaces ``spec.prefault.workers`` when not 0.
    """
    if not isinstance(pool, OffloadPool):
        body = pool
        try:
            pool = OffloadPool.model_validate(body)
        except ValidationError as exc:
            name = (body.get("metadata") or {}).get("name")
            raise SpecError(f"pool {name}: {exc}") from None
    spec = pool.spec
    vllm = spec.compat.vllm if spec.compat else None
    namespaces = spec.consumers.namespaces
    return PoolRequest(
        name=pool.name,
        capacity=spec.capacity_bytes(),
        medium=spec.medium,
        layout_type=spec.layout.type,
        ranks=spec.layout.rank_count,
        # the engine's one row field: an Interleaved slot, or a Replicated/PerRank row
        slot_bytes=spec.slot_size_bytes() or spec.layout_row_size_bytes(),
        max_files=spec.segments.max_files,
        min_segment=spec.min_size_bytes(),
        workers=workers_override or spec.prefault.workers,
        numa=spec.prefault.numa_policy(),
        uid=spec.consumers.uid,
        gid=spec.consumers.gid,
        mode=spec.mode_int(),
        compat_engine_id=vllm.engine_id if vllm else None,
        compat_row_bytes=vllm.row_bytes() if vllm else None,
        compat_segments=vllm.num_segments if vllm else DEFAULT_VLLM_SEGMENTS,
        generation=max(1, pool.generation),
        scrub=spec.consumers.scrub_policy,
        consumer_namespaces=",".join(sorted(namespaces)) if namespaces else None,
        pool_uid=str(pool.metadata.get("uid") or ""),
        partitions=spec.partitions,
    )
