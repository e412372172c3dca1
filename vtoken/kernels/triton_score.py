"""Two-phase Triton scorer over a paged K cache (semantics: ``vtoken.kernels.score``).

Design (``docs/gpu-kernels.md``, "The scoring kernel")
------------------------------------------------------
Per layer, two launches on the caller's stream, both reading K straight from the paged cache
through the block table (any block/head/token strides, int64 offsets):

* **Phase A** ``_score_lse_kernel``, grid ``(R, cdiv(max_q, BLOCK_Q), Hkv)``: program
  ``(item, q-tile, kv head)`` loads ``BLOCK_Q`` query rows x the ``G = Hq/Hkv`` query heads
  that share the kv head as one ``[BLOCK_Q*BLOCK_G, hd]`` tile, streams the item's K tiles
  ``[BLOCK_N, hd]`` (only up to the tile's last visible key), and keeps the online softmax
  statistics (running max, rescaled sum of exponentials) per (row, head). It writes
  ``lse = max + log(sum)`` to an fp32 ``[lse_rows, Hq]`` scratch. Single-row items (decode
  rows; ``lg_off >= 0``) also store their scaled logits to an fp32 ``[Hq, n]`` scratch.
* **Phase B** ``_score_prob_kernel``, grid ``(R, cdiv(max_n, BLOCK_N))``: program
  ``(item, key tile)`` computes ``p = exp(logit - lse)`` for its ``BLOCK_N`` keys, sums over
  heads (and query rows) in registers and adds the ``[BLOCK_N]`` result to ``out``.
  Single-row items read the logits back from the scratch (all heads as one
  ``[BLOCK_H, BLOCK_N]`` tile; K is not read again). Multi-row items (prefill chunks) load
  their K tile once per kv head and recompute the logits of every query row that can see the
  tile (causal mask by physical index). Each output element belongs to exactly one program:
  no atomics. Layers launched in order on one stream make the read-modify-write of ``out`` a
  sum over layers.

No ``[heads, q, n]`` matrix exists for a multi-row item; the buffers are ``out`` (one float
per scored key), ``lse`` (one float per scored query row and head) and, for single-row items
only, the ``[Hq, n]`` logits (the logits scratch).

Arithmetic: K and q are loaded in their dtype and converted to fp32; ``tl.dot`` runs with
``input_precision="ieee"`` (no TF32), so the result equals the fp32 PyTorch reference up to
summation order. Rows of the dot tile beyond ``ql`` / ``G`` and keys beyond ``n`` are masked.

Grid bounds ``max_q`` / ``max_n`` may be upper bounds: programs past an item's ``ql`` / ``n``
return at once. The items tensor lives on the device; nothing in a launch reads host state
of the batch except the two bounds, so a launch with fixed bounds and persistent buffers is
capturable in a CUDA graph (not yet tried on a GPU).

Cost (memory-bound decode row, per layer; an estimate, never measured on a GPU): phase A
reads K once and writes ``4*Hq`` bytes of logits per key, phase B reads them back and
read-modify-writes ``out``: ``n * (Hkv*hd*b + 8*Hq + 8)`` bytes, about 0.56x the attention
kernel's K+V bytes for Llama-3-8B heads (``docs/gpu-kernels.md``, "Cost estimate"). Prefill chunks compute
``q k^T`` twice (about 1x the attention FLOPs).

``triton.jit`` is applied lazily (first launch) so that ``TRITON_INTERPRET`` is read then,
as in ``vtoken.kernels.triton_move``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from vtoken.kernels.score_plan import ScorePlan, validate_score_inputs
from vtoken.kernels.triton_move import _check_device, interpret_mode

__all__ = ["score_attention_triton", "launch_score_kernels"]

_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max (no inf - inf = NaN)

# Reductions go through ``tl.reduce`` with triton's own combine functions instead of
# ``tl.sum`` / ``tl.max`` / ``tl.zeros``: those are ``@triton.jit`` library functions, which
# the interpreter cannot call when triton was imported before ``TRITON_INTERPRET`` was set
# (the test session); ``tl.reduce`` with these exact combine functions maps to numpy in the
# interpreter and to the usual reductions when compiled.
_SUM = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max


def _score_lse_kernel(
    q_ptr, s_qt, s_qh, s_qd,  # query [T, Hq, hd] and its strides (elements)
    kv_ptr, s_kb, s_kh, s_kn,  # layer view [B, Hkv, BS, 2*hd]: block, head, token strides
    bt_ptr, s_bt,  # block table [rows, max_blocks] (int32/int64) and its row stride
    items_ptr,  # int64 [R, 8]: bt_row, n, q_start, ql, col_off, last_off, lse_off, lg_off
    lse_ptr,  # fp32 [lse_rows, Hq] (written)
    lg_ptr,  # fp32 logits scratch, [Hq, n] per item with lg_off >= 0 (written)
    scale,  # softmax scale
    BS,  # tokens per block of the view
    HQ,  # query heads
    G,  # query heads per kv head
    HD,  # head size
    BLOCK_Q: tl.constexpr,  # query rows per program
    BLOCK_G: tl.constexpr,  # next power of two >= G
    BLOCK_N: tl.constexpr,  # keys per tile
    BLOCK_D: tl.constexpr,  # next power of two >= hd (>= 16)
):
    pid_r = tl.program_id(0)
    pid_q = tl.program_id(1)
    kh = tl.program_id(2)
    it = items_ptr + pid_r * 8
    bt_row = tl.load(it + 0)
    n = tl.load(it + 1)
    q_start = tl.load(it + 2)
    ql = tl.load(it + 3)
    lse_off = tl.load(it + 6)
    lg_off = tl.load(it + 7)
    q0 = pid_q * BLOCK_Q
    if q0 < ql:
        m_idx = tl.arange(0, BLOCK_Q * BLOCK_G)
        qi = q0 + m_idx // BLOCK_G  # query row within the item
        g = m_idx % BLOCK_G
        row_ok = (qi < ql) & (g < G)
        head = kh * G + g
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HD
        q = tl.load(
            q_ptr + (q_start + qi).to(tl.int64)[:, None] * s_qt + head[:, None] * s_qh
            + d[None, :] * s_qd,
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        qpos = n - ql + qi  # physical index of each query row: sees keys j <= qpos
        last_row = tl.minimum(q0 + BLOCK_Q, ql) - 1
        kv_end = n - ql + last_row + 1
        m_i = tl.full([BLOCK_Q * BLOCK_G], _NEG_BIG, tl.float32)
        l_i = tl.full([BLOCK_Q * BLOCK_G], 0.0, tl.float32)
        bt = bt_ptr + bt_row * s_bt
        kbase = kv_ptr + kh.to(tl.int64) * s_kh
        for j0 in range(0, kv_end, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            j_ok = j < kv_end
            blk = tl.load(bt + j // BS, mask=j_ok, other=0).to(tl.int64)
            k = tl.load(
                kbase + (blk * s_kb + (j % BS).to(tl.int64) * s_kn)[:, None] + d[None, :],
                mask=j_ok[:, None] & d_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            if lg_off >= 0:  # single-row item: keep the logits for phase B ([Hq, n] per item)
                tl.store(lg_ptr + lg_off * HQ + head.to(tl.int64)[:, None] * n + j[None, :], s,
                         mask=row_ok[:, None] & j_ok[None, :])
            vis = j_ok[None, :] & (j[None, :] <= qpos[:, None])
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
            l_i = l_i * tl.exp(m_i - m_new) + tl.reduce(tl.exp(s - m_new[:, None]), 1, _SUM)
            m_i = m_new
        lse = m_i + tl.log(l_i)
        tl.store(lse_ptr + (lse_off + qi).to(tl.int64) * HQ + head, lse, mask=row_ok)


def _score_prob_kernel(
    q_ptr, s_qt, s_qh, s_qd,  # as in _score_lse_kernel
    kv_ptr, s_kb, s_kh, s_kn,
    bt_ptr, s_bt,
    items_ptr,
    lse_ptr,  # fp32 [lse_rows, Hq] (read)
    lg_ptr,  # fp32 logits scratch (read)
    out_ptr,  # fp32 output (read-modify-write, +=)
    scale,
    BS,
    HQ,
    HKV,  # kv heads
    G,
    HD,
    BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two >= HQ (logits-scratch items)
):
    pid_r = tl.program_id(0)
    pid_t = tl.program_id(1)
    it = items_ptr + pid_r * 8
    bt_row = tl.load(it + 0)
    n = tl.load(it + 1)
    q_start = tl.load(it + 2)
    ql = tl.load(it + 3)
    col_off = tl.load(it + 4)
    last_off = tl.load(it + 5)
    lse_off = tl.load(it + 6)
    lg_off = tl.load(it + 7)
    j0 = pid_t * BLOCK_N
    if (j0 < n) & ((col_off >= 0) | (last_off >= 0)):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < n
        col_acc = tl.full([BLOCK_N], 0.0, tl.float32)
        last_acc = tl.full([BLOCK_N], 0.0, tl.float32)
        if lg_off >= 0:
            # Single-row item (sees all n keys): probabilities from the phase-A logits, all
            # query heads at once; K is not read again.
            hh = tl.arange(0, BLOCK_H)
            h_ok = hh < HQ
            lse_h = tl.load(lse_ptr + lse_off * HQ + hh, mask=h_ok, other=0.0)
            lg = tl.load(lg_ptr + lg_off * HQ + hh.to(tl.int64)[:, None] * n + j[None, :],
                         mask=h_ok[:, None] & j_ok[None, :], other=0.0)
            p = tl.where(h_ok[:, None] & j_ok[None, :], tl.exp(lg - lse_h[:, None]), 0.0)
            col_acc += tl.reduce(p, 0, _SUM)
            last_acc += tl.reduce(p, 0, _SUM)
        else:
            blk = tl.load(bt_ptr + bt_row * s_bt + j // BS, mask=j_ok, other=0).to(tl.int64)
            koff = blk * s_kb + (j % BS).to(tl.int64) * s_kn
            d = tl.arange(0, BLOCK_D)
            d_ok = d < HD
            m_idx = tl.arange(0, BLOCK_Q * BLOCK_G)
            # Query row i sees key j iff j <= n - ql + i: rows before q_first see none of it.
            q_first = tl.maximum(j0 - (n - ql), 0)
            qt_first = q_first // BLOCK_Q
            qt_end = (ql + BLOCK_Q - 1) // BLOCK_Q
            k_ptrs = kv_ptr + koff[:, None] + d[None, :]
            for kh in range(0, HKV):
                # Head kh's tile: the pointer advances by one head stride per iteration
                # (64-bit pointer arithmetic, so kh * s_kh never overflows a 32-bit product).
                k = tl.load(k_ptrs, mask=j_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
                k_ptrs += s_kh
                for qt in range(qt_first, qt_end):
                    qi = qt * BLOCK_Q + m_idx // BLOCK_G
                    g = m_idx % BLOCK_G
                    row_ok = (qi < ql) & (g < G)
                    head = kh * G + g
                    q = tl.load(
                        q_ptr + (q_start + qi).to(tl.int64)[:, None] * s_qt
                        + head[:, None] * s_qh + d[None, :] * s_qd,
                        mask=row_ok[:, None] & d_ok[None, :],
                        other=0.0,
                    ).to(tl.float32)
                    lse = tl.load(lse_ptr + (lse_off + qi).to(tl.int64) * HQ + head,
                                  mask=row_ok, other=0.0)
                    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
                    vis = row_ok[:, None] & j_ok[None, :] & (j[None, :] <= (n - ql + qi)[:, None])
                    p = tl.where(vis, tl.exp(s - lse[:, None]), 0.0)
                    col_acc += tl.reduce(p, 0, _SUM)
                    last_acc += tl.reduce(tl.where((qi == ql - 1)[:, None], p, 0.0), 0, _SUM)
        if col_off >= 0:
            o = out_ptr + col_off + j
            tl.store(o, tl.load(o, mask=j_ok, other=0.0) + col_acc, mask=j_ok)
        if last_off >= 0:
            o = out_ptr + last_off + j
            tl.store(o, tl.load(o, mask=j_ok, other=0.0) + last_acc, mask=j_ok)


_KERNELS: dict[bool, tuple] = {}


def _kernels(interpret: bool):
    k = _KERNELS.get(interpret)
    if k is None:
        k = (triton.jit(_score_lse_kernel), triton.jit(_score_prob_kernel))
        _KERNELS[interpret] = k
    return k


def _blocks(g: int, hd: int, max_q: int) -> tuple[int, int, int, int]:
    """(BLOCK_Q, BLOCK_G, BLOCK_N, BLOCK_D); dot tiles are at least 16 x 16 x 16."""
    block_g = triton.next_power_of_2(max(g, 1))
    block_d = max(16, triton.next_power_of_2(hd))
    rows = max(16, block_g)  # at least 16 rows in the dot tile
    want_q = max(1, rows // block_g)
    if max_q > want_q:  # prefill chunks: bigger q tiles, fewer K passes in phase A
        want_q = max(want_q, min(triton.next_power_of_2(max_q), max(1, 64 // block_g)))
    block_n = 32 if block_d <= 128 else 16
    return want_q, block_g, block_n, block_d


def launch_score_kernels(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    items: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    logits: torch.Tensor,
    *,
    scale: float,
    max_q: int,
    max_n: int,
) -> None:
    """Launch phase A then phase B for one layer; no validation, no host reads of tensors.

    Args:
        query: ``[T, Hq, hd]`` (any strides), on the launch device.
        kv_cache: ``[num_blocks, Hkv, block_size, 2*hd]`` view, contiguous last dimension.
        block_table: int32/int64 ``[rows, max_blocks]``, column stride 1.
        items: int64 ``[R, 8]`` contiguous (``score.ITEM_COLUMNS``), on the device.
        out: fp32 ``[>= out_size]`` contiguous; mutated (``+=``).
        lse: fp32 ``[>= lse_rows, Hq]`` contiguous scratch; overwritten.
        logits: fp32 ``[>= logits_per_head * Hq]`` contiguous scratch (any 1-element fp32
            tensor when no item uses it); overwritten.
        scale: softmax scale.
        max_q, max_n: bounds on every item's ``ql`` and ``n`` (fixed bounds keep the grid
            constant, e.g. for CUDA graph capture).

    Mutates:
        ``out`` (``+=``), ``lse`` and ``logits`` (overwritten); nothing else.
    """
    r = items.shape[0]
    if r == 0 or max_n <= 0 or max_q <= 0:
        return
    hq, hd = int(query.shape[1]), int(query.shape[2])
    hkv, bs = int(kv_cache.shape[1]), int(kv_cache.shape[2])
    g = hq // hkv
    bq, bg, bn, bd = _blocks(g, hd, max_q)
    lse_k, prob_k = _kernels(interpret_mode())
    common = (
        query, query.stride(0), query.stride(1), query.stride(2),
        kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_table, block_table.stride(0),
        items,
        lse,
        logits,
    )
    meta = dict(BLOCK_Q=bq, BLOCK_G=bg, BLOCK_N=bn, BLOCK_D=bd)
    lse_k[(r, triton.cdiv(max_q, bq), hkv)](*common, float(scale), bs, hq, g, hd, **meta)
    prob_k[(r, triton.cdiv(max_n, bn))](*common, out, float(scale), bs, hq, hkv, g, hd, **meta,
                                        BLOCK_H=triton.next_power_of_2(hq))


def _scratch(t: Optional[torch.Tensor], name: str, shape: tuple[int, ...], device) -> torch.Tensor:
    if t is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    ok = (t.dtype == torch.float32 and t.is_contiguous() and t.dim() == len(shape)
          and t.shape[0] >= shape[0] and tuple(t.shape[1:]) == tuple(shape[1:]))
    if not ok:
        want = ", ".join([f">= {shape[0]}"] + [str(x) for x in shape[1:]])
        raise ValueError(f"{name} is {t.dtype} {tuple(t.shape)}; expected contiguous float32 "
                         f"[{want}]")
    return t


def score_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    plan: ScorePlan,
    out: torch.Tensor,
    *,
    scale: float,
    lse: Optional[torch.Tensor] = None,
    logits: Optional[torch.Tensor] = None,
) -> None:
    """Accumulate one layer's attention scores into ``out`` (``vtoken.kernels.score``).

    Args:
        query: ``[T, Hq, hd]`` post-RoPE queries (fp32/fp16/bf16, any strides).
        kv_cache: the layer's ``[num_blocks, Hkv, block_size, 2*hd]`` paged view (any
            block/head/token strides; K = ``[..., :hd]``).
        block_table: int32/int64 ``[num_rows, max_blocks]`` physical block ids, in the view's
            block unit.
        plan: the step's :class:`~vtoken.kernels.score.ScorePlan` (its items are copied to the
            device once and reused by every layer).
        out: fp32 ``[plan.out_size]`` on the device; ``+=`` this layer's sums over heads.
        scale: softmax scale.
        lse: optional fp32 ``[>= plan.lse_rows, Hq]`` scratch (allocated when None); pass the
            same buffer to every layer of a step to avoid an allocation per layer.
        logits: optional fp32 ``[>= max(1, plan.logits_per_head * Hq)]`` scratch (allocated
            when None).

    Mutates:
        ``out`` (``+=``), ``lse`` and ``logits`` (overwritten); the KV cache is only read.

    Raises:
        ValueError: see :func:`vtoken.kernels.score.validate_score_inputs`, a badly shaped
            scratch, CUDA tensors under ``TRITON_INTERPRET=1``, or CPU tensors without it.
    """
    hq, _hkv, _hd, _bs = validate_score_inputs(query, kv_cache, block_table, out, plan)
    _check_device(query.device)
    if plan.out_size == 0:
        return
    lse = _scratch(lse, "lse", (plan.lse_rows, hq), query.device)
    logits = _scratch(logits, "logits", (max(1, plan.logits_per_head * hq),), query.device)
    items = plan.items_on(query.device)
    kw = dict(scale=scale, max_q=plan.max_q, max_n=plan.max_n)
    if query.is_cuda:
        with torch.cuda.device(query.device):
            launch_score_kernels(query, kv_cache, block_table, items, out, lse, logits, **kw)
    else:
        launch_score_kernels(query, kv_cache, block_table, items, out, lse, logits, **kw)
