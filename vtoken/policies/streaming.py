"""StreamingLLM: attention sinks plus a recent window (Xiao et al., arXiv 2309.17453)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vtoken.policies.base import AttentionNeed, EvictionPolicy

__all__ = ["StreamingLLMPolicy"]

#: Attention sinks kept by default (the paper's and the reference code's ``start_size``).
DEFAULT_SINKS = 4


@dataclass
class StreamingLLMPolicy(EvictionPolicy):
    """StreamingLLM, "Efficient Streaming Language Models with Attention Sinks"
    (Xiao et al., ICLR 2024, arXiv 2309.17453, Sec. 3.2).

    Idea: the first few tokens absorb a large share of attention ("attention
    sinks") whatever their content; keeping them plus a sliding window of the most
    recent tokens keeps a model stable on unbounded streams. The middle is dropped.

    Score: the logical position, so the victims are the oldest non-sink tokens.

    Defaults (tokens, ``B`` = budget): ``sink_tokens = min(4, B)`` (the paper's four
    sinks), ``recent_tokens = B - sink_tokens`` (the rest of the budget is the
    window; when ``sink_tokens`` is set explicitly the config clamps this default to
    ``B - sink_tokens``), ``slack = 0``.

    Needs: nothing from attention (``AttentionNeed.NONE``).

    Departures from the paper:

    * Original positions are kept: cached keys keep the RoPE rotation of their
      logical position and are not re-rotated. The paper caches pre-RoPE keys and
      re-applies RoPE with positions inside the cache ("pos-shift"), on which its
      perplexity results rely.
    * One token set for all heads and layers (as the paper).
    """

    name: ClassVar[str] = "streaming"
    paper: ClassVar[str] = 'StreamingLLM, arXiv 2309.17453'
    summary: ClassVar[str] = 'sinks + recent window'
    needs: ClassVar[AttentionNeed] = AttentionNeed.NONE

    @classmethod
    def default_sink_tokens(cls, budget: int) -> int:
        return min(DEFAULT_SINKS, max(budget, 0))

    @classmethod
    def default_recent_tokens(cls, budget: int) -> int:
        return max(0, budget - cls.default_sink_tokens(budget))

    def score_batched(self, fields, logical_pos, live):
        return logical_pos.to(torch.float64)
