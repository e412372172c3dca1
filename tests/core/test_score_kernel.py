"""The two-phase Triton scorer (vtoken.kernels.triton_score) against PyTorch, under the interpreter.

Three implementations are compared on the same K values:

* the CPU worker's ``StepScores`` (the scorer the policies are tested with on CPU), fed a
  CPU-attention-style cache holding the same keys;
* ``score_attention_reference`` (PyTorch over vLLM's GPU-layout views);
* ``score_attention_triton`` under ``TRITON_INTERPRET=1`` on CPU tensors.

The GPU-layout views come from vLLM's own ``create_kv_cache_views`` (tests/core/vllm_kv_views.py)
for ``LBNHC`` (default) and ``LBHNC`` (FlashInfer SM100), with shuffled physical blocks. Sizes
are small because the interpreter runs every program in Python.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_kv_views import vllm_kv_views
from vtoken.kernels import triton_available
from vtoken.kernels.score import (
    ScoreRow,
    plan_scores,
    score_attention,
    score_attention_reference,
    score_attention_triton,
    step_score_row,
)
from vtoken.policies.base import AttentionNeed

from vtoken.integrations.vllm.worker.scoring import StepScores

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed")

COL, LAST = AttentionNeed.COL_SUM.value, AttentionNeed.LAST_ROW.value


@pytest.fixture(scope="module")
def interpret():
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


class Impl:
    """The attributes StepScores reads from an attention impl."""

    def __init__(self, hq, hkv, hd):
        self.num_heads, self.num_kv_heads, self.head_size = hq, hkv, hd
        self.scale = 1.0 / math.sqrt(hd)


class Meta:
    def __init__(self, qsl, seq_lens, block_table):
        self.query_start_loc, self.seq_lens, self.block_table = qsl, seq_lens, block_table


def make_batch(reqs, *, hq, hkv, hd, bs, layers, layout, dtype, seed, device="cpu",
               page_pad_bytes=0, split=False):
    """A ragged step. ``reqs``: list of (n, qlen, need) per batch row (need 0 = not scored).

    ``split``: vLLM manager blocks of ``2*bs`` tokens viewed as kernel blocks of ``bs`` (the
    view, and so the block table, is in kernel blocks). ``page_pad_bytes``: padded pages.

    Returns a dict with per-layer GPU-layout caches, the matching CPU-layout caches for
    StepScores, per-layer queries [T, Hq, hd], block table, query_start_loc, seq_lens.
    """
    gen = torch.Generator().manual_seed(seed)
    nblocks = [-(-n // bs) for n, _, _ in reqs]
    num_blocks = sum(nblocks) + 4  # a few blocks nobody uses
    num_blocks += num_blocks % 2 if split else 0  # whole manager blocks
    _raw, caches = vllm_kv_views(layout, num_layers=layers,
                                 num_blocks=num_blocks // 2 if split else num_blocks,
                                 block_size=2 * bs if split else bs,
                                 kernel_block_size=bs if split else None,
                                 page_pad_bytes=page_pad_bytes, num_kv_heads=hkv, head_size=hd,
                                 dtype=dtype, device=device)
    assert caches[0].shape[0] == num_blocks and caches[0].shape[2] == bs
    cpu_caches, queries = [], []
    for c in caches:
        vals = torch.randn(c.shape, generator=gen).to(dtype)
        c.copy_(vals.to(device))
        cpu = torch.empty(num_blocks, hkv, bs, 2 * hd, dtype=dtype)
        # vLLM's CPU layout with an identity token map: K region = [bs, hd] row-major.
        cpu.view(num_blocks, hkv, 2, bs, hd)[:, :, 0] = vals[..., :hd]
        cpu.view(num_blocks, hkv, 2, bs, hd)[:, :, 1] = vals[..., hd:]
        cpu_caches.append(cpu)
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(nblocks) + 1
    bt = torch.randint(0, num_blocks, (len(reqs), max_blocks), generator=gen, dtype=torch.int32)
    at = 0
    for i, nb in enumerate(nblocks):
        bt[i, :nb] = perm[at : at + nb].to(torch.int32)
        at += nb
    qlens = [q for _, q, _ in reqs]
    qsl = torch.tensor([0] + list(np.cumsum(qlens)), dtype=torch.int32)
    T = int(qsl[-1])
    for _ in range(layers):
        # A strided query (like a slice of the fused QKV projection output).
        big = torch.randn(T, hq + 2, hd, generator=gen).to(dtype)
        queries.append(big[:, 1 : 1 + hq])
    seq_lens = torch.tensor([n for n, _, _ in reqs], dtype=torch.int32)
    return dict(caches=caches, cpu_caches=cpu_caches,
                queries=queries, bt=bt, qsl=qsl, seq_lens=seq_lens)


def score_rows(reqs, qsl):
    rows, which = [], []
    for i, (n, _q, need) in enumerate(reqs):
        if need:
            rows.append(step_score_row(i, n, int(qsl[i]), int(qsl[i + 1]), bool(need & COL),
                                       bool(need & LAST)))
            which.append(i)
    return rows, which


def run_step_scores(batch, reqs, hq, hkv, hd):
    from vtoken.integrations.vllm.worker.kv_layout import CPUKVLayout, TokenLayout

    bs = batch["cpu_caches"][0].shape[2]
    ident = torch.arange(bs * hd).view(bs, hd)
    layout = CPUKVLayout(TokenLayout(idx_k=ident, idx_v=ident))
    st = StepScores([(i, f"r{i}", need) for i, (_, _, need) in enumerate(reqs) if need])
    meta = Meta(batch["qsl"], batch["seq_lens"], batch["bt"])
    for q, cpu in zip(batch["queries"], batch["cpu_caches"]):
        st.accumulate(Impl(hq, hkv, hd), q.contiguous().view(q.shape[0], -1), cpu, meta, layout)
    return st.result()


def run_kernel(fn, batch, plan, hq, hd, **kw):
    out = plan.new_out(batch["caches"][0].device)
    bt = batch["bt"].to(out.device)
    for q, c in zip(batch["queries"], batch["caches"]):
        fn(q.to(c.device), c, bt, plan, out, scale=1.0 / math.sqrt(hd), **kw)
    return plan.results(out, hq * len(batch["caches"]))


def assert_same(got, step_res, which, reqs, atol):
    for (col, last), i in zip(got, which):
        n, _q, need = reqs[i]
        exp_col, exp_last = step_res[f"r{i}"]
        assert (col is None) == (exp_col is None), (i, need)
        assert (last is None) == (exp_last is None), (i, need)
        for a, b in ((col, exp_col), (last, exp_last)):
            if a is not None:
                assert a.shape == (n,)
                np.testing.assert_allclose(a, b, rtol=0, atol=atol)


# A ragged batch: decode rows (H2O col+last, TOVA last), a prefill chunk with column sums and
# the last row, a chunk with column sums only, a last-row-only chunk, a row that is not scored,
# and a chunk whose n is exactly its query length (first chunk of a prompt).
def ragged(bs):
    return [
        (bs + 5, 1, COL | LAST),
        (2 * bs + 1, 1, LAST),
        (bs + 9, 7, COL | LAST),
        (bs - 3, 4, COL),
        (2 * bs, 6, LAST),
        (bs + 2, 1, 0),
        (9, 9, COL | LAST),
    ]


HEADS = [pytest.param(4, 1, id="MQA"), pytest.param(6, 2, id="GQA3"), pytest.param(4, 4, id="MHA")]


@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("hq, hkv", HEADS)
def test_reference_matches_step_scores(bs, hq, hkv):
    reqs = ragged(bs)
    hd = 16
    batch = make_batch(reqs, hq=hq, hkv=hkv, hd=hd, bs=bs, layers=2, layout=KVCacheLayout.LBNHC,
                       dtype=torch.float32, seed=bs + hq)
    rows, which = score_rows(reqs, batch["qsl"])
    plan = plan_scores(rows)
    got = run_kernel(score_attention_reference, batch, plan, hq, hd)
    assert_same(got, run_step_scores(batch, reqs, hq, hkv, hd), which, reqs, atol=1e-6)


def check_triton_vs_step_scores(bs, hq, hkv, *, device="cpu", hd=16, dtype=torch.float32,
                                layout=None, reqs=None):
    """The Triton scorer (interpreter on CPU, compiled on CUDA) against StepScores (CPU)."""
    reqs = reqs or ragged(bs)
    if layout is None:
        layout = KVCacheLayout.LBNHC if bs != 32 else KVCacheLayout.LBHNC
    batch = make_batch(reqs, hq=hq, hkv=hkv, hd=hd, bs=bs, layers=2, layout=layout,
                       dtype=dtype, seed=bs * hq + hkv, device=device)
    rows, which = score_rows(reqs, batch["qsl"])
    expect = run_step_scores(batch, reqs, hq, hkv, hd)
    for scratch in (True, False):  # decode rows: logits kept between phases / recomputed
        plan = plan_scores(rows, logits_scratch=scratch)
        got = run_kernel(score_attention_triton, batch, plan, hq, hd)
        assert_same(got, expect, which, reqs, atol=1e-5)
        # Probability mass: a decode row sums to 1, a chunk's column sums to its query rows.
        for (col, last), i in zip(got, which):
            n, q, need = reqs[i]
            if col is not None:
                assert col.sum() == pytest.approx(q if q > 1 else 1, abs=1e-5)
            if last is not None:
                assert last.sum() == pytest.approx(1.0, abs=1e-5)


@needs_triton
@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("hq, hkv", HEADS)
def test_triton_matches_step_scores(interpret, bs, hq, hkv):
    """Decode rows, prefill chunks, GQA/MQA/MHA, block sizes 16/32/64, ragged batch: the
    interpreter kernel gives StepScores' numbers to 1e-5 (two layers summed)."""
    check_triton_vs_step_scores(bs, hq, hkv)


