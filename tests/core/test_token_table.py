"""Tests for vtoken.token_table.TokenTable (with the repack planner and Naive-Evict)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference.repack import NaiveEvictCounter, cdiv
from reference.token_table import TokenTable

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------- hand cases
def test_issue_example_exact_slot_map():
    t = TokenTable(4)
    t.append(10)
    assert t.logical_pos.tolist() == list(range(10)) and t.num_blocks() == 3
    plan = t.evict_slots(np.array([1, 2, 7]))
    assert (plan.src.tolist(), plan.dst.tolist()) == ([8, 9], [1, 2])
    assert plan.freed_block_indices.tolist() == [2]
    assert t.logical_pos.tolist() == [0, 8, 9, 3, 4, 5, 6]
    assert (t.num_live, t.num_logical, t.offset, t.num_blocks()) == (7, 10, 3, 2)
    assert [t.slot_of(p) for p in range(10)] == [0, -1, -1, 3, 4, 5, 6, -1, 1, 2]
    t.check_invariants()
    t.append(2)  # logical 10, 11 at slots 7, 8
    assert t.logical_pos.tolist() == [0, 8, 9, 3, 4, 5, 6, 10, 11]
    assert t.slot_of(10) == 7 and t.slot_of(11) == 8 and t.num_blocks() == 3
    t.check_invariants()


def test_evict_positions_after_moves():
    t = TokenTable(4)
    t.append(10)
    t.evict_slots([1, 2, 7])  # slots: [0, 8, 9, 3, 4, 5, 6]
    plan = t.evict_positions(np.array([8, 0]))  # slots 1 and 0 -> new n = 5, tail 5, 6
    assert (plan.dst.tolist(), plan.src.tolist()) == ([0, 1], [5, 6])
    assert t.logical_pos.tolist() == [5, 6, 9, 3, 4]
    assert plan.freed_block_indices.tolist() == []
    assert t.offset == 5
    t.check_invariants()


def test_slot_of_out_of_range_and_slots_of():
    t = TokenTable(2)
    assert t.slot_of(0) == -1
    t.append(3)
    t.evict_positions([1])
    assert t.slot_of(-1) == -1 and t.slot_of(3) == -1 and t.slot_of(1) == -1
    assert t.slots_of(np.array([0, 1, 2, 3, -5])).tolist() == [0, -1, 1, -1, -1]


def test_growth_keeps_contents():
    t = TokenTable(16)
    for _ in range(50):
        t.append(7)
    t.evict_slots(np.arange(0, 350, 5))
    t.append(1000)
    t.check_invariants()
    assert t.num_logical == 1350 and t.num_live == 1350 - 70


def test_logical_pos_view_is_read_only():
    t = TokenTable(4)
    t.append(3)
    with pytest.raises(ValueError):
        t.logical_pos[0] = 5


def test_empty_eviction_returns_empty_plan():
    t = TokenTable(4)
    t.append(5)
    plan = t.evict_slots([])
    assert plan.num_moves == 0 and plan.new_num_live == 5 and t.num_live == 5
    plan = t.evict_positions(np.array([], dtype=np.int64))
    assert plan.num_moves == 0 and t.num_live == 5


def test_reset():
    t = TokenTable(4)
    t.append(9)
    t.evict_slots([0, 4])
    t.reset()
    assert (t.num_live, t.num_logical, t.offset, t.num_blocks()) == (0, 0, 0, 0)
    t.check_invariants()
    t.append(3)
    assert t.logical_pos.tolist() == [0, 1, 2]
    t.check_invariants()


def test_validation_names_the_culprit_and_leaves_table_unchanged():
    t = TokenTable(4)
    t.append(6)
    t.evict_positions([2])
    before = t.logical_pos.copy()
    with pytest.raises(ValueError, match="slot 3 is given more than once"):
        t.evict_slots([3, 3])
    with pytest.raises(ValueError, match="slot 5 is out of range"):
        t.evict_slots([0, 5])
    with pytest.raises(ValueError, match="position 2 is already evicted"):
        t.evict_positions([1, 2])
    with pytest.raises(ValueError, match="position 6 is out of range"):
        t.evict_positions([6])
    with pytest.raises(ValueError, match="position 4 is given more than once"):
        t.evict_positions([4, 4])
    with pytest.raises(ValueError, match="append count"):
        t.append(-2)
    with pytest.raises(ValueError, match="block_size"):
        TokenTable(0)
    assert t.logical_pos.tolist() == before.tolist() and t.num_live == 5
    t.check_invariants()


@pytest.mark.parametrize(
    "corrupt, msg",
    [
        (lambda t: t._pos_of_slot.__setitem__(1, 0), "not distinct"),
        (lambda t: t._slot_of_pos.__setitem__(3, 0), "does not map back"),
        (lambda t: t._slot_of_pos.__setitem__(1, 2), "evicted position does not map to -1"),
        (lambda t: setattr(t, "num_live", 9), "num_live"),
        (lambda t: t._pos_of_slot.__setitem__(0, 99), "out of"),
        (lambda t: t._pos_of_slot.__setitem__(7, 4), "not cleared"),
    ],
)
def test_check_invariants_detects_corruption(corrupt, msg):
    t = TokenTable(4)
    t.append(8)
    t.evict_slots([1])
    t.check_invariants()
    corrupt(t)
    with pytest.raises(AssertionError, match=msg):
        t.check_invariants()


# ----------------------------------------------------------------- properties
def brute_force_retained(num_logical: int, dead: set[int], block_size: int) -> int:
    retained = 0
    for b in range(cdiv(num_logical, block_size)):
        block = range(b * block_size, (b + 1) * block_size)
        if not (block.stop <= num_logical and all(p in dead for p in block)):
            retained += 1
    return retained


@SETTINGS
@given(st.integers(1, 64), st.data())
def test_random_histories_against_independent_models(block_size, data):
    """Random append/evict histories, checked against a set model and a simulated slot array."""
    t = TokenTable(block_size)
    naive = NaiveEvictCounter(block_size)
    live: set[int] = set()  # model: live logical positions
    dead: set[int] = set()
    num_logical = 0
    sim = np.zeros(0, dtype=np.int64)  # simulated physical slots: logical position per slot

    for _ in range(data.draw(st.integers(1, 10), label="steps")):
        op = data.draw(st.sampled_from(["append", "evict_slots", "evict_positions"]), label="op")
        if op == "append" or not live:
            n = data.draw(st.integers(0, 120), label="append n")
            t.append(n)
            naive.append(n)
            new = np.arange(num_logical, num_logical + n, dtype=np.int64)
            live.update(new.tolist())
            sim = np.concatenate([sim, new])
            num_logical += n
        else:
            old_n = t.num_live
            if op == "evict_slots":
                slots = data.draw(
                    st.lists(st.integers(0, old_n - 1), unique=True, min_size=1, max_size=old_n),
                    label="slots",
                )
                victims = [int(sim[s]) for s in slots]
                plan = t.evict_slots(np.array(slots, dtype=np.int64))
            else:
                victims = data.draw(
                    st.lists(st.sampled_from(sorted(live)), unique=True, min_size=1),
                    label="positions",
                )
                slots = [int(np.flatnonzero(sim == p)[0]) for p in victims]
                plan = t.evict_positions(np.array(victims, dtype=np.int64))
            naive.evict_positions(np.array(victims, dtype=np.int64))
            live.difference_update(victims)
            dead.update(victims)

            new_n = old_n - len(victims)
            holes = sorted(s for s in slots if s < new_n)
            assert plan.old_num_live == old_n and plan.new_num_live == new_n
            # Minimal, ascending pairing, every dst < src, no slot used twice.
            assert plan.num_moves == len(holes) and plan.dst.tolist() == holes
            assert plan.src.tolist() == sorted(set(range(new_n, old_n)) - set(slots))
            assert np.all(plan.dst < plan.src)
            used = plan.src.tolist() + plan.dst.tolist()
            assert len(set(used)) == len(used)
            assert plan.freed_block_indices.tolist() == list(
                range(cdiv(new_n, block_size), cdiv(old_n, block_size))
            )
            # Gather-then-scatter on the simulated slot array gives the table's map.
            gathered = sim[plan.src]
            sim[plan.dst] = gathered
            sim = sim[:new_n]

        t.check_invariants()
        n = t.num_live
        assert n == len(live) and t.num_logical == num_logical and t.offset == len(dead)
        assert np.array_equal(t.logical_pos, sim)  # dense: slots 0..n-1 hold the live tokens
        assert set(t.logical_pos.tolist()) == live
        assert np.all(t.logical_pos >= np.arange(n))  # moves only lower a token's slot
        assert all(t.slot_of(p) == -1 for p in dead)
        assert t.num_blocks() == cdiv(n, block_size)
        assert naive.num_retained_blocks == brute_force_retained(num_logical, dead, block_size)
        assert naive.num_retained_blocks >= t.num_blocks()
