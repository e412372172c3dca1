"""Prefill column sums tiled over query rows (issue 15 item 7) equal the untiled computation.

``prefill_stats`` computes the chunk's causal probabilities a few query rows at a time, so its
extra memory is linear in the prompt length.

* The tiling is exact: computed in float64, every tile size gives the untiled result (one tile
  holding the whole chunk, one ``[Hq, ql, n]`` logits tensor) and an independent float64
  softmax to 1e-12.
* In float32 (the worker's dtype) tile sizes agree to float32 rounding only: the CPU matmul's
  rounding depends on how many query rows are in the product (measured: up to ~4e-6 absolute
  in the logits between 1-row and 200-row products), so no float32 tiling can match the
  former untiled path (``untiled_reference``) bit for bit; they agree to 2e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

from vtoken.integrations.vllm.worker.scoring import StepScores, prefill_stats
from vtoken.policies.base import AttentionNeed


def untiled_reference(q, k, scale):
    """The pre-tiling computation: float32 ``[Hq, ql, n]`` logits, returns float64 probs ``[ql, n]``."""
    ql, Hq, _ = q.shape
    n = k.shape[1]
    kk = k.repeat_interleave(Hq // k.shape[0], dim=0)
    logits = torch.bmm(q.permute(1, 0, 2).float(), kk.transpose(1, 2)) * scale
    qpos = torch.arange(n - ql, n).view(1, ql, 1)
    logits = logits.masked_fill(torch.arange(n).view(1, 1, n) > qpos, float("-inf"))
    return torch.softmax(logits, dim=-1).mean(dim=0).double()


def float64_reference(q, k, scale):
    ql, Hq, _ = q.shape
    n = k.shape[1]
    kk = k.double().repeat_interleave(Hq // k.shape[0], dim=0)
    logits = torch.einsum("qhd,hnd->hqn", q.double(), kk) * scale
    mask = torch.arange(n).view(1, 1, n) > torch.arange(n - ql, n).view(1, ql, 1)
    return torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1).mean(dim=0)


def _qk(ql, n, hq, hkv, hd, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(ql, hq + 1, hd, generator=g).to(dtype)  # strided, like a slice of the QKV output
    k = torch.randn(hkv, n, hd, generator=g) * 2.0
    return big[:, 1:], k


@pytest.mark.parametrize("ql,n,hq,hkv,dtype", [(200, 260, 6, 2, torch.float32), (97, 97, 4, 4, torch.bfloat16),
                                               (64, 300, 9, 3, torch.float32)])
def test_tiles_equal_untiled(ql, n, hq, hkv, dtype):
    hd = 16
    q, k = _qk(ql, n, hq, hkv, hd, dtype, seed=ql + n)
    scale = 1.0 / math.sqrt(hd)
    whole = hq * n * (ql + 5)  # one tile holds the whole chunk: the untiled computation
    exact = float64_reference(q, k, scale)
    old = untiled_reference(q, k, scale)
    # the tiling is exact: in float64, T = 1, 7, 33 rows per tile equal the untiled result to 1e-12
    ref_col, ref_last = prefill_stats(q, k, scale, True, tile_elems=whole, dtype=torch.float64)
    torch.testing.assert_close(ref_col, exact.sum(dim=0), rtol=0, atol=1e-12)
    torch.testing.assert_close(ref_last, exact[-1], rtol=0, atol=1e-12)
    for rows in (1, 7, 33):
        col, last = prefill_stats(q, k, scale, True, tile_elems=hq * n * rows, dtype=torch.float64)
        assert col.dtype == last.dtype == torch.float64 and col.shape == last.shape == (n,)
        torch.testing.assert_close(col, ref_col, rtol=0, atol=1e-12)
        torch.testing.assert_close(last, ref_last, rtol=0, atol=1e-12)
    # the worker's float32 computation: every tile size within float32 rounding of the exact
    # values and of the former untiled float32 path (CPU matmul rounding depends on the row count)
    for rows in (1, 7, 33, ql + 5):
        col, last = prefill_stats(q, k, scale, True, tile_elems=hq * n * rows)
        torch.testing.assert_close(col, ref_col, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(last, ref_last, rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(col, old.sum(dim=0), rtol=2e-6, atol=2e-6)
    col, last = prefill_stats(q, k, scale, False, tile_elems=hq * n * 7)
    assert last is None
    # every query row's probabilities sum to 1: the column sums total ql
    assert abs(float(col.sum()) - ql) < 1e-4


def test_tile_size_rows():
    """Below one row per tile the tile is one row (never zero); bad head counts are refused."""
    q, k = _qk(5, 40, 2, 1, 8, torch.float32, seed=1)
    col, _ = prefill_stats(q, k, 0.3, False, tile_elems=1, dtype=torch.float64)
    torch.testing.assert_close(col, float64_reference(q, k, 0.3).sum(dim=0), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="Hq=3 must be a multiple of Hkv=2"):
        prefill_stats(torch.zeros(2, 3, 8), torch.zeros(2, 4, 8), 1.0, False)


class _Impl:
    def __init__(self, hq, hkv, hd):
        self.num_heads, self.num_kv_heads, self.head_size, self.scale = hq, hkv, hd, 1.0 / math.sqrt(hd)


class _Meta:
    def __init__(self, qsl, seq_lens, block_table):
        self.query_start_loc, self.seq_lens, self.block_table = qsl, seq_lens, block_table


class _Layout:
    """A KVLayout stand-in whose cache holds one request's keys ``[Hkv, n, hd]`` per layer."""

    def gather_keys(self, kv_cache, block_ids, num_tokens):
        return kv_cache[:, :num_tokens].float()


def test_step_scores_tiled_equals_untiled_over_layers():
    """StepScores' multi-row path (a 150-row prefill chunk over 180 keys, 3 layers) with 3-row
    tiles equals one whole-chunk tile, and the float64 probabilities averaged over layers and
    heads, to float32 accuracy."""
    hq, hkv, hd, ql, n, L = 4, 2, 8, 150, 180, 3
    COL, LAST = AttentionNeed.COL_SUM.value, AttentionNeed.LAST_ROW.value
    meta = _Meta(torch.tensor([0, ql], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                 torch.zeros(1, 8, dtype=torch.int32))
    layers = [_qk(ql, n, hq, hkv, hd, torch.float32, seed=10 + i) for i in range(L)]
    outs = []
    for tile in (hq * n * 3, 1 << 30):
        st = StepScores([(0, "r", COL | LAST)], tile_elems=tile)
        for q, k in layers:
            st.accumulate(_Impl(hq, hkv, hd), q.reshape(ql, hq * hd), k, meta, _Layout())
        outs.append(st.result()["r"])
    (c0, l0), (c1, l1) = outs
    assert abs(c0 - c1).max() <= 2e-6 and abs(l0 - l1).max() <= 1e-7  # float32 matmul rounding
    ref = sum(float64_reference(q, k, 1.0 / math.sqrt(hd)) for q, k in layers) / L
    assert abs(c0 - ref.sum(dim=0).numpy()).max() <= 1e-5
    assert abs(l0 - ref[-1].numpy()).max() <= 1e-6
