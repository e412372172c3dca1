"""Tests for vtoken.kernels: reference vs Triton (interpreter on CPU) token moves.

The Triton tests run the kernel under ``TRITON_INTERPRET=1`` on CPU tensors. ``triton.jit``
reads that variable when it decorates a function; ``vtoken.kernels.triton_move`` decorates
lazily at launch time, so the module fixture below only needs the variable set while these
tests run (it is restored afterwards so other test modules are not affected). One test also
runs a fresh subprocess that sets the variable before importing anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vtoken.kernels import (  # noqa: E402
    move_tokens,
    move_tokens_reference,
    move_tokens_triton,
    triton_available,
)

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8]
INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.fixture(scope="module")
def interpret():
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


# ---------------------------------------------------------------------------- helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_OF[t.element_size()])


def random_fill(t: torch.Tensor, gen: torch.Generator) -> None:
    if t.dtype.is_floating_point:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))
    else:
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.int64).to(t.dtype))


def make_cache(layout: str, layers: int, nb: int, bs: int, h: int, hd: int, dtype, pad: int, gen):
    """Return (buffer, views). The caches live inside one padded buffer so that writes
    outside the views are detectable and base addresses may be misaligned (pad elements).

    layouts: "kv_first" = per layer [2, nb, bs, H, hd] (K = kv[0], slot stride = row);
             "kv_inner" = per layer [nb, bs, 2, H, hd] (slot stride = 2 * row).
    """
    per_layer = 2 * nb * bs * h * hd
    buf = torch.empty(pad + layers * per_layer + pad, dtype=dtype)
    random_fill(buf, gen)
    views = []
    row = h * hd
    for layer in range(layers):
        flat = buf[pad + layer * per_layer : pad + (layer + 1) * per_layer]
        if layout == "kv_first":
            kv = flat.view(2, nb, bs, h, hd)
            views += [kv[0].view(nb * bs, row), kv[1].view(nb * bs, row)]
        else:
            kv = flat.view(nb, bs, 2, h, hd)
            slots = kv.view(nb * bs, 2, row)
            views += [slots[:, 0], slots[:, 1]]
    return buf, views


def oracle(views, src, dst):
    """Row-by-row gather-then-scatter in plain Python (independent of the implementations)."""
    for v in views:
        rows = [bits(v)[int(s)].clone() for s in src]
        for d, r in zip(dst.tolist(), rows):
            bits(v)[d] = r


@st.composite
def move_case(draw):
    layout = draw(st.sampled_from(["kv_first", "kv_inner"]))
    layers = draw(st.integers(1, 3))
    nb = draw(st.integers(2, 4))
    bs = draw(st.sampled_from([4, 8]))
    h = draw(st.integers(1, 3))
    hd = draw(st.sampled_from([3, 4, 8]))
    dtype = draw(st.sampled_from(DTYPES))
    pad = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    num_slots = nb * bs
    m = draw(st.integers(0, num_slots // 2))
    repeat_src = draw(st.booleans())
    return layout, layers, nb, bs, h, hd, dtype, pad, seed, num_slots, m, repeat_src


def build(case):
    layout, layers, nb, bs, h, hd, dtype, pad, seed, num_slots, m, repeat_src = case
    gen = torch.Generator().manual_seed(seed)
    buf, views = make_cache(layout, layers, nb, bs, h, hd, dtype, pad, gen)
    perm = torch.randperm(num_slots, generator=gen)
    dst = perm[:m].clone()
    if repeat_src and m > 0:
        pool = perm[m:]
        src = pool[torch.randint(0, pool.numel(), (m,), generator=gen)]
    else:
        src = perm[m : 2 * m].clone()
    return buf, views, src.to(torch.int64), dst.to(torch.int64), layout, layers, nb, bs, h, hd, pad


def rebind(views, buf, new_buf):
    """The same views (offset/shape/stride) but over ``new_buf`` instead of ``buf``."""
    base = buf.data_ptr()
    out = []
    for v in views:
        off = (v.data_ptr() - base) // v.element_size()
        out.append(new_buf.as_strided(v.shape, v.stride(), off))
    return out


# ---------------------------------------------------------------------------- hand case


def hand_views(dtype=torch.float32):
    # 3 blocks x block size 4 = 12 slots; H=1, hd=2 -> row 2. Slot s of K holds [s, s+0.5],
    # of V [100+s, 100.5+s].
    kv = torch.empty(2, 3, 4, 1, 2, dtype=dtype)
    s = torch.arange(12, dtype=torch.float32)
    kv[0].view(12, 2).copy_(torch.stack([s, s + 0.5], 1))
    kv[1].view(12, 2).copy_(torch.stack([100 + s, 100.5 + s], 1))
    return kv, [kv[0].view(12, 2), kv[1].view(12, 2)]


def check_hand(kv):
    k, v = kv[0].view(12, 2).float(), kv[1].view(12, 2).float()
    exp_k = torch.stack([torch.arange(12.0), torch.arange(12.0) + 0.5], 1)
    exp_k[1] = torch.tensor([8.0, 8.5])
    exp_k[2] = torch.tensor([9.0, 9.5])
    assert torch.equal(k, exp_k)
    assert torch.equal(v, exp_k + 100)


def test_hand_case_reference():
    kv, views = hand_views()
    move_tokens_reference(views, torch.tensor([8, 9]), torch.tensor([1, 2]))
    check_hand(kv)


def test_dispatch_cpu_uses_reference():
    kv, views = hand_views(torch.bfloat16)
    move_tokens(views, torch.tensor([8, 9]), torch.tensor([1, 2]))
    check_hand(kv)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_hand_case_triton(interpret, dtype):
    kv, views = hand_views(dtype)
    if dtype == torch.uint8:
        kv.view(-1).copy_(torch.arange(kv.numel(), dtype=torch.uint8))
        exp = kv.clone()
        ev = [exp[0].view(12, 2), exp[1].view(12, 2)]
        for e in ev:
            e[[1, 2]] = e[[8, 9]]
        move_tokens_triton(views, torch.tensor([8, 9]), torch.tensor([1, 2]), debug=True)
        assert torch.equal(kv, exp)
    else:
        move_tokens_triton(views, torch.tensor([8, 9]), torch.tensor([1, 2]), debug=True)
        check_hand(kv)


@needs_triton
def test_interpreter_kernel_is_interpreted(interpret):
    from triton.runtime.interpreter import InterpretedFunction

    from vtoken.kernels import triton_move

    kv, views = hand_views()
    move_tokens_triton(views, torch.tensor([8]), torch.tensor([1]))
    assert isinstance(triton_move._KERNELS[True], InterpretedFunction)


@needs_triton
def test_triton_fresh_process_env_before_import():
    """TRITON_INTERPRET set before torch/triton are imported, as a user would run it."""
    code = textwrap.dedent(
        """
        import os
        assert os.environ["TRITON_INTERPRET"] == "1"
        import torch
        from vtoken.kernels import move_tokens_triton
        kv = torch.arange(2 * 3 * 4 * 2, dtype=torch.float32).view(2, 3, 4, 1, 2)
        exp = kv.clone()
        for e in (exp[0].view(12, 2), exp[1].view(12, 2)):
            e[[1, 2]] = e[[8, 9]]
        move_tokens_triton([kv[0].view(12, 2), kv[1].view(12, 2)],
                           torch.tensor([8, 9]), torch.tensor([1, 2]), debug=True)
        assert torch.equal(kv, exp), (kv, exp)
        print("OK")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("OK")


