"""The registration plan: which byte ranges of a region one rank registers, in how many calls.

Why a plan at all, rather than one call over the whole mapping (what engines did first):

* one registration above 512 GiB fails on recent NVIDIA drivers and some hosts reject single
  calls above ~96-128 GiB, so calls are chunked (at most ``max_chunk``, 64 GiB by default);
* a chunk seam must never cut a copy unit (a row: one KV block of every rank), so seams sit on
  row boundaries, and on page boundaries too, because two registrations that share a page
  collide (``CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED``);
* in an interleaved layout a rank only ever copies its own slot of each row, so registering the
  page-aligned range around each slot pins roughly ``1/ranks`` of the region instead of all of
  it (vLLM measured 274.9 -> 68.8 GB per rank, 20.8 -> 6.8 s). That only pays when the slot is
  at least a page smaller than the row (otherwise the rounded ranges cover whole rows anyway)
  and when the number of calls stays bounded (``max_ranges``, 65,536 by default).

Everything here is pure arithmetic on integers so it can be property-tested exhaustively.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_MAX_CHUNK = 64 << 30
DEFAULT_MAX_RANGES = 65536

Range = tuple[int, int]  # (offset, length) in bytes from the start of the region


@dataclass(frozen=True)
class PinGeometry:
    """Which bytes of a mapped region one rank uses, as the engine lays its rows over it.

    The engine's numbers, not the pool's: the first ``total_bytes`` of the region are rows of
    ``row_bytes`` and the rank's data is ``[slot_offset, slot_offset + slot_bytes)`` of each.
    A whole region (vLLM's replicated tier, a PerRank region) is ``slot_offset=0,
    slot_bytes=row_bytes``. ``Attachment.pin(geometry=...)`` plans from this instead of the
    manifest's layout, so a pool of any layout serves any engine that fits in it.
    """

    total_bytes: int
    row_bytes: int
    slot_offset: int
    slot_bytes: int

    def plan(
        self, page_size: int, max_chunk: int = DEFAULT_MAX_CHUNK, max_ranges: int = DEFAULT_MAX_RANGES
    ) -> list[Range]:
        return plan_pin_ranges(
            self.total_bytes,
            self.row_bytes,
            self.slot_offset,
            self.slot_bytes,
            page_size,
            max_chunk=max_chunk,
            max_ranges=max_ranges,
        )


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def plan_pin_ranges(
    total_bytes: int,
    row_bytes: int,
    slot_offset: int,
    slot_bytes: int,
    page_size: int,
    max_chunk: int = DEFAULT_MAX_CHUNK,
    max_ranges: int = DEFAULT_MAX_RANGES,
) -> list[Range]:
    """Return the ``(offset, length)`` ranges one rank registers, sorted and non-overlapping.

    The region is ``total_bytes // row_bytes`` rows; the rank's bytes are
    ``[slot_offset, slot_offset + slot_bytes)`` of every row. A whole region (Replicated,
    PerRank) is simply ``slot_offset=0, slot_bytes=row_bytes``.

    * Slot-selective plan, used when ``slot_bytes <= row_bytes - page_size`` and the result
      needs at most ``max_ranges`` ranges: per row, the slot rounded outwards to pages (never
      past ``total_bytes``); ranges that touch are coalesced as long as the result stays
      within ``max_chunk``.
    * Otherwise, and for whole regions: chunks of at most ``max_chunk`` bytes whose seams lie
      on row boundaries that are also page boundaries (multiples of lcm(row, page)).

    Together the ranges cover every byte of the rank's slots. Raises ValueError for
    geometries that cannot be honoured (for example a row-and-page unit above ``max_chunk``).
    """
    total_bytes = _positive_int("total_bytes", total_bytes)
    row_bytes = _positive_int("row_bytes", row_bytes)
    slot_bytes = _positive_int("slot_bytes", slot_bytes)
    page_size = _positive_int("page_size", page_size)
    max_chunk = _positive_int("max_chunk", max_chunk)
    max_ranges = _positive_int("max_ranges", max_ranges)
    if isinstance(slot_offset, bool) or not isinstance(slot_offset, int):
        raise TypeError(f"slot_offset must be an int, got {type(slot_offset).__name__}")
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if total_bytes % row_bytes:
        raise ValueError(f"total_bytes {total_bytes} is not a whole number of {row_bytes}-byte rows")
    if slot_offset < 0 or slot_offset + slot_bytes > row_bytes:
        raise ValueError(
            f"slot [{slot_offset}, {slot_offset + slot_bytes}) does not fit a {row_bytes}-byte row"
        )
    if slot_bytes <= row_bytes - page_size:
        selective = _slot_ranges(
            total_bytes, row_bytes, slot_offset, slot_bytes, page_size, max_chunk, max_ranges
        )
        if selective is not None:
            return selective
    return row_chunks(total_bytes, row_bytes, page_size, max_chunk)


def row_chunks(total_bytes: int, row_bytes: int, page_size: int, max_chunk: int) -> list[Range]:
    """Whole-region plan: chunks <= ``max_chunk`` with seams on row *and* page boundaries."""
    unit = math.lcm(row_bytes, page_size)
    if unit > max_chunk:
        raise ValueError(
            f"cannot chunk: a seam must fall on a row ({row_bytes} B) and page ({page_size} B) "
            f"boundary, every {unit} bytes, which exceeds max_chunk ({max_chunk} B)"
        )
    chunk = (max_chunk // unit) * unit
    return [(off, min(chunk, total_bytes - off)) for off in range(0, total_bytes, chunk)]


def _slot_ranges(
    total_bytes: int,
    row_bytes: int,
    slot_offset: int,
    slot_bytes: int,
    page_size: int,
    max_chunk: int,
    max_ranges: int,
) -> list[Range] | None:
    """Page-rounded per-row slot ranges, coalesced; None when the plan is not allowed."""
    mask = page_size - 1
    out: list[list[int]] = []  # [start, end) pairs, mutable while coalescing
    for row_start in range(0, total_bytes, row_bytes):
        start = (row_start + slot_offset) & ~mask
        end = min((row_start + slot_offset + slot_bytes + mask) & ~mask, total_bytes)
        if end - start > max_chunk:
            return None  # a single slot range would already break the per-call limit
        # With slot <= row - page the gap between two slots is >= a page, so rounded ranges
        # can touch but never overlap: merge touching ones while the merged range fits a call.
        if out and start == out[-1][1] and end - out[-1][0] <= max_chunk:
            out[-1][1] = end
            continue
        out.append([start, end])
        if len(out) > max_ranges:
            return None
    return [(s, e - s) for s, e in out]


def split_at(ranges: Iterable[Range], cuts: Sequence[int]) -> list[Range]:
    """Split ranges at the given sorted offsets (segment starts), so no range spans two files.

    Each registration call then belongs to exactly one segment file, which is what the
    per-file registration lock serialises.
    """
    out: list[Range] = []
    for off, length in ranges:
        end = off + length
        i = bisect.bisect_right(cuts, off)
        while i < len(cuts) and cuts[i] < end:
            out.append((off, cuts[i] - off))
            off = cuts[i]
            i += 1
        out.append((off, end - off))
    return out