@needs_triton
@pytest.mark.parametrize("layout, pad, split", [
    (KVCacheLayout.BLHNC, 0, False),
    (KVCacheLayout.LHBNC, 0, False),
    (KVCacheLayout.LBNHC, 64, False),
    (KVCacheLayout.LBNHC, 0, True),
    (KVCacheLayout.LBHNC, 0, True),
], ids=["BLHNC", "LHBNC", "LBNHC-padded", "LBNHC-kernel-split", "LBHNC-kernel-split"])
def test_triton_other_layouts_bf16(interpret, layout, pad, split):
    """Block-outer and head-outer layouts, padded pages, kernel-block splits; bf16 keys and
    queries, head size 24 (masked dims)."""
    reqs = [(20, 1, COL | LAST), (40, 5, COL | LAST), (17, 1, LAST)]
    hq, hkv, hd, bs = 6, 3, 24, 16
    batch = make_batch(reqs, hq=hq, hkv=hkv, hd=hd, bs=bs, layers=2, layout=layout,
                       dtype=torch.bfloat16, seed=5, page_pad_bytes=pad, split=split)
    rows, which = score_rows(reqs, batch["qsl"])
    plan = plan_scores(rows)
    got = run_kernel(score_attention_triton, batch, plan, hq, hd)
    exp = run_kernel(score_attention_reference, batch, plan, hq, hd)
    for (a_col, a_last), (b_col, b_last) in zip(got, exp):
        for a, b in ((a_col, b_col), (a_last, b_last)):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert_same(got, run_step_scores(batch, reqs, hq, hkv, hd), which, reqs, atol=1e-5)


