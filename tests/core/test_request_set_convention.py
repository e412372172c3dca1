"""Request sets follow one statistic convention on the worker, in the oracle and in the masked
reference (``tests/reference/oracle/__init__.py``, "Token-set conventions"): a set's statistic is the mean of the
post-softmax probabilities over the (layer, query head) pairs it covers, equal weight per pair
(``request``: all ``L * Hq``), then summed over the step's rows (``col_sum``) or taken at its last
row (``last_row``).

* :class:`StepScores` (the worker) for a ``request`` row, on its one-query (decode) path and its
  prefill path over several rows, equals that mean written out here in float64 from ``q`` and
  ``k`` (an independent computation), to float32 rounding; so does the per-set path's
  ``set_means("request", ...)`` of the per-KV-head means, and the oracle's
  :func:`attention_stats` / :func:`attention_stats_sets`. The probabilities differ per query head
  (scaled queries), so a sum instead of a mean, KV heads instead of query heads or one layer's
  weight instead of another's would show.
* The same request's H2O decisions on the worker (:class:`DeviceDecider`, statistics of a
  prefill chunk and of decode rows) equal the per-request policy's on the float64 reference
  statistics.

CPU only, no model, one thread, a few seconds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vtoken.config import parse_config
from vtoken.side_cache import DeviceDecider
from vtoken.integrations.vllm.worker.scoring import StepScores
from reference.oracle import attention_stats, attention_stats_sets
from reference.policies import AttentionStats, TokenView, reference
from vtoken.policies.base import AttentionNeed

torch.set_num_threads(1)

L, HQ, HKV, HD, BS = 3, 6, 2, 16, 32
G = HQ // HKV
COL, LAST = AttentionNeed.COL_SUM.value, AttentionNeed.LAST_ROW.value


class _Impl:
    num_heads, num_kv_heads, head_size, scale = HQ, HKV, HD, 1.0 / math.sqrt(HD)


class _Meta:
    def __init__(self, qsl, seq_lens, block_table):
        self.query_start_loc, self.seq_lens, self.block_table = qsl, seq_lens, block_table


class _Layout:
    """A KVLayout stand-in over a cache ``[num_blocks, Hkv, B, hd]``."""

    def gather_keys(self, kv_cache, block_ids, num_tokens):
        k = kv_cache[block_ids.long()]  # [nb, Hkv, B, hd]
        return k.permute(1, 0, 2, 3).reshape(HKV, -1, HD)[:, :num_tokens].float()

    def gather_keys_batched(self, kv_cache, blocks, offsets):
        return kv_cache[blocks, :, offsets[None, :]].permute(0, 2, 1, 3).float()  # [R, Hkv, n, hd]


def _reference(qs: list[torch.Tensor], ks: list[torch.Tensor], ql: int) -> np.ndarray:
    """float64 ``[ql, n]``: the mean over every (layer, query head) pair of the causal
    probabilities of the step's ``ql`` rows (the last ``ql`` of the ``n`` keys); query head
    ``h`` reads KV head ``h // G``; a plain loop, as tests/core/masked_reference.py does."""
    n = ks[0].shape[1]
    acc = np.zeros((ql, n))
    future = torch.arange(n)[None, :] > torch.arange(n - ql, n)[:, None]
    for q, k in zip(qs, ks):
        for h in range(HQ):
            logits = (q[:, h].double() @ k[h // G].double().T) * _Impl.scale
            acc += torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1).numpy()
    return acc / (L * HQ)


def _step(n: int, ql: int, seed: int):
    """One request's step over ``n`` keys with ``ql`` query rows, every layer: the queries
    ``[ql, Hq, hd]`` (head ``h`` scaled by ``1 + h``: the heads' probabilities differ) and keys
    ``[Hkv, n, hd]``, and the same keys in a paged cache."""
    g = torch.Generator().manual_seed(seed)
    qs = [torch.randn(ql, HQ, HD, generator=g) * torch.arange(1, HQ + 1).view(1, HQ, 1) for _ in range(L)]
    ks = [torch.randn(HKV, n, HD, generator=g) for _ in range(L)]
    nb = -(-n // BS)
    caches = []
    for k in ks:
        pad = torch.zeros(HKV, nb * BS, HD)
        pad[:, :n] = k
        caches.append(torch.cat([torch.zeros(1, HKV, BS, HD), pad.view(HKV, nb, BS, HD).permute(1, 0, 2, 3)]))
    meta = _Meta(torch.tensor([0, ql], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                 torch.arange(1, nb + 1, dtype=torch.int32)[None])
    return qs, ks, caches, meta


def _worker(qs, caches, meta, ql: int, via_sets: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """StepScores' (col_sum, last_row) of a ``request`` row: its own path, or (``via_sets``) the
    per-set path (per-KV-head means, then ``set_means("request", ...)``)."""
    st = StepScores([(0, "r", COL | LAST)], grans={"r": "request"} if via_sets else None)
    for li, (q, kv) in enumerate(zip(qs, caches)):
        st.accumulate(_Impl(), q.reshape(ql, HQ * HD), kv, meta, _Layout(), layer_index=li)
    col, last = st.result()["r"]
    if via_sets:
        assert col.shape == last.shape == (1, meta.seq_lens[0])
        return col[0], last[0]
    return col, last


@pytest.mark.parametrize("ql,n", [(1, 45), (40, 40), (17, 70)], ids=["decode", "prefill", "chunk"])
def test_request_statistics_are_the_mean_over_layers_and_query_heads(ql, n):
    qs, ks, caches, meta = _step(n, ql, seed=ql + n)
    ref = _reference(qs, ks, ql)
    want_col, want_last = ref.sum(axis=0), ref[-1]
    # the worker's request path, and the per-set path's set_means("request") of per-KV-head means
    for via_sets in (False, True):
        col, last = _worker(qs, caches, meta, ql, via_sets)
        np.testing.assert_allclose(col, want_col, rtol=1e-5, atol=1e-7, err_msg=f"col_sum, via_sets={via_sets}")
        np.testing.assert_allclose(last, want_last, rtol=1e-5, atol=1e-7, err_msg=f"last_row, via_sets={via_sets}")
    # the oracle, from the same probabilities (float32, as the eager model hands them over)
    probs = []
    future = torch.arange(n)[None, :] > torch.arange(n - ql, n)[:, None]
    for q, k in zip(qs, ks):
        logits = torch.einsum("qhd,hnd->hqn", q, k.repeat_interleave(G, dim=0)) * _Impl.scale
        probs.append(torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)[None])
    both = AttentionNeed.COL_SUM | AttentionNeed.LAST_ROW
    for st in (attention_stats(probs, both), attention_stats_sets(probs, both, "request", HKV)[0]):
        np.testing.assert_allclose(st.col_sum, want_col, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(st.last_row, want_last, rtol=1e-5, atol=1e-7)


def test_request_decisions_on_the_worker_equal_the_policy_on_reference_statistics():
    """H2O, one request set: a 60-token prompt (one chunk), then decode steps evicting 21 and then
    1 token each; the worker's statistics folded into a DeviceDecider pick the same victims as
    the per-request policy on the float64 reference statistics."""
    P, budget, steps = 60, 40, 6
    cfg = parse_config({"policy": "h2o", "budget": budget, "granularity": "request"})
    policy = reference(cfg.make_policy(budget))
    state = policy.init_state()
    nb = 8
    dec = DeviceDecider(policy.policy, (nb + 1) * BS, BS, max_requests=1)
    rows = torch.tensor([0])
    table = torch.arange(1, nb + 1)[None]
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(HKV, P + steps, HD, generator=g) for _ in range(L)]  # every position's keys
    pos = np.arange(P)  # the live logical positions, ascending (the reference's slot order)
    dec.append(rows, table, torch.tensor([P]))
    state.reset_slots(0, P)
    ql, logical = P, P
    for d in range(steps + 1):
        # the step's forward over the live keys in logical order (the decider's slots may differ:
        # give it its own slot order)
        qs = [torch.randn(ql, HQ, HD, generator=g) * torch.arange(1, HQ + 1).view(1, HQ, 1) for _ in range(L)]
        ks = [k[:, torch.from_numpy(pos)] for k in keys]
        ref = _reference(qs, ks, ql)
        policy.observe(state, len(pos), AttentionStats(col_sum=ref.sum(axis=0)), TokenView(pos, logical, P))
        slot_pos = dec.logical_pos(0, table[0]).numpy()  # slot -> logical position on the worker
        order = np.searchsorted(pos, slot_pos)
        n = len(pos)
        kv = [torch.cat([torch.zeros(1, HKV, BS, HD), torch.nn.functional.pad(k[:, torch.from_numpy(slot_pos)],
                                                                               (0, 0, 0, nb * BS - n))
                         .view(HKV, nb, BS, HD).permute(1, 0, 2, 3)]) for k in keys]
        meta = _Meta(torch.tensor([0, ql], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                     table.to(torch.int32))
        # the query rows are the newest ql positions, which sit in the last ql slots on both sides
        assert (slot_pos[n - ql:] == pos[n - ql:]).all()
        col, _ = _worker(qs, kv, meta, ql)
        np.testing.assert_allclose(col, ref.sum(axis=0)[order], rtol=1e-5, atol=1e-7)
        dec.observe(rows, table, torch.from_numpy(col)[None], None)
        if d == steps:
            break
        k = max(0, n - budget)
        ev = dec.evict(rows, table, torch.tensor([k]), sink_tokens=policy.sink_tokens,
                       recent_tokens=policy.recent_tokens)
        victims = policy.select_victims(state, TokenView(pos, logical, P), k)
        assert sorted(ev.evicted_pos.tolist()) == sorted(pos[victims].tolist()), d
        keep = np.setdiff1d(np.arange(n), victims)
        state.compact(keep)
        pos = np.append(pos[keep], logical)
        state.reset_slots(len(pos) - 1, len(pos))
        dec.append(rows, table, torch.tensor([1]))
        logical += 1
        ql = 1
