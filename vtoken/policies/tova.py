"""TOVA: Token Omission Via Attention (Oren et al., arXiv 2401.06104)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vtoken.policies.base import AttentionNeed, BatchedFields, EvictionPolicy

__all__ = ["TOVAPolicy"]


@dataclass
class TOVAPolicy(EvictionPolicy):
    """TOVA, "Token Omission Via Attention" (Oren et al., "Transformers are
    Multi-State RNNs", arXiv 2401.06104, Sec. 3.3).

    Idea: treat the cache as a bounded multi-state RNN; when it is full, drop the
    token that the current (last) query attends to least. In steady state this
    drops one token per step.

    Score: ``last``, the attention row of the last query of the most recent step that
    sampled a token (``stats.last_row``: post-softmax probabilities averaged over
    the query heads and layers of the token set). Each such step overwrites it; a step without a last row
    (a non-final prefill chunk) leaves it unchanged, and tokens written in that step
    score 0 until the next last row arrives.

    Defaults: no protections (``sink_tokens = 0``, ``recent_tokens = 0``), as the
    paper; ``slack = 0`` (evict as soon as the cache exceeds the budget).

    Needs: ``AttentionNeed.LAST_ROW``.

    Departures from the paper:

    * Token sets (``granularity``, ``docs/granularity.md``): by default one set per layer, as the paper, with the row averaged
      over the layer's query heads. ``request`` averages over layers too; ``head`` and ``head_shared`` keep a set
      per KV head.
    * Ties go to the smaller logical position (evicted first).
    """

    name: ClassVar[str] = "tova"
    paper: ClassVar[str] = 'TOVA, arXiv 2401.06104'
    summary: ClassVar[str] = "last query's attention"
    needs: ClassVar[AttentionNeed] = AttentionNeed.LAST_ROW

    @classmethod
    def default_granularity(cls) -> str:
        return "layer"

    def side_specs(self):
        return {"last": ((), torch.float64)}

    def observe_batched(self, fields: BatchedFields, live, col_sum, last_row) -> None:
        if last_row is not None:
            fields["last"].copy_(last_row.to(torch.float64))

    def score_batched(self, fields: BatchedFields, logical_pos, live) -> torch.Tensor:
        return fields["last"]
