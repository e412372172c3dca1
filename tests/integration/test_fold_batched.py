"""``WorkerEviction.fold`` of ``StepScores.batched()`` (the one-query rows as padded tensors, one
``observe`` per group) leaves the side caches bit for bit as ``fold`` of ``StepScores.result()``
(the per-request ``ScoreMap``): every granularity, column sums and last rows, rows of different
lengths and of one length (no padding to mask), the deferred (layer stack) and the layer-by-layer
scoring, and a row with non-finite statistics (a fault confined to it on both paths). No engine;
a few seconds."""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from vtoken.config import VTokenConfig
from vtoken.integrations.vllm.protocol import StepPayload, WorkerSpec
from vtoken.integrations.vllm.worker.eviction import WorkerEviction
from vtoken.integrations.vllm.worker.kv_layout import CPUKVLayout, CPULayerStack, probe_cpu_layout
from vtoken.integrations.vllm.worker.scoring import BatchedScores, StepScores, set_means, set_means_batched
from vtoken.policies.base import AttentionNeed

L, H, HQ, BS, HD = 3, 3, 9, 32, 64
NB = 24  # KV blocks the keys are read from


def _spec(policy: str, gran: str) -> WorkerSpec:
    return WorkerSpec(VTokenConfig(policy=policy, budget=16, granularity=gran).plan())


#: (request, policy, granularity)
REQS = [("a", "h2o", "request"), ("b", "h2o", "head"), ("c", "h2o", "layer"), ("d", "h2o", "head_shared"),
        ("e", "tova", "head"), ("f", "tova", "request"), ("g", "h2o", "head"), ("h", "tova", "layer")]


def _caches(seed: int):
    g = torch.Generator().manual_seed(seed)
    layout = probe_cpu_layout(torch.float32, "vec", BS, HD, H)
    per = NB * H * BS * 2 * HD
    buf = torch.randn(L * per, generator=g)
    caches = [(buf[l * per:(l + 1) * per].view(NB, H, BS, 2 * HD), CPUKVLayout(layout)) for l in range(L)]
    return caches, CPULayerStack.build(caches), g


def _decisions(lens: list[int]) -> WorkerEviction:
    """Every request of REQS started with ``lens[i]`` live tokens (its own blocks)."""
    wd = WorkerEviction(64, BS, "cpu", num_layers=L, num_kv_heads=H)
    new, nxt = [], 1
    for (rid, _, _), n in zip(REQS, lens):
        nb = -(-n // BS)
        new.append(NS(req_id=rid, block_ids=(list(range(nxt, nxt + nb)),)))
        nxt += nb
    so = NS(finished_req_ids=set(), preempted_req_ids=set(), scheduled_new_reqs=new,
            scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
            num_scheduled_tokens={rid: n for (rid, _, _), n in zip(REQS, lens)})
    wd.begin(so, StepPayload(states={rid: _spec(p, gr) for rid, p, gr in REQS}))
    # some state to add to (the same in both copies)
    rng = np.random.default_rng(1)
    for g in wd.groups.values():
        for k, t in g.dec.side.fields.items():
            if k != "pos":
                t.copy_(torch.from_numpy(rng.random(tuple(t.shape))).to(t.dtype))
    return wd


def _scores(lens: list[int], with_stack: bool, nan_row: int | None = None) -> StepScores:
    caches, stack, g = _caches(3)
    if with_stack:
        assert stack is not None and stack.views is not None
    R = len(REQS)
    block_table = torch.stack([torch.randperm(NB, generator=g)[:4] for _ in range(R)]).to(torch.int32)
    meta = NS(query_start_loc=torch.arange(R + 1), seq_lens=torch.tensor(lens), block_table=block_table)
    impl = NS(num_heads=HQ, head_size=HD, num_kv_heads=H, scale=0.125)
    rows = [(i, rid, VTokenConfig(policy=p, budget=16).make_policy().needs.value) for i, (rid, p, _) in enumerate(REQS)]
    grans = {rid: gr for rid, _, gr in REQS if gr != "request"}
    st = StepScores(rows, grans=grans, stack=stack if with_stack else None)
    for l, (kv, lay) in enumerate(caches):
        q = torch.randn(R, HQ * HD, generator=g)
        if nan_row is not None and l == 1:
            q[nan_row] = float("nan")
        st.accumulate(impl, q, kv, meta, lay, layer_index=l)
    return st


def _state(wd: WorkerEviction) -> dict:
    return {key: {k: t.clone() for k, t in g.dec.side.fields.items()} for key, g in wd.groups.items()}


@pytest.mark.parametrize("lens", [[70, 33, 96, 64, 5, 40, 128, 17], [64] * 8], ids=["ragged", "uniform"])
@pytest.mark.parametrize("with_stack", [True, False], ids=["deferred", "per-layer"])
def test_batched_fold_equals_the_score_map_fold(lens, with_stack):
    st = _scores(lens, with_stack)
    legacy, batched = st.result(), st.batched()
    assert isinstance(batched, BatchedScores) and not batched.rest and batched.rids == [r for r, _, _ in REQS]
    a, b = _decisions(lens), _decisions(lens)
    assert all(torch.equal(x, y) for ga, gb in zip(_state(a).values(), _state(b).values())
               for x, y in zip(ga.values(), gb.values()))
    a.fold(legacy)
    b.fold(batched)
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        for k in sa[key]:
            assert torch.equal(sa[key][k], sb[key][k]), (key, k)
    # and the fold changed something
    assert any(not torch.equal(x, y) for ga, gb in zip(_state(_decisions(lens)).values(), sa.values())
               for x, y in zip(ga.values(), gb.values()))
    assert a.take_faults() is None and b.take_faults() is None


def test_a_non_finite_row_is_a_fault_on_both_paths():
    lens = [70, 33, 96, 64, 5, 40, 128, 17]
    st = _scores(lens, True, nan_row=1)
    legacy, batched = st.result(), st.batched()
    a, b = _decisions(lens), _decisions(lens)
    a.fold(legacy)
    b.fold(batched)
    fa, fb = a.take_faults(), b.take_faults()
    assert fa is not None and fa.keys() == fb.keys() == {"b"}
    assert "b" not in a.where and "b" not in b.where
    sa, sb = _state(a), _state(b)
    for key in sa:
        for k in sa[key]:
            assert torch.equal(sa[key][k], sb[key][k]), (key, k)


@pytest.mark.parametrize("gran", ["head", "layer", "head_shared"])
def test_set_means_batched_equals_row_by_row(gran):
    g = torch.Generator().manual_seed(0)
    t = torch.rand(5, 4, 3, 37, generator=g, dtype=torch.float64)
    got = set_means_batched(gran, t)
    for r in range(5):
        n = 37 - 3 * r
        want = set_means(gran, torch.stack([t[r, l, :, :n] for l in range(4)]))
        assert torch.equal(got[r, :, :n], want), (gran, r)


def test_batched_scores_read_as_the_score_map():
    """``BatchedScores`` reads as ``result()``'s ``ScoreMap`` (hooks and tests that rewrite a step's
    statistics use it so), array for array."""
    lens = [70, 33, 96, 64, 5, 40, 128, 17]
    st = _scores(lens, True)
    want, got = st.result(), st.batched()
    assert bool(got) and len(got) == len(want) and set(got.keys()) == set(want) == set(got)
    for rid, v in got.items():
        assert len(v) == len(want[rid])
        for a, b in zip(v, want[rid]):
            assert (a is None and b is None) or np.array_equal(a, b), rid