@needs_triton
def test_triton_accumulates_into_existing_out(interpret):
    """out += per call: two calls on the same layer give twice one call."""
    reqs = [(30, 1, COL), (12, 4, COL | LAST)]
    batch = make_batch(reqs, hq=2, hkv=1, hd=16, bs=16, layers=1, layout=KVCacheLayout.LBNHC,
                       dtype=torch.float32, seed=1)
    rows, _ = score_rows(reqs, batch["qsl"])
    plan = plan_scores(rows)
    args = (batch["queries"][0], batch["caches"][0], batch["bt"], plan)
    once, twice = plan.new_out("cpu"), plan.new_out("cpu")
    score_attention_triton(*args, once, scale=0.25)
    score_attention_triton(*args, twice, scale=0.25)
    score_attention_triton(*args, twice, scale=0.25)
    torch.testing.assert_close(twice, 2 * once, rtol=0, atol=1e-6)
    assert float(once[:30].sum()) == pytest.approx(2.0, abs=1e-5)  # decode row, 2 heads


def test_plan_layout_and_errors():
    plan = plan_scores([ScoreRow(0, 5, 0, 1, True, True), ScoreRow(1, 8, 1, 3, True, True),
                        ScoreRow(2, 4, 4, 1, False, True), ScoreRow(3, 6, 5, 2, False, False)])
    assert plan.items.tolist() == [
        [0, 5, 0, 1, 0, -1, 0, 0],
        [1, 8, 1, 3, 5, 13, 1, -1],
        [2, 4, 4, 1, 21, -1, 4, 5],
        [3, 6, 5, 2, -1, -1, 5, -1],
    ]
    assert (plan.out_size, plan.lse_rows, plan.max_q, plan.max_n) == (25, 7, 3, 8)
    assert plan.logits_per_head == 9
    assert plan_scores(plan.rows, logits_scratch=False).items[:, 7].tolist() == [-1] * 4
    assert plan.col_slices == [(0, 5), (5, 8), None, None]
    assert plan.last_slices == [(0, 5), (13, 8), (21, 4), None]
    assert step_score_row(2, 10, 3, 7, col=False, last=True) == ScoreRow(2, 10, 6, 1, False, True)
    assert step_score_row(2, 10, 3, 7, col=True, last=False) == ScoreRow(2, 10, 3, 4, True, False)
    with pytest.raises(ValueError, match="n = 2 < ql = 3"):
        plan_scores([ScoreRow(0, 2, 0, 3, True, False)])
    with pytest.raises(ValueError, match="ql = 0"):
        plan_scores([ScoreRow(0, 2, 0, 0, True, False)])


