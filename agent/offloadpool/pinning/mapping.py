"""One contiguous virtual range holding every segment file of a region, back to back.

Why: the node splits a large region over several files (parallel population, no single huge
file), but the engine wants one pointer and one tensor. So the helper first reserves an
address range big enough for the whole region (``PROT_NONE``, ``MAP_NORESERVE``: no memory,
just address space), then maps each segment file over its part with ``MAP_FIXED``. Huge-page
files can only be mapped at huge-page-aligned addresses, so the reservation is over-sized by
one alignment unit and trimmed to an aligned start.
"""

from __future__ import annotations

from collections.abc import Sequence

from offloadpool.pinning import libc


def reserve(size: int, alignment: int) -> int:
    """Reserve ``size`` bytes of address space starting at a multiple of ``alignment``."""
    if size <= 0:
        raise ValueError(f"cannot reserve {size} bytes")
    alignment = max(alignment, libc.PAGE_SIZE)
    extra = alignment - libc.PAGE_SIZE  # mmap already returns page-aligned addresses
    flags = libc.MAP_PRIVATE | libc.MAP_ANONYMOUS | libc.MAP_NORESERVE
    raw = libc.mmap(0, size + extra, libc.PROT_NONE, flags)
    start = (raw + alignment - 1) // alignment * alignment
    if start > raw:
        libc.munmap(raw, start - raw)
    tail = raw + size + extra - (start + size)
    if tail:
        libc.munmap(start + size, tail)
    return start


def map_segments(base: int, segments: Sequence[tuple[int, int, int]]) -> None:
    """Map each ``(offset, length, fd)`` file at ``base + offset`` over the reservation.

    On failure the caller unmaps the whole range (which removes both the reservation and any
    file mapping already placed), so nothing is left mapped.
    """
    for offset, length, fd in segments:
        libc.mmap(
            base + offset, length, libc.PROT_READ | libc.PROT_WRITE, libc.MAP_SHARED | libc.MAP_FIXED, fd, 0
        )


def unmap(base: int, size: int) -> None:
    """Remove every mapping in the range (file mappings and leftover reservation alike)."""
    libc.munmap(base, size)


def fence(base: int, size: int) -> None:
    """Replace the range by an inaccessible reservation holding no memory.

    Used when the attachment closes while views into it are still alive: the segment pages
    are released, the address range stays reserved so nothing else is mapped there, and a
    stale view faults instead of silently reading someone else's memory.
    """
    flags = libc.MAP_PRIVATE | libc.MAP_ANONYMOUS | libc.MAP_NORESERVE | libc.MAP_FIXED
    libc.mmap(base, size, libc.PROT_NONE, flags)
