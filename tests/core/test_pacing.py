"""Pressure pacing's plan (vtoken/pacing.py) against a brute-force reference."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.pacing import Candidate, plan_pressure_evictions, tokens_to_free_blocks


def _cdiv(a, b):
    return -(-a // b)


def test_most_reclaimable_first_then_running_order():
    B = 32
    cands = [Candidate("a", 0, live=100, held=4, budget=40),   # reclaimable 4 - 2 = 2
             Candidate("b", 1, live=200, held=7, budget=40),   # 5
             Candidate("c", 2, live=200, held=7, budget=40)]   # 5, later in the queue than b
    plan, freed = plan_pressure_evictions(cands, 6, B)
    assert freed == 6
    # b gives 5 blocks (down to 2 blocks: 63 live at most, floor 40 -> 200 - 63 = 137), c gives 1 (6 blocks: 191)
    assert plan == {"b": 137, "c": 9}
    assert plan_pressure_evictions(cands, 0, B) == ({}, 0)
    assert plan_pressure_evictions(cands, 100, B)[1] == 12  # never below the budgets


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 400), st.integers(0, 3), st.integers(1, 200)), min_size=1, max_size=6),
       st.integers(-2, 30), st.sampled_from([16, 32]))
def test_plan_frees_what_it_says_and_respects_budgets(specs, shortfall, B):
    cands = []
    for i, (live, extra, budget) in enumerate(specs):
        held = _cdiv(live + 1, B) + extra  # holds at least the blocks its live tokens + 1 need
        cands.append(Candidate(f"r{i}", i, live, held, budget))
    plan, freed = plan_pressure_evictions(cands, shortfall, B)
    total_reclaimable = sum(c.reclaimable(B) for c in cands)
    assert freed == max(0, min(shortfall, total_reclaimable)) or (shortfall > 0 and freed <= shortfall)
    by_id = {c.req_id: c for c in cands}
    really_freed = 0
    for rid, k in plan.items():
        c = by_id[rid]
        assert 0 < k <= c.live - min(c.live, c.budget)  # never below the budget
        keep = _cdiv(c.live - k + 1, B)  # blocks kept after evicting k (room for one new token)
        really_freed += c.held - keep
    assert really_freed >= freed  # the tokens asked free at least the blocks counted


def test_tokens_to_free_blocks_examples():
    assert tokens_to_free_blocks(live=95, held=3, blocks=0, budget=10, block_size=32) == 0
    assert tokens_to_free_blocks(live=96, held=4, blocks=1, budget=10, block_size=32) == 1
    assert tokens_to_free_blocks(live=50, held=2, blocks=1, budget=45, block_size=32) == 5  # floor
