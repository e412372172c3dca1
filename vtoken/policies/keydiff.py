"""KeyDiff: evict the keys most similar to their head's mean key (Park et al., arXiv 2504.15364)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from vtoken.policies.base import AttentionNeed, BatchedFields, EvictionPolicy

__all__ = ["KeyDiffPolicy", "key_similarity"]


def key_similarity(keys: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """KeyDiff's similarity of each live key to its head's anchor (the mean of the live unit keys).

    Args:
        keys: float ``[R, H, N, D]``: per request and head, the keys of slots ``0..N-1``
            (post-RoPE, as cached; slots at and past ``live[r]`` are ignored).
        live: int64 ``[R]``, ``0 <= live <= N``.

    Returns:
        float64 ``[R, H, N]``: ``cos(k_i, mu)`` with ``mu = mean_j k_j / |k_j|`` over the request's
        live slots (Park et al., arXiv 2504.15364, Sec. 3, eq. for the anchor and the score);
        ``NaN`` at and past ``live``, and for a zero key or a zero anchor (cosine undefined).
    """
    k = keys.to(torch.float64)
    n = k.shape[2]
    live_f = live.to(device=k.device, dtype=torch.float64)
    nk = torch.linalg.vector_norm(k, dim=-1)  # [R, H, N]
    inv = torch.where(nk > 0, 1.0 / torch.where(nk > 0, nk, 1.0), 0.0)  # 1 / |k|; a zero key counts 0
    # the anchor mu = mean over the live slots of k / |k|, and k . mu, as batched matrix products
    # (no [R, H, N, D] temporary of unit keys)
    w = (torch.arange(n, device=k.device)[None, :] < live[:, None].to(k.device)).to(torch.float64)
    w = w / live_f.clamp(min=1)[:, None]  # [R, N]
    mu = torch.matmul((w[:, None, :] * inv)[:, :, None, :], k)  # [R, H, 1, D]
    num = torch.matmul(k, mu.transpose(-1, -2))[..., 0] * inv  # [R, H, N]: unit k . mu
    den = torch.linalg.vector_norm(mu, dim=-1)  # [R, H, 1]
    ok = (w[:, None, :] > 0) & (nk > 0) & (den > 0)
    return torch.where(ok, num / torch.where(den > 0, den, 1.0), float("nan"))


@dataclass
class KeyDiffPolicy(EvictionPolicy):
    """KeyDiff, "Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
    Resource-Constrained Environments" (Park et al., arXiv 2504.15364, Sec. 3, Algorithm 1).

    Idea: geometrically distinctive keys receive more attention. Per head, the anchor is the
    mean of the cached keys normalized to unit length, and a token's score is
    ``-cos(k_i, anchor)``: the keys most similar to the anchor are evicted first, the most
    distinctive kept. The score needs no attention weights, only the cached keys.

    When: at eviction time, on the worker, from the keys in the KV cache (the anchor depends on
    every live key, so it cannot be fixed when a key is written): before the step's forward, for
    the requests that evict in it, one read of their live keys per layer
    (``KVLayout.gather_keys_batched``). No statistic is computed in the forward.

    Score: ``-sim``, where ``sim`` (:func:`key_similarity`) is set for every live slot just
    before each eviction (``stats.key_sim``). With several (layer, KV head) pairs in a token
    set the similarity is their mean (``docs/granularity.md``); under tensor parallelism a
    ``request`` or ``layer`` set sums its ranks' similarities (one all-reduce per evicting
    step).

    Defaults: ``granularity = head`` (the paper scores each head's cache by its own anchor;
    on the worker), no protections (``sink_tokens = 0``, ``recent_tokens = 0``,
    as the paper), ``slack = 0``.

    Departures from the paper:

    * The paper evicts block-wise while prefilling (a prompt chunk at a time); vToken evicts
      before a decode step once the request is over its budget, and, with ``prefill_eviction:
      chunks`` (the default), before each prefill chunk too. Either
      way the anchor covers the whole live cache at that moment.
    * With ``granularity`` other than ``head`` a set ranks the mean similarity of its heads.
    * Ties go to the smaller logical position (evicted first); a zero key has no cosine and
      is evicted first.
    """

    name: ClassVar[str] = "keydiff"
    paper: ClassVar[str] = 'KeyDiff, arXiv 2504.15364'
    summary: ClassVar[str] = "least cosine similarity to the head's mean key, at eviction"
    needs: ClassVar[AttentionNeed] = AttentionNeed.NONE
    #: scores from the cached keys right before each eviction (on the worker)
    eviction_keys: ClassVar[bool] = True

    @classmethod
    def default_granularity(cls) -> str:
        return "head"

    def side_specs(self):
        return {"sim": ((), torch.float64)}

    def observe_batched(self, fields: BatchedFields, live, col_sum, last_row,
                        key_sim: Optional[torch.Tensor] = None, **_) -> None:
        if key_sim is not None:
            fields["sim"].copy_(torch.nan_to_num(key_sim.to(torch.float64), nan=float("inf")))

    def score_batched(self, fields: BatchedFields, logical_pos, live) -> torch.Tensor:
        return -fields["sim"]
