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
    "HugePages-2Mi": Medium("HugePages-2Mi", "hugetlbfs", 2 * MiB),
    "HugePages-1Gi": Medium("HugePages-1Gi", "hugetlbfs", 1 * GiB),
    "Memory": Medium("Memory", "tmpfs", mmap.PAGESIZE, huge="never"),
    # Segments are kept 2 MiB multiples so every file can be backed by huge pages end to end.
    "MemoryTHP": Medium("MemoryTHP", "tmpfs", 2 * MiB, huge="always"),
}


def medium(name: str) -> Medium:
    try:
        return MEDIA[name]
    except KeyError:
        raise RequestError(f"unknown medium {name!r}; known: {', '.join(MEDIA)}") from None