# ---------------------------------------------------------------------------- random cases


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(move_case())
def test_reference_matches_oracle(case):
    buf, views, src, dst, *_ = build(case)
    expect_buf = buf.clone()
    expect_views = rebind(views, buf, expect_buf)
    oracle(expect_views, src, dst)
    move_tokens_reference(views, src, dst)
    assert torch.equal(bits(buf), bits(expect_buf))


@needs_triton
@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(move_case())
def test_triton_matches_reference_bitwise(interpret, case):
    buf, views, src, dst, layout, layers, nb, bs, h, hd, pad = build(case)
    before = buf.clone()
    ref_buf = buf.clone()
    ref_views = rebind(views, buf, ref_buf)
    move_tokens_reference(ref_views, src, dst)
    move_tokens_triton(views, src, dst, debug=True)

    # Bit for bit, in the native dtype and reinterpreted as integers.
    assert torch.equal(buf, ref_buf)  # NaN-free data, so float equality is exact
    assert torch.equal(bits(buf), bits(ref_buf))
    if buf.dtype == torch.bfloat16:
        assert torch.equal(buf.view(torch.int16), ref_buf.view(torch.int16))

    # Padding around the caches never written.
    assert torch.equal(bits(buf[:pad]), bits(before[:pad]))
    if pad:
        assert torch.equal(bits(buf[-pad:]), bits(before[-pad:]))
    # Rows not named in dst untouched; dst rows hold the old src rows.
    old_views = rebind(views, buf, before)
    keep = torch.ones(nb * bs, dtype=torch.bool)
    keep[dst] = False
    for v, o in zip(views, old_views):
        assert torch.equal(bits(v)[keep], bits(o)[keep])
        assert torch.equal(bits(v)[dst], bits(o)[src])


