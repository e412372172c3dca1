"""``benchmarks/bench_sla.py``'s rate search: the binary search (``--search bisect``) finds the same
SLA rate as the full sweep on every monotone attainment curve, with the knee's two neighbouring
grid rates measured, in at most ``ceil(log2(n + 1))`` loads. Pure functions: no server."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_sla import bisect_rates, sla_rate  # noqa: E402

THR = 0.9


def _sweep_reference(grid: list[float], att: dict[float, float]) -> float | None:
    """The definition, written out: the highest rate that passes with every lower rate passing."""
    best = None
    for r in sorted(grid):
        if att[r] < THR:
            return best
        best = r
    return best


@given(st.lists(st.integers(1, 400), min_size=1, max_size=12, unique=True), st.data())
def test_bisect_finds_the_sweeps_sla_rate(xs, data):
    grid = sorted(x / 100 for x in xs)
    knee = data.draw(st.integers(0, len(grid)))          # the first missing grid index
    att = {r: (0.95 if i < knee else 0.5) for i, r in enumerate(grid)}
    calls: list[float] = []

    def passes(r):
        calls.append(r)
        return att[r] >= THR

    measured = bisect_rates(list(reversed(grid)), passes)   # the grid's order on the command line is free
    assert measured == calls
    assert len(measured) == len(set(measured)) <= math.ceil(math.log2(len(grid) + 1))
    expected = grid[knee - 1] if knee else None
    assert _sweep_reference(grid, att) == expected
    assert sla_rate(measured, [att[r] for r in measured], THR) == expected
    if knee > 0:
        assert grid[knee - 1] in measured                 # the highest passing rate
    if knee < len(grid):
        assert grid[knee] in measured                     # the lowest missing rate


def test_sla_rate_stops_at_the_first_miss_and_treats_no_completions_as_a_miss():
    assert sla_rate([0.5, 1.0, 2.0, 3.0], [0.95, 0.8, 0.95, 0.95], THR) == 0.5
    assert sla_rate([3.0, 0.5, 1.0], [0.0, 0.91, 0.9], THR) == 1.0
    assert sla_rate([0.5, 1.0], [None, 1.0], THR) is None
    assert sla_rate([], [], THR) is None


def test_bisect_on_the_issue_26_grid_measures_three_rates():
    grid = [0.25, 0.375, 0.5, 0.75, 1, 1.25, 1.5]
    assert bisect_rates(grid, lambda r: r <= 0.5) == [0.75, 0.375, 0.5]
    assert bisect_rates(grid, lambda r: False) == [0.75, 0.375, 0.25]
    assert bisect_rates(grid, lambda r: True) == [0.75, 1.25, 1.5]
