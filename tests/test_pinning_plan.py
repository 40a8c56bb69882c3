"""Property tests of the registration plan over random geometries.

Sizes are small abstract byte counts (pages of 1..256 bytes) so thousands of geometries run in
seconds; the arithmetic is the same at GiB scale. Independent oracles: the union of the
page-rounded slots (computed here by plain interval union) and the fallback chunking.
"""

from __future__ import annotations

import bisect
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offloadpool.pinning import plan_pin_ranges
from offloadpool.pinning.plan import row_chunks, split_at


@st.composite
def geometries(draw: st.DrawFn, chunk_floor: bool = True) -> dict[str, int]:
    """Random geometries, biased towards the edges where the rules switch.

    Each biased choice draws its branch index first (rather than ``one_of``), so the shape of
    the draw never depends on whether two branches happen to coincide.
    """
    page = 1 << draw(st.integers(0, 8))
    if draw(st.booleans()):
        row = draw(st.integers(1, 2048))
    else:
        row = page * draw(st.integers(1, 16))
    rows = draw(st.integers(1, 200))
    edges = [v for v in (row - page - 1, row - page, row - page + 1, page, row) if 1 <= v <= row]
    if draw(st.booleans()):
        slot = draw(st.integers(1, row))
    else:
        slot = edges[draw(st.integers(0, len(edges) - 1))]
    offset = [draw(st.integers(0, row - slot)), 0, row - slot][draw(st.integers(0, 2))]
    unit = math.lcm(row, page)
    rounded = -(-(slot + 2 * page) // page) * page  # a little above one rounded slot
    low = unit if chunk_floor else 1
    bounds = [
        (low, max(low, rows * row + 4 * page)),
        (low, 4 * max(low, unit)),
        (max(low, rounded - 2 * page), max(low, 3 * rounded)),
    ]
    lo, hi = bounds[draw(st.integers(0, 2))]
    max_chunk = draw(st.integers(lo, hi))
    if draw(st.booleans()):
        max_ranges = draw(st.integers(1, rows + 2))
    else:
        max_ranges = draw(st.integers(max(1, rows - 3), rows + 1))
    return dict(
        total_bytes=rows * row,
        row_bytes=row,
        slot_offset=offset,
        slot_bytes=slot,
        page_size=page,
        max_chunk=max_chunk,
        max_ranges=max_ranges,
    )


def model(g: dict[str, int]) -> list[tuple[int, int]] | str:
    """Reference: the issue's rules written plainly ("error" when no plan is possible)."""
    total, row, page, cap = g["total_bytes"], g["row_bytes"], g["page_size"], g["max_chunk"]
    if g["slot_bytes"] <= row - page:
        ranges: list[tuple[int, int]] = []
        ok = True
        for s, e in rounded_slots(g):
            if e - s > cap:
                ok = False
                break
            if ranges and ranges[-1][0] + ranges[-1][1] == s and e - ranges[-1][0] <= cap:
                ranges[-1] = (ranges[-1][0], e - ranges[-1][0])
            else:
                ranges.append((s, e - s))
        if ok and len(ranges) <= g["max_ranges"]:
            return ranges
    unit = math.lcm(row, page)
    if unit > cap:
        return "error"
    step = cap // unit * unit
    return [(o, min(step, total - o)) for o in range(0, total, step)]


def union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union of [start, end) intervals, touching ones merged."""
    out: list[list[int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def rounded_slots(g: dict[str, int]) -> list[tuple[int, int]]:
    p = g["page_size"]
    out = []
    for r in range(0, g["total_bytes"], g["row_bytes"]):
        s = r + g["slot_offset"]
        e = s + g["slot_bytes"]
        out.append((s // p * p, min(-(-e // p) * p, g["total_bytes"])))
    return out


def covered(ranges_union: list[tuple[int, int]], start: int, end: int) -> bool:
    starts = [s for s, _ in ranges_union]
    i = bisect.bisect_right(starts, start) - 1
    return i >= 0 and ranges_union[i][0] <= start and end <= ranges_union[i][1]


def check_invariants(g: dict[str, int], plan: list[tuple[int, int]]) -> str:
    """Assert what every plan must satisfy; return "selective" or "chunks"."""
    total, row, page = g["total_bytes"], g["row_bytes"], g["page_size"]
    assert plan, "empty plan"
    prev_end = 0
    for off, length in plan:
        assert length > 0
        assert off >= prev_end, f"overlap or unsorted at {off} (previous end {prev_end})"
        assert length <= g["max_chunk"], f"range {off}+{length} exceeds max_chunk {g['max_chunk']}"
        prev_end = off + length
    assert prev_end <= total
    u = union([(o, o + n) for o, n in plan])
    for r in range(0, total, row):
        s = r + g["slot_offset"]
        assert covered(u, s, s + g["slot_bytes"]), f"slot at {s} not covered"
    try:
        fallback: list[tuple[int, int]] | None = row_chunks(total, row, page, g["max_chunk"])
    except ValueError:
        fallback = None  # no chunk plan exists for this cap; the plan must be selective
    if plan == fallback:
        unit = math.lcm(row, page)
        assert all(off % unit == 0 for off, _ in plan), "chunk seam off the row/page grid"
        assert u == [(0, total)]
        return "chunks"
    check_selective(g, plan)
    return "selective"


def check_selective(g: dict[str, int], plan: list[tuple[int, int]]) -> None:
    """Slot-selective: only when the slot is a page smaller than the row; page-aligned; exactly
    the rounded slots (no more, no less); at most max_ranges ranges."""
    page, total = g["page_size"], g["total_bytes"]
    assert g["slot_bytes"] <= g["row_bytes"] - page, "selective plan for a slot not a page smaller"
    assert len(plan) <= g["max_ranges"]
    for off, length in plan:
        assert off % page == 0, f"range start {off} not page-aligned"
        assert (off + length) % page == 0 or off + length == total
    assert union([(o, o + n) for o, n in plan]) == union(rounded_slots(g))


@settings(max_examples=1500, deadline=None)
@given(geometries())
def test_plan_invariants(g: dict[str, int]) -> None:
    check_invariants(g, plan_pin_ranges(**g))


@settings(max_examples=1500, deadline=None)
@given(geometries(chunk_floor=False))
def test_matches_the_rules(g: dict[str, int]) -> None:
    """Against a plain model of the rules, including when no plan is possible."""
    expected = model(g)
    if expected == "error":
        with pytest.raises(ValueError, match="exceeds max_chunk"):
            plan_pin_ranges(**g)
        return
    plan = plan_pin_ranges(**g)
    assert plan == expected
    check_invariants(g, plan)


@settings(max_examples=800, deadline=None)
@given(geometries())
def test_fallback_rule(g: dict[str, int]) -> None:
    """With no chunk cap in the way, selective iff slot <= row - page and <= max_ranges ranges."""
    g = {**g, "max_chunk": max(g["total_bytes"], math.lcm(g["row_bytes"], g["page_size"]))}
    plan = plan_pin_ranges(**g)
    check_invariants(g, plan)
    eligible = g["slot_bytes"] <= g["row_bytes"] - g["page_size"]
    needed = len(union(rounded_slots(g)))
    if eligible and needed <= g["max_ranges"]:
        check_selective(g, plan)
    else:
        assert plan == row_chunks(g["total_bytes"], g["row_bytes"], g["page_size"], g["max_chunk"])


@settings(max_examples=500, deadline=None)
@given(geometries())
def test_whole_region_is_row_aligned_chunks(g: dict[str, int]) -> None:
    g = {**g, "slot_offset": 0, "slot_bytes": g["row_bytes"]}
    plan = plan_pin_ranges(**g)
    assert plan == row_chunks(g["total_bytes"], g["row_bytes"], g["page_size"], g["max_chunk"])
    assert check_invariants(g, plan) == "chunks"
    assert sum(n for _, n in plan) == g["total_bytes"]


@settings(max_examples=500, deadline=None)
@given(geometries(), st.lists(st.integers(1, 400_000), max_size=8))
def test_split_at_segments(g: dict[str, int], cuts: list[int]) -> None:
    plan = plan_pin_ranges(**g)
    cuts = sorted({c for c in cuts if c < g["total_bytes"]})
    pieces = split_at(plan, cuts)
    assert union([(o, o + n) for o, n in pieces]) == union([(o, o + n) for o, n in plan])
    for off, length in pieces:
        assert length > 0
        assert not any(off < c < off + length for c in cuts), "a piece spans a segment start"


def test_vllm_tp4_geometry_registers_a_quarter() -> None:
    """The motivating case: TP4, 256 GiB interleaved, each rank pins only its own slots."""
    gib = 1 << 30
    slot = 1 << 20
    plan = plan_pin_ranges(256 * gib, 4 * slot, 2 * slot, slot, 4096)
    assert len(plan) == 65536
    assert sum(n for _, n in plan) == 64 * gib
    assert plan[0] == (2 * slot, slot)
    # One more row than max_ranges allows: whole-region chunks of at most 64 GiB instead.
    plan = plan_pin_ranges(256 * gib, 4 * slot, 2 * slot, slot, 4096, max_ranges=65535)
    assert plan == [(i * 64 * gib, 64 * gib) for i in range(4)]


def test_chunks_never_exceed_max_chunk_on_row_seams() -> None:
    gib = 1 << 30
    row = 3 << 20  # rows of 3 MiB, 2 MiB pages: seams every lcm = 6 MiB
    plan = plan_pin_ranges(600 * row, row, 0, row, 2 << 20, max_chunk=gib)
    assert all(n <= gib for _, n in plan)
    assert all(off % (6 << 20) == 0 for off, _ in plan)
    assert sum(n for _, n in plan) == 600 * row


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(total_bytes=0), "total_bytes"),
        (dict(row_bytes=-1), "row_bytes"),
        (dict(total_bytes=4096 * 3 + 1), "whole number"),
        (dict(slot_offset=4096 * 3, slot_bytes=4096 * 2), "does not fit"),
        (dict(slot_offset=-1), "does not fit"),
        (dict(page_size=3000), "power of two"),
        (dict(max_chunk=0), "max_chunk"),
        (dict(max_ranges=0), "max_ranges"),
        (dict(max_chunk=4096 * 2), "exceeds max_chunk"),  # a 16 KiB row cannot fit 8 KiB calls
    ],
)
def test_bad_input_is_refused(kwargs: dict[str, int], message: str) -> None:
    args = dict(
        total_bytes=4096 * 4 * 8, row_bytes=4096 * 4, slot_offset=0, slot_bytes=4096 * 4, page_size=4096
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        plan_pin_ranges(**args)


def test_non_integers_are_refused() -> None:
    with pytest.raises(TypeError):
        plan_pin_ranges(1.5, 1, 0, 1, 1)  # type: ignore[arg-type]  # the wrong type is the test
    with pytest.raises(TypeError):
        plan_pin_ranges(8, 4, True, 1, 1)  # type: ignore[arg-type]  # the wrong type is the test
