"""Attention scores for eviction policies, read back from a paged K cache.

What is computed (the semantics of the CPU worker's ``StepScores``): for each *scored item*
(one request row of one step) with ``n`` live physical slots ``0..n-1`` and ``ql`` scored query
rows (tokens ``q_start .. q_start+ql-1`` of the step's ``query``), query row ``i`` sits at
physical index ``n - ql + i`` and sees keys ``j <= n - ql + i`` (causal by physical index; valid
because every token new this step sits after all older live tokens). For query head ``h`` the
post-softmax probability is::

    p[h, i, j] = softmax_j(scale * <q[i, h], k[j, h // (Hq // Hkv)]>)     (GQA / MQA / MHA)

and the item accumulates, into an fp32 output buffer, summed over query heads:

* ``col`` (H2O column sums): ``out[col_off + j] += sum_h sum_i p[h, i, j]``;
* ``last`` (TOVA / Scissorhands last row): ``out[last_off + j] += sum_h p[h, ql-1, j]``.

Calling once per layer sums over layers. Dividing by ``Hq_total * num_layers`` at the end
gives the mean over heads and layers that ``vtoken.policies.base`` defines
(:meth:`ScorePlan.results`). A decode row, or a prefill row whose policy only wants the last
row, is an item with ``ql = 1`` (its query is the step's last token of that request, which
sees all ``n`` keys); its single vector serves as both ``col`` and ``last``.

Cache layout: one layer's vLLM view ``kv_cache [num_blocks, Hkv, block_size, 2*hd]`` with any
block/head/token strides (K = ``[..., :hd]``, V = ``[..., hd:]``, never read), addressed
through the request's block-table row (block ids in the view's block unit).

Implementations:

* :func:`score_attention_reference`: PyTorch, any device (materialises ``[Hq, ql, n]`` per
  item; the test oracle and the fallback).
* :func:`score_attention_triton` (``vtoken.kernels.triton_score``): two Triton phases, no
  ``[heads, q, n]`` matrix (see that module).

This module never imports vllm or triton.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from vtoken.kernels.score_plan import (
    ITEM_COLUMNS,
    ScorePlan,
    ScoreRow,
    plan_scores,
    step_score_row,
    validate_score_inputs,
)

__all__ = [
    "ITEM_COLUMNS",
    "ScoreRow",
    "ScorePlan",
    "plan_scores",
    "step_score_row",
    "score_attention",
    "score_attention_reference",
    "score_attention_triton",
    "validate_score_inputs",
]

def score_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    plan: ScorePlan,
    out: torch.Tensor,
    *,
    scale: float,
) -> None:
    """Accumulate one layer's scores into ``out`` with plain PyTorch (module docstring).

    Args:
        query: ``[T, Hq, hd]`` post-RoPE queries of the step.
        kv_cache: the layer's ``[num_blocks, Hkv, block_size, 2*hd]`` view.
        block_table: ``[num_rows, max_blocks]`` block ids (the view's block unit).
        plan: from :func:`plan_scores`.
        out: fp32 ``[plan.out_size]``; mutated (``+=``).
        scale: softmax scale (``1/sqrt(hd)`` normally).

    Mutates:
        ``out`` (``+=``) only.

    Raises:
        ValueError: see :func:`validate_score_inputs`.
    """
    hq, hkv, hd, bs = validate_score_inputs(query, kv_cache, block_table, out, plan)
    g = hq // hkv
    for r, cs, ls in zip(plan.rows, plan.col_slices, plan.last_slices):
        if cs is None and ls is None:
            continue
        j = torch.arange(r.n, device=kv_cache.device)
        blk = block_table[r.bt_row].to(torch.int64)[j // bs]
        k = kv_cache[blk, :, j % bs, :hd].float()  # [n, Hkv, hd]
        k = k.permute(1, 0, 2).repeat_interleave(g, dim=0)  # [Hq, n, hd]
        q = query[r.q_start : r.q_start + r.ql].float().permute(1, 0, 2)  # [Hq, ql, hd]
        logits = torch.bmm(q, k.transpose(1, 2)) * scale  # [Hq, ql, n]
        qpos = torch.arange(r.n - r.ql, r.n, device=j.device).view(1, r.ql, 1)
        logits = logits.masked_fill(j.view(1, 1, r.n) > qpos, float("-inf"))
        probs = torch.softmax(logits, dim=-1).sum(dim=0)  # [ql, n], summed over heads
        if r.ql == 1:
            seg = cs if cs is not None else ls
            out[seg[0] : seg[0] + r.n] += probs[0]
            continue
        if cs is not None:
            out[cs[0] : cs[0] + r.n] += probs.sum(dim=0)
        if ls is not None:
            out[ls[0] : ls[0] + r.n] += probs[-1]


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
    """Accumulate one layer's scores into ``out`` with the two-phase Triton kernels.

    Same arguments and semantics as :func:`score_attention_reference`; see
    :func:`vtoken.kernels.triton_score.score_attention_triton` (``lse`` / ``logits`` are the
    optional fp32 scratches, reused across layers when given). CUDA tensors, or CPU tensors
    under ``TRITON_INTERPRET=1``.
    """
    from vtoken.kernels import triton_score

    triton_score.score_attention_triton(
        query, kv_cache, block_table, plan, out, scale=scale, lse=lse, logits=logits
    )


def score_attention(
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
    """Triton on CUDA tensors (when triton imports), the PyTorch reference otherwise.

    On CPU the reference is used: the Triton interpreter is far slower than PyTorch there
    (measured in ``tests/core/test_score_kernel.py``, ``test_interpreter_speed_vs_torch``).
    """
    if query.is_cuda:
        from vtoken.kernels.move import triton_available

        if triton_available():
            score_attention_triton(
                query, kv_cache, block_table, plan, out, scale=scale, lse=lse, logits=logits
            )
            return
    score_attention_reference(query, kv_cache, block_table, plan, out, scale=scale)