@needs_triton
def test_triton_copies_nan_payloads_bitwise(interpret):
    """Arbitrary 16-bit patterns (NaNs with payloads, -0, subnormals) survive the move."""
    gen = torch.Generator().manual_seed(7)
    kv = torch.randint(-(2**15), 2**15, (2, 3, 4, 2, 4), generator=gen, dtype=torch.int16)
    kv = kv.view(torch.bfloat16)
    views = [kv[0].view(12, 8), kv[1].view(12, 8)]
    ref = kv.clone()
    move_tokens_reference([ref[0].view(12, 8), ref[1].view(12, 8)], torch.tensor([3, 7, 11]),
                          torch.tensor([0, 4, 5]))
    move_tokens_triton(views, torch.tensor([3, 7, 11]), torch.tensor([0, 4, 5]))
    assert torch.equal(kv.view(torch.int16), ref.view(torch.int16))


@needs_triton
def test_triton_aliased_views_and_long_rows(interpret):
    """Duplicate views are moved once; rows longer than one BLOCK chunk are walked."""
    from vtoken.kernels import triton_move

    gen = torch.Generator().manual_seed(3)
    row = triton_move._MAX_BLOCK * 2 + 3  # odd length -> byte words, 3 chunks
    cache = torch.randint(0, 256, (6, row), generator=gen, dtype=torch.uint8)
    ref = cache.clone()
    src, dst = torch.tensor([5, 0]), torch.tensor([1, 2])
    move_tokens_reference([ref], src, dst)
    move_tokens_triton([cache, cache], src, dst, debug=True)
    assert torch.equal(cache, ref)


# ---------------------------------------------------------------------------- validation


def _views():
    kv = torch.zeros(2, 3, 4, 1, 2)
    return [kv[0].view(12, 2), kv[1].view(12, 2)]


T = torch.tensor


