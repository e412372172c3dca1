"""``select_one`` / ``plan_one`` (rows that evict at most one token: a decode step) give the same
victims and moves, in the same order, as ``select_victims`` + ``plan_moves``: random rows with
ties, protections of every kind (ints and per-row tensors), rows with nothing to evict (k = 0 or
every token protected), padding; and they refuse NaN scores (the general pair decides then)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vtoken.select import plan_moves, plan_one, select_one, select_victims


def _case(rng: np.random.Generator, r: int, n: int, per_row: bool):
    live = torch.from_numpy(np.where(rng.random(r) < 0.4, n, rng.integers(0, n + 1, r)))
    logical = live + torch.from_numpy(rng.integers(0, 40, r))
    pos = torch.full((r, n), -7, dtype=torch.int64)  # padding holds junk
    for i in range(r):
        m = int(live[i])
        # the recent window's positions are live (as the protocol keeps them), the rest a random subset
        lg = int(logical[i])
        pos[i, :m] = torch.from_numpy(rng.permutation(np.concatenate([
            rng.choice(max(lg - 8, 0), size=max(m - min(m, 8), 0), replace=False) if m > 8 else np.zeros(0, int),
            np.arange(lg - min(m, 8), lg)])).astype(np.int64))
    scores = torch.from_numpy(np.round(rng.random((r, n)) * 4) / 4)  # many ties
    k = torch.from_numpy(rng.integers(0, 2, r))
    if per_row:
        prot = dict(sink_tokens=torch.from_numpy(rng.integers(0, 4, r)),
                    recent_tokens=torch.from_numpy(rng.integers(0, 9, r)),
                    protected_prefix=torch.from_numpy(rng.integers(0, 6, r)))
    else:
        prot = dict(sink_tokens=int(rng.integers(0, 3)), recent_tokens=int(rng.integers(0, 9)),
                    protected_prefix=0)
    return scores, pos, live, k, logical, prot


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_select_one_equals_select_victims_and_plan_moves(seed, per_row):
    rng = np.random.default_rng(seed)
    for r, n in ((1, 1), (5, 7), (16, 40), (33, 96)):
        scores, pos, live, k, logical, prot = _case(rng, r, n, per_row)
        for nl in (None, logical):
            victims = select_victims(scores, pos, live, k, num_logical=nl, **prot)
            plan = plan_moves(victims, live)
            ev_rows, ev_cols = victims.nonzero(as_tuple=True)
            one = select_one(scores, pos, live, k, num_logical=nl, **prot)
            assert one is not None
            for a, b in zip(one.plan, plan):
                assert torch.equal(a, b), (seed, r, n)
            assert torch.equal(one.ev_rows, ev_rows) and torch.equal(one.ev_cols, ev_cols)
            assert torch.equal(one.has, victims.any(dim=1))


def test_select_one_refuses_nan_scores():
    scores = torch.tensor([[0.5, float("nan"), 0.25]])
    assert select_one(scores, torch.tensor([[0, 1, 2]]), torch.tensor([3]), torch.tensor([1])) is None


def test_plan_one_with_the_last_slot_as_victim_moves_nothing():
    one = plan_one(torch.tensor([True, True, False]), torch.tensor([4, 1, 0]), torch.tensor([5, 5, 5]))
    assert one.plan.rows.tolist() == [1] and one.plan.src.tolist() == [4] and one.plan.dst.tolist() == [1]
    assert one.plan.new_live.tolist() == [4, 4, 5]
    assert one.ev_rows.tolist() == [0, 1] and one.ev_cols.tolist() == [4, 1]


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_all_live_rows_skip_the_padding_mask_with_the_same_answer(seed, per_row):
    """``all_live`` (every row has N live slots, the decider knows): same as without it."""
    rng = np.random.default_rng(100 + seed)
    for r, n in ((3, 9), (16, 40)):
        scores, pos, live, k, logical, prot = _case(rng, r, n, per_row)
        keep = live == n
        if not keep.any():
            continue
        scores, pos, live, k, logical = scores[keep], pos[keep], live[keep], k[keep], logical[keep]
        prot = {a: (v[keep] if isinstance(v, torch.Tensor) else v) for a, v in prot.items()}
        for nl in (None, logical):
            want = select_one(scores, pos, live, k, num_logical=nl, **prot)
            got = select_one(scores, pos, live, k, num_logical=nl, all_live=True, **prot)
            for a, b in zip(got.plan, want.plan):
                assert torch.equal(a, b)
            assert torch.equal(got.ev_rows, want.ev_rows) and torch.equal(got.ev_cols, want.ev_cols)
