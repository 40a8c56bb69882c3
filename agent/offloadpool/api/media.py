"""Media, layouts, policies, deliveries, node phases and page sizes, as the API models type them.

Every name is the engine's (``offloadpool.region.vocabulary``) and every page size too
(``offloadpool.region.memory.media``): the page size is the granule a pool's memory comes in on a
medium (capacity a whole number of pages, a segment at least one page). Memory uses the base
page; MemoryTHP (tmpfs huge=always) keeps 2 MiB granules so every segment can be backed by
transparent huge pages end to end. The CRD's CEL rules hard-code the same numbers;
tests/test_api_models.py checks they agree with the node engine.
"""

from __future__ import annotations

from offloadpool.region import vocabulary as words
from offloadpool.region.memory import media as engine_media
from offloadpool.region.memory.media import is_hugetlbfs as is_hugetlbfs

Medium = words.MediumName
LayoutType = words.LayoutName
NumaPolicy = words.NumaPolicyName
ReclaimPolicy = words.ReclaimPolicyName
ScrubPolicy = words.ScrubPolicyName
Delivery = words.DeliveryName
NodePhase = words.NodePhaseName

MEDIA: tuple[str, ...] = words.MEDIA
LAYOUTS: tuple[str, ...] = words.LAYOUTS
NUMA_POLICIES: tuple[str, ...] = words.NUMA_POLICIES
RECLAIM_POLICIES: tuple[str, ...] = words.RECLAIM_POLICIES
NODE_PHASES: tuple[str, ...] = words.NODE_PHASES
SCRUB_POLICIES: tuple[str, ...] = words.SCRUB_POLICIES
DELIVERIES: tuple[str, ...] = words.DELIVERIES

PAGE_SIZES: dict[str, int] = {name: spec.page_size for name, spec in engine_media.MEDIA.items()}

#: Kubernetes resource the agent DaemonSet requests for the medium (huge pages are their own
#: resource; tmpfs pages are charged as memory).
SCHEDULING_RESOURCE: dict[str, str] = {
    words.HUGEPAGES_2MI: "hugepages-2Mi",
    words.HUGEPAGES_1GI: "hugepages-1Gi",
    words.MEMORY: "memory",
    words.MEMORY_THP: "memory",
}


def page_size(medium: str) -> int:
    """Bytes per page of ``medium``; ValueError naming the known media otherwise."""
    try:
        return PAGE_SIZES[medium]
    except KeyError:
        raise ValueError(f"unknown medium {medium!r}; known: {', '.join(MEDIA)}") from None


#: Media backed by a hugetlbfs mount (pages reserved up front): the node engine's own list.
HUGEPAGE_MEDIA: tuple[str, ...] = tuple(name for name in MEDIA if is_hugetlbfs(name))
