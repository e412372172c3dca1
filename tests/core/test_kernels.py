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
           "row_words": "i32", "V": "i32", "WORD": "constexpr", "R": "constexpr",
           "BLOCK": "constexpr"}
    src = ASTSource(fn=kernel, signature=sig,
                    constexprs={"WORD": tl.int64, "R": 16, "BLOCK": 64})
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
