"""The KV layout: token addressing inside vLLM's KV caches (CPU: probed; GPU: paged): probe, move, gather.

vLLM's CPU attention backend stores each layer as ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]``; each (block, head) holds a K region of
``block_size * head_size`` elements followed by a V region, and the interior of each
region is packed for the kernel's ISA (``vec``: K transposed; ``amx``: pairs
interleaved). In every case a token's elements are a fixed permutation *within one
block*, so a token is addressed by two index maps ``idx_k[offset, dim]`` and
``idx_v[offset, dim]`` into the K and V regions.

The maps are **probed**, not hard-coded: once per (dtype, isa, block_size, head_size)
we write known values through the upstream packing op
(``vllm._custom_ops.cpu_attn_reshape_and_cache``, patches/ entry
``vllm._custom_ops.cpu_attn_reshape_and_cache``) into a scratch block and read back
where each (offset, dim) landed. There is no separate self-check at start-up: the probe
itself reads the positions back through the real packing op, and
``tests/integration/test_kv_layout.py`` checks moves and key reads bit-exact against random
tokens written by the upstream op, for every dtype/ISA pair the machine supports.

The worker reaches a backend's layout only through the :class:`KVLayout` interface
(move tokens, read keys); :class:`CPUKVLayout` implements it for the probed CPU layout.
:class:`PagedKVLayout` implements it for the GPU backends' logical view
``[num_blocks, num_kv_heads, block_size, 2*head_size]`` in any ``KVCacheLayout`` (FlashAttention:
:func:`flash_attn_kv_layout`).

Example (block size 4, one head, ``vec`` K layout, head_size 2)::

    K region (8 elements):  [k0d0 k1d0 k2d0 k3d0 | k0d1 k1d1 k2d1 k3d1]
    idx_k = [[0, 4], [1, 5], [2, 6], [3, 7]]   # idx_k[offset, dim]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional, Protocol

import torch

__all__ = ["KVLayout", "CPUKVLayout", "TokenLayout", "probe_cpu_layout", "move_tokens_cpu", "gather_keys_cpu", "cpu_kv_layout",
           "CPULayerStack", "PagedKVLayout", "flash_attn_kv_layout", "view_axis_order"]


@dataclass(frozen=True)
class TokenLayout:
    """Where a token's K and V elements sit inside one (block, head) region.

    Attributes:
        idx_k: int64 ``[block_size, head_size]``: flat index in the K region.
        idx_v: int64 ``[block_size, head_size]``: flat index in the V region.
    """

    idx_k: torch.Tensor
    idx_v: torch.Tensor
    #: ``(offset stride, dim stride)`` when ``idx_k[o, d] == o * a + d * b`` (the ``vec`` layouts),
    #: else None; then moves and key reads use strided views instead of element-wise gathers
    k_strides: Optional[tuple[int, int]] = field(init=False, repr=False, compare=False)
    v_strides: Optional[tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "k_strides", _affine_strides(self.idx_k))
        object.__setattr__(self, "v_strides", _affine_strides(self.idx_v))

    @property
    def block_size(self) -> int:
        return int(self.idx_k.shape[0])


def _affine_strides(idx: torch.Tensor) -> Optional[tuple[int, int]]:
    """``(a, b)`` with ``idx[o, d] == o * a + d * b`` for every (offset, dim), or None."""
    bs, hd = idx.shape
    a = int(idx[1, 0] - idx[0, 0]) if bs > 1 else 1
    b = int(idx[0, 1] - idx[0, 0]) if hd > 1 else 1
    if int(idx[0, 0]) != 0 or a <= 0 or b <= 0:
        return None
    o = torch.arange(bs, dtype=idx.dtype)[:, None]
    d = torch.arange(hd, dtype=idx.dtype)[None, :]
    return (a, b) if torch.equal(idx, o * a + d * b) else None


def _token_view(kv_cache: torch.Tensor, which: int, strides: tuple[int, int]) -> torch.Tensor:
    """``[num_blocks, num_kv_heads, block_size, head_size]`` view of the K (``which`` 0) or V (1)
    regions of a layer whose in-region layout is affine with ``strides`` (a view: writes land in
    ``kv_cache``)."""
    nb, H, bs, two_hd = kv_cache.shape
    hd = two_hd // 2
    flat = kv_cache.view(nb, H, 2, bs * hd)[:, :, which, :]
    return flat.as_strided((nb, H, bs, hd), (flat.stride(0), flat.stride(1), *strides), flat.storage_offset())


def _gather_blocks_kv(kv_cache: torch.Tensor, k_strides: tuple[int, int], v_strides: tuple[int, int],
                      block_rows: torch.Tensor, n: int,
                      out: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``([R, num_kv_heads, n, head_size],) * 2``: keys and values of slots ``0..n-1`` of
    each block-table row, from one copy of the rows' whole blocks (K and V regions together),
    converted straight into ``out`` when given (two float32 tensors of that shape)."""
    bs = kv_cache.shape[2]
    nblk = -(-n // bs)
    R, H = block_rows.shape[0], kv_cache.shape[1]
    blk = kv_cache[block_rows[:, :nblk].reshape(-1)]  # [R * nblk, H, bs, 2hd]: one gather, same inner layout
    res = []
    for i, (which, strides) in enumerate(((0, k_strides), (1, v_strides))):
        t = _token_view(blk, which, strides)  # [R * nblk, H, bs, hd] (a view of the copy)
        hd = t.shape[3]
        t = t.view(R, nblk, H, bs, hd).permute(0, 2, 1, 3, 4)  # [R, H, nblk, bs, hd]
        if out is None:
            res.append(t.float().reshape(R, H, nblk * bs, hd)[:, :, :n])
            continue
        dst = out[i]
        full, rest = divmod(n, bs)  # whole blocks, then the last block's first `rest` slots
        if full:
            dst[:, :, : full * bs].view(R, H, full, bs, hd).copy_(t[:, :, :full])
        if rest:
            dst[:, :, full * bs:].copy_(t[:, :, full, :rest])
        res.append(dst)
    return res[0], res[1]


def _gather_blocks(kv_cache: torch.Tensor, strides: tuple[int, int], block_rows: torch.Tensor, n: int,
                   which: int = 0) -> torch.Tensor:
    """float32 ``[R, num_kv_heads, n, head_size]``: the keys (``which`` 0; values: 1) of slots
    ``0..n-1`` of each block-table row (int64 ``[R, >= cdiv(n, block_size)]``), copied a whole
    block at a time through the strided K (V) view (affine layouts only)."""
    bs = kv_cache.shape[2]
    nblk = -(-n // bs)
    kb = _token_view(kv_cache, which, strides)[block_rows[:, :nblk]].float()  # [R, nblk, H, bs, hd]
    R, _, H, _, hd = kb.shape
    return kb.permute(0, 2, 1, 3, 4).reshape(R, H, nblk * bs, hd)[:, :, :n]


@lru_cache(maxsize=None)
def probe_cpu_layout(dtype: torch.dtype, isa: str, block_size: int, head_size: int, num_kv_heads: int = 1) -> TokenLayout:
    """Probe the packed CPU layout by writing known values through vLLM's packing op.

    Three probes, each writing small integers exactly representable in bf16:
    the token offset + 1, ``dim % 128 + 1`` and ``dim // 128 + 1``.

    Raises:
        RuntimeError: the probe did not find a bijection (an unsupported layout).
    """
    from vllm import _custom_ops

    if block_size > 255:
        raise RuntimeError(f"vToken's layout probe supports block_size <= 255, got {block_size}")
    H, bs, hd = num_kv_heads, block_size, head_size
    off = torch.arange(bs).view(bs, 1, 1).expand(bs, H, hd)
    dim = torch.arange(hd).view(1, 1, hd).expand(bs, H, hd)
    slots = torch.arange(bs, dtype=torch.int64)

    def run(vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = torch.zeros(1, H, 2 * bs, hd, dtype=dtype)
        kc, vc = cache.chunk(2, dim=2)
        v = vals.to(dtype).contiguous()
        _custom_ops.cpu_attn_reshape_and_cache(v, v, kc, vc, slots, isa)
        flat = cache.view(1, H, 2, bs * hd)[0, 0]
        return flat[0].float().round().long(), flat[1].float().round().long()

    ko, vo = run(off + 1)
    kd0, vd0 = run(dim % 128 + 1)
    kd1, vd1 = run(dim // 128 + 1)
    maps = []
    for o_vals, d0, d1 in ((ko, kd0, kd1), (vo, vd0, vd1)):
        idx = torch.full((bs, hd), -1, dtype=torch.int64)
        o = o_vals - 1
        d = (d1 - 1) * 128 + (d0 - 1)
        ok = (o >= 0) & (o < bs) & (d >= 0) & (d < hd)
        if int(ok.sum()) != bs * hd:
            raise RuntimeError(f"CPU KV layout probe failed for dtype={dtype}, isa={isa}, block_size={bs}, head_size={hd}")
        idx[o, d] = torch.arange(bs * hd)
        if int((idx < 0).sum()) != 0:
            raise RuntimeError(f"CPU KV layout probe found no bijection (dtype={dtype}, isa={isa})")
        maps.append(idx)
    return TokenLayout(idx_k=maps[0], idx_v=maps[1])


def _regions(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V region views ``[num_blocks, block_size*head_size, num_kv_heads]`` of a layer."""
    nb, H, bs, two_hd = kv_cache.shape
    flat = kv_cache.view(nb, H, 2, bs * (two_hd // 2))
    return flat[:, :, 0, :].permute(0, 2, 1), flat[:, :, 1, :].permute(0, 2, 1)


def move_tokens_cpu(kv_cache: torch.Tensor, layout: TokenLayout, src: torch.Tensor, dst: torch.Tensor,
                    heads: Optional[torch.Tensor] = None) -> None:
    """Move tokens inside one layer's CPU KV cache, in place (gather all, then scatter).

    Args:
        kv_cache: ``[num_blocks, num_kv_heads, block_size, 2*head_size]``, any dtype; mutated.
        layout: the probed :class:`TokenLayout` for this layer.
        src, dst: int64 ``[M]`` global slot ids (``block_id * block_size + offset``); disjoint
            (within a head, when ``heads`` is given).
        heads: int64 ``[M]``: move only this KV head of each pair (per-head token sets,
            ``docs/granularity.md``); None: every head.
    """
    if src.numel() == 0:
        return
    bs = layout.block_size
    sb, so = src // bs, src % bs
    db, do = dst // bs, dst % bs
    if layout.k_strides is not None and layout.v_strides is not None:
        for which, strides in ((0, layout.k_strides), (1, layout.v_strides)):
            view = _token_view(kv_cache, which, strides)
            if heads is None:
                view[db, :, do, :] = view[sb, :, so, :]  # [M, H, hd] (a copy: gather first)
            else:
                view[db, heads, do, :] = view[sb, heads, so, :]  # [M, hd]
        return
    kr, vr = _regions(kv_cache)
    for region, idx in ((kr, layout.idx_k), (vr, layout.idx_v)):
        if heads is None:
            vals = region[sb[:, None], idx[so]]  # [M, hd, H] (a copy: gather first)
            region[db[:, None], idx[do]] = vals
        else:
            vals = region[sb[:, None], idx[so], heads[:, None]]  # [M, hd]
            region[db[:, None], idx[do], heads[:, None]] = vals


def gather_keys_cpu(kv_cache: torch.Tensor, layout: TokenLayout, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Keys of a request's physical slots ``0..num_tokens-1``.

    Args:
        kv_cache: ``[num_blocks, num_kv_heads, block_size, 2*head_size]``.
        block_ids: int64 ``[>= cdiv(num_tokens, block_size)]``: the request's block-table row.
        num_tokens: physical sequence length (live tokens, including this step's).

    Returns:
        float32 ``[num_kv_heads, num_tokens, head_size]``.
    """
    bs = layout.block_size
    if layout.k_strides is not None:
        return _gather_blocks(kv_cache, layout.k_strides, block_ids[None], num_tokens)[0]
    kr, _ = _regions(kv_cache)
    s = torch.arange(num_tokens)
    b = block_ids[s // bs]
    k = kr[b[:, None], layout.idx_k[s % bs]]  # [n, hd, H]
    return k.permute(2, 0, 1).float()


class KVLayout(Protocol):
    """Token addressing in one attention backend's per-layer KV cache (the worker's only view of it).

    Slots are global: ``block_id * block_size + offset``.
    """

    def move_tokens(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                    heads: Optional[torch.Tensor] = None) -> None:
        """Copy K and V of slots ``src`` to slots ``dst`` (int64 ``[M]``, disjoint), in place;
        ``heads`` (int64 ``[M]``): only that KV head of each pair (None: every head)."""

    def gather_keys(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """float32 ``[num_kv_heads, num_tokens, head_size]``: keys of a request's slots ``0..num_tokens-1``."""

    def gather_keys_batched(self, kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """float32 ``[R, num_kv_heads, n, head_size]``: keys at ``blocks[r, i]``, offset ``offsets[i]``.

        ``blocks``: int64 ``[R, n]`` block ids; ``offsets``: int64 ``[n]`` in-block offsets.
        """

    def gather_values_batched(self, kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """float32 ``[R, num_kv_heads, n, head_size]``: values at ``blocks[r, i]``, offset ``offsets[i]``
        (as :meth:`gather_keys_batched`)."""

    def gather_kv_batched(self, kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                          out: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at once (:meth:`gather_keys_batched`, :meth:`gather_values_batched`),
        written into ``out`` (two float32 ``[R, num_kv_heads, n, head_size]`` tensors) when given."""

    def gather_kv_rows(self, kv_cache: torch.Tensor, block_rows: torch.Tensor, n: int,
                       out: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Keys and values of slots ``0..n-1`` of each block-table row (int64 ``[R, >= cdiv(n, B)]``)
        into ``out`` (two float32 ``[R, num_kv_heads, n, head_size]`` tensors)."""


@dataclass
class CPUKVLayout:
    """:class:`KVLayout` of vLLM's CPU attention backend, from the probed :class:`TokenLayout`."""

    token_layout: TokenLayout
    _idx_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def block_size(self) -> int:
        return self.token_layout.block_size

    def move_tokens(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                    heads: Optional[torch.Tensor] = None) -> None:
        move_tokens_cpu(kv_cache, self.token_layout, src, dst, heads)

    def gather_keys(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return gather_keys_cpu(kv_cache, self.token_layout, block_ids, num_tokens)

    def gather_keys_batched(self, kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self._gather_batched(kv_cache, blocks, offsets, 0)

    def gather_values_batched(self, kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self._gather_batched(kv_cache, blocks, offsets, 1)

    def gather_kv_batched(self, kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                          out: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        lay = self.token_layout
        n = blocks.shape[1]
        bs = lay.block_size
        if lay.k_strides is not None and lay.v_strides is not None and n > 0:
            bt = blocks[:, ::bs]  # whole blocks in block-table order: one copy of K and V together
            if torch.equal(offsets, torch.arange(n) % bs) and torch.equal(
                    blocks, bt.repeat_interleave(bs, dim=1)[:, :n]):
                return _gather_blocks_kv(kv_cache, lay.k_strides, lay.v_strides, bt, n, out)
        k, v = self._gather_batched(kv_cache, blocks, offsets, 0), self._gather_batched(kv_cache, blocks, offsets, 1)
        if out is None:
            return k, v
        out[0].copy_(k)
        out[1].copy_(v)
        return out

    def gather_kv_rows(self, kv_cache: torch.Tensor, block_rows: torch.Tensor, n: int,
                       out: tuple[torch.Tensor, torch.Tensor]) -> None:
        lay = self.token_layout
        if n <= 0:
            return
        if lay.k_strides is not None and lay.v_strides is not None:
            _gather_blocks_kv(kv_cache, lay.k_strides, lay.v_strides, block_rows, n, out)
            return
        bs = lay.block_size
        cols = torch.arange(n)
        self.gather_kv_batched(kv_cache, block_rows[:, cols // bs], cols % bs, out)

    def _gather_batched(self, kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                        which: int) -> torch.Tensor:
        lay = self.token_layout
        n = blocks.shape[1]
        bs = lay.block_size
        strides = lay.v_strides if which else lay.k_strides
        if strides is not None and n > 0:
            # Whole blocks in block-table order (how StepScores builds its indices): copy each
            # block's keys through a strided view, not token by token (about 4x faster here).
            bt = blocks[:, ::bs]  # [R, nblk]
            if torch.equal(offsets, torch.arange(n) % bs) and torch.equal(
                    blocks, bt.repeat_interleave(bs, dim=1)[:, :n]):
                return _gather_blocks(kv_cache, strides, bt, n, which)
        idx = (lay.idx_v if which else lay.idx_k)[offsets]  # [n, hd]
        region = _regions(kv_cache)[which]  # [nb, bs*hd, Hkv]
        k = region[blocks[:, :, None], idx[None]]  # [R, n, hd, Hkv]
        return k.permute(0, 3, 1, 2).float()


class CPULayerStack:
    """Every layer's CPU KV cache addressed as one flat tensor, so that a step's moves in all
    layers are one gather and one scatter instead of a chain of small ops per layer.

    vLLM places the layers of a KV-cache group in one backing allocation
    (``vllm.v1.worker.utils.allocate_kv_cache``: layer ``l`` at its own offset of the same
    buffer, every layer with the same shape and strides). Element ``d`` of the K (``w = 0``) or
    V (``w = 1``) vector of KV head ``h`` of slot offset ``o`` in block ``b`` of layer ``l`` sits
    at ``off[l] + b * s0 + h * s1 + w * B * hd + idx_w[o, d]`` of that buffer (``idx_w``: the
    probed :class:`TokenLayout`, any ISA's packing). :meth:`build` returns None when the caches
    do not fit that model (then the per-layer :func:`move_tokens_cpu` is used).

    Args:
        flat: ``[numel]`` view of the shared buffer in the caches' dtype.
        layer_off: int64 ``[L]`` element offset of each layer's cache (:meth:`kv_caches` order).
        elem: int64 ``[B, 2, hd]``: ``w * B * hd + idx_w[o, d]``.
        s0, s1: element strides of a block and of a KV head.
        num_kv_heads: ``H``.
        num_blocks: blocks per layer.
        strides: the K and V ``(offset, dim)`` strides of the probed layout (``TokenLayout.k_strides``,
            ``v_strides``; None where it is not affine).
    """

    def __init__(self, flat: torch.Tensor, layer_off: torch.Tensor, elem: torch.Tensor, s0: int, s1: int,
                 num_kv_heads: int, num_blocks: int,
                 strides: tuple[Optional[tuple[int, int]], Optional[tuple[int, int]]]):
        self.flat, self.layer_off, self.elem = flat, layer_off, elem
        self.s0, self.s1, self.num_kv_heads = s0, s1, num_kv_heads
        self.block_size = int(elem.shape[0])
        self.num_blocks = num_blocks
        #: ``[L, num_blocks, H, B, hd]`` strided views of every layer's keys and values (one
        #: tensor each), where the layers sit at a constant positive stride and the packing is
        #: affine (the ``vec`` layouts); else None (reads go layer by layer)
        self.views: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        off = layer_off.tolist()
        step = off[1] - off[0] if len(off) > 1 else 1
        if None not in strides and step > 0 and off == [off[0] + i * step for i in range(len(off))]:
            hd = elem.shape[2]
            self.views = tuple(flat.as_strided((len(off), num_blocks, num_kv_heads, self.block_size, hd),
                                               (step, s0, s1, *st), off[0] + w * self.block_size * hd)
                               for w, st in enumerate(strides))

    def read_rows(self, block_rows: torch.Tensor, n: int, which: int,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Keys (``which`` 0) or values (1) of slots ``0..n-1`` of each block-table row, every
        layer at once (one gather of whole blocks; one converting copy of the whole blocks below
        ``n``, one of the last block's first slots): ``dtype`` (float32
        or float64; either holds the cache's bf16/fp16 values exactly) ``[R, L * H, n, hd]``,
        layer-major, contiguous (the whole blocks' slots past ``n`` are not copied). Only where
        :attr:`views` is set.

        Args:
            block_rows: int64 ``[R, >= cdiv(n, B)]`` block ids.
        """
        bs = self.block_size
        nblk = -(-n // bs)
        t = self.views[which][:, block_rows[:, :nblk]]  # [L, R, nblk, H, B, hd], the cache's dtype
        L, R, _, H, _, hd = t.shape
        t = t.permute(1, 0, 3, 2, 4, 5)  # [R, L, H, nblk, B, hd]
        out = torch.empty((R, L, H, n, hd), dtype=dtype)
        full = n // bs
        if full:  # the whole blocks in one converting copy, the last block's first slots in another
            out[:, :, :, : full * bs].view(R, L, H, full, bs, hd).copy_(t[:, :, :, :full])
        if n > full * bs:
            out[:, :, :, full * bs:].copy_(t[:, :, :, full, : n - full * bs])
        return out.view(R, L * H, n, hd)

    @classmethod
    def build(cls, caches: list[tuple[torch.Tensor, "KVLayout"]]) -> Optional["CPULayerStack"]:
        """The stack of ``caches`` (``[num_blocks, H, B, 2*hd]`` views with their layouts), or
        None: not every layout is the same :class:`CPUKVLayout`, the caches differ in shape,
        strides or dtype, do not share one storage, or a (block, head) region is not one
        contiguous run of ``2 * B * hd`` elements."""
        if not caches or not all(isinstance(lay, CPUKVLayout) for _, lay in caches):
            return None
        kv0, lay0 = caches[0]
        if kv0.device.type != "cpu" or kv0.dim() != 4:
            return None
        for kv, lay in caches:
            if (lay.token_layout is not lay0.token_layout or kv.shape != kv0.shape or kv.stride() != kv0.stride()
                    or kv.dtype != kv0.dtype or kv.untyped_storage().data_ptr() != kv0.untyped_storage().data_ptr()):
                return None
        nb, H, bs, two_hd = kv0.shape
        hd = two_hd // 2
        if kv0.stride(3) != 1 or kv0.stride(2) != two_hd or bs != lay0.block_size:
            return None
        tl = lay0.token_layout
        elem = torch.stack([tl.idx_k, tl.idx_v + bs * hd], dim=1).to(torch.int64)  # [B, 2, hd]
        numel = kv0.untyped_storage().nbytes() // kv0.element_size()
        flat = kv0.as_strided((numel,), (1,), 0)
        return cls(flat, torch.tensor([kv.storage_offset() for kv, _ in caches], dtype=torch.int64), elem,
                   kv0.stride(0), kv0.stride(1), H, nb, (tl.k_strides, tl.v_strides))

    def move(self, src: torch.Tensor, dst: torch.Tensor, layers: Optional[torch.Tensor] = None,
             heads: Optional[torch.Tensor] = None) -> None:
        """Copy K and V of slots ``src`` to ``dst`` (int64 ``[M]`` global slot ids), every read
        before any write, in place.

        Args:
            layers: int64 ``[M]``: the layer (index into the stack) of each move; None: every layer.
            heads: int64 ``[M]``: the KV head of each move; None: every head.
        Moves must be disjoint within each (layer, head) they touch.
        """
        if src.numel() == 0:
            return
        bs = self.block_size
        if self.views is not None:  # affine packing: whole (token, head) rows of the [L, nb, H, B, hd] views
            sb, so, db, do = src // bs, src % bs, dst // bs, dst % bs
            at_l = slice(None) if layers is None else layers
            at_h = slice(None) if heads is None else heads
            for v in self.views:  # K, then V (disjoint regions): each read whole before its write
                v[at_l, db, at_h, do] = v[at_l, sb, at_h, so]
            return
        lp = (self.layer_off[layers][None, :, None] if layers is not None
              else self.layer_off[:, None, None])  # [A, M | 1, 1]
        hp = (heads * self.s1)[None, :, None] if heads is not None else (
            torch.arange(self.num_kv_heads) * self.s1)[None, None, :]  # [1, M | 1, B']

        def index(slots: torch.Tensor) -> torch.Tensor:
            base = lp + hp + ((slots // bs) * self.s0)[None, :, None]  # [A, M, B']
            return base[..., None, None] + self.elem[slots % bs][None, :, None]  # [A, M, B', 2, hd]

        s, d = index(src), index(dst)
        self.flat[d] = self.flat[s]


@lru_cache(maxsize=None)
def cpu_kv_layout(dtype: torch.dtype, isa: str, block_size: int, head_size: int, num_kv_heads: int = 1) -> CPUKVLayout:
    """The :class:`CPUKVLayout` for one (dtype, ISA, block size, head size) (probed once)."""
    return CPUKVLayout(probe_cpu_layout(dtype, isa, block_size, head_size, num_kv_heads))


# ---------------------------------------------------------------------- GPU: FlashAttention
def view_axis_order(kv_cache: torch.Tensor) -> tuple[int, ...]:
    """Axes of a 4-D per-layer view ``[B, H, N, C]`` from the largest stride to the smallest.

    Axes of size 1 carry no layout information and are left out (their stride is arbitrary).
    """
    dims = [d for d in range(4) if kv_cache.shape[d] > 1]
    return tuple(sorted(dims, key=lambda d: (-kv_cache.stride(d), d)))


@dataclass(frozen=True)
class PagedKVLayout:
    """:class:`KVLayout` of a GPU attention backend whose per-layer cache is vLLM's logical view
    ``[num_blocks, num_kv_heads, block_size, 2*head_size]`` (K = ``[..., :hd]``, V = ``[..., hd:]``)
    with the strides of one engine-wide ``KVCacheLayout`` (FlashAttention in vLLM 0.32:
    ``LBNHC`` unless ``VLLM_KV_CACHE_LAYOUT`` picks another).

    Moves use the stride-generic Triton kernel on CUDA tensors and the PyTorch reference on
    CPU (``vtoken.kernels.move_tokens_paged``); key reads are plain indexing (tests, the
    ``VTOKEN_TEST_WORKER_DIR`` hook; the GPU scorer reads the cache itself).

    Attributes:
        layout: the ``KVCacheLayout`` member name (``"LBNHC"``, ``"LBHNC"``, ...).
        backend: the attention backend's name (``"FLASH_ATTN"``).
    """

    layout: str
    backend: str = "FLASH_ATTN"

    def check_view(self, kv_cache: torch.Tensor) -> None:
        """Check that ``kv_cache`` is a 4-D view laid out as :attr:`layout` says.

        Raises:
            ValueError: wrong rank, a content dimension that is not contiguous, or axes whose
                stride order differs from ``KVCacheLayout[layout].layer_view_order``.
        """
        from vllm.v1.kv_cache_layout import KVCacheLayout

        if kv_cache.dim() != 4:
            raise ValueError(f"{self.backend} KV cache view has shape {tuple(kv_cache.shape)}; expected "
                             "[num_blocks, num_kv_heads, block_size, 2*head_size]")
        if kv_cache.shape[3] > 1 and kv_cache.stride(3) != 1:
            raise ValueError(f"{self.backend} KV cache content stride is {kv_cache.stride(3)}; expected 1")
        want = tuple(d for d in KVCacheLayout[self.layout].layer_view_order if kv_cache.shape[d] > 1)
        got = view_axis_order(kv_cache)
        if got != want:
            raise ValueError(f"{self.backend} KV cache view strides {tuple(kv_cache.stride())} (shape "
                             f"{tuple(kv_cache.shape)}) give axis order {got}; KVCacheLayout.{self.layout} "
                             f"means {want}")

    def move_tokens(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                    heads: Optional[torch.Tensor] = None) -> None:
        if heads is not None:  # per-head token sets: one (slot, head) pair per move, K and V at once
            bs = kv_cache.shape[2]
            kv_cache[dst // bs, heads, dst % bs, :] = kv_cache[src // bs, heads, src % bs, :]
            return
        from vtoken.kernels import move_tokens_paged

        move_tokens_paged([kv_cache], src, dst, debug=False)

    def gather_keys(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        bs, hd = kv_cache.shape[2], kv_cache.shape[3] // 2
        s = torch.arange(num_tokens, device=kv_cache.device)
        b = block_ids.to(kv_cache.device, torch.int64)[s // bs]
        return kv_cache[b, :, s % bs, :hd].permute(1, 0, 2).float()  # [H, n, hd]

    def gather_keys_batched(self, kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        hd = kv_cache.shape[3] // 2
        k = kv_cache[blocks.to(kv_cache.device), :, offsets.to(kv_cache.device)[None, :], :hd]  # [R, n, H, hd]
        return k.permute(0, 2, 1, 3).float()

    def gather_values_batched(self, kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        hd = kv_cache.shape[3] // 2
        v = kv_cache[blocks.to(kv_cache.device), :, offsets.to(kv_cache.device)[None, :], hd:]  # [R, n, H, hd]
        return v.permute(0, 2, 1, 3).float()

    def gather_kv_batched(self, kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                          out: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        hd = kv_cache.shape[3] // 2
        kv = kv_cache[blocks.to(kv_cache.device), :, offsets.to(kv_cache.device)[None, :], :]  # [R, n, H, 2hd]
        kv = kv.permute(0, 2, 1, 3)
        if out is None:
            kv = kv.float()
            return kv[..., :hd], kv[..., hd:]
        out[0].copy_(kv[..., :hd])
        out[1].copy_(kv[..., hd:])
        return out

    def gather_kv_rows(self, kv_cache: torch.Tensor, block_rows: torch.Tensor, n: int,
                       out: tuple[torch.Tensor, torch.Tensor]) -> None:
        if n <= 0:
            return
        bs = kv_cache.shape[2]
        cols = torch.arange(n, device=block_rows.device)
        self.gather_kv_batched(kv_cache, block_rows[:, cols // bs], cols % bs, out)


def flash_attn_kv_layout(cache_config=None) -> PagedKVLayout:
    """FlashAttention's :class:`PagedKVLayout`, resolved with vLLM's own functions.

    The layout is the one vLLM resolved for the engine (``cache_config.kv_cache_layout``,
    recorded in every worker before its caches are allocated); without one, the first of
    ``get_supported_kv_cache_layouts([FlashAttentionBackend])`` (FlashAttention declares no
    preference, so vLLM's default order applies: ``LBNHC`` first).
    """
    name = getattr(cache_config, "kv_cache_layout", None) if cache_config is not None else None
    if name is None:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

        name = get_supported_kv_cache_layouts([FlashAttentionBackend])[0].name
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return PagedKVLayout(layout=KVCacheLayout[str(name)].name, backend="FLASH_ATTN")
