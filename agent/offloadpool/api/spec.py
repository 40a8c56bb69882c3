"""OffloadPool spec: what every selected node must hold. Written by users.

This is the ONE place the API's defaults live on the Python side; the CRD in
``crds/offloadpool.io_offloadpools.yaml`` carries the same defaults for the API server, and
``tests/test_crd_defaults.py`` proves the two agree. The cross-field rules below are the CRD's
CEL rules restated, so that a spec read from a file (CLI, tests) fails with the same field
named before any memory is touched; ``tests/test_api_models.py`` runs every invalid case the
API server rejects through these models too.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from offloadpool.region.files import vllm_compat
from offloadpool.region.memory import numa
from offloadpool.region.request import (
    DEFAULT_LAYOUT,
    DEFAULT_MAX_FILES,
    DEFAULT_MEDIUM,
    DEFAULT_MIN_SEGMENT,
    DEFAULT_NUMA,
    DEFAULT_PARTITIONS,
    DEFAULT_SCRUB,
    DEFAULT_VLLM_SEGMENTS,
    MAX_FILES_LIMIT,
    MAX_PARTITIONS,
)
from offloadpool.region.request import (
    DEFAULT_MODE as DEFAULT_MODE_BITS,
)
from offloadpool.region.vocabulary import (
    DELIVERY_DRA,
    DELIVERY_HOST_PATH,
    INTERLEAVED,
    NUMA_NONE,
    PER_RANK,
    RECLAIM_DELETE,
    REPLICATED,
)

from .base import Quantity, SpecModel
from .media import (
    Delivery,
    LayoutType,
    Medium,
    NumaPolicy,
    ReclaimPolicy,
    ScrubPolicy,
    is_hugetlbfs,
    page_size,
)
from .quantity import format_quantity, parse_quantity

# The defaults the node engine also applies are the engine's own constants (imported, never
# restated: the engine is stdlib-only and cannot import this module); the rest are the API's.
# The CRD carries the same values for the API server; tests/test_crd_defaults.py checks them.
DEFAULT_MIN_SIZE = format_quantity(DEFAULT_MIN_SEGMENT)
DEFAULT_PREFAULT_WORKERS = 0
DEFAULT_UID = 0
DEFAULT_GID = 0
DEFAULT_MODE = f"{DEFAULT_MODE_BITS:04o}"
DEFAULT_RECLAIM: ReclaimPolicy = RECLAIM_DELETE
DEFAULT_DELIVERY: Delivery = DELIVERY_HOST_PATH
MAX_RANKS = 256
MAX_PREFAULT_WORKERS = 256
MAX_ID = 2**31 - 1
MAX_NUMA_NODE = numa.MAX_NODE

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class LayoutSpec(SpecModel):
    """How the ranks of one engine share the memory."""

    type: LayoutType = DEFAULT_LAYOUT
    #: Required for PerRank and Interleaved; Replicated treats an absent value as 1.
    ranks: int | None = Field(default=None, ge=1, le=MAX_RANKS)
    #: Interleaved only: bytes per rank per row (row = ranks × slotSize).
    slot_size: Quantity | None = None
    #: Replicated and PerRank only: the engine's row (its copy unit), so that segment files
    #: split on whole rows; an Interleaved row is ranks × slotSize instead.
    row_size: Quantity | None = None

    @model_validator(mode="after")
    def _rules(self) -> LayoutSpec:
        if self.type != REPLICATED and self.ranks is None:
            raise ValueError("spec.layout.ranks is required when spec.layout.type is PerRank or Interleaved")
        if self.slot_size is not None and self.type != INTERLEAVED:
            raise ValueError("spec.layout.slotSize is only valid when spec.layout.type is Interleaved")
        if self.row_size is not None and self.type == INTERLEAVED:
            raise ValueError(
                "spec.layout.rowSize is for Replicated and PerRank layouts: an Interleaved row is "
                "spec.layout.ranks × spec.layout.slotSize"
            )
        return self

    @property
    def rank_count(self) -> int:
        """Ranks, with Replicated's absent value meaning 1."""
        return self.ranks or 1


class SegmentsSpec(SpecModel):
    """How a region is split into files."""

    max_files: int = Field(default=DEFAULT_MAX_FILES, ge=1, le=MAX_FILES_LIMIT)
    min_size: Quantity = DEFAULT_MIN_SIZE


