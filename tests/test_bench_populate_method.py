"""How `bench populate` measures: the order of its cases, and its paired runs."""

from __future__ import annotations

import contextlib
import math

import pytest

from offloadpool.bench.populate import paired_times, round_orders


@pytest.mark.parametrize("n", [2, 3, 4, 9, 13, 16])
def test_every_round_runs_every_case_once(n: int) -> None:
    for order in round_orders(n, 7):
        assert sorted(order) == list(range(n))


@pytest.mark.parametrize("n", [3, 5, 9, 13, 16])
def test_a_case_follows_a_different_case_in_every_round(n: int) -> None:
    """Rotating one order (the bench before) gives every case the same predecessor in every
    round; this is the property that rotation lacked."""
    strides = sum(1 for s in range(1, n) if math.gcd(s, n) == 1)
    orders = round_orders(n, strides)
    for case in range(n):
        before = [order[order.index(case) - 1] for order in orders if order.index(case) > 0]
        assert len(before) == len(set(before)), (case, before)
    assert len({tuple(o) for o in orders}) == strides


def test_one_case_alone_still_runs_every_round() -> None:
    assert round_orders(1, 3) == [[0], [0], [0]]


def test_pairs_alternate_who_runs_first_and_each_run_is_warmed() -> None:
    """Each pair gives (kernel seconds, offloadpool seconds) of the timed runs; whoever ran first
    in one pair runs second in the next, and every timed run comes right after its own warm run."""
    calls: list[str] = []
    seconds = {"kernel": iter([2.0, 2.0, 3.0, 3.0]), "ours": iter([4.0, 4.0, 1.0, 1.0])}

    def case(name: str) -> float:
        calls.append(name)
        return next(seconds[name])

    times = paired_times(lambda: case("kernel"), lambda: case("ours"), contextlib.nullcontext, 2)
    assert times == [(2.0, 4.0), (3.0, 1.0)]
    assert calls == ["kernel", "kernel", "ours", "ours", "ours", "ours", "kernel", "kernel"]
