"""The probed CPU KV layout: token moves and key reads are bit-exact against vLLM's own packing op.

No engine: writes random tokens with ``vllm._custom_ops.cpu_attn_reshape_and_cache`` (the op the
CPU backend uses) into a cache, then checks ``gather_keys_cpu`` and ``move_tokens_cpu`` against
the values written, for every dtype/ISA pair this machine supports.
"""

from __future__ import annotations

import pytest
import torch

ops = pytest.importorskip("vllm._custom_ops")

from vtoken.integrations.vllm.worker.kv_layout import (  # noqa: E402
    CPUKVLayout, TokenLayout, _regions, gather_keys_cpu, move_tokens_cpu, probe_cpu_layout)


def _cases():
    cases = [(torch.float32, "vec"), (torch.bfloat16, "vec"), (torch.float16, "vec")]
    if torch.cpu._is_amx_tile_supported():
        cases.append((torch.bfloat16, "amx"))
    return cases


def _values(kv, layout, block_ids, n):
    """K and V of slots 0..n-1 as [n, H, hd] (independent of the code under test: uses the maps only)."""
    bs = layout.block_size
    kr, vr = _regions(kv)
    s = torch.arange(n)
    b = block_ids[s // bs]
    k = kr[b[:, None], layout.idx_k[s % bs]].permute(0, 2, 1)
    v = vr[b[:, None], layout.idx_v[s % bs]].permute(0, 2, 1)
    return k, v


@pytest.mark.parametrize("dtype,isa", _cases())
def test_probe_move_and_gather_bit_exact(dtype, isa):
    g = torch.Generator().manual_seed(0)
    nb, H, bs, hd = 6, 3, 32, 64
    layout = probe_cpu_layout(dtype, isa, bs, hd, H)
    cache = torch.zeros(nb, H, 2 * bs, hd, dtype=dtype)
    kc, vc = cache.chunk(2, dim=2)
    n = 150
    k = torch.randn(n, H, hd, generator=g).to(dtype)
    v = torch.randn(n, H, hd, generator=g).to(dtype)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    kv = cache.view(nb, H, bs, 2 * hd)
    blocks = torch.arange(nb)

    # reads: every written slot gives back exactly what the packing op was given
    keys = gather_keys_cpu(kv, layout, blocks, nb * bs)  # [H, n_slots, hd] fp32
    assert torch.equal(keys[:, slots].permute(1, 0, 2), k.float())
    kk, vv = _values(kv, layout, blocks, nb * bs)
    assert torch.equal(kk[slots], k) and torch.equal(vv[slots], v)

    # moves: 40 written tokens into 40 unwritten slots; everything else untouched
    free = torch.tensor(sorted(set(range(nb * bs)) - set(slots.tolist())))[:40]
    before_k, before_v = kk.clone(), vv.clone()
    move_tokens_cpu(kv, layout, slots[:40], free)
    kk, vv = _values(kv, layout, blocks, nb * bs)
    assert torch.equal(kk[free], k[:40]) and torch.equal(vv[free], v[:40])
    others = torch.ones(nb * bs, dtype=torch.bool)
    others[free] = False
    assert torch.equal(kk[others], before_k[others]) and torch.equal(vv[others], before_v[others])


def test_probe_layout_is_a_permutation_per_block():
    lay = probe_cpu_layout(torch.float32, "vec", 32, 64, 1)
    for idx in (lay.idx_k, lay.idx_v):
        assert sorted(idx.flatten().tolist()) == list(range(32 * 64))
    # vec layout: K transposed (dim-major), V token-major
    assert lay.idx_k[1, 0] == 1 and lay.idx_k[0, 1] == 32
    assert lay.idx_v[1, 0] == 64 and lay.idx_v[0, 1] == 1


def _general(layout):
    """The same maps with the strided fast paths off (the element-wise gather/scatter path)."""
    lay = TokenLayout(idx_k=layout.idx_k, idx_v=layout.idx_v)
    object.__setattr__(lay, "k_strides", None)
    object.__setattr__(lay, "v_strides", None)
    return lay


def test_vec_layouts_take_the_strided_path_and_amx_like_maps_do_not():
    lay = probe_cpu_layout(torch.bfloat16, "vec", 32, 64, 3)
    assert lay.k_strides == (1, 32) and lay.v_strides == (64, 1)
    # pairs interleaved (as amx packs bf16): not affine, so the general path is used
    bs, hd = 4, 4
    o, d = torch.arange(bs)[:, None], torch.arange(hd)[None, :]
    pairs = (d // 2) * (2 * bs) + o * 2 + d % 2
    assert sorted(pairs.flatten().tolist()) == list(range(bs * hd))
    assert TokenLayout(idx_k=pairs, idx_v=pairs).k_strides is None


@pytest.mark.parametrize("dtype,isa", _cases())
def test_strided_paths_equal_the_general_path(dtype, isa):
    """Moves, single-request key reads and StepScores' batched reads (padded rows whose indices
    repeat the last block, as ``StepScores._build`` makes them) give bit-identical results on the
    strided fast path and on the element-wise path, for every layout this machine probes."""
    g = torch.Generator().manual_seed(1)
    nb, H, bs, hd = 24, 3, 32, 64
    layout = probe_cpu_layout(dtype, isa, bs, hd, H)
    slow = _general(layout)
    kv = torch.randn(nb, H, bs, 2 * hd, generator=g).to(dtype)
    lens = [150, 97, 1, 32]
    bt = torch.stack([torch.randperm(nb, generator=g)[:5] for _ in lens])  # [R, 5] block-table rows
    for r, n in enumerate(lens):
        assert torch.equal(gather_keys_cpu(kv, layout, bt[r], n), gather_keys_cpu(kv, slow, bt[r], n))
    max_n = max(lens)
    s = torch.arange(max_n)
    blocks = bt[:, (s // bs).clamp(max=bt.shape[1] - 1)]
    fast_b = CPUKVLayout(layout).gather_keys_batched(kv, blocks, s % bs)
    slow_b = CPUKVLayout(slow).gather_keys_batched(kv, blocks, s % bs)
    assert fast_b.shape == (len(lens), H, max_n, hd) and torch.equal(fast_b, slow_b)
    # indices not in whole-block order fall back (and still agree)
    shuffled = blocks[:, torch.randperm(max_n, generator=g)]
    assert torch.equal(CPUKVLayout(layout).gather_keys_batched(kv, shuffled, s % bs),
                       CPUKVLayout(slow).gather_keys_batched(kv, shuffled, s % bs))
    perm = torch.randperm(nb * bs, generator=g)
    src, dst = perm[:60], perm[60:120]
    a, b = kv.clone(), kv.clone()
    move_tokens_cpu(a, layout, src, dst)
    move_tokens_cpu(b, slow, src, dst)
    assert torch.equal(a, b) and not torch.equal(a, kv)


@pytest.mark.parametrize("dtype,isa", _cases())
def test_key_and_value_reads_equal_the_index_maps(dtype, isa):
    """Expected Attention's read of keys and values (``gather_kv_rows``: whole blocks, one copy of K
    and V per layer, straight into float32 rows; ``gather_kv_batched``; ``gather_values_batched``)
    equals the probed index maps' element-wise read, on the strided path and the general one, for
    lengths that end inside a block."""
    g = torch.Generator().manual_seed(2)
    nb, H, bs, hd = 24, 3, 32, 64
    layout = probe_cpu_layout(dtype, isa, bs, hd, H)
    kv = torch.randn(nb, H, bs, 2 * hd, generator=g).to(dtype)
    lens = [150, 97, 1]
    bt = torch.stack([torch.randperm(nb, generator=g)[:5] for _ in lens])
    n = max(lens)
    s = torch.arange(n)
    for lay in (layout, _general(layout)):
        out = (torch.full((len(lens), H, n, hd), float("nan")), torch.full((len(lens), H, n, hd), float("nan")))
        CPUKVLayout(lay).gather_kv_rows(kv, bt, n, out)
        kb, vb = CPUKVLayout(lay).gather_kv_batched(kv, bt[:, s // bs], s % bs)
        vals = CPUKVLayout(lay).gather_values_batched(kv, bt[:, s // bs], s % bs)
        for r in range(len(lens)):
            want_k, want_v = _values(kv, layout, bt[r], n)  # [n, H, hd] in the cache's dtype
            for got in (out[0][r], kb[r]):
                assert torch.equal(got.permute(1, 0, 2), want_k.float())
            for got in (out[1][r], vb[r], vals[r]):
                assert torch.equal(got.permute(1, 0, 2), want_v.float())


@pytest.mark.parametrize("dtype,isa", _cases())
def test_per_head_moves_touch_only_their_head(dtype, isa):
    """Per-head token sets (issue 23): a move of (slot, head) copies that head's K and V only; the
    strided and element-wise paths agree; every other (slot, head) is untouched. Checked against
    the maps alone (``_values``), not against the code under test."""
    g = torch.Generator().manual_seed(2)
    nb, H, bs, hd = 8, 3, 32, 64
    layout = probe_cpu_layout(dtype, isa, bs, hd, H)
    kv = torch.randn(nb, H, bs, 2 * hd, generator=g).to(dtype)
    perm = torch.randperm(nb * bs, generator=g)
    src, dst = perm[:50], perm[50:100]
    heads = torch.randint(0, H, (50,), generator=g)
    blocks = torch.arange(nb)
    k0, v0 = _values(kv, layout, blocks, nb * bs)  # [slots, H, hd]
    a, b = kv.clone(), kv.clone()
    move_tokens_cpu(a, layout, src, dst, heads)
    move_tokens_cpu(b, _general(layout), src, dst, heads)
    assert torch.equal(a, b)
    k1, v1 = _values(a, layout, blocks, nb * bs)
    want_k, want_v = k0.clone(), v0.clone()
    want_k[dst, heads] = k0[src, heads]
    want_v[dst, heads] = v0[src, heads]
    assert torch.equal(k1, want_k) and torch.equal(v1, want_v)
    assert not torch.equal(k1, k0)


@pytest.mark.parametrize("dtype,isa", _cases())
@pytest.mark.parametrize("mode", ["head", "layer", "head_shared", "request"])
def test_layer_stack_moves_equal_the_maps_in_every_layer(dtype, isa, mode):
    """``CPULayerStack``: the layers of one backing buffer (as ``allocate_kv_cache`` lays them
    out, here with a gap before the first) moved in one gather and one scatter. Each token set
    kind's moves (per (layer, head), per layer, per head over every layer, every layer and
    head) land exactly where the index maps say, and nothing else changes."""
    from vtoken.integrations.vllm.worker.kv_layout import CPULayerStack

    g = torch.Generator().manual_seed(3)
    L, nb, H, bs, hd = 4, 6, 3, 32, 64
    layout = probe_cpu_layout(dtype, isa, bs, hd, H)
    lay = CPUKVLayout(layout)
    per = nb * H * bs * 2 * hd
    buf = torch.randn(L * per + 96, generator=g).to(dtype)
    caches = [(buf[96 + l * per: 96 + (l + 1) * per].view(nb, H, bs, 2 * hd), lay) for l in range(L)]
    stack = CPULayerStack.build(caches)
    assert stack is not None
    blocks = torch.arange(nb)
    before = [_values(kv, layout, blocks, nb * bs) for kv, _ in caches]  # [slots, H, hd] each
    m = 40
    perm = torch.randperm(nb * bs, generator=g)
    src, dst = perm[:m], perm[m:2 * m]
    layers = torch.randint(0, L, (m,), generator=g) if mode in ("head", "layer") else None
    heads = torch.randint(0, H, (m,), generator=g) if mode in ("head", "head_shared") else None
    stack.move(src, dst, layers, heads)
    for l, (kv, _) in enumerate(caches):
        want_k, want_v = before[l][0].clone(), before[l][1].clone()
        sel = torch.ones(m, dtype=torch.bool) if layers is None else layers == l
        s_, d_ = src[sel], dst[sel]
        if heads is None:
            want_k[d_], want_v[d_] = before[l][0][s_], before[l][1][s_]
        else:
            h_ = heads[sel]
            want_k[d_, h_], want_v[d_, h_] = before[l][0][s_, h_], before[l][1][s_, h_]
        k1, v1 = _values(kv, layout, blocks, nb * bs)
        assert torch.equal(k1, want_k) and torch.equal(v1, want_v), (mode, l)
    assert torch.equal(buf[:96], torch.randn(L * per + 96, generator=torch.Generator().manual_seed(3)).to(dtype)[:96])


def test_layer_stack_needs_one_buffer_and_one_layout():
    """Caches in separate allocations, or with different shapes, do not stack (moves then go
    layer by layer)."""
    from vtoken.integrations.vllm.worker.kv_layout import CPULayerStack

    lay = CPUKVLayout(probe_cpu_layout(torch.float32, "vec", 32, 64, 3))
    apart = [(torch.zeros(4, 3, 32, 128), lay), (torch.zeros(4, 3, 32, 128), lay)]
    assert CPULayerStack.build(apart) is None
    buf = torch.zeros(2 * 4 * 3 * 32 * 128)
    one = [(buf[: buf.numel() // 2].view(4, 3, 32, 128), lay), (buf[buf.numel() // 2:].view(4, 3, 32, 128), lay)]
    assert CPULayerStack.build(one) is not None
    assert CPULayerStack.build([one[0], (buf[: 3 * 3 * 32 * 128].view(3, 3, 32, 128), lay)]) is None
    assert CPULayerStack.build([]) is None


@pytest.mark.parametrize("dtype,isa", _cases())
def test_layer_stack_reads_every_layer_as_the_maps_say(dtype, isa):
    """``CPULayerStack.read_rows``: keys and values of every layer for a batch of block-table rows
    in one copy, equal to the index maps' values layer by layer (affine layouts; the others
    have no strided views and read layer by layer)."""
    from vtoken.integrations.vllm.worker.kv_layout import CPULayerStack

    g = torch.Generator().manual_seed(4)
    L, nb, H, bs, hd = 3, 7, 3, 32, 64
    layout = probe_cpu_layout(dtype, isa, bs, hd, H)
    per = nb * H * bs * 2 * hd
    buf = torch.randn(L * per + 64, generator=g).to(dtype)
    caches = [(buf[64 + l * per: 64 + (l + 1) * per].view(nb, H, bs, 2 * hd), CPUKVLayout(layout)) for l in range(L)]
    stack = CPULayerStack.build(caches)
    if layout.k_strides is None or layout.v_strides is None:
        assert stack.views is None
        return
    rows = torch.tensor([[4, 1, 6], [0, 5, 2]])
    # two whole blocks and 6 slots of the third; whole blocks only; less than one block
    for n, which, out_dtype in ((70, 0, torch.float32), (70, 1, torch.float32), (64, 0, torch.float64),
                                (6, 1, torch.float64), (96, 1, torch.float32)):
        got = stack.read_rows(rows, n, which, out_dtype)
        assert got.shape == (2, L * H, n, hd) and got.dtype == out_dtype and got.is_contiguous()
        for l, (kv, _) in enumerate(caches):
            for r in range(2):
                want = _values(kv, layout, rows[r], n)[which]  # [n, H, hd]
                assert torch.equal(got[r, l * H:(l + 1) * H], want.permute(1, 0, 2).to(out_dtype)), (n, which, l, r)
    # layers at uneven offsets: no strided views
    uneven = [caches[0], (buf[64 + 2 * per: 64 + 3 * per].view(nb, H, bs, 2 * hd), caches[0][1]), caches[1]]
    assert CPULayerStack.build(uneven).views is None


@pytest.mark.parametrize("dtype,isa", _cases())
def test_deferred_decode_scores_equal_layer_by_layer_and_the_reference(dtype, isa):
    """``StepScores`` with a layer stack: the one-query rows keep only their queries per layer
    and read every layer's keys once after the forward. Its statistics equal the per-layer path
    and a float64 reference (softmax of ``q . k * scale`` over the slots, mean over query heads,
    then over layers; a ``head`` row's sets: each (layer, KV head)'s mean over its query heads)."""
    from types import SimpleNamespace

    from vtoken.integrations.vllm.worker.kv_layout import CPULayerStack
    from vtoken.integrations.vllm.worker.scoring import StepScores
    from vtoken.policies.base import AttentionNeed

    g = torch.Generator().manual_seed(5)
    L, nb, H, bs, hd, Hq = 3, 8, 3, 32, 64, 9
    layout = probe_cpu_layout(dtype, isa, bs, hd, H)
    per = nb * H * bs * 2 * hd
    buf = torch.randn(L * per + 64, generator=g).to(dtype)
    caches = [(buf[64 + l * per: 64 + (l + 1) * per].view(nb, H, bs, 2 * hd), CPUKVLayout(layout)) for l in range(L)]
    stack = CPULayerStack.build(caches)
    if stack.views is None:
        pytest.skip("no strided views for this layout: scoring stays layer by layer")
    lens = [70, 33, 96]
    block_table = torch.tensor([[4, 1, 6], [0, 5, 7], [2, 3, 7]], dtype=torch.int32)
    meta = SimpleNamespace(query_start_loc=torch.tensor([0, 1, 2, 3]), seq_lens=torch.tensor(lens),
                           block_table=block_table)
    impl = SimpleNamespace(num_heads=Hq, head_size=hd, num_kv_heads=H, scale=0.125)
    need = AttentionNeed.COL_SUM.value | AttentionNeed.LAST_ROW.value
    rows = [(0, "a", need), (1, "b", need), (2, "c", AttentionNeed.LAST_ROW.value)]
    grans = {"b": "head"}
    qs = [torch.randn(3, Hq * hd, generator=g) for _ in range(L)]

    def run(with_stack):
        st = StepScores(rows, grans=grans, stack=stack if with_stack else None)
        assert st.deferred == with_stack
        for l, (kv, lay) in enumerate(caches):
            st.accumulate(impl, qs[l], kv, meta, lay, layer_index=l)
        return st.result()

    got, per_layer = run(True), run(False)
    G = Hq // H
    for i, (_, rid, nd) in enumerate(rows):
        n = lens[i]
        sets = []
        for l, (kv, _) in enumerate(caches):
            k = _values(kv, layout, block_table[i].long(), n)[0].double()  # [n, H, hd]
            q = qs[l][i].double().view(Hq, hd)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q, k.repeat_interleave(G, dim=1)) * 0.125, dim=-1)
            sets.append(p.view(H, G, n).mean(dim=1))  # [H, n]
        want = torch.stack(sets).reshape(L * H, n) if rid in grans else torch.stack(sets).mean(dim=(0, 1))
        for j, flag in enumerate((AttentionNeed.COL_SUM.value, AttentionNeed.LAST_ROW.value)):
            if not nd & flag:
                assert got[rid][j] is None and per_layer[rid][j] is None
                continue
            assert got[rid][j].shape == want.shape, rid
            assert torch.allclose(torch.from_numpy(got[rid][j]), want, rtol=1e-5, atol=1e-7), (rid, j)
            assert torch.allclose(torch.from_numpy(got[rid][j]), torch.from_numpy(per_layer[rid][j]),
                                  rtol=1e-6, atol=1e-9), (rid, j)