@pytest.mark.parametrize(
    "views, src, dst, match",
    [
        (lambda: [torch.zeros(12, 2), torch.zeros(12, 3)], T([0]), T([1]), "shape"),
        (lambda: [torch.zeros(12, 2), torch.zeros(10, 2)], T([0]), T([1]), "shape"),
        (lambda: [torch.zeros(12, 2), torch.zeros(12, 2, dtype=torch.float16)], T([0]), T([1]),
         "dtype"),
        (lambda: [torch.zeros(12, 2, 1)], T([0]), T([1]), "2-D"),
        (lambda: [torch.zeros(2, 12).t()], T([0]), T([1]), "contiguous"),
        (lambda: [torch.zeros(24).as_strided((12, 2), (1, 1))], T([0]), T([1]), "overlap"),
        (_views, T([0, 1]), T([2]), "lengths"),
        (_views, T([0], dtype=torch.int32), T([1]), "int64"),
        (_views, T([[0]]), T([[1]]), "1-D"),
        (_views, T([12]), T([1]), "out of range"),
        (_views, T([0]), T([-1]), "out of range"),
        (_views, T([0, 1]), T([1, 2]), "both a source and a destination"),
        (_views, T([0, 1]), T([2, 2]), "more than once"),
    ],
)
def test_validation_errors(views, src, dst, match):
    with pytest.raises(ValueError, match=match):
        move_tokens_reference(views(), src, dst)


def test_overlap_check_optional():
    kv = torch.arange(48, dtype=torch.float32).view(2, 3, 4, 1, 2)
    views = [kv[0].view(12, 2)]
    # Chain 0->1, 1->2: gather-then-scatter semantics (2 gets the OLD row 1).
    move_tokens_reference(views, T([0, 1]), T([1, 2]), check_overlap=False)
    assert views[0][1].tolist() == [0.0, 1.0]
    assert views[0][2].tolist() == [2.0, 3.0]


def test_empty_moves_are_noops():
    views = _views()
    move_tokens_reference(views, T([], dtype=torch.int64), T([], dtype=torch.int64))
    move_tokens_reference([], T([1]), T([2]))


@needs_triton
def test_triton_validation(interpret):
    views = _views()
    with pytest.raises(ValueError, match="out of range"):
        move_tokens_triton(views, T([99]), T([1]), debug=True)
    with pytest.raises(ValueError, match="both a source and a destination"):
        move_tokens_triton(views, T([1]), T([1]), debug=True)
    with pytest.raises(ValueError, match="dtype"):
        move_tokens_triton([views[0], views[1].to(torch.float16)], T([0]), T([1]))