def test_validation_errors():
    plan = plan_scores([ScoreRow(0, 5, 0, 1, True, False)])
    q, kv = torch.zeros(1, 4, 8), torch.zeros(2, 2, 4, 16)
    bt, out = torch.zeros(1, 2, dtype=torch.int32), torch.zeros(5)
    with pytest.raises(ValueError, match="2\\*head_size"):
        score_attention_reference(q, torch.zeros(2, 2, 4, 12), bt, plan, out, scale=1.0)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        score_attention_reference(torch.zeros(1, 3, 8), kv, bt, plan, out, scale=1.0)
    with pytest.raises(ValueError, match="float32"):
        score_attention_reference(q, kv, bt, plan, out.double(), scale=1.0)
    with pytest.raises(ValueError, match="needs 2 blocks"):
        score_attention_reference(q, kv, bt[:, :1], plan, out, scale=1.0)
    with pytest.raises(ValueError, match="block_table"):
        score_attention_reference(q, kv, bt.float(), plan, out, scale=1.0)


@needs_triton
def test_interpreter_speed_vs_torch(interpret):
    """Could the CPU path use the Triton kernel (interpreter)? Measured here, asserted loosely.

    Case: SmolLM2-like heads (9 query, 3 KV, hd 64), bs 32, one layer, 8 decode rows of
    n = 200 plus one 16-row prefill chunk (n = 200). Recorded on this 2-core machine:
    see docs/gpu-kernels.md (the interpreter is orders of magnitude slower than PyTorch,
    so the CPU path keeps PyTorch: ``score_attention`` dispatches to the reference on CPU).
    """
    reqs = [(200, 1, COL | LAST)] * 8 + [(200, 16, COL | LAST)]
    batch = make_batch(reqs, hq=9, hkv=3, hd=64, bs=32, layers=1, layout=KVCacheLayout.LBNHC,
                       dtype=torch.float32, seed=3)
    rows, _ = score_rows(reqs, batch["qsl"])
    plan = plan_scores(rows)

    def timed(fn, reps):
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            run_kernel(fn, batch, plan, 9, 64)
            best = min(best, time.perf_counter() - t0)
        return best

    t_torch = timed(score_attention_reference, 5)  # best of 5: robust to a busy machine
    t_step = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        run_step_scores(batch, reqs, 9, 3, 64)
        t_step = min(t_step, time.perf_counter() - t0)
    t_triton = timed(score_attention_triton, 1)
    print(f"\nscoring, 1 layer: torch reference {t_torch * 1e3:.1f} ms, StepScores "
          f"{t_step * 1e3:.1f} ms, Triton interpreter {t_triton * 1e3:.1f} ms")
    assert t_triton > t_torch  # if this ever fails, revisit score_attention's CPU dispatch
    got = run_kernel(score_attention, batch, plan, 9, 64)  # CPU dispatch = the reference
    exp = run_kernel(score_attention_reference, batch, plan, 9, 64)
    for (a, b), (c, d) in zip(got, exp):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)


