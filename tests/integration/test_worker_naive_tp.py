"""Naive-Evict's freed blocks under tensor parallelism with per-head token sets, model-free.

Each TP rank holds the token sets of its own KV heads, so a logical block is freed only once it is
dead in every set of every rank: ``WorkerEviction.take_naive_freed`` sums the per-block eviction
counts over the TP group. Two ranks (two ``WorkerEviction``, one KV head each) whose statistics
make rank 0 evict the first block and rank 1 the second: each alone would free one block, together
none. The all-reduce is replaced by adding the other rank's counts."""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import torch

from vtoken.config import VTokenConfig
from vtoken.integrations.vllm.protocol import StepPayload, WorkerSpec
from vtoken.integrations.vllm.worker.eviction import WorkerEviction

B = 32


def _rank(low: slice, gran: str = "head") -> tuple[WorkerEviction, str]:
    """One rank: a request of 64 prompt tokens (2 blocks), its statistics lowest on ``low``,
    then an eviction of 32 tokens (H2O evicts the lowest accumulated scores)."""
    plan = VTokenConfig(policy="h2o", budget=32, sink_tokens=0, recent_tokens=0, granularity=gran).plan()
    dec = WorkerEviction(num_blocks=8, block_size=B, device="cpu", num_layers=1, num_kv_heads=1)
    rid = "r"
    cached = NS(req_ids=[], new_block_ids=[], resumed_req_ids=set())
    so = NS(finished_req_ids=[], scheduled_new_reqs=[NS(req_id=rid, block_ids=([2, 5, 6],))],
            scheduled_cached_reqs=cached, num_scheduled_tokens={rid: 64})
    dec.begin(so, StepPayload(states={rid: WorkerSpec(plan)}))
    col = np.ones(64)
    col[low] = 0.0
    dec.fold({rid: (col, None)})
    so = NS(finished_req_ids=[], scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={rid: 1})
    dec.begin(so, StepPayload(evict={rid: 32}))
    return dec, rid


def _dead(dec: WorkerEviction) -> torch.Tensor:
    (g,) = dec.groups.values()
    return g.dec.dead[[dec.where["r"][1]]].to(torch.float64)


def _other_rank(d: torch.Tensor, shapes: list):
    """The all-reduce as the other rank adds to it: its 0/1 "dead in all my sets" flag per block."""
    def tp_sum(t):
        shapes.append(t.shape)
        flag = torch.nn.functional.pad(d, (0, max(0, t.shape[1] - d.shape[1])))[:, : t.shape[1]] == B
        return t + flag.to(t.dtype)
    return tp_sum


def test_a_block_is_freed_only_when_dead_on_every_rank():
    a, rid = _rank(slice(0, 32))
    b, _ = _rank(slice(32, 64))
    da, db = _dead(a), _dead(b)
    assert da[0, 0] == B and db[0, 1] == B  # each rank alone: one block entirely dead
    shapes: list = []
    assert a.take_naive_freed(_other_rank(db, shapes), 2) is None  # nothing freed across ranks (0: no change)
    assert b.take_naive_freed(_other_rank(da, shapes), 2) is None
    assert shapes == [torch.Size([1, 3])] * 2  # cdiv(65 logical, 32) blocks, the same width on every rank
    # without tensor parallelism the same rank frees its block
    a1, _ = _rank(slice(0, 32))
    assert a1.take_naive_freed() == {rid: 1}


def test_a_block_dead_on_every_rank_is_freed():
    """Both ranks evict the first block: freed on both (the threshold is not too high)."""
    a, rid = _rank(slice(0, 32))
    b, _ = _rank(slice(0, 32))
    da, db = _dead(a), _dead(b)
    shapes: list = []
    assert [a.take_naive_freed(_other_rank(db, shapes), 2), b.take_naive_freed(_other_rank(da, shapes), 2)] == [
        {rid: 1}, {rid: 1}]


def test_an_eviction_of_a_step_that_never_samples_is_reported_later():
    """A step that evicts but schedules no token never reaches take_naive_freed: its count waits
    for the next one; a request dropped meanwhile is not reported."""
    a, rid = _rank(slice(0, 32))
    cached = NS(req_ids=[], new_block_ids=[], resumed_req_ids=set())
    a.begin(NS(finished_req_ids=[], scheduled_new_reqs=[], scheduled_cached_reqs=cached,
               num_scheduled_tokens={rid: 1}), StepPayload())
    assert a.take_naive_freed() == {rid: 1}
    b, _ = _rank(slice(0, 32))
    b.begin(NS(finished_req_ids=[rid], scheduled_new_reqs=[], scheduled_cached_reqs=cached,
               num_scheduled_tokens={}), StepPayload())
    assert b.take_naive_freed() is None