@needs_triton
def test_triton_cpu_without_interpreter_rejected(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA"):
        move_tokens_triton(_views(), T([0]), T([1]))


@needs_triton
def test_kernel_compiles_for_sm90_without_gpu(monkeypatch):
    """The compiled (non-interpreter) path lowers to a cubin for an H100/H200-class target;
    int64 -> pointer casts and the tile loop are accepted by the real compiler."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vtoken.kernels import triton_move

    kernel = triton.jit(do_not_specialize=["M"])(triton_move._move_rows_kernel)
    sig = {"meta_ptr": "*i64", "src_ptr": "*i64", "dst_ptr": "*i64", "M": "i32",
           "V": "i32", "BS": "i32", "H": "i32", "HEAD_WORDS": "constexpr",
           "WORD": "constexpr", "R": "constexpr", "BLOCK": "constexpr"}
    src = ASTSource(fn=kernel, signature=sig,
                    constexprs={"HEAD_WORDS": 32, "WORD": tl.int64, "R": 16, "BLOCK": 64})
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    except Exception as exc:  # pragma: no cover - toolchain missing on this install
        if "ptxas" in str(exc).lower():
            pytest.skip(f"no ptxas: {exc}")
        raise
    assert "ld.global.b64" in compiled.asm["ptx"]
    assert len(compiled.asm["cubin"]) > 0


@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="no CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_triton_matches_reference(dtype):
    """On a GPU: the compiled kernel against the reference, SmolLM2-like row (3 x 64)."""
    gen = torch.Generator().manual_seed(0)
    cpu_buf, cpu_views = make_cache("kv_inner", 4, 64, 16, 3, 64, dtype, 1, gen)
    buf = cpu_buf.cuda()
    views = rebind(cpu_views, cpu_buf, buf)
    perm = torch.randperm(64 * 16, generator=gen)
    src, dst = perm[:300].cuda(), perm[300:600].cuda()
    ref_buf = buf.clone()
    move_tokens_reference(rebind(views, buf, ref_buf), src, dst)
    move_tokens(views, src, dst, debug=True)
    torch.cuda.synchronize()
    assert torch.equal(bits(buf), bits(ref_buf))


# ---------------------------------------------------------------------------- vLLM layouts
#
# Paged per-layer views [num_blocks, H, block_size, 2*hd] built by vLLM's own
# create_kv_cache_views / compute_layout_strides (tests/core/vllm_kv_views.py) for every
# KVCacheLayout, with padded pages, kernel-block splits and misaligned group starts.

from vllm_kv_views import ALL_LAYOUTS, vllm_kv_views  # noqa: E402

from vtoken.kernels import (  # noqa: E402
    move_tokens_paged,
    move_tokens_paged_reference,
    move_tokens_paged_triton,
)


def paged_oracle(caches, src, dst):
    """Token by token, head by head, through the logical [B, H, N, C] indices."""
    bs = caches[0].shape[2]
    for c in caches:
        old = {int(s): [bits(c)[int(s) // bs, h, int(s) % bs].clone() for h in range(c.shape[1])]
               for s in src}
        for s, d in zip(src.tolist(), dst.tolist()):
            for h in range(c.shape[1]):
                bits(c)[d // bs, h, d % bs] = old[s][h]


@st.composite
def paged_case(draw):
    layout = draw(st.sampled_from(ALL_LAYOUTS))
    compact = set(layout.value[:2]) == {0, 1}
    pad = draw(st.sampled_from([0, 0, 8, 6])) if compact else 0
    # Kernel-block splits need dense, layer-outer pages (vLLM raises otherwise).
    split = draw(st.booleans()) and pad == 0 and layout.name in ("LBNHC", "LBHNC")
    dtype = draw(st.sampled_from(DTYPES))
    hd = draw(st.sampled_from([1, 2, 3, 4, 8]))
    h = draw(st.integers(1, 3))
    bs = draw(st.sampled_from([2, 4, 8]))
    layers = draw(st.integers(1, 3))
    nb = draw(st.integers(2, 4))
    lead = draw(st.integers(0, 3)) * dtype.itemsize if dtype.itemsize < 8 else 0
    seed = draw(st.integers(0, 2**31 - 1))
    m = draw(st.integers(0, nb * bs // 2))
    return layout, pad, split, dtype, hd, h, bs, layers, nb, lead, seed, m


def build_paged(case):
    layout, pad, split, dtype, hd, h, bs, layers, nb, lead, seed, m = case
    gen = torch.Generator().manual_seed(seed)
    raw, caches = vllm_kv_views(
        layout, num_layers=layers, num_blocks=nb, block_size=bs, num_kv_heads=h, head_size=hd,
        dtype=dtype, page_pad_bytes=pad * dtype.itemsize, lead_bytes=lead,
        kernel_block_size=bs // 2 if split else None,
    )
    raw.copy_(torch.randint(-128, 128, raw.shape, generator=gen, dtype=torch.int8))
    if dtype.is_floating_point:  # no NaN patterns, so float comparisons are exact too
        for c in caches:
            c.copy_(torch.randn(c.shape, generator=gen).to(dtype))
    num_slots = caches[0].shape[0] * caches[0].shape[2]
    perm = torch.randperm(num_slots, generator=gen)
    return raw, caches, perm[m : 2 * m].clone(), perm[:m].clone()


def _rebind_one(c, raw, new_raw):
    """The view ``c`` of ``raw`` (same byte offset, shape, strides) over ``new_raw``."""
    off_bytes = c.data_ptr() - raw.data_ptr()
    item = c.element_size()
    tail = new_raw[off_bytes:]
    typed = tail[: tail.numel() // item * item].view(c.dtype)
    return typed.as_strided(c.shape, c.stride())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paged_case())
def test_paged_reference_matches_oracle(case):
    raw, caches, src, dst = build_paged(case)
    exp_raw = raw.clone()
    paged_oracle([_rebind_one(c, raw, exp_raw) for c in caches], src, dst)
    move_tokens_paged_reference(caches, src, dst)
    assert torch.equal(raw, exp_raw)


@needs_triton
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(paged_case())
def test_paged_triton_matches_reference_bitwise(interpret, case):
    """Every vLLM layout: the whole backing buffer (other layers, page padding, bytes before
    the group) equals the reference's, byte for byte."""
    raw, caches, src, dst = build_paged(case)
    ref_raw = raw.clone()
    move_tokens_paged_reference([_rebind_one(c, raw, ref_raw) for c in caches], src, dst)
    move_tokens_paged_triton(caches, src, dst, debug=True)
    assert torch.equal(raw, ref_raw)


@needs_triton
@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda x: x.name)
def test_paged_triton_hand_case_every_layout(interpret, layout):
    """Token s, head h, element c holds 1000*s + 100*h + c; move 9 -> 1 and 14 -> 2."""
    raw, caches = vllm_kv_views(layout, num_layers=2, num_blocks=4, block_size=4,
                                num_kv_heads=2, head_size=2, dtype=torch.float32)
    slot = torch.arange(16).view(4, 1, 4, 1)  # [B, 1, N, 1]: block * 4 + offset
    head = torch.arange(2).view(1, 2, 1, 1)
    col = torch.arange(4).view(1, 1, 1, 4)
    for i, c in enumerate(caches):
        c.copy_((1000 * slot + 100 * head + col + 10000 * i).float())
    exp = [c.clone() for c in caches]
    move_tokens_paged_triton(caches, torch.tensor([9, 14]), torch.tensor([1, 2]), debug=True)
    for i, (c, e) in enumerate(zip(caches, exp)):
        e[0, :, 1] = e[2, :, 1]
        e[0, :, 2] = e[3, :, 2]
        assert torch.equal(c, e)
        assert c[0, 1, 1, 3].item() == 1000 * 9 + 100 + 3 + 10000 * i


