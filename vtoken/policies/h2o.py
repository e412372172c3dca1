"""H2O: Heavy-Hitter Oracle (Zhang et al., arXiv 2306.14048)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vtoken.policies.base import AttentionNeed, BatchedFields, EvictionPolicy

__all__ = ["H2OPolicy"]


@dataclass
class H2OPolicy(EvictionPolicy):
    """H2O, "Heavy-Hitter Oracle" (Zhang et al., NeurIPS 2023, arXiv 2306.14048, Sec. 3-4).

    Idea: a small set of "heavy hitter" tokens receives most of the attention mass,
    and a token's accumulated attention over the steps so far predicts whether it
    stays important. The cache keeps the most recent tokens plus the tokens with the
    largest accumulated attention.

    Score: ``acc``, the sum of ``stats.col_sum`` over every step that touched the
    token (prefill chunks and decode steps), cumulative, not windowed, with no
    normalisation (as the reference code). Evicted tokens' scores are dropped (their
    slots are reused and reset).

    Defaults (tokens, ``B`` = budget): ``recent_tokens = B // 2`` (the paper's equal
    split between heavy hitters and recent tokens; the heavy-hitter share is
    therefore ``B - B // 2``), ``sink_tokens = 0`` (H2O has no explicit sinks; the
    first tokens usually win as heavy hitters), ``slack = 0`` (evict as soon as the
    cache exceeds the budget, i.e. one token per decode step once full).

    Needs: ``AttentionNeed.COL_SUM`` at every step.

    Departures from the paper:

    * Token sets (``granularity``, ``docs/granularity.md``): by default, under
      one heavy-hitter set per (layer, KV head), as the paper's
      per-head sets, with the statistic of a KV head the mean over its query heads
      (grouped-query attention; the paper's models have one query head per KV head).
      ``layer`` averages over a layer's query heads, ``head_shared`` over every layer
      and the KV head's query heads, ``request`` over every layer and query head.
    * The budget is an absolute number of tokens (with the recent share as above),
      not ``heavy_ratio``/``recent_ratio`` times the prompt length fixed at prefill.
    * Ties in ``acc`` go to the smaller logical position (evicted first).
    """

    name: ClassVar[str] = "h2o"
    paper: ClassVar[str] = 'H2O, arXiv 2306.14048'
    summary: ClassVar[str] = 'accumulated attention (heavy hitters) + recent window'
    needs: ClassVar[AttentionNeed] = AttentionNeed.COL_SUM
    prompt_statistics: ClassVar[bool] = True

    @classmethod
    def default_granularity(cls) -> str:
        return "head"

    @classmethod
    def default_recent_tokens(cls, budget: int) -> int:
        return budget // 2

    def side_specs(self):
        return {"acc": ((), torch.float64)}

    def observe_batched(self, fields: BatchedFields, live, col_sum, last_row) -> None:
        if col_sum is not None:
            fields["acc"] += col_sum.to(torch.float64)

    def score_batched(self, fields: BatchedFields, logical_pos, live) -> torch.Tensor:
        return fields["acc"]
