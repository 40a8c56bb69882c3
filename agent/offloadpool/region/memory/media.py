"""The four media a pool can live on, and what each means for the kernel.

``HugePages-*`` are hugetlbfs mounts: pages come from the kernel's persistent huge page pool
(reserved up front with ``min_size=``), are zeroed when faulted and are never swapped or split,
which makes both the pre-fault and the engine's later pinning cheap. ``Memory`` is tmpfs with
4 KiB pages; ``MemoryTHP`` is tmpfs with ``huge=always`` (transparent huge pages for the files,
best effort, no reservation).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

from offloadpool.region.errors import RequestError
from offloadpool.region.vocabulary import HUGEPAGES_1GI, HUGEPAGES_2MI, MEMORY, MEMORY_THP

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True)
class Medium:
    name: str
    fstype: str  # "hugetlbfs" or "tmpfs"
    page_size: int  # the unit every segment size is a multiple of
    huge: str | None = None  # tmpfs huge= option

    @property
    def hugetlb(self) -> bool:
        return self.fstype == "hugetlbfs"

    @property
    def sysfs_dir(self) -> str:
        """The kernel's per-size huge page pool (hugetlbfs media only)."""
        return f"/sys/kernel/mm/hugepages/hugepages-{self.page_size // KiB}kB"


MEDIA: dict[str, Medium] = {
    HUGEPAGES_2MI: Medium(HUGEPAGES_2MI, "hugetlbfs", 2 * MiB),
    HUGEPAGES_1GI: Medium(HUGEPAGES_1GI, "hugetlbfs", 1 * GiB),
    MEMORY: Medium(MEMORY, "tmpfs", mmap.PAGESIZE, huge="never"),
    # Segments are kept 2 MiB multiples so every file can be backed by huge pages end to end.
    MEMORY_THP: Medium(MEMORY_THP, "tmpfs", 2 * MiB, huge="always"),
}


def medium(name: str) -> Medium:
    try:
        return MEDIA[name]
    except KeyError:
        raise RequestError(f"unknown medium {name!r}; known: {', '.join(MEDIA)}") from None


def is_hugetlbfs(name: str) -> bool:
    """True for a medium backed by a hugetlbfs mount (pages reserved up front): the one
    huge-page test, for a name that may not be a medium at all (then False)."""
    known = MEDIA.get(name)
    return known is not None and known.hugetlb