def test_paged_dispatch_cpu_uses_reference():
    raw, caches = vllm_kv_views(ALL_LAYOUTS[0], num_layers=1, num_blocks=2, block_size=2,
                                num_kv_heads=1, head_size=1, dtype=torch.float32)
    caches[0].copy_(torch.arange(8.0).view(2, 1, 2, 2))
    move_tokens_paged(caches, torch.tensor([3]), torch.tensor([0]))
    assert caches[0].flatten().tolist() == [6.0, 7.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: [torch.zeros(2, 1, 2, 4), torch.zeros(2, 1, 2, 4, dtype=torch.float16)], "dtype"),
        (lambda: [torch.zeros(2, 1, 2, 4), torch.zeros(3, 1, 2, 4)], "shape"),
        (lambda: [torch.zeros(2, 1, 2)], "4-D"),
        (lambda: [torch.zeros(2, 1, 4, 2).transpose(2, 3)], "contiguous"),
    ],
)
def test_paged_validation_errors(make, match):
    with pytest.raises(ValueError, match=match):
        move_tokens_paged_reference(make(), T([0]), T([1]))


BIG_OFFSET_SCRIPT = r"""
import os, resource, sys
def _rss_kb():  # current resident set of this process, in KiB (ru_maxrss may carry the parent's peak)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
_RSS0 = _rss_kb()
_PEAK = 0
os.environ["TRITON_INTERPRET"] = "1"
import torch
sys.path.insert(0, os.environ["VIEWS_DIR"])
from vllm_kv_views import vllm_kv_views
from vllm.v1.kv_cache_layout import KVCacheLayout
from vtoken.kernels import move_tokens_paged_triton

# uint8 elements, head_size 2 + head_size_v 1: C = 3 bytes, so the kernel's word is one byte
# and its offsets are counted in elements. 2 layers x 2^30/3*... blocks: the last slots sit
# past 2^31 (and 2^32) elements. torch.empty leaves the pages untouched, so only the pages
# of the rows read or written below become resident (a few MiB, not 4.5 GiB).
bs, H = 16, 2
page = bs * H * 3
nb = (2**32 + 2**28) // (2 * page) + 1
for layout in (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLNHC):
    raw, caches = vllm_kv_views(layout, num_layers=2, num_blocks=nb, block_size=bs,
                                num_kv_heads=H, head_size=2, head_size_v=1, dtype=torch.uint8)
    top = nb * bs
    src = torch.tensor([top - 1, top - bs - 3, 5, top // 2 + 7], dtype=torch.int64)
    dst = torch.tensor([1, top - 2, top - 7 * bs, 3], dtype=torch.int64)
    near = torch.cat([dst - 1, dst + 1]).clamp(0, top - 1)
    near = near[~torch.isin(near, dst)]
    def rows(c, s):
        return c[s // bs, :, s % bs].clone()  # [M, H, C] via torch's own int64 indexing
    gen = torch.Generator().manual_seed(0)
    for c in caches:
        for s in torch.cat([src, dst, near]).tolist():
            c[s // bs, :, s % bs] = torch.randint(0, 256, (H, 3), generator=gen, dtype=torch.uint8)
    max_off = max((c[-1, -1, -1, -1].data_ptr() - raw.data_ptr()) for c in caches)
    assert max_off > 2**32, max_off
    want = [rows(c, src) for c in caches]
    keep = [rows(c, near) for c in caches]
    move_tokens_paged_triton(caches, src, dst, debug=True)
    for c, w, k in zip(caches, want, keep):
        assert torch.equal(rows(c, dst), w), layout
        assert torch.equal(rows(c, near), k), layout
    _PEAK = max(_PEAK, _rss_kb() - _RSS0)  # resident growth while the big buffer is alive
    del raw, caches
print("RSS_MB", _PEAK // 1024)
print("OK")
"""


