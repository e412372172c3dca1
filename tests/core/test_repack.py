"""Tests for vtoken.repack: plan_repack, RepackPlan and NaiveEvictCounter."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference.repack import NaiveEvictCounter, RepackPlan, cdiv, plan_repack

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def apply_plan(slot_array: np.ndarray, plan: RepackPlan) -> np.ndarray:
    """Gather-then-scatter on a copy, truncated to the new live count."""
    out = slot_array.copy()
    gathered = out[plan.src]
    out[plan.dst] = gathered
    return out[: plan.new_num_live]


# ----------------------------------------------------------------- hand cases
def test_issue_example_b4_n10_evict_1_2_7():
    plan = plan_repack(np.array([7, 1, 2]), num_live=10, block_size=4)
    assert plan.old_num_live == 10 and plan.new_num_live == 7
    assert plan.src.tolist() == [8, 9]
    assert plan.dst.tolist() == [1, 2]
    assert plan.num_moves == plan.tokens_moved == 2
    assert plan.num_evicted == 3
    assert plan.num_blocks_before == 3 and plan.num_blocks_after == 2
    assert plan.freed_block_indices.tolist() == [2]
    assert plan.num_freed_blocks == 1
    assert plan.bytes_moved(1000) == 2000
    slots = np.arange(10)
    assert apply_plan(slots, plan).tolist() == [0, 8, 9, 3, 4, 5, 6]


def test_evicting_only_the_tail_moves_nothing():
    plan = plan_repack([9, 8, 7], 10, 4)
    assert plan.num_moves == 0 and plan.new_num_live == 7
    assert plan.freed_block_indices.tolist() == [2]


def test_holes_pair_ascending_with_live_tail_ascending():
    # B=2, 12 live; evict 0, 3, 5, 10 -> new n = 8; holes below 8: 0, 3, 5;
    # tail [8, 12) = 8, 9, 10(x), 11 -> sources 8, 9, 11.
    plan = plan_repack([10, 5, 3, 0], 12, 2)
    assert plan.dst.tolist() == [0, 3, 5]
    assert plan.src.tolist() == [8, 9, 11]
    assert plan.freed_block_indices.tolist() == [4, 5]
    assert apply_plan(np.arange(12), plan).tolist() == [8, 1, 2, 9, 4, 11, 6, 7]


def test_partial_block_does_not_free_until_empty():
    # B=4, 9 live (3 blocks, last one partial). Evict 1 -> 8 live: block 2 freed.
    plan = plan_repack([1], 9, 4)
    assert plan.src.tolist() == [8] and plan.dst.tolist() == [1]
    assert plan.freed_block_indices.tolist() == [2]
    # Evict 1 of 8 -> 7 live, still 2 blocks.
    plan = plan_repack([0], 8, 4)
    assert plan.freed_block_indices.tolist() == []
    assert plan.src.tolist() == [7] and plan.dst.tolist() == [0]


def test_evict_everything():
    plan = plan_repack(np.arange(5)[::-1], 5, 4)
    assert plan.new_num_live == 0 and plan.num_moves == 0
    assert plan.freed_block_indices.tolist() == [0, 1]


def test_empty_eviction_and_make_empty():
    for plan in (plan_repack(np.array([], dtype=np.int64), 6, 4), plan_repack([], 6, 4),
                 RepackPlan.make_empty(6, 4)):
        assert plan.old_num_live == plan.new_num_live == 6
        assert plan.num_moves == 0 and plan.freed_block_indices.size == 0
        assert plan.src.dtype == np.int64 and plan.dst.dtype == np.int64
    assert plan_repack([], 0, 1).new_num_live == 0


def test_plan_arrays_are_int64_and_read_only():
    plan = plan_repack(np.array([0, 1], dtype=np.int32), 8, 4)
    assert plan.src.dtype == np.int64 and plan.dst.dtype == np.int64
    with pytest.raises(ValueError):
        plan.src[0] = 0
    with pytest.raises(ValueError):
        plan.dst[0] = 0


def test_plan_cost_does_not_depend_on_num_live():
    # A context of 10**12 slots: only the k evicted slots and the k-slot tail are touched.
    n = 10**12
    plan = plan_repack([3, n - 2], n, 16)
    assert plan.dst.tolist() == [3] and plan.src.tolist() == [n - 1]
    assert plan.new_num_live == n - 2


def test_cdiv():
    assert [cdiv(a, 4) for a in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


# ----------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "slots, num_live, msg",
    [
        ([1, 3, 1], 10, "slot 1 is given more than once"),
        ([10], 10, "slot 10 is out of range"),
        ([-1, 2], 10, "slot -1 is out of range"),
        ([0], 0, "slot 0 is out of range"),
    ],
)
def test_plan_rejects_bad_slots(slots, num_live, msg):
    with pytest.raises(ValueError, match=msg):
        plan_repack(np.array(slots), num_live, 4)


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="block_size"):
        plan_repack([0], 4, 0)
    with pytest.raises(TypeError, match="block_size"):
        plan_repack([0], 4, 2.0)
    with pytest.raises(ValueError, match="num_live"):
        plan_repack([], -1, 4)
    with pytest.raises(TypeError, match="integer dtype"):
        plan_repack(np.array([1.0]), 4, 4)
    with pytest.raises(ValueError, match="one-dimensional"):
        plan_repack(np.array([[1]]), 4, 4)
    with pytest.raises(ValueError, match="bytes_per_token"):
        plan_repack([1], 4, 4).bytes_moved(-1)


# ----------------------------------------------------------------- properties
@st.composite
def evictions(draw):
    block_size = draw(st.integers(1, 64))
    num_live = draw(st.integers(0, 300))
    evicted = draw(st.lists(st.integers(0, max(num_live - 1, 0)), unique=True, max_size=num_live))
    if num_live == 0:
        evicted = []
    return block_size, num_live, evicted


@SETTINGS
@given(evictions())
def test_plan_properties(case):
    block_size, num_live, evicted = case
    plan = plan_repack(np.array(evicted, dtype=np.int64), num_live, block_size)
    new_n = num_live - len(evicted)
    assert plan.new_num_live == new_n and plan.old_num_live == num_live
    holes = sorted(s for s in evicted if s < new_n)
    # Minimal: exactly one move per hole below the new length.
    assert plan.dst.tolist() == holes
    assert plan.src.tolist() == sorted(set(range(new_n, num_live)) - set(evicted))
    assert np.all(plan.dst < plan.src)
    assert np.all(plan.dst < new_n) and np.all(plan.src >= new_n)
    # No slot used twice; src and dst disjoint.
    both = np.concatenate([plan.src, plan.dst])
    assert np.unique(both).size == both.size
    # The result is dense and holds exactly the survivors.
    after = apply_plan(np.arange(num_live), plan)
    assert sorted(after.tolist()) == sorted(set(range(num_live)) - set(evicted))
    assert plan.freed_block_indices.tolist() == list(
        range(cdiv(new_n, block_size), cdiv(num_live, block_size))
    )
    assert plan.bytes_moved(7) == 7 * len(holes)


# ---------------------------------------------------------------- Naive-Evict
def brute_force_retained(num_logical: int, dead: set[int], block_size: int) -> int:
    """Blocks of the append-only layout not freed, recounted from scratch."""
    retained = 0
    for b in range(cdiv(num_logical, block_size)):
        lo, hi = b * block_size, (b + 1) * block_size
        full = hi <= num_logical
        if not (full and all(p in dead for p in range(lo, hi))):
            retained += 1
    return retained


def test_naive_evict_hand_case():
    c = NaiveEvictCounter(4)
    c.append(10)  # blocks [0..3] [4..7] [8, 9]
    assert c.num_retained_blocks == 3
    assert c.evict_positions([1, 2, 7]).tolist() == []
    assert c.num_retained_blocks == 3  # vToken would hold 2
    assert c.evict_positions([0, 3]).tolist() == [0]  # block 0 fully dead
    assert c.num_retained_blocks == 2
    assert c.evict_positions([8, 9]).tolist() == []  # last block is partial: kept
    assert c.num_retained_blocks == 2
    c.append(1)  # position 10 joins the partial block 2
    assert c.num_retained_blocks == 2
    c.append(1)  # position 11 fills block 2 (two live tokens in it)
    assert c.evict_positions([10]).tolist() == []
    assert c.evict_positions([11]).tolist() == [2]
    assert c.num_retained_blocks == 1  # only block 1 (4, 5, 6 live)
    assert c.num_freed_blocks == 2 and c.num_dead == 9 and c.num_logical == 12
    assert c.evict_positions([4, 5, 6]).tolist() == [1]
    assert c.num_retained_blocks == 0


def test_naive_evict_append_spanning_blocks():
    c = NaiveEvictCounter(3)
    c.append(2)
    c.append(8)  # 10 tokens: blocks 0, 1, 2 full, block 3 partial
    assert c.num_retained_blocks == 4
    assert c.evict_positions(np.arange(3, 10)).tolist() == [1, 2]
    assert c.num_retained_blocks == 2


def test_naive_evict_validation_and_reset():
    c = NaiveEvictCounter(4)
    c.append(5)
    with pytest.raises(ValueError, match="position 5 is out of range"):
        c.evict_positions([5])
    with pytest.raises(ValueError, match="position 2 is given more than once"):
        c.evict_positions([2, 2])
    c.evict_positions([2])
    with pytest.raises(ValueError, match="position 2 is already evicted"):
        c.evict_positions([1, 2])
    assert c.num_dead == 1  # unchanged by the failed call
    with pytest.raises(ValueError):
        c.append(-1)
    c.reset()
    assert c.num_logical == 0 and c.num_retained_blocks == 0 and c.num_dead == 0
    c.append(4)
    assert c.evict_positions([0, 1, 2, 3]).tolist() == [0]


@SETTINGS
@given(st.integers(1, 64), st.data())
def test_naive_evict_matches_brute_force(block_size, data):
    c = NaiveEvictCounter(block_size)
    dead: set[int] = set()
    n = 0
    for _ in range(data.draw(st.integers(1, 12))):
        if data.draw(st.booleans()) or n == len(dead):
            k = data.draw(st.integers(0, 150))
            c.append(k)
            n += k
        else:
            live = sorted(set(range(n)) - dead)
            victims = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=1))
            c.evict_positions(np.array(victims))
            dead.update(victims)
        assert c.num_logical == n and c.num_dead == len(dead)
        assert c.num_retained_blocks == brute_force_retained(n, dead, block_size)


@pytest.mark.parametrize("k", [1, 31, 32, 33, 64, 200])
def test_small_and_vectorised_paths_agree_with_model(k):
    # plan_repack and NaiveEvictCounter switch from Python ints to numpy above 32 indices.
    rng = np.random.default_rng(k)
    for block_size in (1, 3, 16):
        num_live = 400
        evicted = rng.choice(num_live, size=k, replace=False)
        plan = plan_repack(evicted, num_live, block_size)
        new_n = num_live - k
        assert plan.dst.tolist() == sorted(s for s in evicted.tolist() if s < new_n)
        assert plan.src.tolist() == sorted(set(range(new_n, num_live)) - set(evicted.tolist()))
        c = NaiveEvictCounter(block_size)
        c.append(num_live + 1)
        dead: set[int] = set()
        for _ in range(3):
            live = np.array(sorted(set(range(num_live + 1)) - dead))
            victims = rng.choice(live, size=min(k, live.size), replace=False)
            before = c.num_freed_blocks
            freed = c.evict_positions(victims)
            dead.update(victims.tolist())
            assert freed.dtype == np.int64 and np.all(np.diff(freed) > 0)
            assert c.num_freed_blocks - before == freed.size
            assert c.num_retained_blocks == brute_force_retained(num_live + 1, dead, block_size)
