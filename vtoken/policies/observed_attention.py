"""Observed attention: H2O's accumulated attention with no recent window (kvpress's
``ObservedAttentionPress``; Zhang et al., arXiv 2306.14048)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vtoken.policies.h2o import H2OPolicy

__all__ = ["ObservedAttentionPolicy"]


@dataclass
class ObservedAttentionPolicy(H2OPolicy):
    """Observed attention: keep the tokens that received the most attention so far, and nothing else.

    Idea: the attention a key has received predicts the attention it will receive (H2O, Zhang et
    al., NeurIPS 2023, arXiv 2306.14048, Sec. 3, "heavy hitters"). kvpress lists the same score
    as ``ObservedAttentionPress``, computed once from the prompt's attention matrix. This policy
    is the heavy-hitter half of H2O alone: no recent window and no attention sinks by default,
    so a new token must earn its place against the prompt's heavy hitters.

    Score: ``acc``, each key's probability summed over every query row that attended it so far
    (prefill chunks and decode steps); the state, the statistics (``AttentionNeed.COL_SUM``) and
    the batched forms are H2O's.

    Defaults (tokens): ``recent_tokens = 0``, ``sink_tokens = 0``, ``slack = 0``; one token set
    per (layer, KV head), as H2O.

    Departures: kvpress averages each key's attention over the queries that saw it and scores
    once after the prompt; here the sum keeps accumulating through decoding, as in H2O, and ties
    go to the older token, as for every policy. Without a recent window the token just written
    can be evicted at the next step when its attention is the lowest.
    """

    name: ClassVar[str] = "observed_attention"
    paper: ClassVar[str] = 'H2O, arXiv 2306.14048'
    summary: ClassVar[str] = 'accumulated attention, no recent window'

    @classmethod
    def default_recent_tokens(cls, budget: int) -> int:
        return 0
