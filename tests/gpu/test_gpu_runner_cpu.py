"""The CUDA worker's pieces that run on CPU tensors (issue 14, item 1), checked against references.

* ``PagedKVLayout`` (FlashAttention's layout): the stride order of views built by vLLM's own
  ``create_kv_cache_views`` for every ``KVCacheLayout`` is recognised, a wrong one refused; moves
  and key reads equal plain PyTorch indexing of the logical view; the layout vLLM resolves for
  FlashAttention (``get_supported_kv_cache_layouts``) is ``LBNHC``;
* ``GPUStepScores`` (the Triton scorer's plan; the PyTorch scorer on CPU tensors) gives the CPU
  worker's ``StepScores`` numbers to 1e-5 for decode rows, prefill chunks and last-row-only rows;
* ``GPUWorkerStep`` applies the worker's moves per token set through the paged layout;
* the runners' physical inputs: MRV2 gives attention a **persistent** ``seq_lens`` buffer on
  every step (same address with and without offsets; ``input_batch.seq_lens`` stays logical),
  physical positions and upper bounds; V1 subtracts in place and recomputes the slot mapping
  from ``position - offset``;
* ``VTokenGPUWorker._make_model_runner`` builds the adapter of the runner vLLM picked.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from vllm_kv_views import ALL_LAYOUTS, vllm_kv_views  # noqa: E402

from vtoken.config import VTokenConfigError  # noqa: E402
from vtoken.integrations.vllm.worker.kv_layout import PagedKVLayout, flash_attn_kv_layout  # noqa: E402
from vtoken.integrations.vllm.protocol import StepPayload  # noqa: E402
from vtoken.policies.base import AttentionNeed  # noqa: E402

COL, LAST = AttentionNeed.COL_SUM.value, AttentionNeed.LAST_ROW.value


def _views(layout, layers=2, nb=12, bs=16, h=2, hd=8, dtype=torch.float32, **kw):
    raw, views = vllm_kv_views(layout, num_layers=layers, num_blocks=nb, block_size=bs, num_kv_heads=h,
                               head_size=hd, dtype=dtype, **kw)
    g = torch.Generator().manual_seed(0)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=g).to(dtype))
    return raw, views


# ---------------------------------------------------------------------- layout
@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda x: x.name)
def test_view_order_recognised_for_every_layout(layout):
    _, views = _views(layout)
    PagedKVLayout(layout.name).check_view(views[0])


def test_wrong_layout_refused():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    _, views = _views(KVCacheLayout.LBHNC)
    with pytest.raises(ValueError) as ei:
        PagedKVLayout("LBNHC").check_view(views[0])
    assert "give axis order (0, 1, 2, 3); KVCacheLayout.LBNHC means (0, 2, 1, 3)" in str(ei.value)


def test_flash_attn_layout_resolved_by_vllm():
    assert flash_attn_kv_layout(None) == PagedKVLayout("LBNHC", "FLASH_ATTN")
    assert flash_attn_kv_layout(SimpleNamespace(kv_cache_layout=None)).layout == "LBNHC"
    assert flash_attn_kv_layout(SimpleNamespace(kv_cache_layout="LBHNC")).layout == "LBHNC"


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda x: x.name)
def test_moves_and_key_reads_match_indexing(layout):
    raw, views = _views(layout, dtype=torch.bfloat16)
    lay = PagedKVLayout(layout.name)
    bs, hd = 16, 8
    src = torch.tensor([3, 40, 77, 150], dtype=torch.int64)
    dst = torch.tensor([100, 5, 190, 33], dtype=torch.int64)
    ref = [v.clone() for v in views]
    for r in ref:
        vals = r[src // bs, :, src % bs, :].clone()
        r[dst // bs, :, dst % bs, :] = vals
    before = raw.clone()
    lay.move_tokens(views[1], src, dst)
    assert torch.equal(views[1], ref[1])  # the moved layer, bit for bit
    # the other layer is untouched: compare its bytes with the copy taken before
    _, views_before = vllm_kv_views(layout, num_layers=2, num_blocks=12, block_size=bs, num_kv_heads=2, head_size=hd,
                                    dtype=torch.bfloat16, raw=before)
    assert torch.equal(views[0].view(torch.int16), views_before[0].view(torch.int16))
    blocks = torch.tensor([7, 2, 11], dtype=torch.int64)
    k = lay.gather_keys(views[1], blocks, 40)
    s = torch.arange(40)
    want = views[1][blocks[s // bs], :, s % bs, :hd].permute(1, 0, 2).float()
    assert k.shape == (2, 40, hd) and torch.equal(k, want)
    kb = lay.gather_keys_batched(views[1], blocks[s // bs][None].repeat(2, 1), s % bs)
    assert kb.shape == (2, 2, 40, hd) and torch.equal(kb[0], want) and torch.equal(kb[1], want)


# ---------------------------------------------------------------------- scores
def _score_case(seed=0):
    from vllm.v1.kv_cache_layout import KVCacheLayout

    g = torch.Generator().manual_seed(seed)
    hq, hkv, hd, bs = 6, 2, 16, 16
    _, views = _views(KVCacheLayout.LBNHC, layers=2, nb=20, bs=bs, h=hkv, hd=hd)
    # batch: r0 decode (n=37), r1 prefill chunk of 5 rows (n=21), r2 unscored decode, r3 chunk of 4, last row only
    q_lens, n = [1, 5, 1, 4], [37, 21, 50, 30]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    perm = torch.randperm(20, generator=g)
    bt = torch.zeros(4, 4, dtype=torch.int32)
    at = 0
    for i, ni in enumerate(n):
        k = -(-ni // bs)
        bt[i, :k] = perm[at:at + k].to(torch.int32)
        at += k
    meta = SimpleNamespace(query_start_loc=torch.from_numpy(qsl), seq_lens=torch.tensor(n, dtype=torch.int32),
                           block_table=bt)
    query = torch.randn(int(qsl[-1]), hq * hd, generator=g)
    impl = SimpleNamespace(num_heads=hq, head_size=hd, num_kv_heads=hkv, scale=hd ** -0.5)
    rows = [(0, "a", COL | LAST), (1, "b", COL), (3, "d", LAST)]
    return views, meta, query, impl, rows, qsl, np.array(n)


def test_gpu_step_scores_equal_cpu_step_scores():
    from vtoken.integrations.vllm.worker.gpu_runner import GPUStepScores
    from vtoken.integrations.vllm.worker.scoring import StepScores

    views, meta, query, impl, rows, qsl, n = _score_case()
    lay = PagedKVLayout("LBNHC")
    ref, got = StepScores(rows), GPUStepScores(rows, lambda: (qsl, n))
    for kv in views:
        ref.accumulate(impl, query, kv, meta, lay)
        got.accumulate(impl, query, kv, meta, lay)
    r, o = ref.result(), got.result()
    assert sorted(r) == sorted(o) == ["a", "b", "d"]
    for rid in r:
        for x, y in zip(r[rid], o[rid]):
            assert (x is None) == (y is None), rid
            if x is not None:
                assert x.shape == y.shape
                np.testing.assert_allclose(y, x, atol=1e-5, rtol=0)
    assert o["b"][1] is None and o["d"][0] is None
    assert got.num_layers == 2 and got.num_heads == 6
    np.testing.assert_allclose(o["a"][0].sum(), 1.0, atol=1e-5)  # one query row: a distribution


# ---------------------------------------------------------------------- worker step
def _step(views, layout="LBNHC"):
    from vtoken.integrations.vllm.worker.gpu_runner import GPUWorkerStep

    fc = {f"layer.{i}": SimpleNamespace(kv_cache=v, impl=SimpleNamespace()) for i, v in enumerate(views)}
    return GPUWorkerStep(fc, PagedKVLayout(layout), lambda: (np.zeros(1), np.zeros(0)))


def test_step_applies_the_worker_moves_per_set_and_records_offsets():
    """The worker's moves (``WorkerEviction``: global slots and each move's token set) go to
    every layer through the paged layout, per set: ``request`` moves every layer and head,
    ``head`` only the (layer, KV head) of its set; offsets and score requests are recorded."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from vtoken.kernels import move_tokens_paged_reference

    _, views = _views(KVCacheLayout.LBNHC, layers=3)
    ref = [v.clone() for v in views]
    src, dst = torch.tensor([1, 2, 30]), torch.tensor([60, 61, 5])
    move_tokens_paged_reference(ref, src, dst)
    ws = _step(views)
    ws._apply_set_moves("request", src, dst, torch.zeros(3, dtype=torch.int64))
    assert all(torch.equal(v, r) for v, r in zip(views, ref))
    # head sets: set s = layer * Hkv + head; move slot 7 -> 3 in (layer 2, head 1) only
    before = [v.clone() for v in views]
    ws._apply_set_moves("head", torch.tensor([7]), torch.tensor([3]), torch.tensor([2 * 2 + 1]))
    bs = views[0].shape[2]
    for layer, v in enumerate(views):
        want = before[layer].clone()
        if layer == 2:
            want[3 // bs, 1, 3 % bs] = before[layer][7 // bs, 1, 7 % bs]
        assert torch.equal(v, want), layer
    p = StepPayload(offsets={"a": 3, "b": 0}, scores={"a": COL})
    ws.offsets["b"] = 2
    ws.begin_step(p)
    assert ws.offsets == {"a": 3} and ws.score_reqs == {"a": COL} and ws.needs_scores()
    ws.begin_step(None)
    assert not ws.needs_scores()


def test_kernel_block_split_refused():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from vtoken.integrations.vllm.worker.gpu_runner import check_caches
    from vtoken.integrations.vllm.frontend.refusals import REFUSALS

    _, views = _views(KVCacheLayout.LBNHC, layers=2, bs=32, kernel_block_size=16)
    ws = _step(views)
    with pytest.raises(VTokenConfigError) as ei:
        check_caches(ws, 32)
    reason = next(r.reason for r in REFUSALS if r.key == "block_size")
    assert str(ei.value) == (f"--block-size = 32: vToken does not support it yet ({reason}; the attention backend "
                             "splits it into kernel blocks of 16 tokens)")
    _, views = _views(KVCacheLayout.LBNHC, layers=2, bs=32)
    assert check_caches(_step(views), 32) == 2


def test_pinned_staging_cpu_copy_and_bounds():
    from vtoken.integrations.vllm.worker.gpu_runner import PinnedStaging

    st = PinnedStaging()
    dst = torch.full((5,), -1, dtype=torch.int32)
    out = st.copy(dst, np.array([4, 5, 6], dtype=np.int64))
    assert out.data_ptr() == dst.data_ptr() and dst.tolist() == [4, 5, 6, -1, -1]
    with pytest.raises(ValueError, match="staging: 6 values for a device buffer of 5"):
        st.copy(dst, np.arange(6))


# ---------------------------------------------------------------------- runners' physical inputs
def _v2_runner(offsets: dict[str, int]):
    from vtoken.integrations.vllm.worker.gpu_runner import VTokenGPUModelRunnerV2

    r = VTokenGPUModelRunnerV2.__new__(VTokenGPUModelRunnerV2)
    r.max_num_reqs, r.max_num_tokens, r.device = 8, 64, torch.device("cpu")
    r._vt = _step([])
    r._vt.offsets.update(offsets)
    r._vt_init_buffers()
    return r


def _v2_batch():
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    buf = InputBuffers(8, 64, torch.device("cpu"))
    ib = InputBatch.make_dummy(3, 7, buf)  # 3 requests of 2, 2, 3 tokens
    ib.seq_lens.copy_(torch.tensor([40, 12, 33], dtype=torch.int32))
    ib.positions.copy_(torch.tensor([38, 39, 10, 11, 30, 31, 32]))
    return dataclasses.replace(ib, req_ids=["a", "b", "c"], seq_lens_cpu_upper_bound=torch.tensor([40, 12, 33]),
                               num_computed_tokens_np=np.array([38, 10, 30]))


def test_v2_physical_seq_lens_persistent_buffer_every_step():
    r = _v2_runner({"a": 5, "c": 2})
    ib = _v2_batch()
    off = r._vt.batch_offsets(ib.req_ids)
    assert off.tolist() == [5, 0, 2]
    phys = r._vt_physical_seq_lens(ib, off)
    assert phys.seq_lens.tolist() == [35, 12, 31]
    assert phys.seq_lens_cpu_upper_bound.tolist() == [35, 12, 31]
    assert phys.seq_lens.data_ptr() == r._vt_phys_seq_lens.data_ptr()
    assert ib.seq_lens.tolist() == [40, 12, 33] and ib.seq_lens_cpu_upper_bound.tolist() == [40, 12, 33]
    plain = r._vt_physical_seq_lens(ib, None)  # no offsets: the same buffer (what FULL graphs captured)
    assert plain.seq_lens.data_ptr() == r._vt_phys_seq_lens.data_ptr() and plain.seq_lens.tolist() == [40, 12, 33]
    assert plain.seq_lens_cpu_upper_bound is ib.seq_lens_cpu_upper_bound


def test_v2_physical_positions_and_host_lengths():
    r = _v2_runner({"a": 5, "c": 2})
    ib = _v2_batch()
    off = r._vt.batch_offsets(ib.req_ids)
    pos = r._vt_physical_positions(ib, off)
    assert pos.tolist() == [33, 34, 10, 11, 28, 29, 30]
    assert pos.data_ptr() == r._vt_phys_pos.data_ptr() and ib.positions.tolist()[0] == 38
    qsl, n = r._vt_host_lengths(ib)
    assert qsl.tolist() == [0, 2, 4, 7] and n.tolist() == [35, 12, 31]


def test_v1_physical_inputs_in_place():
    from vtoken.integrations.vllm.worker.gpu_runner import VTokenGPUModelRunner

    r = VTokenGPUModelRunner.__new__(VTokenGPUModelRunner)
    r.max_num_reqs, r.max_num_tokens, r.device = 8, 64, torch.device("cpu")
    r._vt_init_buffers()
    calls = []
    r.input_batch = SimpleNamespace(block_table=SimpleNamespace(
        compute_slot_mapping=lambda n, qsl, pos: calls.append((n, qsl.tolist(), pos.tolist()))))
    r.seq_lens = torch.tensor([40, 12, 33, 0], dtype=torch.int32)
    r.optimistic_seq_lens_cpu = torch.tensor([40, 12, 33, 0], dtype=torch.int32)
    r.positions = torch.tensor([39, 10, 11, 31, 32, 0], dtype=torch.int64)
    r.req_indices = SimpleNamespace(gpu=torch.tensor([0, 1, 1, 2, 2, 0]))
    r.query_start_loc = SimpleNamespace(gpu=torch.tensor([0, 1, 3, 5, 5], dtype=torch.int32))
    r._vt_physical_inputs(np.array([5, 0, 2]), 3, 5, np.array([1, 2, 2]))
    assert r.seq_lens.tolist() == [35, 12, 31, 0] and r.optimistic_seq_lens_cpu.tolist() == [35, 12, 31, 0]
    assert r.positions.tolist() == [39, 10, 11, 31, 32, 0]  # logical (RoPE)
    assert calls == [(3, [0, 1, 3, 5], [34, 10, 11, 29, 30])]


# ---------------------------------------------------------------------- worker
@pytest.mark.parametrize("v2,encoder_only,want", [
    (True, False, "VTokenGPUModelRunnerV2"), (False, False, "VTokenGPUModelRunner"), (True, True, "upstream")])
def test_worker_builds_the_runner_vllm_picked(monkeypatch, v2, encoder_only, want):
    from vllm.v1.worker.gpu_worker import Worker

    from vtoken.integrations.vllm.worker import gpu_runner
    from vtoken.integrations.vllm.worker.gpu_worker import VTokenGPUWorker

    made = []
    for name in ("VTokenGPUModelRunner", "VTokenGPUModelRunnerV2"):
        monkeypatch.setattr(gpu_runner, name, lambda cfg, dev, _n=name: made.append((_n, cfg, dev)) or _n)
    monkeypatch.setattr(Worker, "_make_model_runner", lambda self: made.append(("upstream",)) or "upstream")
    w = VTokenGPUWorker.__new__(VTokenGPUWorker)
    w.use_v2_model_runner, w.device = v2, "cuda:0"
    w.vllm_config = SimpleNamespace(is_mm_encoder_only=encoder_only)
    assert w._make_model_runner() == want
    assert made[0][0] == want and len(made) == 1
    if want != "upstream":
        assert made[0][1:] == (w.vllm_config, "cuda:0")


# ---------------------------------------------------------------------- on a GPU (make device-check)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make device-check)")


@cuda
def test_cuda_gpu_step_scores_equal_cpu_step_scores():
    from vtoken.integrations.vllm.worker.gpu_runner import GPUStepScores
    from vtoken.integrations.vllm.worker.scoring import StepScores

    views, meta, query, impl, rows, qsl, n = _score_case(1)
    lay = PagedKVLayout("LBNHC")
    ref = StepScores(rows)
    got = GPUStepScores(rows, lambda: (qsl, n))
    cmeta = SimpleNamespace(query_start_loc=meta.query_start_loc.cuda(), seq_lens=meta.seq_lens.cuda(),
                            block_table=meta.block_table.cuda())
    for kv in views:
        ref.accumulate(impl, query, kv, meta, lay)
        got.accumulate(impl, query.cuda(), kv.cuda(), cmeta, lay)
    r, o = ref.result(), got.result()
    assert sorted(r) == sorted(o)
    for rid in r:
        for x, y in zip(r[rid], o[rid]):
            assert (x is None) == (y is None)
            if x is not None:
                np.testing.assert_allclose(y, x, atol=1e-5, rtol=0)
