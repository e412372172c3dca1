"""Attention statistics for the eviction policies, computed next to the stock attention kernel.

:class:`StepScores` is filled by the attention wrapper of
:class:`~vtoken.integrations.vllm.worker_core.VTokenWorkerCore`, layer by layer, from the
query the attention layer received and the keys it reads back from the KV cache through the
backend's :class:`~vtoken.integrations.vllm.kv_layout.KVLayout`. The statistics are those of
:mod:`vtoken.policies.base` (post-softmax probabilities averaged over query heads and layers).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from vtoken.integrations.vllm.kv_layout import KVLayout
from vtoken.policies.base import AttentionNeed

__all__ = ["StepScores"]


class StepScores:
    """Accumulates one step's attention statistics per request across layers.

    For each request row that asked for scores: post-softmax probabilities of the
    step's query rows against the request's physical slots ``0..seq_len-1``, averaged
    over query heads, summed over layers; divided by the number of layers at the end
    (so: the mean over layers and heads, as ``vtoken.policies.base`` defines).

    Rows that need one query row (decode steps, and prefill rows of policies that only
    want the last row) are scored together in one batched gather + einsum per layer
    (keys padded to the longest row and masked); prefill rows that need column sums over
    several query rows take a per-row causal path. The gather indices are built once
    per step, at the first layer.

    Args:
        rows: ``(batch row, req_id, AttentionNeed value)`` of the rows to score; the batch
            row indexes the attention metadata (``query_start_loc``, ``seq_lens``, ``block_table``).
    """

    def __init__(self, rows: list[tuple[int, str, int]]):
        self.rows = rows
        self.col: dict[str, torch.Tensor] = {}
        self.last: dict[str, torch.Tensor] = {}
        self.num_layers = 0
        self.num_heads = 0  #: query heads this rank scored per layer (``impl.num_heads``: Hq / TP)
        self._plan: Optional[dict[str, Any]] = None
        self._single_acc: Optional[torch.Tensor] = None  # float64 [R, max_n]

    def _build(self, meta, kv_cache: torch.Tensor) -> dict[str, Any]:
        qsl = meta.query_start_loc
        singles, multis = [], []
        for row, rid, need in self.rows:
            qs, qe = int(qsl[row]), int(qsl[row + 1])
            n = int(meta.seq_lens[row])
            if qe <= qs or n <= 0:
                continue
            if qe - qs == 1 or not need & AttentionNeed.COL_SUM.value:
                singles.append((row, rid, need, n, qe - 1))
            else:
                multis.append((row, rid, need, n, qs, qe))
        plan: dict[str, Any] = dict(singles=singles, multis=multis)
        if singles:
            bs = kv_cache.shape[2]
            max_n = max(x[3] for x in singles)
            s = torch.arange(max_n)
            bt = meta.block_table[torch.tensor([x[0] for x in singles])].to(torch.int64)  # [R, max_blocks]
            blocks = bt[:, (s // bs).clamp(max=bt.shape[1] - 1)].clamp(0, kv_cache.shape[0] - 1)  # [R, max_n]
            lens = torch.tensor([x[3] for x in singles])
            plan.update(blocks=blocks, offsets=s % bs, pad=s[None, :] >= lens[:, None],
                        q_index=torch.tensor([x[4] for x in singles]), max_n=max_n)
        return plan

    def accumulate(self, impl, query: torch.Tensor, kv_cache: torch.Tensor, meta, layout: KVLayout) -> None:
        """Fold one layer's probabilities in (called by the attention wrapper, every layer).

        Args:
            impl: the layer's attention impl (``num_heads``, ``head_size``, ``num_kv_heads``, ``scale``).
            query: ``[num_tokens, num_heads * head_size]`` (this rank's heads), post-RoPE.
            kv_cache: the layer's KV cache.
            meta: the backend's attention metadata (physical ``seq_lens`` and slots).
            layout: the backend's :class:`KVLayout` for this layer.
        """
        if self._plan is None:
            self._plan = self._build(meta, kv_cache)
        plan = self._plan
        self.num_layers += 1
        Hq, hd, Hkv = impl.num_heads, impl.head_size, impl.num_kv_heads
        if self.num_heads and Hq != self.num_heads:
            raise ValueError(f"vToken scoring: layer with {Hq} query heads after layers with {self.num_heads}; "
                             "the tensor-parallel mean needs one head count per rank")
        self.num_heads = Hq
        q_all = query.view(-1, Hq, hd)
        if plan["singles"]:
            k = layout.gather_keys_batched(kv_cache, plan["blocks"], plan["offsets"])  # [R, Hkv, max_n, hd]
            R = k.shape[0]
            q = q_all[plan["q_index"]].float().view(R, Hkv, Hq // Hkv, hd)
            logits = torch.einsum("rkgd,rknd->rkgn", q, k) * impl.scale
            logits.masked_fill_(plan["pad"][:, None, None, :], float("-inf"))
            probs = torch.softmax(logits, dim=-1).mean(dim=(1, 2)).double()  # [R, max_n]
            self._single_acc = probs if self._single_acc is None else self._single_acc + probs
        for row, rid, need, n, qs, qe in plan["multis"]:
            q = q_all[qs:qe]
            ql = qe - qs
            k = layout.gather_keys(kv_cache, meta.block_table[row].to(torch.int64), n)  # [Hkv, n, hd]
            k = k.repeat_interleave(Hq // Hkv, dim=0)  # [Hq, n, hd]
            logits = torch.bmm(q.permute(1, 0, 2).float(), k.transpose(1, 2)) * impl.scale  # [Hq, ql, n]
            qpos = torch.arange(n - ql, n).view(1, ql, 1)  # query i sits at physical index n - ql + i
            logits = logits.masked_fill(torch.arange(n).view(1, 1, n) > qpos, float("-inf"))
            probs = torch.softmax(logits, dim=-1).mean(dim=0).double()  # [ql, n]
            c = probs.sum(dim=0)
            self.col[rid] = c if rid not in self.col else self.col[rid] + c
            if need & AttentionNeed.LAST_ROW.value:
                r = probs[-1]
                self.last[rid] = r if rid not in self.last else self.last[rid] + r

    def result(self) -> dict[str, tuple[Optional[np.ndarray], Optional[np.ndarray]]]:
        """req_id -> (col_sum, last_row), float64 numpy ``[num_live]`` (None where not asked)."""
        L = max(self.num_layers, 1)
        out = {}
        if self._plan is not None and self._single_acc is not None:
            acc = (self._single_acc / L).numpy()
            for i, (_, rid, need, n, _) in enumerate(self._plan["singles"]):
                row = acc[i, :n]
                col = row if need & AttentionNeed.COL_SUM.value else None
                last = row.copy() if need & AttentionNeed.LAST_ROW.value else None
                out[rid] = (col, last)
        for rid, c in self.col.items():
            r = self.last.get(rid)
            out[rid] = ((c / L).numpy(), None if r is None else (r / L).numpy())
        return out