BIG_SCORE_SCRIPT = r"""
import math, os, resource, sys
def _rss_kb():  # current resident set of this process, in KiB (ru_maxrss may carry the parent's peak)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
_RSS0 = _rss_kb()
_PEAK = 0
os.environ["TRITON_INTERPRET"] = "1"
import numpy as np
import torch
sys.path.insert(0, os.environ["VIEWS_DIR"])
from vllm_kv_views import vllm_kv_views
from vllm.v1.kv_cache_layout import KVCacheLayout
from vtoken.kernels.score import ScoreRow, plan_scores, score_attention_reference, score_attention_triton

# fp16, 2 kv heads x (2 x 8) elements x 16 tokens = 512 elements per block; 2^22 + 2^18 blocks
# put the top blocks past 2^31 elements (4.5 GiB of untouched torch.empty pages).
bs, hkv, hq, hd = 16, 2, 4, 8
nb = 2**22 + 2**18
for layout in (KVCacheLayout.LBNHC, KVCacheLayout.LHBNC):
    raw, (kv,) = vllm_kv_views(layout, num_layers=1, num_blocks=nb, block_size=bs,
                               num_kv_heads=hkv, head_size=hd, dtype=torch.float16)
    gen = torch.Generator().manual_seed(0)
    blocks = torch.tensor([[nb - 1, 3, nb - 2, nb // 2 + 5], [nb - 3, nb - 4, 0, 0]], dtype=torch.int32)
    for b in blocks.flatten().unique().tolist():
        kv[b] = torch.randn(kv[b].shape, generator=gen).to(torch.float16)
    far = max(kv[b, h].data_ptr() for b in blocks.flatten().tolist() for h in range(hkv))
    assert (far - raw.data_ptr()) // 2 > 2**31, far - raw.data_ptr()
    q = torch.randn(6, hq, hd, generator=gen).to(torch.float16)
    plan = plan_scores([ScoreRow(0, 55, 0, 5, True, True), ScoreRow(1, 20, 5, 1, True, True)])
    ref, got = plan.new_out("cpu"), plan.new_out("cpu")
    score_attention_reference(q, kv, blocks, plan, ref, scale=1 / math.sqrt(hd))
    score_attention_triton(q, kv, blocks, plan, got, scale=1 / math.sqrt(hd))
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=0, atol=1e-5 * hq)
    assert abs(float(got[55:110].sum()) - hq) < 1e-4  # last row of the chunk: one per head
    _PEAK = max(_PEAK, _rss_kb() - _RSS0)  # resident growth while the big buffer is alive
    del raw, kv
print("RSS_MB", _PEAK // 1024)
print("OK")
"""


@needs_triton
def test_triton_offsets_past_2_31_elements():
    """Block ids whose element offset exceeds 2^31 (int32 arithmetic would wrap), for a
    token-contiguous and a head-outer layout. The 4.5 GiB fp16 buffer comes from
    ``torch.empty`` and only the blocks used are written, so little of it becomes resident;
    a subprocess keeps a wrong address from crashing the test session."""
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1",
               VIEWS_DIR=os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", BIG_SCORE_SCRIPT], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    assert out.stdout.strip().endswith("OK")
    assert int(out.stdout.split("RSS_MB")[1].split()[0]) < 2048


