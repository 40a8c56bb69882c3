"""Media, layouts and page sizes.

The page size is the granule a pool's memory comes in on a medium: capacity must be a whole
number of pages, and a segment at least one page. Memory uses the base 4 KiB page; MemoryTHP
(tmpfs huge=always) keeps 2 MiB granules so every segment can be backed by transparent huge
pages end to end, as the node engine (offloadpool.region.media) plans it. The CRD's CEL rules
hard-code the same numbers; tests/test_api_models.py checks they agree with the node engine.
"""

from __future__ import annotations

from typing import Literal, get_args

from offloadpool.region import media as engine_media

Medium = Literal["HugePages-2Mi", "HugePages-1Gi", "Memory", "MemoryTHP"]
LayoutType = Literal["Replicated", "PerRank", "Interleaved"]
NumaPolicy = Literal["None", "Interleave", "Spread"]
ReclaimPolicy = Literal["Delete", "Retain"]
ScrubPolicy = Literal["OnConsumerChange", "Always", "Never"]
NodePhase = Literal[
    "Pending", "Provisioning", "Populating", "Scrubbing", "Ready", "Draining", "Released", "Failed"
]

MEDIA: tuple[str, ...] = get_args(Medium)
LAYOUTS: tuple[str, ...] = get_args(LayoutType)
NUMA_POLICIES: tuple[str, ...] = get_args(NumaPolicy)
RECLAIM_POLICIES: tuple[str, ...] = get_args(ReclaimPolicy)
NODE_PHASES: tuple[str, ...] = get_args(NodePhase)
SCRUB_POLICIES: tuple[str, ...] = get_args(ScrubPolicy)

PAGE_SIZES: dict[str, int] = {
    "HugePages-2Mi": 2 * 1024**2,
    "HugePages-1Gi": 1024**3,
    "Memory": 4 * 1024,
    "MemoryTHP": 2 * 1024**2,
}

#: Kubernetes resource the agent DaemonSet requests for the medium (huge pages are their own
#: resource; tmpfs pages are charged as memory).
SCHEDULING_RESOURCE: dict[str, str] = {
    "HugePages-2Mi": "hugepages-2Mi",
    "HugePages-1Gi": "hugepages-1Gi",
    "Memory": "memory",
    "MemoryTHP": "memory",
}


def page_size(medium: str) -> int:
    """Bytes per page of ``medium``; ValueError naming the known media otherwise."""
    try:
        return PAGE_SIZES[medium]
    except KeyError:
        raise ValueError(f"unknown medium {medium!r}; known: {', '.join(MEDIA)}") from None


#: Media backed by a hugetlbfs mount (pages reserved up front): the node engine's own list.
HUGEPAGE_MEDIA: tuple[str, ...] = tuple(name for name, spec in engine_media.MEDIA.items() if spec.hugetlb)


def is_hugetlbfs(medium: str) -> bool:
    """True for media backed by a hugetlbfs mount (pages reserved up front)."""
    return medium in HUGEPAGE_MEDIA
