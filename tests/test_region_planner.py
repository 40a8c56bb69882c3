"""The segment planner: sizes and file counts per the rules, for random geometries."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offloadpool.region.errors import RequestError
from offloadpool.region.files import vllm_compat
from offloadpool.region.files.planner import plan, segment_sizes
from offloadpool.region.request import PoolRequest

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGES = st.sampled_from([4 * KiB, 2 * MiB, GiB])


@st.composite
def geometries(draw):
    page = draw(PAGES)
    row = draw(
        st.one_of(
            st.none(),
            st.integers(1, 64).map(lambda n: n * draw(st.sampled_from([4 * KiB, 1 * MiB, 2 * MiB, 3 * MiB]))),
        )
    )
    granule = math.lcm(page, row) if row else page
    units = draw(st.integers(1, 4096))
    region = units * granule
    max_files = draw(st.integers(1, 40))
    min_segment = draw(st.sampled_from([page, 64 * MiB, 256 * MiB, GiB, 3 * GiB]))
    return region, page, row, max_files, min_segment


@settings(max_examples=400, deadline=None)
@given(geometries())
def test_segment_sizes_follow_the_rules(geometry):
    region, page, row, max_files, min_segment = geometry
    sizes = segment_sizes(region, page, row, max_files, min_segment)
    granule = math.lcm(page, row) if row else page
    assert sum(sizes) == region
    assert 1 <= len(sizes) <= max_files
    assert all(s > 0 and s % page == 0 for s in sizes)
    # every boundary on a page and on a row
    offset = 0
    for s in sizes[:-1]:
        offset += s
        assert offset % granule == 0
    if len(sizes) > 1:
        assert all(s >= min_segment for s in sizes)
        assert max(sizes) - min(sizes) <= granule
    # k = min(max_files, floor(R / minSegment)) whenever the granule divides both
    if min_segment % granule == 0:
        assert len(sizes) == max(1, min(max_files, region // min_segment))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 2 * GiB // (2 * MiB) - 1))
def test_below_two_gib_is_one_file_with_default_minimum(pages):
    assert segment_sizes(pages * 2 * MiB, 2 * MiB, None, 32, GiB) == [pages * 2 * MiB]


@settings(max_examples=200, deadline=None)
@given(
    medium=st.sampled_from(["HugePages-2Mi", "HugePages-1Gi", "Memory", "MemoryTHP"]),
    layout=st.sampled_from(["Replicated", "PerRank", "Interleaved"]),
    ranks=st.integers(1, 8),
    per_rank_pages=st.integers(1, 200),
    max_files=st.integers(1, 32),
    min_segment=st.sampled_from([GiB, 256 * MiB, 4 * GiB]),
)
def test_plan_regions_per_layout(medium, layout, ranks, per_rank_pages, max_files, min_segment):
    page = {"HugePages-2Mi": 2 * MiB, "HugePages-1Gi": GiB, "Memory": 4 * KiB, "MemoryTHP": 2 * MiB}[medium]
    cap = ranks * per_rank_pages * page
    p = plan(
        PoolRequest(
            name="p",
            capacity=cap,
            medium=medium,
            layout_type=layout,
            ranks=ranks,
            max_files=max_files,
            min_segment=min_segment,
        )
    )
    assert p.total_bytes == cap and p.page_size == page
    if layout == "PerRank":
        assert [r.rank for r in p.regions] == list(range(ranks))
        assert all(r.bytes == cap // ranks for r in p.regions)
    else:
        assert len(p.regions) == 1 and p.regions[0].bytes == cap
    names = [s.file for s in p.segments]
    assert len(names) == len(set(names))
    for r in p.regions:
        assert len(r.segments) <= max_files
        assert sum(s.bytes for s in r.segments) == r.bytes


def test_interleaved_rows_never_straddle_files():
    slot = 3 * MiB  # row 6 MiB with 2 ranks: lcm with the 2 MiB page is 6 MiB
    p = plan(
        PoolRequest(
            name="p",
            capacity=1536 * 6 * MiB,
            medium="HugePages-2Mi",
            layout_type="Interleaved",
            ranks=2,
            slot_bytes=slot,
            min_segment=GiB,
        )
    )
    assert p.layout.row_bytes == 6 * MiB and p.layout.slot_bytes == slot
    # 9 GiB would be 9 files of 1 GiB, but 1 GiB is not a whole number of 6 MiB rows: files
    # keep whole rows and at least the minimum, so there are 8
    assert len(p.segments) == 8
    for s in p.segments:
        assert s.offset % (6 * MiB) == 0 and s.bytes >= GiB


def test_compat_splits_as_stock_vllm_does_and_refuses_per_rank():
    # Below 2 GiB (or numSegments 1) vLLM uses one file, whatever its rows.
    assert (
        len(
            plan(
                PoolRequest(name="p", capacity=2 * GiB - 2 * MiB, medium="MemoryTHP", compat_engine_id="e1")
            ).segments
        )
        == 1
    )
    assert (
        len(
            plan(
                PoolRequest(
                    name="p", capacity=8 * GiB, medium="MemoryTHP", compat_engine_id="e1", compat_segments=1
                )
            ).segments
        )
        == 1
    )
    # From 2 GiB on, CPUOffloadingSpec's 32 segments make k = total // 1 GiB files on whole rows.
    with pytest.raises(RequestError, match="rowSize"):
        plan(PoolRequest(name="p", capacity=8 * GiB, medium="MemoryTHP", compat_engine_id="e1"))
    row = 3 * 256 * KiB  # 3 ranks' slots: 8 GiB is 10922.67 rows, so take a whole number of them
    cap = (8 * GiB // row) * row
    p = plan(
        PoolRequest(name="p", capacity=cap, medium="Memory", compat_engine_id="e1", compat_row_bytes=row)
    )
    assert len(p.segments) == 7  # k = 7 (7.99 GiB): 1561 rows per file, the last holds 1556
    assert [s.bytes for s in p.segments] == vllm_compat.segment_sizes(p.total_bytes, row, 32)
    assert all(s.bytes % row == 0 for s in p.segments)
    with pytest.raises(RequestError, match="PerRank"):
        plan(PoolRequest(name="p", capacity=8 * GiB, layout_type="PerRank", ranks=2, compat_engine_id="e1"))
    with pytest.raises(RequestError, match="MAP_FIXED"):  # vLLM cannot map several hugetlbfs files
        plan(
            PoolRequest(
                name="p",
                capacity=2 * GiB,
                medium="HugePages-2Mi",
                compat_engine_id="e1",
                compat_row_bytes=512 * KiB,
            )
        )
    assert (
        len(
            plan(
                PoolRequest(name="p", capacity=64 * MiB, medium="HugePages-2Mi", compat_engine_id="e1")
            ).segments
        )
        == 1
    )  # one file: fine


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(capacity=3 * MiB, medium="HugePages-2Mi"),
            r"3.00 MiB .* not a multiple of the 2.00 MiB .* page size",
        ),
        (dict(capacity=GiB + 2 * MiB, medium="HugePages-1Gi"), "not a multiple"),
        (
            dict(capacity=6 * MiB, medium="HugePages-2Mi", layout_type="PerRank", ranks=2),
            "does not divide into 2",
        ),
        (
            dict(capacity=10 * MiB, medium="Memory", layout_type="Interleaved", ranks=2, slot_bytes=3 * MiB),
            "rows",
        ),
        (dict(capacity=GiB, medium="Floppy"), "medium 'Floppy' is unknown"),
        (dict(capacity=GiB, layout_type="Striped"), "layout.type"),
        (dict(capacity=0), "capacity must be a positive integer"),
        (dict(capacity=GiB, ranks=0), "ranks must be a positive integer"),
        (dict(capacity=GiB, max_files=0), "max_files"),
        (dict(capacity=GiB, numa="moon"), "numa policy"),
        (dict(capacity=GiB, mode=0o17777), "mode"),
        (dict(capacity=GiB, compat_engine_id="../x"), "compat engine id"),
    ],
)
def test_bad_requests_name_the_problem(kwargs, match):
    with pytest.raises(RequestError, match=match):
        plan(PoolRequest(name="p", **kwargs))


def test_bad_name():
    with pytest.raises(RequestError, match="DNS-1123"):
        plan(PoolRequest(name="../etc", capacity=GiB))
