"""Segment plan: from a PoolRequest to regions and the segment files that back them.

Rules (docs/node-engine.md, "What one `provision` call does"), and why:

* Layouts: ``Replicated`` = one region of S shared by every rank; ``PerRank`` = r regions of S/r,
  one per rank, so no rank maps memory it never uses; ``Interleaved`` = one region whose rows
  hold r slots of ``slot_bytes`` each.
* A region of R bytes is split into k = min(max_files, floor(R / min_segment)) files (at least
  one). One file serialises parallel population on the file's page cache lock, many files let
  workers populate side by side; tiny files only add mappings. With the default 1 GiB minimum
  this yields "one file below 2 GiB".
* Boundaries fall on the granule g = lcm(page size, row size): every file is a whole number of
  pages (hugetlbfs refuses anything else) and no row straddles two files (so an engine's copy
  unit never spans a file boundary). k is lowered, if needed, so that every file holds at least
  ``min_segment`` bytes; when g divides both R and ``min_segment`` (the usual case) this is
  exactly the formula above. Sizes differ by at most one granule, the larger ones first; a
  remainder smaller than g (R not a multiple of the lcm) goes to the last file.
* A stock-vLLM compat pool is split the way vLLM itself splits its region (``vllm_compat``:
  up to ``num_segments`` files of >= 1 GiB on vLLM's rows, larger ones first, the rest last),
  because unmodified vLLM maps the files by name at the offsets it computes; ``segments``
  settings do not apply to it. Each file must still be whole pages of the medium, and a
  hugetlbfs medium can serve only a one-file region (vLLM maps several with MAP_FIXED at 4 KiB).
* A pool of ``partitions`` shares is that many pools of ``capacity / partitions`` side by side
  in the one mount: share p's files are ``p<p>-r<i>-s<k>``, its regions follow share p-1's
  (``region.holding.shares`` gives each share its own directory and manifest). One share keeps the
  names of a pool without shares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from offloadpool.region.errors import RequestError, fmt_bytes
from offloadpool.region.files import vllm_compat
from offloadpool.region.files.manifest import MOUNT_NAME, Layout, Region, Segment
from offloadpool.region.memory.media import Medium, medium
from offloadpool.region.request import PoolRequest
from offloadpool.region.vocabulary import INTERLEAVED, PER_RANK


@dataclass(frozen=True)
class Plan:
    """The regions of a pool and their segment files (paths relative to the pool directory).

    With ``shares`` > 1, ``regions`` holds every share's regions, share 0's first."""

    medium: Medium
    layout: Layout
    regions: tuple[Region, ...]
    shares: int = 1

    @property
    def page_size(self) -> int:
        return self.medium.page_size

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.regions)

    @property
    def segments(self) -> list[Segment]:
        """Every segment file in logical order (region 0's files first)."""
        return [s for r in self.regions for s in r.segments]


def segment_sizes(
    region_bytes: int, page_size: int, row_bytes: int | None, max_files: int, min_segment: int
) -> list[int]:
    """Split ``region_bytes`` into file sizes by the rules in the module docstring."""
    if region_bytes <= 0 or region_bytes % page_size:
        raise RequestError(
            f"region size {fmt_bytes(region_bytes)} is not a positive multiple of the page size "
            f"{fmt_bytes(page_size)}"
        )
    if row_bytes is not None and region_bytes % row_bytes:
        raise RequestError(
            f"region size {fmt_bytes(region_bytes)} is not a whole number of {fmt_bytes(row_bytes)} rows"
        )
    granule = math.lcm(page_size, row_bytes) if row_bytes else page_size
    units = region_bytes // granule
    per_file_units = -(-min_segment // granule)  # ceil: every file >= min_segment
    k = max(1, min(max_files, units // per_file_units))
    if units == 0:  # region smaller than one granule (page * row lcm): one file
        return [region_bytes]
    base, extra = divmod(units, k)
    sizes = [(base + (1 if i < extra else 0)) * granule for i in range(k)]
    sizes[-1] += region_bytes - units * granule
    return sizes


def row_bytes_of(req: PoolRequest) -> int | None:
    """Row size implied by the request: Interleaved rows hold every rank's slot."""
    if req.slot_bytes is None:
        return None
    return req.slot_bytes * req.ranks if req.layout_type == INTERLEAVED else req.slot_bytes


def compat_segment_sizes(req: PoolRequest, page_size: int, layout_rows: int | None) -> list[int]:
    """The file sizes stock vLLM expects for ``req`` (a compat pool), or RequestError saying
    which setting would make vLLM adopt the pool."""
    if req.layout_type == PER_RANK:
        raise RequestError(
            "compat.vllm exposes one region that every rank of an unmodified vLLM maps; it "
            "cannot be combined with the PerRank layout (one region per rank)"
        )
    total, row = req.capacity, req.compat_row_bytes
    wanted = vllm_compat.file_count(total, req.compat_segments)
    if wanted > 1 and medium(req.medium).hugetlb:
        # vLLM maps file i with MAP_FIXED at its offset in an anonymous reservation aligned only
        # to 4 KiB (2 MiB at best, on kernels that align large anonymous mappings); hugetlbfs
        # refuses a mapping not aligned to its page (EINVAL, shown with vLLM's own code for
        # HugePages-1Gi in tests/test_vllm_compat.py). One file is mapped without MAP_FIXED.
        raise RequestError(
            f"stock vLLM maps a {fmt_bytes(total)} region as {wanted} files with MAP_FIXED at 4 KiB "
            f"alignment, which {req.medium} (hugetlbfs) refuses; use Memory or MemoryTHP, or a "
            f"region vLLM keeps in one file (below 2 GiB, or numSegments 1)"
        )
    if row is None:
        if wanted > 1:
            raise RequestError(
                f"stock vLLM splits a {fmt_bytes(total)} region into {wanted} files on its rows "
                f"(num_segments {req.compat_segments}); give compat.vllm.rowSize (vLLM's "
                f"kv_bytes_per_chunk) so the pool splits the same way, or numSegments 1 "
                f"(TieringOffloadingSpec)"
            )
        return [total]
    if row % vllm_compat.VLLM_PAGE or total % row:
        raise RequestError(
            f"compat.vllm.rowSize {row} must be a multiple of {vllm_compat.VLLM_PAGE} (vLLM rounds "
            f"its rows up to it) and divide the capacity {fmt_bytes(total)} (vLLM's region is "
            f"a whole number of rows: capacity {(total // row) * row} would fit)"
        )
    if layout_rows is not None and layout_rows != row:
        raise RequestError(
            f"the layout's rows ({layout_rows} bytes: ranks x slotSize) differ from "
            f"compat.vllm.rowSize ({row}); vLLM's row is the one its files are split on"
        )
    sizes = vllm_compat.segment_sizes(total, row, req.compat_segments)
    odd = [s for s in sizes if s % page_size]
    if odd:
        raise RequestError(
            f"stock vLLM splits this region into files of {fmt_bytes(sizes[0])} "
            f"({len(sizes)} files), which are not whole {fmt_bytes(page_size)} pages of "
            f"{req.medium}; use Memory (4 KiB pages) or a rowSize whose files come out as "
            f"whole pages"
        )
    return sizes


def plan(req: PoolRequest) -> Plan:
    """Validate ``req`` and lay out its regions and segment files; touches nothing."""
    req.validate()
    med = medium(req.medium)
    rows = row_bytes_of(req)
    if req.capacity % med.page_size:
        raise RequestError(
            f"capacity {fmt_bytes(req.capacity)} is not a multiple of the {fmt_bytes(med.page_size)} "
            f"page size of {med.name}"
        )
    shares = req.partitions
    if req.capacity % (shares * med.page_size):
        raise RequestError(
            f"capacity {fmt_bytes(req.capacity)} does not divide into {shares} partitions of whole "
            f"{fmt_bytes(med.page_size)} pages of {med.name}"
        )
    share = req.capacity // shares
    if req.layout_type == PER_RANK:
        if share % (req.ranks * med.page_size):
            raise RequestError(
                f"PerRank capacity {fmt_bytes(share)}{' per partition' if shares > 1 else ''} does not "
                f"divide into {req.ranks} regions of whole {fmt_bytes(med.page_size)} pages"
            )
        region_sizes = [share // req.ranks] * req.ranks
    else:
        region_sizes = [share]
    regions: list[Region] = []
    for p in range(shares):
        prefix = f"p{p}-" if shares > 1 else ""
        for rank, size in enumerate(region_sizes):
            offset, segs = 0, []
            if req.compat_engine_id is not None:
                sizes = compat_segment_sizes(req, med.page_size, rows)
            else:
                sizes = segment_sizes(size, med.page_size, rows, req.max_files, req.min_segment)
            for s, nbytes in enumerate(sizes):
                segs.append(
                    Segment(file=f"{MOUNT_NAME}/{prefix}r{rank}-s{s:03d}", offset=offset, bytes=nbytes)
                )
                offset += nbytes
            regions.append(
                Region(
                    index=len(regions),
                    bytes=size,
                    segments=tuple(segs),
                    rank=rank if req.layout_type == PER_RANK else None,
                )
            )
    layout = Layout(
        type=req.layout_type,
        ranks=req.ranks,
        row_bytes=rows,
        slot_bytes=req.slot_bytes if req.layout_type == INTERLEAVED else None,
    )
    return Plan(medium=med, layout=layout, regions=tuple(regions), shares=shares)
