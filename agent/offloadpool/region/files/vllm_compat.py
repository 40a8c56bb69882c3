"""Stock vLLM's file layout for its CPU KV region, so a compat pool can be adopted as it is.

vLLM 0.33.0's ``SharedOffloadRegion`` (``vllm/v1/kv_offload/cpu/shared_offload_region.py``)
names its region ``/dev/shm/vllm_offload_<engine_id>.mmap`` and, for a region of ``total``
bytes in rows of ``row`` bytes, splits it into files

    k = min(num_segments, total // 1 GiB)          (num_segments: 32 for CPUOffloadingSpec,
    rows_per_file = max(1, cdiv(total / row, max(1, k)))   1 for TieringOffloadingSpec)

``<path>``, ``<path>.1`` … on whole rows, the last file holding what is left (so there may be
fewer than k files). A worker that finds file 0 already there joins: it waits until file 0 is
at least segment 0's length and maps every file by name at its offset, without checking the
other sizes. So a pool that vLLM adopts must have exactly these files, with exactly these
sizes: one more or one less, or a boundary moved, and vLLM fails (FileNotFoundError, a
30 s TimeoutError, or a fault on a short file) or maps the wrong bytes.

This module restates that arithmetic for the node engine, which must produce the layout before
vLLM runs; tests/test_vllm_compat.py checks it by having vLLM's own class adopt the files.
"""

from __future__ import annotations

#: vLLM's ``_MIN_SEGMENT_BYTES``: smaller segments are not worth a file.
VLLM_MIN_SEGMENT = 1 << 30
#: ``CPUOffloadingSpec``'s ``_REGION_SEGMENTS`` (``TieringOffloadingSpec`` passes 1).
CPU_OFFLOADING_SEGMENTS = 32
#: vLLM maps segments at 4 KiB (``mmap.PAGESIZE``) alignment and asserts rows are multiples of it.
VLLM_PAGE = 4096


def region_file(engine_id: str) -> str:
    """``vllm_offload_<engine_id>.mmap``: the file vLLM looks for (and creates if absent)."""
    return f"vllm_offload_{engine_id}.mmap"


def file_names(engine_id: str, count: int) -> list[str]:
    """vLLM's names of a region in ``count`` files: ``<file>``, ``<file>.1`` … ``<file>.{count-1}``."""
    first = region_file(engine_id)
    return [first] + [f"{first}.{i}" for i in range(1, count)]


def file_count(total_bytes: int, num_segments: int) -> int:
    """How many files vLLM wants before rows are known: ``max(1, min(num_segments, total // 1 GiB))``.

    1 means a single file whatever the row size (below 2 GiB, or ``num_segments`` 1)."""
    return max(1, min(num_segments, total_bytes // VLLM_MIN_SEGMENT))


def segment_sizes(total_bytes: int, row_bytes: int, num_segments: int) -> list[int]:
    """The byte length of each of vLLM's files for a region of ``total_bytes`` in rows of
    ``row_bytes`` (``total_bytes`` a whole number of rows), in file order."""
    if row_bytes <= 0 or total_bytes <= 0 or total_bytes % row_bytes:
        raise ValueError(f"a region of {total_bytes} bytes is not a whole number of {row_bytes}-byte rows")
    num_chunks = total_bytes // row_bytes
    k = min(num_segments, total_bytes // VLLM_MIN_SEGMENT)
    rows = max(1, -(-num_chunks // max(1, k)))
    return [min(rows, num_chunks - row) * row_bytes for row in range(0, num_chunks, rows)]