class PrefaultSpec(SpecModel):
    """How the agent pre-faults the region."""

    workers: int = Field(default=DEFAULT_PREFAULT_WORKERS, ge=0, le=MAX_PREFAULT_WORKERS)
    numa: NumaPolicy = DEFAULT_NUMA
    #: PerRank only: rank r's region on NUMA node ``numa_nodes[r]`` (one entry per rank); whether
    #: each node exists is the node's to say (``offloadpool.region.memory.numa``).
    numa_nodes: list[Annotated[int, Field(ge=0, le=MAX_NUMA_NODE)]] | None = Field(
        default=None, max_length=MAX_RANKS
    )

    @model_validator(mode="after")
    def _rules(self) -> PrefaultSpec:
        if self.numa_nodes is not None and self.numa != NUMA_NONE:
            raise ValueError(
                "spec.prefault.numaNodes is itself the placement: leave spec.prefault.numa None (its default)"
            )
        return self

    def numa_policy(self) -> str:
        """The engine's policy text: ``numa``, or one node per region from ``numaNodes``."""
        return self.numa if self.numa_nodes is None else numa.per_rank_policy(self.numa_nodes)


class Toleration(SpecModel):
    """The core/v1 Toleration shape, passed to the pool's agent pods."""

    key: str | None = Field(default=None, max_length=317)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(default=None, max_length=63)
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None

    @model_validator(mode="after")
    def _rules(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError("spec.tolerations[].value must be empty when operator is Exists")
        if not self.key and self.operator != "Exists":
            raise ValueError("spec.tolerations[].key may be empty only when operator is Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("spec.tolerations[].tolerationSeconds needs effect NoExecute")
        return self


class ConsumersSpec(SpecModel):
    """Who may use the memory, and as whom the segment files are owned."""

    namespaces: list[str] | None = Field(default=None, max_length=256)
    uid: int = Field(default=DEFAULT_UID, ge=0, le=MAX_ID)
    gid: int = Field(default=DEFAULT_GID, ge=0, le=MAX_ID)
    mode: str = Field(default=DEFAULT_MODE, pattern=r"^0[0-7]{3}$")
    #: When the node zeroes the memory before another consumer can map it
    #: (``offloadpool.region.lifecycle.scrub``); OnConsumerChange also covers a pool re-created over a
    #: retained region. None (unset) means ``DEFAULT_SCRUB``, applied in the conversion and not
    #: by the CRD: a stored default would appear in every existing pool at an upgrade, and the
    #: agents of the release before refuse a field they do not know.
    scrub: ScrubPolicy | None = None
    #: How the admission webhook gives a labelled pod the pool: HostPath (a hostPath volume and a
    #: lease sidecar), CSI (an inline ``csi`` volume of the node plugin, no sidecar: the
    #: publication holds the pool) or DRA (the pool's extended resource alone, which the
    #: scheduler satisfies with a device of the pool's DeviceClass; the operator then advertises
    #: no node resource for it). None (unset) means ``DEFAULT_DELIVERY``, not stored by the CRD,
    #: for the reason ``scrub`` is not (and so a pool without it keeps its fingerprint).
    delivery: Delivery | None = None

    @property
    def scrub_policy(self) -> str:
        """The policy in force: ``scrub``, or the default when unset."""
        return self.scrub or DEFAULT_SCRUB

    @property
    def delivery_mode(self) -> Delivery:
        """The delivery in force: ``delivery``, or the default when unset."""
        return self.delivery or DEFAULT_DELIVERY

    @field_validator("namespaces")
    @classmethod
    def _namespaces(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return value
        for ns in value:
            if len(ns) > 63 or not re.match(_DNS_LABEL, ns):
                raise ValueError(f"spec.consumers.namespaces: {ns!r} is not a namespace name (DNS label)")
        if len(set(value)) != len(value):
            raise ValueError("spec.consumers.namespaces: duplicate namespace")
        return value

    def mode_int(self) -> int:
        """The file mode as an int: ``"0660"`` -> ``0o660``."""
        return int(self.mode, 8)


class VllmCompatSpec(SpecModel):
    """Stock vLLM: the region under vLLM's own names, ``vllm_offload_<engineId>.mmap`` and
    ``….mmap.1`` …, split into files exactly as vLLM 0.33.0's ``SharedOffloadRegion`` splits it
    (``offloadpool.region.files.vllm_compat``), so unmodified vLLM adopts it as an existing region."""

    engine_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    #: vLLM's row (``CPUOffloadingSpec.kv_bytes_per_chunk``); needed when vLLM makes several files.
    row_size: Quantity | None = None
    #: vLLM's ``num_segments``: 32 for CPUOffloadingSpec, 1 for TieringOffloadingSpec.
    num_segments: int = Field(default=DEFAULT_VLLM_SEGMENTS, ge=1, le=MAX_FILES_LIMIT)

    @property
    def file_name(self) -> str:
        return vllm_compat.region_file(self.engine_id)

    def row_bytes(self) -> int | None:
        return None if self.row_size is None else parse_quantity(self.row_size)


class CompatSpec(SpecModel):
    """Compatibility with engines that do not use the pinning helper."""

    vllm: VllmCompatSpec | None = None


class OffloadPoolSpec(SpecModel):
    """What every selected node must hold."""

    capacity: Quantity
    medium: Medium = DEFAULT_MEDIUM
    layout: LayoutSpec = Field(default_factory=LayoutSpec)
    segments: SegmentsSpec = Field(default_factory=SegmentsSpec)
    prefault: PrefaultSpec = Field(default_factory=PrefaultSpec)
    node_selector: dict[str, str] | None = Field(default=None, max_length=64)
    tolerations: list[Toleration] | None = Field(default=None, max_length=64)
    consumers: ConsumersSpec = Field(default_factory=ConsumersSpec)
    reclaim_policy: ReclaimPolicy = DEFAULT_RECLAIM
    compat: CompatSpec | None = None
    #: independent shares per node, one engine on each (``offloadpool.region.holding.shares``)
    partitions: int = Field(default=DEFAULT_PARTITIONS, ge=1, le=MAX_PARTITIONS)

    # -- the CRD's cross-field CEL rules, restated -----------------------------------------
    @model_validator(mode="after")
    def _rules(self) -> OffloadPoolSpec:
        page = page_size(self.medium)
        cap = self.capacity_bytes()
        if cap % page:
            raise ValueError(
                f"spec.capacity ({self.capacity}) must be a whole number of pages of spec.medium "
                f"{self.medium} (a multiple of {page} bytes)"
            )
        if self.layout.type != REPLICATED and self.layout.ranks is not None:
            if cap % (self.layout.ranks * page):
                raise ValueError(
                    f"spec.capacity ({self.capacity}) must split into spec.layout.ranks "
                    f"({self.layout.ranks}) equal parts of whole {page}-byte pages"
                )
        ranks = 1 if self.layout.type == REPLICATED or self.layout.ranks is None else self.layout.ranks
        if cap % (self.partitions * ranks * page):
            raise ValueError(
                f"spec.capacity ({self.capacity}) must split into spec.partitions ({self.partitions}) "
                f"equal shares of whole {page}-byte pages (for PerRank and Interleaved layouts, "
                f"ranks × whole pages each)"
            )
        if self.partitions > 1 and self.compat is not None and self.compat.vllm is not None:
            raise ValueError(
                "spec.partitions above 1 cannot be combined with spec.compat.vllm: stock vLLM "
                "maps one region under its own file names, which one engine uses"
            )
        compat_vllm = self.compat is not None and self.compat.vllm is not None
        if self.consumers.delivery == DELIVERY_DRA and compat_vllm:
            raise ValueError(
                "spec.consumers.delivery DRA cannot be combined with spec.compat.vllm: the DRA "
                "plugin mounts the pool's directory, not stock vLLM's files in /dev/shm"
            )
        slot = self.slot_size_bytes()
        if slot is not None and self.layout.ranks is not None:
            if slot > cap // self.layout.ranks or cap % (self.layout.ranks * slot):
                raise ValueError(
                    f"spec.layout.slotSize does not fit: spec.capacity ({self.capacity}) must be a "
                    f"whole number of rows of {self.layout.ranks} × {slot} bytes"
                )
        row = self.layout_row_size_bytes()
        if row is not None and self.layout.type != INTERLEAVED:
            regions = self.partitions * (self.layout.rank_count if self.layout.type == PER_RANK else 1)
            if cap % (regions * row):
                raise ValueError(
                    f"spec.layout.rowSize does not fit: every region (spec.capacity {self.capacity} / "
                    f"{regions}) must be a whole number of {row}-byte rows"
                )
            if self.compat is not None and self.compat.vllm is not None:
                raise ValueError(
                    "spec.layout.rowSize cannot be combined with spec.compat.vllm: stock vLLM's files "
                    "are split on its own row, spec.compat.vllm.rowSize"
                )
        if self.min_size_bytes() < page:
            raise ValueError(
                f"spec.segments.minSize ({self.segments.min_size}) must be at least one page of "
                f"spec.medium {self.medium} ({page} bytes)"
            )
        nodes = self.prefault.numa_nodes
        if nodes is not None and (
            self.layout.type != PER_RANK or len(nodes) != (self.layout.ranks or 1) * self.partitions
        ):
            raise ValueError(
                "spec.prefault.numaNodes lists one NUMA node per region: it needs spec.layout.type "
                "PerRank and exactly spec.layout.ranks entries per share (spec.layout.ranks x "
                "spec.partitions, share by share)"
            )
        if self.compat is not None and self.compat.vllm is not None:
            vllm = self.compat.vllm
            if self.layout.type == PER_RANK:
                raise ValueError(
                    "spec.compat.vllm needs one region shared by every rank, which a PerRank "
                    "layout cannot give: use spec.layout.type Replicated or Interleaved"
                )
            row = vllm.row_bytes()
            several = cap >= 2 * vllm_compat.VLLM_MIN_SEGMENT and vllm.num_segments > 1
            if several and is_hugetlbfs(self.medium):
                raise ValueError(
                    "spec.compat.vllm on a HugePages medium needs a region stock vLLM keeps in one "
                    "file (capacity below 2Gi, or numSegments 1): vLLM maps several files with "
                    "MAP_FIXED into a 4Ki-aligned reservation, which hugetlbfs refuses (EINVAL); "
                    "use Memory or MemoryTHP"
                )
            if row is None and several:
                raise ValueError(
                    "spec.compat.vllm.rowSize is required when stock vLLM splits its region into "
                    "several files (spec.capacity of 2Gi or more and numSegments above 1): give "
                    "vLLM's kv_bytes_per_chunk, or numSegments 1 for TieringOffloadingSpec"
                )
            if row is not None and (row <= 0 or row % vllm_compat.VLLM_PAGE or cap % row):
                raise ValueError(
                    "spec.compat.vllm.rowSize must be a positive multiple of 4Ki that divides "
                    "spec.capacity: vLLM's region is a whole number of its 4Ki-aligned rows"
                )
        return self

    # -- derived values the agent and engine use ------------------------------------------
    def capacity_bytes(self) -> int:
        """Bytes per node."""
        return parse_quantity(self.capacity)

    def min_size_bytes(self) -> int:
        """Smallest segment file, in bytes."""
        return parse_quantity(self.segments.min_size)

    def slot_size_bytes(self) -> int | None:
        """Interleaved slot bytes per rank per row, or None when not given."""
        return None if self.layout.slot_size is None else parse_quantity(self.layout.slot_size)

    def layout_row_size_bytes(self) -> int | None:
        """``layout.rowSize`` in bytes (Replicated and PerRank), or None when not given."""
        return None if self.layout.row_size is None else parse_quantity(self.layout.row_size)

    def row_bytes(self) -> int | None:
        """Interleaved row bytes (ranks × slotSize), or None when not given."""
        slot = self.slot_size_bytes()
        return None if slot is None else slot * self.layout.rank_count

    def page_size(self) -> int:
        """Bytes per page of the medium."""
        return page_size(self.medium)

    def mode_int(self) -> int:
        """Segment file mode as an int (``0o660``)."""
        return self.consumers.mode_int()

    def region_count(self) -> int:
        """Regions per node: one per rank for PerRank, else one."""
        return self.layout.rank_count if self.layout.type == PER_RANK else 1

    def region_bytes(self) -> int:
        """Bytes of each region."""
        return self.capacity_bytes() // self.region_count()

    def compat_file(self) -> str | None:
        """File name stock vLLM adopts, when spec.compat.vllm is set."""
        if self.compat is None or self.compat.vllm is None:
            return None
        return self.compat.vllm.file_name

    def vllm_compat_file_count(self) -> int:
        """How many files stock vLLM maps for this pool (0 without spec.compat.vllm): what the
        webhook mounts into a pod and the agent links, by vLLM's own split."""
        if self.compat is None or self.compat.vllm is None:
            return 0
        vllm = self.compat.vllm
        row = vllm.row_bytes()
        if row is None:
            return 1
        return len(vllm_compat.segment_sizes(self.capacity_bytes(), row, vllm.num_segments))
