"""Naive-Evict's freed blocks under tensor parallelism with per-head token sets, model-free.

Each TP rank holds the token sets of its own KV heads, so a logical block is freed only once it is
dead in every set of every rank: ``WorkerDecisions.take_naive_freed`` sums the per-block eviction
counts over the TP group. Two ranks (two ``WorkerDecisions``, one KV head each) whose statistics
make rank 0 evict the first block and rank 1 the second: each alone would free one block, together
none. The all-reduce is replaced by adding the other rank's counts."""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import torch

from vtoken.config import VTokenConfig
from vtoken.integrations.vllm.payload import StepPayload, WorkerSpec
from vtoken.integrations.vllm.worker.decisions import WorkerDecisions

B = 32


def _rank(low: slice) -> tuple[WorkerDecisions, str]:
    """One rank: a request of 64 prompt tokens (2 blocks), its statistics lowest on ``low``,
    then an eviction of 32 tokens (H2O evicts the lowest accumulated scores)."""
    pol = VTokenConfig(policy="h2o", budget=32, sink_tokens=0, recent_tokens=0, decide_on="worker").make_policy()
    dec = WorkerDecisions(num_blocks=8, block_size=B, device="cpu", num_layers=1, num_kv_heads=1)
    rid = "r"
    cached = NS(req_ids=[], new_block_ids=[], resumed_req_ids=set())
    so = NS(finished_req_ids=[], scheduled_new_reqs=[NS(req_id=rid, block_ids=([2, 5, 6],))],
            scheduled_cached_reqs=cached, num_scheduled_tokens={rid: 64})
    dec.begin(so, StepPayload(states={rid: WorkerSpec(pol, 0, 0, 0, granularity="head")}))
    col = np.ones(64)
    col[low] = 0.0
    dec.fold({rid: (col, None)})
    so = NS(finished_req_ids=[], scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={rid: 1})
    dec.begin(so, StepPayload(evict={rid: 32}))
    return dec, rid


def _dead(dec: WorkerDecisions) -> torch.Tensor:
    (g,) = dec.groups.values()
    return g.dec.dead[[dec.where["r"][1]]].to(torch.float64)


def test_a_block_is_freed_only_when_dead_on_every_rank():
    a, rid = _rank(slice(0, 32))
    b, _ = _rank(slice(32, 64))
    da, db = _dead(a), _dead(b)
    assert da[0, 0] == B and db[0, 1] == B  # each rank alone: one block entirely dead
    pad = lambda t, w: torch.nn.functional.pad(t, (0, w - t.shape[1]))  # noqa: E731
    sums = []

    def other(d):
        def tp_sum(t):
            sums.append(t.shape)
            return t + pad(d, t.shape[1])[:, : t.shape[1]]
        return tp_sum

    assert a.take_naive_freed(other(db), 2) is None  # nothing freed across ranks (0: no change)
    assert b.take_naive_freed(other(da), 2) is None
    assert sums == [torch.Size([1, 3])] * 2  # cdiv(65 logical, 32) blocks, the same width on every rank
    # without tensor parallelism the same rank frees its block
    a1, _ = _rank(slice(0, 32))
    assert a1.take_naive_freed() == {rid: 1}
