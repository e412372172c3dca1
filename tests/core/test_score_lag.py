"""Lagged attention statistics (vtoken/score_lag.py) against an independent reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.policies.base import AttentionNeed, AttentionStats
from vtoken.score_lag import ScoreLagQueue, first_evicting_decode_step, remap_stats


def _reference_remap(values, from_pos, to_pos):
    by_pos = {int(p): float(v) for p, v in zip(from_pos, values)}
    return [by_pos.get(int(p), float("nan")) for p in to_pos]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_remap_matches_a_dict_reference(data):
    n_logical = data.draw(st.integers(1, 60))
    from_pos = np.array(data.draw(st.permutations(range(n_logical)))[: data.draw(st.integers(1, n_logical))])
    # the new layout: some tokens of the old one (evictions, any slot order) plus some new ones
    kept = [p for p in from_pos.tolist() if data.draw(st.booleans())]
    extra = data.draw(st.integers(0, 3))
    to_pos = np.array(data.draw(st.permutations(kept + list(range(n_logical, n_logical + extra)))), dtype=np.int64)
    col = np.array(data.draw(st.lists(st.floats(0, 1), min_size=len(from_pos), max_size=len(from_pos))))
    out = remap_stats(AttentionStats(col_sum=col, last_row=None), from_pos, to_pos, n_logical + extra)
    np.testing.assert_array_equal(out.col_sum, _reference_remap(col, from_pos, to_pos))
    assert out.last_row is None and out.num_keys == len(from_pos)


def test_identical_layout_is_not_copied():
    pos = np.array([3, 0, 2, 1])
    col = np.array([0.1, 0.2, 0.3, 0.4])
    out = remap_stats(AttentionStats(col_sum=col), pos, pos.copy(), 4)
    assert out.col_sum is col and out.num_keys == 4


def test_wrong_length_is_refused():
    with pytest.raises(ValueError, match="col_sum covers 3 slots; the step had 4"):
        remap_stats(AttentionStats(col_sum=np.zeros(3)), np.arange(4), np.arange(4), 4)
    q = ScoreLagQueue(1)
    q.expect(0, np.arange(5), sampled=True)
    with pytest.raises(ValueError, match="last_row covers 4 slots; step 0 had 5 live tokens"):
        q.deliver(0, AttentionStats(last_row=np.zeros(4)))


def test_queue_releases_in_step_order_after_the_lag():
    q = ScoreLagQueue(lag=1)
    for k in range(4):
        q.expect(k, np.arange(10 + k), sampled=k != 1)
    assert q.deliver(0, AttentionStats(col_sum=np.ones(10)))
    assert not q.deliver(7, AttentionStats(col_sum=np.ones(3)))  # not expected: a stale output
    assert q.ready(1) == []  # lag 1: step 0 is due only from step 2
    q.deliver(1, AttentionStats(col_sum=np.ones(11), last_row=np.ones(11)))
    got = q.ready(3)  # steps 0 and 1 are due; 2 is not delivered (and not due)
    assert [e.step for e in got] == [0, 1]
    assert got[1].stats.last_row is None  # step 1 sampled no token: its last row is dropped
    assert q.ready(10) == []  # step 2 is due but missing: it blocks step 3 to keep the order
    q.deliver(3, AttentionStats(col_sum=np.ones(13)))
    assert q.ready(10) == []
    q.deliver(2, AttentionStats(col_sum=np.ones(12)))
    assert [e.step for e in q.ready(10)] == [2, 3] and len(q) == 0


def test_sync_lag_releases_everything_before_the_next_decision():
    q = ScoreLagQueue(lag=0)
    q.expect(5, np.arange(3), sampled=True)
    q.deliver(5, AttentionStats(col_sum=np.ones(3)))
    assert q.ready(5) == [] and [e.step for e in q.ready(6)] == [5]


def test_first_evicting_step():
    assert first_evicting_decode_step(AttentionNeed.NONE, 1) == 1
    assert first_evicting_decode_step(AttentionNeed.COL_SUM, 0) == 1
    assert first_evicting_decode_step(AttentionNeed.LAST_ROW, 1) == 2
    with pytest.raises(ValueError, match="lag = -1"):
        first_evicting_decode_step(AttentionNeed.NONE, -1)


@pytest.mark.parametrize("policy", ["h2o", "tova", "scissorhands"])
def test_policies_leave_nan_slots_untouched(policy):
    from vtoken.config import parse_config
    from vtoken.policies.base import TokenView

    cfg = parse_config({"policy": policy, "budget": 16})
    pol = cfg.make_policy(16)
    s = pol.init_state()
    s.reset_slots(0, 4)
    view = TokenView(logical_pos=np.arange(4), num_logical=4, prompt_len=4)
    full = np.array([0.4, 0.3, 0.2, 0.1])
    pol.observe(s, 4, AttentionStats(col_sum=full, last_row=full), view)
    before = pol.score(s, view)
    lagged = np.array([0.1, np.nan, 0.6, np.nan])
    pol.observe(s, 4, AttentionStats(col_sum=lagged, last_row=lagged, num_keys=3), view)
    after = pol.score(s, view)
    assert not np.isnan(after).any()
    if policy == "h2o":
        np.testing.assert_allclose(after, before + [0.1, 0, 0.6, 0])
    elif policy == "tova":
        np.testing.assert_allclose(after, [0.1, 0.3, 0.6, 0.1])
    else:  # below uniform over the 3 keys of that step: 0.1 < 1/3 only (NaN counts 0)
        np.testing.assert_array_equal(after - before, [-1, 0, 0, 0])
