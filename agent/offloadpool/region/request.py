"""PoolRequest: what one node must provision for one pool, in plain numbers.

The region engine takes only this (never the Kubernetes objects), so it stays stdlib-only and
runs the same under the agent, the CLI and tests. Converting an OffloadPool spec into a
PoolRequest is the caller's job (``offloadpool.api.conversion.pool_request``, used by both).

The defaults and limits below are the engine's, stdlib-only because the engine must not import
pydantic; ``offloadpool.api`` imports them (never restates them) so the API models, the agent,
the operator and the CLI use the same values, and ``tests/test_crd_defaults.py`` checks the
CRD's defaults equal the models'.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Final

from offloadpool.region.errors import RequestError
from offloadpool.region.files.names import pool_name_error
from offloadpool.region.vocabulary import (
    HUGEPAGES_2MI,
    LAYOUTS,
    MEDIA,
    NUMA_NONE,
    PER_RANK,
    REPLICATED,
    SCRUB_ON_CONSUMER_CHANGE,
    SCRUB_POLICIES,
)

DEFAULT_MEDIUM: Final = HUGEPAGES_2MI
DEFAULT_LAYOUT: Final = REPLICATED
DEFAULT_MAX_FILES: Final = 32
DEFAULT_MIN_SEGMENT: Final = 1 << 30
DEFAULT_NUMA: Final = NUMA_NONE
DEFAULT_MODE: Final = 0o660
#: vLLM 0.33.0's ``num_segments`` for CPUOffloadingSpec (``_REGION_SEGMENTS``).
DEFAULT_VLLM_SEGMENTS: Final = 32
#: Most segment files per region, and most files stock vLLM may split a region into: the
#: CRD's ``maximum`` of ``segments.maxFiles`` and ``compat.vllm.numSegments`` (the CRD is the
#: truth: the engine allows no more than a pool can ask for).
MAX_FILES_LIMIT: Final = 32
#: When the node zeroes a pool's memory before handing it out again: ``SCRUB_POLICIES``
#: (``offloadpool.region.lifecycle.scrub`` applies them).
DEFAULT_SCRUB: Final = SCRUB_ON_CONSUMER_CHANGE
#: Independent shares a node's pool is split into (``spec.partitions``): 1 is one pool for one
#: engine; each share holds ``capacity / partitions`` (``offloadpool.region.holding.shares``).
DEFAULT_PARTITIONS: Final = 1
#: Most shares per node: more engines than this per node has no use, and each share is a few
#: names and files the node makes and an engine scans when it claims one.
MAX_PARTITIONS: Final = 64

_ENGINE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_NAMESPACES = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(,[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*$")
_POOL_UID = re.compile(r"^[A-Za-z0-9-]{0,128}$")


@dataclass(frozen=True)
class PoolRequest:
    """One node's share of a pool.

    ``capacity`` is per node, in bytes. ``slot_bytes`` (Interleaved: one rank's slot in a row;
    PerRank/Replicated: the row/block size) makes segment boundaries fall on rows. ``workers``
    0 means "decide" (cores available, at most files x 4). ``numa`` is ``None`` (no binding),
    ``Interleave`` (pages spread across all nodes), ``Spread`` (region i on node i mod N),
    ``GPU`` (region i on the node of the node's i-th NVIDIA GPU), a node list such as ``"0"``
    or ``"0,1"`` / ``"0-1"`` (bind there), or one node per region, ``"ranks:0,0,1,1"``
    (``region.memory.numa``).

    ``compat_engine_id`` exposes the region under stock vLLM's own file names; its files are
    then split exactly as vLLM splits them (``region.files.vllm_compat``): ``compat_segments`` is
    vLLM's ``num_segments`` (32 for CPUOffloadingSpec, 1 for TieringOffloadingSpec) and
    ``compat_row_bytes`` vLLM's row (``kv_bytes_per_chunk``), needed when that makes more than
    one file.

    ``scrub`` (one of ``SCRUB_POLICIES``), ``consumer_namespaces`` (the namespaces allowed to
    consume it, sorted and comma-joined; None: any) and ``pool_uid`` (the OffloadPool's
    ``metadata.uid``; empty when unknown, e.g. a pool file without one) are who the memory is
    for: the node zeroes it before a different consumer or a re-created pool gets it. None of
    them shapes the memory.

    ``partitions`` splits the node's ``capacity`` into that many independent shares, each laid
    out as a whole pool of ``capacity / partitions`` for one engine (``region.holding.shares``).
    """

    name: str
    capacity: int
    medium: str = DEFAULT_MEDIUM
    layout_type: str = DEFAULT_LAYOUT
    ranks: int = 1
    slot_bytes: int | None = None
    max_files: int = DEFAULT_MAX_FILES
    min_segment: int = DEFAULT_MIN_SEGMENT
    workers: int = 0
    numa: str = DEFAULT_NUMA
    uid: int = 0
    gid: int = 0
    mode: int = DEFAULT_MODE
    compat_engine_id: str | None = None
    compat_row_bytes: int | None = None
    compat_segments: int = DEFAULT_VLLM_SEGMENTS
    generation: int = 1
    scrub: str = DEFAULT_SCRUB
    consumer_namespaces: str | None = None
    pool_uid: str = ""
    partitions: int = DEFAULT_PARTITIONS

    def validate(self) -> None:
        """Raise RequestError naming the field for anything that cannot be planned."""
        name_error = pool_name_error(self.name)  # it becomes a directory name: checked first
        if name_error is not None:
            raise RequestError(name_error)
        if self.medium not in MEDIA:
            raise RequestError(f"medium {self.medium!r} is unknown; known: {', '.join(MEDIA)}")
        if self.layout_type not in LAYOUTS:
            raise RequestError(f"layout.type {self.layout_type!r} is unknown; known: {', '.join(LAYOUTS)}")
        for field in ("capacity", "ranks", "max_files", "min_segment", "generation"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RequestError(f"{field} must be a positive integer, got {value!r}")
        if self.max_files > MAX_FILES_LIMIT:
            raise RequestError(f"max_files {self.max_files} exceeds the limit of {MAX_FILES_LIMIT}")
        if self.slot_bytes is not None and (not isinstance(self.slot_bytes, int) or self.slot_bytes < 1):
            raise RequestError(f"slot_bytes must be a positive integer, got {self.slot_bytes!r}")
        if not isinstance(self.workers, int) or self.workers < 0:
            raise RequestError(f"workers must be >= 0 (0 = automatic), got {self.workers!r}")
        for field in ("uid", "gid"):
            value = getattr(self, field)
            if not isinstance(value, int) or not 0 <= value < 2**32 - 1:
                raise RequestError(f"{field} must be a valid id, got {value!r}")
        if not isinstance(self.mode, int) or not 0 <= self.mode <= 0o7777:
            raise RequestError(f"mode must be a permission mode like 0o660, got {self.mode!r}")
        if self.compat_engine_id is not None and not _ENGINE_ID.match(self.compat_engine_id):
            raise RequestError(
                f"compat engine id {self.compat_engine_id!r} must be 1-128 characters of "
                f"[A-Za-z0-9_.-] (it becomes part of a file name)"
            )
        if self.compat_row_bytes is not None and (
            not isinstance(self.compat_row_bytes, int) or self.compat_row_bytes < 1
        ):
            raise RequestError(f"compat row bytes must be a positive integer, got {self.compat_row_bytes!r}")
        if not isinstance(self.compat_segments, int) or not 1 <= self.compat_segments <= MAX_FILES_LIMIT:
            raise RequestError(
                f"compat segments must be 1-{MAX_FILES_LIMIT} (vLLM's num_segments), "
                f"got {self.compat_segments!r}"
            )
        if self.scrub not in SCRUB_POLICIES:
            raise RequestError(f"scrub {self.scrub!r} is unknown; known: {', '.join(SCRUB_POLICIES)}")
        if self.consumer_namespaces is not None and (
            not isinstance(self.consumer_namespaces, str) or not _NAMESPACES.match(self.consumer_namespaces)
        ):
            raise RequestError(
                f"consumer namespaces {self.consumer_namespaces!r} must be comma-separated namespace names"
            )
        if not isinstance(self.pool_uid, str) or not _POOL_UID.match(self.pool_uid):
            raise RequestError(f"pool uid {self.pool_uid!r} must be empty or a Kubernetes uid")
        if (
            not isinstance(self.partitions, int)
            or isinstance(self.partitions, bool)
            or not 1 <= self.partitions <= MAX_PARTITIONS
        ):
            raise RequestError(f"partitions must be 1-{MAX_PARTITIONS}, got {self.partitions!r}")
        if self.partitions > 1 and self.compat_engine_id is not None:
            raise RequestError(
                "compat.vllm exposes one region under stock vLLM's own file names, which one "
                "engine maps; it cannot be combined with partitions > 1 (one share per engine)"
            )
        from offloadpool.region.memory import numa  # local: numa loads the C library

        numa.check_regions(
            numa.parse_policy(self.numa),
            (self.ranks if self.layout_type == PER_RANK else 1) * self.partitions,
        )

    def fingerprint(self) -> str:
        """Hash of everything that shapes the memory; equal fingerprints mean "same region".

        Ownership, mode, the compat file name, the worker count, the generation and who the
        memory is for (scrub policy, namespaces, pool uid) are left out: they can change on a
        live region (applied in place, zeroed first where ``region.lifecycle.scrub`` says so) without
        rebuilding it.
        """
        shape = {k: getattr(self, k) for k in SHAPE_FIELDS}
        shape["single_file"] = self.compat_engine_id is not None  # compat: vLLM's split
        if self.compat_engine_id is not None and self.compat_row_bytes is not None:
            # Only when given, so the fingerprints of pools made before these fields stay put.
            shape["vllm_split"] = [self.compat_row_bytes, self.compat_segments]
        if self.partitions != DEFAULT_PARTITIONS:
            # Only when not 1, so the fingerprints of pools made before shares stay put.
            shape["partitions"] = self.partitions
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


SHAPE_FIELDS = (
    "capacity",
    "medium",
    "layout_type",
    "ranks",
    "slot_bytes",
    "max_files",
    "min_segment",
    "numa",
)
