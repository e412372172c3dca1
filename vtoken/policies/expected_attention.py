"""Expected Attention: keep the keys future queries are expected to attend to (Devoto et al.,
arXiv 2510.00636, the method kvpress ships as ``ExpectedAttentionPress``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np
import torch

from vtoken.policies.base import AttentionNeed, BatchedFields, EvictionPolicy

__all__ = ["ExpectedAttentionPolicy", "QUERY_SKIP", "rope_pairs", "unrotate", "pair_terms", "future_rotation",
           "rope_prefix_sums", "rotation_from_prefix", "expected_attention"]

#: queries at logical positions below this are left out of the moments (the paper's ``n_sink``:
#: the first positions' hidden states are outliers)
QUERY_SKIP = 4


def rope_pairs(head_size: int, neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The dimensions RoPE rotates together: int64 ``[head_size // 2]`` each, ``(a, b)``.

    ``neox`` (rotate-half, Llama's): ``(i, i + D/2)``; else (GPT-J's interleaved): ``(2i, 2i + 1)``.
    Pair ``p`` turns by ``position * theta_p``: ``x_a' = x_a cos - x_b sin``, ``x_b' = x_b cos + x_a sin``.

    Raises:
        ValueError: an odd ``head_size``.
    """
    if head_size % 2:
        raise ValueError(f"rope_pairs: head_size = {head_size}; allowed: an even number")
    if neox:
        a = torch.arange(head_size // 2)
        return a, a + head_size // 2
    a = torch.arange(0, head_size, 2)
    return a, a + 1


def unrotate(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Undo RoPE: the pre-RoPE queries of post-RoPE ``q``.

    Args:
        q: float ``[M, H, D]``, post-RoPE, token ``m`` at a position whose cosines and sines are
            ``cos[m]`` / ``sin[m]``.
        cos, sin: float ``[M, D/2]``, per token and pair (:func:`rope_pairs` order).
        a, b: the pairs' dimensions (:func:`rope_pairs`).

    Returns:
        ``q``'s dtype, ``[M, H, D]``.
    """
    c, s = cos[:, None, :].to(q.dtype), sin[:, None, :].to(q.dtype)
    qa, qb = q[..., a], q[..., b]
    out = torch.empty_like(q)
    out[..., a] = qa * c + qb * s
    out[..., b] = qb * c - qa * s
    return out


def pair_terms(q: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Second-moment terms of each RoPE pair: ``[..., D/2, 3]`` = ``(q_a^2, q_a q_b, q_b^2)``."""
    qa, qb = q[..., a], q[..., b]
    return torch.stack((qa * qa, qa * qb, qb * qb), dim=-1)


def future_rotation(cos_sin: torch.Tensor, start: torch.Tensor, n_future: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's rotation averaged over each request's next ``n_future`` positions, per pair.

    Args:
        cos_sin: float ``[max_position, D]``: per position the pairs' cosines, then their sines
            (vLLM's ``RotaryEmbedding.cos_sin_cache`` layout).
        start: int64 ``[R]``: each request's next logical position.
        n_future: positions averaged over; those at or past ``max_position`` are left out (no
            request reaches them).

    Returns:
        float64 ``(cos_bar, sin_bar)``, each ``[R, D/2]`` (zeros for a request with no position left).
    """
    return rotation_from_prefix(rope_prefix_sums(cos_sin), start, n_future)


def rope_prefix_sums(cos_sin: torch.Tensor) -> torch.Tensor:
    """float64 ``[max_position + 1, D]``: prefix sums of ``cos_sin``'s rows (row ``p``: positions
    ``0..p-1``), made once per model so that :func:`rotation_from_prefix` is two gathers."""
    d = cos_sin.shape[1]
    return torch.cumsum(torch.cat([torch.zeros(1, d, dtype=torch.float64, device=cos_sin.device),
                                   cos_sin.to(torch.float64)]), dim=0)


def rotation_from_prefix(cs: torch.Tensor, start: torch.Tensor, n_future: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`future_rotation` from :func:`rope_prefix_sums` ``cs``."""
    n_pos, d = cs.shape[0] - 1, cs.shape[1]
    h = d // 2
    lo = start.clamp(0, n_pos)
    hi = (start + n_future).clamp(0, n_pos)
    cnt = (hi - lo).to(torch.float64).clamp(min=1)[:, None]
    avg = (cs[hi] - cs[lo]) / cnt
    return avg[:, :h], avg[:, h:]


def expected_attention(keys: torch.Tensor, live: torch.Tensor, qsum: torch.Tensor, qpair: torch.Tensor,
                       count: torch.Tensor, cos_bar: torch.Tensor, sin_bar: torch.Tensor, a: torch.Tensor,
                       b: torch.Tensor, vnorm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each live key's expected attention from the future queries of its KV head's query heads.

    The future query of a query head is Gaussian with the mean ``mu`` and covariance ``S`` of the
    head's pre-RoPE queries so far, rotated by RoPE's rotation averaged over the next positions
    (``R``): ``mu' = R mu``, ``S' = R S R^T``. Then (Devoto et al., arXiv 2510.00636, Sec. 3,
    the Gaussian moment-generating function) ``E[exp(q . k / sqrt(D))] =
    exp(mu' . k / sqrt(D) + k^T S' k / (2 D))``, normalized over the live keys (a softmax),
    averaged over the KV head's query heads and multiplied by ``|v|``.

    ``S`` is kept per RoPE pair only (its 2x2 diagonal blocks): ``R`` is block-diagonal in the
    pairs, so ``S'``'s diagonal blocks are exact and its cross-pair blocks are dropped (the
    departure :class:`ExpectedAttentionPolicy` states).

    Args:
        keys: float ``[R, Hkv, N, D]``, post-RoPE, as cached; slots at and past ``live[r]`` ignored.
        live: int64 ``[R]``.
        qsum: float64 ``[R, Hq, D]``: per query head the sum of the pre-RoPE queries counted.
        qpair: float64 ``[R, Hq, D/2, 3]``: the sums of :func:`pair_terms`.
        count: ``[R]``: queries counted (0: ``mu = 0``, ``S = 0``, every key scores alike).
        cos_bar, sin_bar: float64 ``[R, D/2]`` (:func:`future_rotation`).
        a, b: the pairs' dimensions (:func:`rope_pairs`).
        vnorm: float ``[R, Hkv, N]``, the values' L2 norms; None: no ``|v|`` factor.

    Returns:
        float64 ``[R, Hkv, N]``; ``NaN`` at and past ``live``.

    Raises:
        ValueError: ``Hq`` not a multiple of ``Hkv``.
    """
    r, hkv, n, d = keys.shape
    hq = qsum.shape[1]
    if hq % hkv:
        raise ValueError(f"expected_attention: {hq} query heads is not a multiple of {hkv} KV heads")
    g = hq // hkv
    cnt = count.to(torch.float64).clamp(min=1)[:, None, None]
    mu = qsum / cnt  # [R, Hq, D]
    e2 = qpair / cnt[..., None]  # [R, Hq, P, 3]
    ma, mb = _pair(mu, a, b)
    x, y, z = e2[..., 0] - ma * ma, e2[..., 1] - ma * mb, e2[..., 2] - mb * mb  # the pair's covariance
    c, s = cos_bar[:, None, :], sin_bar[:, None, :]
    # per query head the weights of the key features k (R mu / sqrt(D)), k * k and k_a k_b
    # (R S R^T's diagonal and cross entries / 2D), each feature in the keys' own dimension order
    w_lin = torch.zeros_like(mu)
    w_lin[..., a] = (c * ma - s * mb) / math.sqrt(d)
    w_lin[..., b] = (s * ma + c * mb) / math.sqrt(d)
    w_sq = torch.zeros_like(mu)
    w_sq[..., a] = (c * c * x - 2 * c * s * y + s * s * z) / (2 * d)
    w_sq[..., b] = (s * s * x + 2 * c * s * y + c * c * z) / (2 * d)
    w_ab = 2 * (c * s * (x - z) + (c * c - s * s) * y) / (2 * d)  # [R, Hq, P]

    def per_kv(t: torch.Tensor) -> torch.Tensor:  # [R, Hq, F] -> [R, Hkv, F, G], float32
        return t.view(r, hkv, g, -1).transpose(-1, -2).to(torch.float32)

    # the products in float32 (the keys are bf16/fp32 already; the moments and weights float64),
    # three batched matmuls per (request, KV head): [N, F] x [F, G]
    k32 = keys.to(torch.float32)
    ka, kb = _pair(k32, a, b)
    logits = (torch.matmul(k32, per_kv(w_lin)) + torch.matmul(k32 * k32, per_kv(w_sq))
              + torch.matmul(ka * kb, per_kv(w_ab))).transpose(-1, -2).to(torch.float64)  # [R, Hkv, G, N]
    pad = torch.arange(n, device=keys.device)[None, :] >= live.to(keys.device)[:, None]  # [R, N]
    logits = logits.masked_fill(pad[:, None, None, :], float("-inf"))
    p = torch.softmax(logits, dim=-1).mean(dim=2)  # [R, Hkv, N]
    if vnorm is not None:
        p = p * vnorm.to(torch.float64)
    return p.masked_fill(pad[:, None, :], float("nan"))


def _pair(t: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t[..., a], t[..., b]``: views (no copy) for RoPE's two layouts, an index otherwise."""
    d, h = t.shape[-1], a.numel()
    ar = torch.arange(h, device=a.device)
    if torch.equal(a, ar) and torch.equal(b, ar + h):  # rotate-half (neox)
        return t[..., :h], t[..., h:]
    if torch.equal(a, 2 * ar) and torch.equal(b, 2 * ar + 1):  # interleaved (GPT-J)
        return t[..., 0::2], t[..., 1::2]
    return t[..., a], t[..., b]


@dataclass
class ExpectedAttentionPolicy(EvictionPolicy):
    """Expected Attention, "Expected Attention: KV Cache Compression by Estimating Attention from
    Future Queries Distribution" (Devoto et al., arXiv 2510.00636, Sec. 3; kvpress's
    ``ExpectedAttentionPress``).

    Idea: the queries to come are not known, but their distribution is: model a head's future
    query as Gaussian, with the mean and covariance of its queries so far rotated to the
    positions to come, and keep the keys with the highest expected attention under it. The score
    needs no attention pass: the query moments are sums kept on the worker, the keys are read
    from the KV cache at eviction.

    When: the worker un-rotates each query the attention layer receives (RoPE's own cosines and
    sines at the token's position) and adds it and its per-pair second moments to the request's
    sums, per (layer, query head), in the forward. Right before a group of requests evicts, one
    read of their live keys and values per layer gives every live slot its score
    (:func:`expected_attention`, with the rotation averaged over the next ``n_future``
    positions).

    Score: the expected attention (``stats.key_sim``, set for every live slot just before each
    eviction); with several (layer, KV head) pairs in a token set, their mean
    (``docs/granularity.md``); under tensor parallelism ``request`` and ``layer`` sets sum their
    ranks' scores as KeyDiff does.

    Defaults: ``granularity = head`` (the paper scores each head's cache), ``sink_tokens = 4``
    (the paper's ``n_sink``: the first keys are kept), ``n_future = 512`` (the paper's
    default), ``recent_tokens = 0``, ``slack = 0``.

    Needs: ``AttentionNeed.QUERY_MOMENTS`` every step (on the worker, ``score_every: 1``;
    refused by name otherwise).

    Departures from the paper:

    * The covariance is kept per RoPE pair (the 2x2 diagonal blocks of the ``D x D`` matrix):
      ``3 D / 2`` floats per query head instead of ``D^2``. RoPE's averaged rotation is
      block-diagonal in the pairs, so the rotated blocks are exact; the cross-pair terms are
      dropped. (A full covariance would be 64 MB per request for a 32-layer, 32-head,
      ``D = 128`` model.)
    * The moments cover every query of the request so far but the first ``QUERY_SKIP`` = 4
      positions (the paper: the prompt's queries when compressing after the prompt, a window of
      recent ones while decoding).
    * vToken evicts before a decode step once the request is over its budget (and, with
      ``prefill_eviction: chunks``, before each prefill chunk), not once after the prompt.
    * Ties go to the smaller logical position (evicted first); a slot with no score (none in
      practice) is evicted first.
    """

    name: ClassVar[str] = "expected_attention"
    paper: ClassVar[str] = 'Expected Attention, arXiv 2510.00636'
    summary: ClassVar[str] = 'expected attention of future queries (Gaussian) times `|v|`, at eviction'
    needs: ClassVar[AttentionNeed] = AttentionNeed.QUERY_MOMENTS
    #: scores from the cached keys right before each eviction (on the worker)
    eviction_keys: ClassVar[bool] = True
    #: the prompt's queries are in the moments: a prefix-cache hit skips them, so it is kept
    prompt_statistics: ClassVar[bool] = True

    #: future positions the RoPE rotation is averaged over
    n_future: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.n_future, bool) or not isinstance(self.n_future, (int, np.integer)) or self.n_future < 1:
            raise ValueError(f"{self.name}: n_future = {self.n_future!r}; allowed: an integer >= 1")

    @classmethod
    def default_granularity(cls) -> str:
        return "head"

    @classmethod
    def default_sink_tokens(cls, budget: int) -> int:
        return min(QUERY_SKIP, budget)

    def side_specs(self):
        return {"ea": ((), torch.float64)}

    def observe_batched(self, fields: BatchedFields, live, col_sum, last_row,
                        key_sim: Optional[torch.Tensor] = None, **_) -> None:
        if key_sim is not None:
            fields["ea"].copy_(torch.nan_to_num(key_sim.to(torch.float64), nan=float("-inf")))

    def score_batched(self, fields: BatchedFields, logical_pos, live) -> torch.Tensor:
        return fields["ea"]
