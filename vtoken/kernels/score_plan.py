"""The scoring kernels' plan and input checks: which rows a step scores, where results go.

:func:`plan_scores` turns per-request :class:`ScoreRow` s into a :class:`ScorePlan` (the int64
``items`` tensor the kernels read, and the output offsets); :func:`validate_score_inputs` checks
the query / paged K cache / block table a launch gets. Shared by the PyTorch reference
(:mod:`vtoken.kernels.score`) and the Triton kernels (:mod:`vtoken.kernels.triton_score`), so
neither imports the other for them. Semantics: :mod:`vtoken.kernels.score`.

This module never imports vllm or triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

__all__ = ["ITEM_COLUMNS", "ScoreRow", "ScorePlan", "plan_scores", "step_score_row", "validate_score_inputs"]

# Columns of the int64 ``items`` tensor [R, 7] the kernels read.
ITEM_COLUMNS = ("bt_row", "n", "q_start", "ql", "col_off", "last_off", "lse_off", "lg_off")


class ScoreRow(NamedTuple):
    """One scored request row of a step (host side).

    Attributes:
        bt_row: the request's row in ``block_table``.
        n: physical sequence length (live tokens including this step's), ``n >= ql >= 1``.
        q_start: index in ``query`` of the first scored query row.
        ql: number of scored query rows (1 for decode rows and last-row-only items).
        col: accumulate the column sums over the ``ql`` rows.
        last: accumulate the last query row's probabilities.
    """

    bt_row: int
    n: int
    q_start: int
    ql: int
    col: bool
    last: bool


def step_score_row(
    bt_row: int, n: int, q_begin: int, q_end: int, col: bool, last: bool
) -> ScoreRow:
    """The item the CPU worker's ``StepScores`` scores for one request row of a step.

    Args:
        bt_row: the request's batch row (its ``block_table`` row).
        n: physical sequence length after this step's tokens (``seq_lens[row]``).
        q_begin, q_end: the request's query rows ``query_start_loc[row] .. [row+1]``.
        col, last: the policy's needs (``AttentionNeed.COL_SUM`` / ``LAST_ROW``).

    Returns:
        one query row (the last, seeing all ``n`` keys) when the request has one query row
        this step or does not want column sums; otherwise all ``q_end - q_begin`` rows with
        the physical causal mask.

    Raises:
        ValueError: ``q_end <= q_begin`` or ``n < q_end - q_begin``.
    """
    ql = q_end - q_begin
    if ql < 1:
        raise ValueError(f"query rows [{q_begin}, {q_end}) are empty; nothing to score")
    if ql == 1 or not col:
        return ScoreRow(bt_row, n, q_end - 1, 1, col, last)
    if n < ql:
        raise ValueError(f"n = {n} < {ql} query rows; n counts this step's tokens too")
    return ScoreRow(bt_row, n, q_begin, ql, col, last)


@dataclass
class ScorePlan:
    """Host-built description of one step's scored items, shared by all layers.

    Attributes:
        rows: the :class:`ScoreRow` list, in item order.
        items: int64 ``[R, 8]`` (columns :data:`ITEM_COLUMNS`), CPU; ``col_off``/``last_off``
            are offsets into the output buffer or -1, ``lse_off`` the item's first row in the
            ``lse`` scratch, ``lg_off`` the item's first element in the logits scratch (-1:
            phase B recomputes the logits from K).
        out_size: length of the fp32 output buffer (elements).
        lse_rows: rows of the ``[lse_rows, Hq]`` fp32 scratch (total scored query rows).
        logits_per_head: the logits scratch holds ``logits_per_head * Hq`` fp32 elements
            (sum of ``n`` over the items that use it).
        max_q, max_n: largest ``ql`` and ``n`` (grid bounds; upper bounds also work).
        col_slices, last_slices: per item, ``(offset, n)`` of its col / last vector in the
            output, or None. For ``ql == 1`` items ``last`` shares the ``col`` segment.
    """

    rows: list[ScoreRow]
    items: torch.Tensor
    out_size: int
    lse_rows: int
    logits_per_head: int
    max_q: int
    max_n: int
    col_slices: list[Optional[tuple[int, int]]]
    last_slices: list[Optional[tuple[int, int]]]
    _device_items: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def items_on(self, device: torch.device) -> torch.Tensor:
        """``items`` on ``device`` (copied once per device, then reused by every layer)."""
        key = str(device)
        t = self._device_items.get(key)
        if t is None:
            t = self.items.to(device)
            self._device_items[key] = t
        return t

    def new_out(self, device: torch.device) -> torch.Tensor:
        """A zeroed fp32 output buffer ``[out_size]`` on ``device``."""
        return torch.zeros(self.out_size, dtype=torch.float32, device=device)

    def results(
        self, out: torch.Tensor, divisor: float
    ) -> list[tuple[Optional[np.ndarray], Optional[np.ndarray]]]:
        """Per item ``(col, last)`` as float64 numpy ``[n]`` divided by ``divisor`` (normally
        ``Hq_total * num_layers``), None where not requested."""
        host = out.detach().to("cpu", torch.float64).numpy() / float(divisor)
        res = []
        for cs, ls in zip(self.col_slices, self.last_slices):
            col = None if cs is None else host[cs[0] : cs[0] + cs[1]].copy()
            last = None if ls is None else host[ls[0] : ls[0] + ls[1]].copy()
            res.append((col, last))
        return res


def plan_scores(rows: Sequence[ScoreRow | tuple], *, logits_scratch: bool = True) -> ScorePlan:
    """Lay out the output buffer and the kernels' item table for one step.

    Args:
        rows: :class:`ScoreRow` (or equal tuples), one per scored request row.
        logits_scratch: single-row items (``ql == 1``: decode rows) keep their logits in an
            fp32 scratch ``[Hq, n]`` between the two Triton phases instead of re-reading K
            (4*Hq bytes written and read per key instead of Hkv*hd*dtype bytes read). Multi-row
            items always recompute (a scratch would be the ``[heads, q, n]`` matrix).

    Returns:
        the :class:`ScorePlan`. Items that ask for nothing (``col`` and ``last`` both false)
        are kept with offsets -1 (they cost nothing in the kernels but a bounds check).

    Raises:
        ValueError: ``ql < 1``, ``n < ql``, or a negative ``bt_row`` / ``q_start``.
    """
    rows = [ScoreRow(*r) for r in rows]
    items = np.zeros((len(rows), len(ITEM_COLUMNS)), dtype=np.int64)
    col_slices: list[Optional[tuple[int, int]]] = []
    last_slices: list[Optional[tuple[int, int]]] = []
    off = 0
    lse_off = 0
    lg_total = 0
    for i, r in enumerate(rows):
        if r.ql < 1:
            raise ValueError(f"rows[{i}].ql = {r.ql}; a scored item needs at least 1 query row")
        if r.n < r.ql:
            raise ValueError(
                f"rows[{i}].n = {r.n} < ql = {r.ql}; the scored query rows are the last ql of "
                "the n physical slots, so n >= ql"
            )
        if r.bt_row < 0 or r.q_start < 0:
            raise ValueError(
                f"rows[{i}] has bt_row = {r.bt_row}, q_start = {r.q_start}; both must be >= 0"
            )
        col_off = last_off = -1
        cs = ls = None
        if r.ql == 1:
            if r.col or r.last:
                col_off, off = off, off + r.n
                cs = (col_off, r.n) if r.col else None
                ls = (col_off, r.n) if r.last else None
        else:
            if r.col:
                col_off, off = off, off + r.n
                cs = (col_off, r.n)
            if r.last:
                last_off, off = off, off + r.n
                ls = (last_off, r.n)
        lg_off = -1
        if logits_scratch and r.ql == 1 and (r.col or r.last):
            lg_off, lg_total = lg_total, lg_total + r.n  # times Hq: see triton_score
        items[i] = (r.bt_row, r.n, r.q_start, r.ql, col_off, last_off, lse_off, lg_off)
        lse_off += r.ql
        col_slices.append(cs)
        last_slices.append(ls)
    return ScorePlan(
        rows=rows,
        items=torch.from_numpy(items),
        out_size=off,
        lse_rows=lse_off,
        logits_per_head=lg_total,
        max_q=max((r.ql for r in rows), default=0),
        max_n=max((r.n for r in rows), default=0),
        col_slices=col_slices,
        last_slices=last_slices,
    )


def validate_score_inputs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    plan: Optional[ScorePlan] = None,
) -> tuple[int, int, int, int]:
    """Check shapes, dtypes and devices of one layer's scoring call.

    Args:
        query: ``[T, Hq, hd]`` (any float dtype, any strides).
        kv_cache: ``[num_blocks, Hkv, block_size, 2*hd]``, contiguous last dimension.
        block_table: int32/int64 ``[num_rows, max_blocks]``, contiguous rows.
        out: fp32 ``[>= plan.out_size]``, contiguous.
        plan: checked against the sizes above when given.

    Returns:
        ``(Hq, Hkv, hd, block_size)``.

    Raises:
        ValueError: naming the argument, its value and what is allowed.
    """
    if query.dim() != 3:
        raise ValueError(f"query has shape {tuple(query.shape)}; expected [T, Hq, head_size]")
    if kv_cache.dim() != 4:
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)}; expected "
            "[num_blocks, num_kv_heads, block_size, 2*head_size]"
        )
    _t, hq, hd = (int(x) for x in query.shape)
    _nb, hkv, bs, c = (int(x) for x in kv_cache.shape)
    if c != 2 * hd:
        raise ValueError(
            f"kv_cache content dimension is {c} but query head_size is {hd}; expected "
            f"C = 2*head_size = {2 * hd} (K then V, equal head sizes)"
        )
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(
            f"query has {hq} heads and kv_cache {hkv} KV heads; Hq must be a multiple of Hkv"
        )
    if c > 1 and kv_cache.stride(3) != 1:
        raise ValueError(f"kv_cache content stride is {kv_cache.stride(3)}; it must be 1")
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"block_table is {block_table.dtype} {tuple(block_table.shape)}; expected int32 or "
            "int64 [num_rows, max_blocks]"
        )
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(f"block_table column stride is {block_table.stride(1)}; it must be 1")
    if out.dtype != torch.float32 or out.dim() != 1 or (out.numel() > 1 and out.stride(0) != 1):
        raise ValueError(
            f"out is {out.dtype} {tuple(out.shape)}; expected a contiguous 1-D float32 buffer"
        )
    for name, t in (("kv_cache", kv_cache), ("block_table", block_table), ("out", out)):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query is on {query.device}")
    if plan is not None:
        if out.numel() < plan.out_size:
            raise ValueError(f"out has {out.numel()} elements; the plan needs {plan.out_size}")
        if plan.rows:
            bad = [r for r in plan.rows if r.bt_row >= block_table.shape[0]]
            if bad:
                raise ValueError(
                    f"bt_row {bad[0].bt_row} is out of range for block_table with "
                    f"{block_table.shape[0]} rows"
                )
            need = max(-(-r.n // bs) for r in plan.rows)
            if need > block_table.shape[1]:
                raise ValueError(
                    f"a row with n = {plan.max_n} needs {need} blocks of {bs}; block_table has "
                    f"{block_table.shape[1]} columns"
                )
            last_q = max(r.q_start + r.ql for r in plan.rows)
            if last_q > query.shape[0]:
                raise ValueError(
                    f"a scored item reads query rows up to {last_q - 1}; query has "
                    f"{query.shape[0]} rows"
                )
    return hq, hkv, hd, bs