@needs_triton
def test_paged_triton_offsets_past_2_31_elements():
    """Slots whose element offset exceeds 2^32 (so int32 offset arithmetic would wrap).

    Pragmatic set-up: uint8 caches with a 3-byte content dimension force one-byte words, so the
    kernel's offsets are element offsets; the backing buffer (4.3 GiB, from vLLM's layout
    functions) comes from ``torch.empty``, whose pages stay unallocated until touched, so the
    run only makes the handful of touched pages resident. It runs in a subprocess so that a
    wrong (wrapped) address would crash that process, not the test session.
    """
    env = dict(os.environ, TRITON_INTERPRET="1",
               VIEWS_DIR=os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", BIG_OFFSET_SCRIPT], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    assert out.stdout.strip().endswith("OK")
    rss_mb = int(out.stdout.split("RSS_MB")[1].split()[0])
    assert rss_mb < 2048, f"peak RSS {rss_mb} MiB: the large buffer was touched"


@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="no CUDA")
@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_cuda_paged_move_every_layout(monkeypatch, layout, dtype):
    """On a GPU: the compiled paged kernel against the reference on vLLM-built CUDA views
    (SmolLM2-like: 3 KV heads x 2 x 64, bs 16, 4 layers), the whole backing buffer compared."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator().manual_seed(0)
    raw, caches = vllm_kv_views(layout, num_layers=4, num_blocks=64, block_size=16,
                                num_kv_heads=3, head_size=64, dtype=dtype, device="cuda")
    raw.copy_(torch.randint(-128, 128, raw.shape, generator=gen, dtype=torch.int8).cuda())
    perm = torch.randperm(64 * 16, generator=gen)
    src, dst = perm[:300].cuda(), perm[300:600].cuda()
    before, ref_raw = raw.clone(), raw.clone()
    move_tokens_paged_reference([_rebind_one(c, raw, ref_raw) for c in caches], src, dst)
    move_tokens_paged(caches, src, dst, debug=True)
    torch.cuda.synchronize()
    assert torch.equal(raw, ref_raw)
    assert not torch.equal(raw, before)  # the moves changed bytes, so equality means something
