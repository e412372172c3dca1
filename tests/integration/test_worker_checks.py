"""The worker's ``VTOKEN_CHECK=1`` checks of its own moves (``vtoken/integrations/vllm/worker/checks.py``):
real evictions through ``WorkerEviction.begin`` pass them and are counted, a block truncated off
one request and given to another in the same step is counted as reused, and each kind of bad
move raises, named. No engine; a second."""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from vtoken.config import VTokenConfig
from vtoken.side_cache import Eviction
from vtoken.integrations.vllm.protocol import StepPayload, WorkerSpec
from vtoken.integrations.vllm.worker.checks import check_group_moves, check_step_blocks, new_blocks_of_step
from vtoken.integrations.vllm.worker.eviction import WorkerEviction

BS = 32


def _spec() -> WorkerSpec:
    return WorkerSpec(VTokenConfig(policy="random", budget=16, granularity="request").plan())


def _so(new=(), cached=(), counts=None):
    return NS(finished_req_ids=set(), preempted_req_ids=set(),
              scheduled_new_reqs=[NS(req_id=r, block_ids=(list(b),)) for r, b in new],
              scheduled_cached_reqs=NS(req_ids=[r for r, _ in cached], new_block_ids=[(list(b),) if b else None
                                                                                     for _, b in cached],
                                       resumed_req_ids=set()),
              num_scheduled_tokens=counts or {})


@pytest.fixture
def checked(monkeypatch):
    monkeypatch.setenv("VTOKEN_CHECK", "1")
    wd = WorkerEviction(16, BS, "cpu", num_layers=1, num_kv_heads=1)
    assert wd._check
    # a: 70 tokens in blocks 1, 2, 3; b: 40 tokens in blocks 4, 5
    wd.begin(_so(new=[("a", [1, 2, 3]), ("b", [4, 5])], counts={"a": 70, "b": 40}),
             StepPayload(states={"a": _spec(), "b": _spec()}))
    return wd


def test_real_moves_pass_and_a_freed_block_given_away_in_the_same_step_is_counted(checked):
    wd = checked
    # a evicts 40 of 70 (keeps 30: ceil(31/32) = 1 block; blocks 2, 3 freed), and in the same step
    # vLLM gives block 3 to b (its next token) and block 2 to a new request c
    moves = wd.begin(_so(new=[("c", [2])], cached=[("a", None), ("b", [3])], counts={"a": 1, "b": 1, "c": 5}),
                     StepPayload(states={"c": _spec()}, evict={"a": 40}, truncate={"a": 1}))
    (_, src, dst, _), = moves
    assert len(src) == wd.check_stats["moves_checked"] > 0
    # every move reads a's tail (slots 30..69: blocks 1-3 of a) into a hole below 30 (block 1)
    assert set((dst // BS).tolist()) == {1} and set((src // BS).tolist()) <= {1, 2, 3}
    # the sources in blocks 2 and 3, now c's and b's: freed and reused within the step
    assert wd.check_stats["freed_reused_same_step"] == len(set((src // BS).tolist()) & {2, 3}) > 0


def _ev(src_slot, dst_slot, new_live, table, rows=None, sets=None):
    src_slot, dst_slot = torch.tensor(src_slot), torch.tensor(dst_slot)
    rows = torch.zeros_like(src_slot) if rows is None else torch.tensor(rows)
    t = torch.tensor(table)
    glob = lambda rel: t[rows, rel // BS] * BS + rel % BS  # noqa: E731
    return Eviction(glob(src_slot), glob(dst_slot), rows, src_slot, dst_slot, torch.tensor(new_live),
                    torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                    torch.zeros_like(src_slot) if sets is None else torch.tensor(sets))


def test_check_group_moves_returns_the_blocks_of_each_move():
    table = np.array([[7, 9, 4]])
    ev = _ev([65, 40], [3, 10], [40], table)
    assert check_group_moves(["a"], np.array([0]), table, BS, np.array([66]), np.array([0]), ev) == [
        ("a", 7, 4), ("a", 7, 9)]


@pytest.mark.parametrize("src, dst, new_live, live0, shared, msg", [
    ([65], [40], [40], 66, 0, "not a repack"),            # dst at the new live count
    ([39], [3], [40], 66, 0, "not a repack"),             # src below the new live count
    ([66], [3], [40], 66, 0, "not a repack"),             # src past the old live count
    ([65], [3], [40], 66, 32, "shared prefix-cache"),    # dst in the shared prefix
    ([65, 64], [3, 3], [40], 66, 0, "same dst"),          # two moves into one hole
])
def test_check_group_moves_refuses_a_bad_move(src, dst, new_live, live0, shared, msg):
    table = np.array([[7, 9, 4]])
    ev = _ev(src, dst, new_live, table)
    with pytest.raises(AssertionError, match=msg):
        check_group_moves(["a"], np.array([0]), table, BS, np.array([live0]), np.array([shared]), ev)


def test_check_group_moves_refuses_a_slot_outside_the_request():
    table = np.array([[7, 9, 4]])
    ev = _ev([65], [3], [40], table)
    ev = ev._replace(dst=torch.tensor([5 * BS + 3]))  # block 5 is not a's
    with pytest.raises(AssertionError, match="not the request's slot"):
        check_group_moves(["a"], np.array([0]), table, BS, np.array([66]), np.array([0]), ev)


def test_check_step_blocks():
    held = {"a": {7}, "b": {9, 4}}
    # a's source block 4 was truncated off a and is b's now (given in this step): counted
    assert check_step_blocks([("a", 7, 4)], held, {4: {"b"}}) == 1
    assert check_step_blocks([("a", 7, 7)], held, {}) == 0
    with pytest.raises(AssertionError, match="no longer holds"):
        check_step_blocks([("a", 9, 7)], {"a": {7}, "b": {4}}, {})
    with pytest.raises(AssertionError, match=r"\['b'\] also hold"):
        check_step_blocks([("a", 7, 4)], {"a": {7}, "b": {7}}, {})
    with pytest.raises(AssertionError, match=r"\['c'\] also hold"):
        check_step_blocks([("a", 7, 4)], held, {7: {"c"}})


def test_new_blocks_of_step():
    so = _so(new=[("c", [2, 6])], cached=[("a", None), ("b", [3])])
    assert new_blocks_of_step(so) == {2: {"c"}, 6: {"c"}, 3: {"b"}}


def test_check_step_blocks_suspended_and_copies():
    # a, preempted and suspended in this step, moved into block 7, now given to b: legal (the moves
    # and the save run before the forward); into a block a prefix-cache copy writes first: not
    assert check_step_blocks([("a", 7, 4)], {"b": {7}}, {7: {"b"}}, suspended=frozenset({"a"})) == 0
    with pytest.raises(AssertionError, match="request 'b''s prefix-cache copy"):
        check_step_blocks([("a", 7, 4)], {"b": {7}}, {7: {"b"}}, suspended=frozenset({"a"}), copy_targets={7: "b"})
    # a request's own copy (its first eviction under prefix caching) is where its moves go next
    assert check_step_blocks([("a", 7, 4)], {"a": {7}}, {7: {"a"}}, copy_targets={7: "a"}) == 0