@needs_triton
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_score_kernels_compile_for_sm90_without_gpu(monkeypatch, dtype):
    """The compiled path (not the interpreter) lowers both phases to SM90 cubins: the dot tile
    shapes, the fp32 "ieee" dot, int64 offsets and the reductions are accepted."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vtoken.kernels import triton_score as ts

    common = {"q_ptr": f"*{dtype}", "s_qt": "i32", "s_qh": "i32", "s_qd": "i32",
              "kv_ptr": f"*{dtype}", "s_kb": "i64", "s_kh": "i32", "s_kn": "i32",
              "bt_ptr": "*i32", "s_bt": "i32", "items_ptr": "*i64", "lse_ptr": "*fp32",
              "lg_ptr": "*fp32"}
    bq, bg, bn, bd = ts._blocks(3, 64, 1)  # SmolLM2 decode: G = 3, hd = 64
    cons = {"BLOCK_Q": bq, "BLOCK_G": bg, "BLOCK_N": bn, "BLOCK_D": bd}
    consts = {k: "constexpr" for k in cons}
    lse_sig = {**common, "scale": "fp32", "BS": "i32", "HQ": "i32", "G": "i32", "HD": "i32",
               **consts}
    prob_sig = {**common, "out_ptr": "*fp32", "scale": "fp32", "BS": "i32", "HQ": "i32",
                "HKV": "i32", "G": "i32", "HD": "i32", **consts, "BLOCK_H": "constexpr"}
    for fn, sig in ((ts._score_lse_kernel, lse_sig), (ts._score_prob_kernel, prob_sig)):
        try:
            consts_of = {**cons, "BLOCK_H": 16} if "BLOCK_H" in sig else cons
            compiled = triton.compile(
                ASTSource(fn=triton.jit(fn), signature=sig, constexprs=consts_of),
                target=GPUTarget("cuda", 90, 32))
        except Exception as exc:  # pragma: no cover - toolchain missing on this install
            if "ptxas" in str(exc).lower():
                pytest.skip(f"no ptxas: {exc}")
            raise
        assert len(compiled.asm["cubin"]) > 0


# ---------------------------------------------------------------------------- real CUDA
# Selected by ``make device-check`` (``-k cuda``); skipped without a GPU.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(),
                                reason="no CUDA")


@needs_cuda
@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("hq, hkv", HEADS)
def test_cuda_score_matches_step_scores(monkeypatch, bs, hq, hkv):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    check_triton_vs_step_scores(bs, hq, hkv, device="cuda")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_score_llama_shape(monkeypatch, dtype):
    """Llama-3-8B heads (32 q, 8 kv, hd 128), bs 16, long rows and a 64-row prefill chunk,
    against the PyTorch reference on the same CUDA tensors."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reqs = [(2048, 1, COL | LAST), (1000, 1, LAST), (777, 64, COL | LAST), (1500, 1, COL)]
    hq, hkv, hd = 32, 8, 128
    batch = make_batch(reqs, hq=hq, hkv=hkv, hd=hd, bs=16, layers=2,
                       layout=KVCacheLayout.LBNHC, dtype=dtype, seed=11, device="cuda")
    rows, _ = score_rows(reqs, batch["qsl"])
    plan = plan_scores(rows)
    got = run_kernel(score_attention_triton, batch, plan, hq, hd)
    exp = run_kernel(score_attention_reference, batch, plan, hq, hd)
    for (a_col, a_last), (b_col, b_last) in zip(got, exp):
        for a, b in ((a_col, b_col), (a_last, b_last)):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@needs_triton
def test_launch_with_upper_bounds_is_identical(interpret):
    """Graph-friendly launch: fixed (larger) grid bounds and device-resident items give the
    same bits as exact bounds; programs past an item's ql / n do nothing."""
    from vtoken.kernels.triton_score import launch_score_kernels

    reqs = [(37, 1, COL | LAST), (20, 6, COL | LAST), (9, 1, LAST)]
    hq, hkv, hd = 4, 2, 16
    batch = make_batch(reqs, hq=hq, hkv=hkv, hd=hd, bs=16, layers=1, layout=KVCacheLayout.LBNHC,
                       dtype=torch.float32, seed=2)
    rows, _ = score_rows(reqs, batch["qsl"])
    plan = plan_scores(rows)
    outs = []
    for max_q, max_n in ((plan.max_q, plan.max_n), (64, 512)):
        out = plan.new_out("cpu")
        lse = torch.full((plan.lse_rows + 5, hq), float("nan"))
        lg = torch.full((plan.logits_per_head * hq + 7,), float("nan"))
        launch_score_kernels(batch["queries"][0], batch["caches"][0], batch["bt"],
                             plan.items_on(torch.device("cpu")), out, lse, lg, scale=0.25,
                             max_q=max_q, max_n=max_n)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert not torch.isnan(outs[0]).any()
    assert float(outs[0].sum()) == pytest.approx(hq * (1 + 6 + 1 + 1), abs=1e-4)
