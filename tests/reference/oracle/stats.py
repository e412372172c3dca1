"""The oracle's statistics per token set (:mod:`reference.oracle`, "Token-set conventions"):
attention probabilities, and the key statistics (K-norm, KeyDiff, Expected Attention) from its cache."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from reference.oracle.moments import QueryMoments
from reference.policies import AttentionStats
from vtoken.policies.base import AttentionNeed


#: the token-set granularities, ``docs/granularity.md``
GRANULARITIES = ("request", "layer", "head", "head_shared")


def attention_stats(attentions: Sequence[torch.Tensor], need: AttentionNeed,
                    window: Optional[int] = None) -> AttentionStats:
    """Reduce one step's per-layer attention probabilities to :class:`AttentionStats`.

    Args:
        attentions: per layer, post-softmax probabilities ``[1, H, q, k]`` (any float
            dtype; H = query heads, q = this step's query rows, k = live keys incl.
            this step's own tokens).
        need: which statistics to compute.
        window: with ``AttentionNeed.WINDOW`` in ``need``: ``col_sum`` sums the last ``window``
            query rows only (SnapKV's observation window).

    Returns:
        ``col_sum`` and/or ``last_row``, float64 numpy ``[k]`` (None where not needed):
        the mean over layers and heads (sum in float64, divided by ``L * H``), then
        summed over the q rows (``col_sum``) or taken at the last row (``last_row``).

    Raises:
        ValueError: no layers, batch != 1, or layers disagree on the shape.
    """
    if not (need & (AttentionNeed.COL_SUM | AttentionNeed.LAST_ROW)):
        return AttentionStats()
    if len(attentions) == 0 or attentions[0] is None:
        raise ValueError("attention_stats: no attention probabilities (is the model using eager attention?)")
    shape = tuple(attentions[0].shape)
    if len(shape) != 4 or shape[0] != 1:
        raise ValueError(f"attention_stats: expected [1, H, q, k] per layer, got {shape}")
    acc = None
    for a in attentions:
        if tuple(a.shape) != shape:
            raise ValueError(f"attention_stats: layer shapes differ: {tuple(a.shape)} vs {shape}")
        s = a[0].to(torch.float64).sum(dim=0)  # [q, k], summed over heads
        acc = s if acc is None else acc + s
    mean = acc / float(len(attentions) * shape[1])
    rows = mean[-window:] if window and need & AttentionNeed.WINDOW else mean
    col_sum = rows.sum(dim=0).cpu().numpy() if need & AttentionNeed.COL_SUM else None
    last_row = mean[-1].cpu().numpy().copy() if need & AttentionNeed.LAST_ROW else None
    return AttentionStats(col_sum=col_sum, last_row=last_row)


def set_index_map(granularity: str, num_layers: int, num_kv_heads: int) -> np.ndarray:
    """Set index of each (layer, KV head), int64 ``[num_layers, num_kv_heads]`` (``docs/granularity.md``):
    request 0, layer ``l``, head ``l * num_kv_heads + g``, head_shared ``g``.

    Raises:
        ValueError: an unknown granularity, or ``num_layers`` / ``num_kv_heads`` < 1.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity = {granularity!r}; allowed: {list(GRANULARITIES)}")
    if num_layers < 1 or num_kv_heads < 1:
        raise ValueError(f"set_index_map: num_layers = {num_layers}, num_kv_heads = {num_kv_heads}; allowed: >= 1")
    lg, g = np.indices((num_layers, num_kv_heads), dtype=np.int64)
    return {"request": 0 * lg, "layer": lg, "head": lg * num_kv_heads + g, "head_shared": g}[granularity]


def attention_stats_sets(attentions: Sequence[torch.Tensor], need: AttentionNeed, granularity: str,
                         num_kv_heads: int, window: Optional[int] = None) -> list[AttentionStats]:
    """Per-set :class:`AttentionStats` of one step (``docs/granularity.md``, "Statistics per set").

    Args:
        attentions: per layer ``l`` (``L`` layers), post-softmax probabilities ``[1, Hq, q, k]``
            (any float dtype); key ``j`` of the query heads of KV head ``g`` is slot ``j`` of the
            set covering (``l``, ``g``).
        need: which statistics to compute.
        granularity: ``"request"``, ``"layer"``, ``"head"`` or ``"head_shared"``.
        num_kv_heads: ``Hkv``; query head ``h`` belongs to KV head ``h // (Hq // Hkv)``.
        window: as for :func:`attention_stats`.

    Returns:
        One :class:`AttentionStats` per set, in set order (``S`` = 1, ``L``, ``L * Hkv``,
        ``Hkv``). A set's ``col_sum`` / ``last_row`` are float64 numpy ``[k]`` (None where not
        needed): the mean of the probabilities over the (layer, query head) pairs the set
        covers (summed in float64, divided by their number), then summed over the ``q`` rows
        (``col_sum``) or taken at the last row (``last_row``). ``"request"`` returns
        ``[attention_stats(attentions, need)]``.

    Raises:
        ValueError: an unknown granularity; ``num_kv_heads < 1``; no layers (any granularity
            but ``"request"``); when statistics are needed: missing probabilities, batch != 1,
            layers that disagree on the shape, or ``Hq`` not a multiple of ``num_kv_heads``.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"attention_stats_sets: granularity = {granularity!r}; allowed: {list(GRANULARITIES)}")
    if granularity == "request":
        return [attention_stats(attentions, need, window)]
    if len(attentions) == 0:
        raise ValueError("attention_stats_sets: no layers (the number of sets depends on them)")
    set_of = set_index_map(granularity, len(attentions), num_kv_heads)
    S = int(set_of.max()) + 1
    if not (need & (AttentionNeed.COL_SUM | AttentionNeed.LAST_ROW)):
        return [AttentionStats() for _ in range(S)]
    if attentions[0] is None:
        raise ValueError("attention_stats_sets: no attention probabilities (is the model using eager attention?)")
    shape = tuple(attentions[0].shape)
    if len(shape) != 4 or shape[0] != 1:
        raise ValueError(f"attention_stats_sets: expected [1, Hq, q, k] per layer, got {shape}")
    Hq = shape[1]
    if Hq % num_kv_heads:
        raise ValueError(f"attention_stats_sets: {Hq} query heads is not a multiple of num_kv_heads = {num_kv_heads}")
    G = Hq // num_kv_heads
    acc: list[Optional[torch.Tensor]] = [None] * S
    pairs = [0] * S
    for l, a in enumerate(attentions):
        if tuple(a.shape) != shape:
            raise ValueError(f"attention_stats_sets: layer shapes differ: {tuple(a.shape)} vs {shape}")
        for g in range(num_kv_heads):
            s = int(set_of[l, g])
            part = a[0, g * G:(g + 1) * G].to(torch.float64).sum(dim=0)  # [q, k]
            acc[s] = part if acc[s] is None else acc[s] + part
            pairs[s] += G
    out = []
    for s in range(S):
        mean = acc[s] / float(pairs[s])
        rows = mean[-window:] if window and need & AttentionNeed.WINDOW else mean
        col_sum = rows.sum(dim=0).cpu().numpy() if need & AttentionNeed.COL_SUM else None
        last_row = mean[-1].cpu().numpy().copy() if need & AttentionNeed.LAST_ROW else None
        out.append(AttentionStats(col_sum=col_sum, last_row=last_row))
    return out


def key_norm_sets(cache, q: int, set_of: np.ndarray) -> list[np.ndarray]:
    """L2 norms of the keys of the last ``q`` cache entries (the step's own tokens, the newest
    positions, so the last entries of every set's cache), averaged per token set.

    Args:
        cache: the oracle's ``DynamicCache`` (per layer keys ``[1, Hkv, T, hd]``).
        q: tokens written in the step.
        set_of: int ``[L, Hkv']`` (layer, KV head) -> set (:func:`set_index_map`; ``Hkv' = 1``
            for ``request``: every head of a layer in set 0).

    Returns:
        per set, float64 ``[q]``: the mean over the set's (layer, KV head) pairs of ``|k|_2``
        (``docs/granularity.md``; ``request``: over every layer and KV head).
    """
    norms = torch.stack([layer.keys[0, :, -q:, :].to(torch.float64).norm(dim=-1) for layer in cache.layers])
    L, H = norms.shape[:2]  # [L, Hkv, q]
    S = int(set_of.max()) + 1
    acc = [torch.zeros(q, dtype=torch.float64) for _ in range(S)]
    cnt = [0] * S
    for l_ in range(L):
        for g in range(H):
            s = int(set_of[l_, g if set_of.shape[1] > 1 else 0])
            acc[s] += norms[l_, g].cpu()
            cnt[s] += 1
    return [(a / c).numpy() for a, c in zip(acc, cnt)]


def key_sim_sets(cache, granularity: str) -> list[np.ndarray]:
    """KeyDiff's statistic from the oracle's cache: each live slot's cosine similarity to its
    (layer, KV head)'s anchor (:func:`vtoken.policies.keydiff.key_similarity`), averaged per
    token set as the worker does (``WorkerStep.key_similarity_sets``): ``head`` the pair's
    own (set ``l * Hkv + g``); ``head_shared`` the mean over layers; ``layer`` the sum over KV
    heads divided by their number; ``request`` that, then the mean over layers.

    Args:
        cache: the oracle's ``DynamicCache`` (per layer keys ``[1, Hkv, T, hd]``, ``T`` live slots).
        granularity: ``"request"``, ``"layer"``, ``"head"`` or ``"head_shared"``.

    Returns:
        per set, float64 ``[T]``.

    Raises:
        ValueError: an unknown granularity.
    """
    from vtoken.policies.keydiff import key_similarity

    if granularity not in GRANULARITIES:
        raise ValueError(f"key_sim_sets: granularity = {granularity!r}; allowed: {list(GRANULARITIES)}")
    sim = torch.stack([key_similarity(layer.keys[0:1], torch.tensor([layer.keys.shape[2]], device=layer.keys.device))[0]
                       .cpu() for layer in cache.layers])  # [L, Hkv, T]
    return _stat_sets(sim, granularity)


def expected_attention_sets(cache, model, moments: QueryMoments, start: int, n_future: int,
                            granularity: str) -> list[np.ndarray]:
    """Expected Attention's statistic from the oracle's cache, per token set (reduced as
    :func:`key_sim_sets`), computed the long way: RoPE's averaged rotation as a ``D x D`` matrix
    from the model's own ``rotary_emb`` (``x cos + rotate_half(x) sin`` at each of the positions
    ``start .. start + n_future - 1`` below ``max_position_embeddings``), the full covariance
    ``R S R^T`` masked to RoPE's 2x2 pair blocks (the departure the engine makes by keeping only
    those), ``softmax(k . mu' / sqrt(D) + k^T S' k / (2 D))`` over the live keys per query head,
    averaged over each KV head's query heads, times ``|v|``.

    Args:
        cache: the oracle's ``DynamicCache`` (per layer keys and values ``[1, Hkv, T, D]``).
        model: the ``transformers`` model (its ``model.rotary_emb`` and config).
        moments: the request's :class:`QueryMoments`.
        start: the request's next logical position.
        n_future: positions averaged over.
        granularity: as :func:`key_sim_sets`.

    Returns:
        per set, float64 ``[T]``.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"expected_attention_sets: granularity = {granularity!r}; allowed: {list(GRANULARITIES)}")
    d, hq = moments.d, moments.hq
    h = d // 2
    max_pos = int(model.config.max_position_embeddings)
    pos = torch.arange(start, min(start + n_future, max_pos))
    dev = next(model.parameters()).device
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32, device=dev), pos[None].to(dev))
    cos_bar, sin_bar = cos[0].to(torch.float64).cpu().mean(dim=0), sin[0].to(torch.float64).cpu().mean(dim=0)  # [D]
    if len(pos) == 0:
        cos_bar, sin_bar = torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
    rot_half = torch.zeros(d, d, dtype=torch.float64)  # rotate_half(x) = [-x2, x1] as a matrix
    rot_half[torch.arange(h), torch.arange(h) + h] = -1.0
    rot_half[torch.arange(h) + h, torch.arange(h)] = 1.0
    r_bar = torch.diag(cos_bar) + torch.diag(sin_bar) @ rot_half  # mean of R(p) = diag(cos) + diag(sin) P
    idx = torch.arange(d)
    pair_mask = ((idx[:, None] % h) == (idx[None, :] % h)).to(torch.float64)
    cnt = max(moments.count, 1)
    out = []
    for i, layer in enumerate(cache.layers):
        k = layer.keys[0].to(torch.float64).cpu()  # [Hkv, T, D]
        v = layer.values[0].to(torch.float64).cpu()
        hkv = k.shape[0]
        g = hq // hkv
        mu = moments.qsum[i] / cnt  # [Hq, D]
        cov = moments.qouter[i] / cnt - torch.einsum("hd,he->hde", mu, mu)
        mu2 = mu @ r_bar.T
        cov2 = (r_bar @ cov @ r_bar.T) * pair_mask
        kk = k.repeat_interleave(g, dim=0)  # [Hq, T, D]: query head j reads KV head j // g
        logits = (torch.einsum("htd,hd->ht", kk, mu2) / np.sqrt(d)
                  + torch.einsum("htd,hde,hte->ht", kk, cov2, kk) / (2 * d))
        p = torch.softmax(logits, dim=-1).view(hkv, g, -1).mean(dim=1)  # [Hkv, T]
        out.append(p * v.norm(dim=-1))
    return _stat_sets(torch.stack(out), granularity)


def _stat_sets(sim: torch.Tensor, granularity: str) -> list[np.ndarray]:
    """Per-(layer, KV head) statistics ``[L, Hkv, T]`` -> per set (:func:`key_sim_sets`' rules)."""
    L, H = sim.shape[:2]
    if granularity == "head":
        return [sim[l_, g].numpy() for l_ in range(L) for g in range(H)]
    if granularity == "head_shared":
        m = sim.mean(dim=0)
        return [m[g].numpy() for g in range(H)]
    per_layer = sim.sum(dim=1) / H  # [L, T]
    if granularity == "layer":
        return [per_layer[l_].numpy() for l_ in range(L)]
    return [per_layer.mean(dim=0).numpy()]
