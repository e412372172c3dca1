"""The dense oracle: token-level KV eviction on a plain Hugging Face model.

The oracle is the ground truth the vLLM integration must match token for token.
It runs one request (batch 1) through a ``transformers`` causal LM with eager
attention and keeps the KV cache as explicit per-layer tensors that hold exactly
the live tokens, **in logical order** (slot ``i`` of the oracle's cache is the
``i``-th smallest live logical position). After an eviction the victims are dropped
from every layer's keys and values (``index_select`` on the kept indices), so the
cache stays dense; new tokens are fed with their **logical** position as RoPE
position. Softmax attention is invariant to the order of the keys, and cached keys
already carry their rotation, so a vLLM engine that holds the same live tokens in
any slot order computes the same outputs.

Step order (``docs/core-contracts.md``, "Step order"), identical to the engine:

1. prefill: the whole prompt in one forward (no eviction during prefill; the
   prompt may exceed the budget), ``policy.observe``, greedy sample;
2. each decode step: ``k = num_to_evict(num_live, budget, slack)``; if ``k > 0``,
   ``victims = policy.select_victims(state, view, k)`` on the oracle's dense
   (logical-order) slots, drop them from the cache and ``state.compact(keep)``;
   then ``state.reset_slots(num_live, num_live + 1)``, forward the last sampled
   token at its logical position, ``policy.observe``, greedy sample.

Attention statistics follow :mod:`vtoken.policies.base` and the token-set conventions below
(request sets: the post-softmax probabilities ``[1, Hq, q, k]`` of every layer,
``output_attentions=True``, summed over layers and query heads in float64 and divided by
``L * Hq``). Only what ``policy.needs`` asks for is computed.

Each step's statistics are folded in right after its forward, before the next decision
(the engine's worker does the same under sync and async scheduling alike).

``cfg.score_every = s > 1`` (attention scores every ``s`` decode steps): the
prefill is always scored; decode step ``d`` (``d = 1`` for the first decode
forward) is scored iff ``d % s == 0``. Unscored steps do not call ``observe``
when the policy needs attention; policies with ``needs == NONE`` are observed
every step with empty stats. This convention must be the engine's too.

A preemption needs no replay: the engine restores a preempted request's K/V and policy
state, so its tokens equal this run's (``docs/integration.md``, "Preemption").

Granularity (``cfg.resolved_granularity()``, ``docs/granularity.md``): ``"request"`` keeps
one token set for the whole request. ``"layer"``, ``"head"`` and ``"head_shared"`` keep ``S``
sets (``L``, ``L * Hkv``, ``Hkv``; (layer ``l``, KV head ``g``) belongs to set ``l``,
``l * Hkv + g``, ``g``), each with its own policy state and its own ascending live logical
positions, which are the slot order of the (layer, KV head) pairs it covers. At a step with
``k > 0`` every set selects ``k`` victims with the same protections, every layer's K/V is
compacted per KV head with the keep indices of the set covering it (a gather along the
sequence axis), and each set's state is compacted. All sets keep the same count, so the cache
length stays one number.

Token-set conventions (one statement for the oracle, ``tests/core/masked_reference.py`` and the
worker: ``StepScores`` / ``set_means`` in ``vtoken/integrations/vllm/worker/scoring.py``,
``vtoken/decider.py``, ``vtoken/select.py``):

* **Attention statistics.** ``p[l, h, i, j]``: post-softmax probability of query head ``h``
  (``Hq`` per layer; ``G = Hq / Hkv`` of them share KV head ``h // G``), query row ``i`` of
  the step, live key ``j`` of the set covering (``l``, ``h // G``), the step's own keys
  included. A set's statistic is the **mean** of ``p`` over the (layer, query head) pairs it
  covers, with equal weight per pair: ``request`` all ``L * Hq`` pairs; ``layer`` set ``l``
  the ``Hq`` query heads of layer ``l``; ``head`` set (``l``, ``g``) the ``G`` query heads of
  KV head ``g`` in layer ``l``; ``head_shared`` set ``g`` the ``L * G`` pairs of KV head ``g``
  over all layers. Query heads, not KV heads, are the unit; since every KV head has ``G``
  query heads, the mean of the per-KV-head means is the same number (the worker's per-set
  path averages each KV head's ``G`` heads first, then ``set_means``). Reduction order is
  immaterial up to rounding: sums in float64 here and in the masked reference; the worker
  computes ``p`` in float32 from the cached keys and reduces in float64 (one-query rows of
  ``request`` sets average a layer's ``Hq`` heads in float32 first), so the engine's values
  differ from these by float32 rounding only (SmolLM2 fp32, one decode step: up to 4.5e-7
  relative, the same for ``request`` and ``head`` sets; the float32 head mean adds 5e-8). Under tensor parallelism ``request`` and ``layer`` statistics are
  summed over the ranks with weights ``Hq / TP`` and divided by ``Hq`` (the same mean over all
  query heads); ``head`` and ``head_shared`` sets are each rank's own.
  ``col_sum`` is the sum over the step's query rows (SnapKV with ``WINDOW``: its last
  ``window`` rows) of that mean; ``last_row`` its last row; float64 ``[num_live]``.
* **Key statistics** are per (layer, KV head) and averaged with equal weight over the pairs the
  set covers (``request``: all ``L * Hkv``): K-norm's ``|k|_2`` of the step's keys
  (:func:`key_norm_sets`), KeyDiff's cosine to the head's anchor and Expected Attention's
  score (that one first averaged over the KV head's ``G`` query heads), :func:`key_sim_sets`.
* **Chunk statistics.** Every prefill chunk is a scored step: its rows attend causally over
  the live tokens of the chunks before it (after any eviction between chunks) and its own;
  ``col_sum`` sums the chunk's rows, ``last_row`` is its last row, folded right after the
  chunk. Without eviction between chunks the chunks' column sums add up to the whole prompt's.
  Decode step ``d`` is one row (``score_every`` as above).
* **Protections**, on logical positions, the same for every set: positions below
  ``max(sink_tokens, protected_prefix)`` and the ``recent_tokens`` largest live positions (the
  recent window: ``recent_tokens`` newest positions, protected from their append until they
  leave it, so every set holds them and every set has the same number of evictable tokens).
  A set with fewer unprotected tokens than ``k`` loses all of them (then every set does).
* **Ties.** Among unprotected live tokens the lowest keep-score is evicted first; equal scores
  go to the smaller logical position (the older token); ``NaN`` sorts after every number
  (``numpy.lexsort`` on (logical position, score)). The policy's score is per set, from that
  set's state only (H2O: the sum of its ``col_sum`` over every scored step since the token's
  append, no normalisation).

This module never imports vllm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

import numpy as np
import torch

from vtoken.config import VTokenConfig, effective_budget, num_to_evict
from vtoken.policies.base import AttentionNeed, AttentionStats, EvictionPolicy, TokenView

if TYPE_CHECKING:  # pragma: no cover
    from vtoken.policies.base import SlotState

__all__ = ["OracleResult", "oracle_generate", "prefill_points", "load_oracle_model", "attention_stats", "attention_stats_sets",
           "key_norm_sets",
           "key_sim_sets", "expected_attention_sets", "QueryMoments",
           "GRANULARITIES", "set_index_map"]

#: the token-set granularities, ``docs/granularity.md``
GRANULARITIES = ("request", "layer", "head", "head_shared")


@dataclass
class OracleResult:
    """What :func:`oracle_generate` produced for one request.

    Per-step lists have one entry per generated token; entry ``i`` describes the
    forward step that produced ``token_ids[i]`` (``i = 0``: the prefill).

    Attributes:
        token_ids: generated token ids (greedy), ``len <= max_new_tokens``; with
            ``ignore_eos=False`` the EOS token that stopped generation is included.
        num_live: live (cached) tokens the step attended over, i.e. after the
            step appended its own tokens (prefill: ``prompt_len``).
        num_logical: tokens ever appended after the step (``prompt_len + i``).
        evicted_positions: int64 ``[k_i]`` logical positions evicted before step
            ``i`` (ascending; empty when nothing was evicted; always empty for ``i = 0``).
        live_positions: int64 ``[num_live[-1]]`` logical positions held in the
            cache after the last step, ascending. The last generated token is not
            in it (its KV was never computed).
        prompt_len: number of prompt tokens.
        budget: the request's effective budget in tokens (None: no eviction).
        slack: the pacing slack in tokens (None: no eviction).
        stop_reason: ``"length"`` or ``"eos"``.
        logits: with ``return_logits=True``, float32 ``[vocab]`` CPU tensors, the
            next-token logits of each step (what was argmax-ed); else None.
        live_positions_sets: granularity other than ``"request"``: one int64
            ``[num_live[-1]]`` array per token set (set index as in ``docs/granularity.md``),
            each set's live logical positions after the last step, ascending (set 0's is
            ``live_positions``); None under ``"request"`` granularity or without eviction.
        evicted_positions_sets: granularity other than ``"request"``: per step, a list of
            ``S`` int64 arrays, the logical positions each set evicted before that step
            (ascending, all of the same length; ``evicted_positions`` is set 0's); None
            under ``"request"`` granularity or without eviction.
    """

    token_ids: list[int]
    num_live: list[int]
    num_logical: list[int]
    evicted_positions: list[np.ndarray]
    live_positions: np.ndarray
    prompt_len: int
    budget: Optional[int] = None
    slack: Optional[int] = None
    stop_reason: str = "length"
    logits: Optional[list[torch.Tensor]] = None
    live_positions_sets: Optional[list[np.ndarray]] = None
    evicted_positions_sets: Optional[list[list[np.ndarray]]] = None
    #: ``prefill_eviction: chunks``: per prefill chunk boundary, the logical positions evicted
    #: before the next chunk (ascending; token set 0's); empty list otherwise
    prefill_evicted_positions: Optional[list[np.ndarray]] = None

    @property
    def num_evicted(self) -> int:
        """Total tokens evicted over the request's life."""
        return int(sum(len(e) for e in self.evicted_positions))


def load_oracle_model(path: str, dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu"):
    """Load a causal LM the way the oracle needs it: eager attention, ``dtype``, eval mode.

    Args:
        path: a Hugging Face model directory (or hub id, if reachable).
        dtype: weights' dtype (tests use float32).
        device: where to put the model.

    Returns:
        ``transformers.AutoModelForCausalLM`` in eval mode.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return model.to(device).eval()


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
    token set as the worker does (``VTokenWorkerCore.key_similarity_sets``): ``head`` the pair's
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


class QueryMoments:
    """Expected Attention's query statistics in the oracle: per layer and query head, the sums of
    the pre-RoPE queries and of their outer products (the **full** ``D x D`` second moment; the
    engine keeps RoPE pairs only), from a forward hook on each layer's ``self_attn.q_proj``
    (pre-RoPE by construction in Llama-style models), on its ``self_attn.q_norm`` in a family
    that normalizes queries between the projection and RoPE (Qwen3, Qwen3-MoE, OLMo 2), or on
    the query columns (the first ``Hq * D``) of a fused ``self_attn.qkv_proj`` (Phi-3): the
    queries RoPE rotates, which the engine recovers by un-rotating; queries at logical
    positions below ``QUERY_SKIP`` left out.

    Raises:
        ValueError: the model has neither ``self_attn.q_proj`` nor ``self_attn.qkv_proj`` modules.
    """

    def __init__(self, model):
        cfg = model.config
        self.hq = int(cfg.num_attention_heads)
        self.d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.projs = [m for name, m in model.named_modules() if name.endswith("self_attn.q_proj")]
        self.q_cols: Optional[int] = None  # a fused projection: the query columns come first
        if not self.projs:
            self.projs = [m for name, m in model.named_modules() if name.endswith("self_attn.qkv_proj")]
            self.q_cols = self.hq * self.d if self.projs else None
        normed = [m for name, m in model.named_modules() if name.endswith("self_attn.q_norm")]
        if normed and len(normed) == len(self.projs):  # QK-norm: the normalized queries are RoPE's input
            self.projs, self.q_cols = normed, None
        if not self.projs:
            raise ValueError("oracle_generate: expected_attention needs the model's self_attn.q_proj "
                             "(or fused self_attn.qkv_proj) modules")
        self.captured: list[Optional[torch.Tensor]] = [None] * len(self.projs)
        self.qsum = torch.zeros(len(self.projs), self.hq, self.d, dtype=torch.float64)
        self.qouter = torch.zeros(len(self.projs), self.hq, self.d, self.d, dtype=torch.float64)
        self.count = 0
        self.hooks = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.projs)]

    def _hook(self, i: int):
        def fn(_mod, _inp, out):
            self.captured[i] = out.detach()
        return fn

    def add(self, positions: np.ndarray) -> None:
        """Fold the queries of the forward that just ran (tokens at ``positions``, int64 ``[q]``)."""
        from vtoken.policies.expected_attention import QUERY_SKIP

        keep = torch.from_numpy(positions >= QUERY_SKIP)
        for i, out in enumerate(self.captured):
            if out is None:
                raise RuntimeError(f"oracle_generate: layer {i}'s q_proj did not run in this forward (a model wrapper "
                                   "that skips the model's forward must replay q_proj's output to its hooks)")
            if self.q_cols is not None:
                out = out[..., :self.q_cols]
            q = out[0].reshape(-1, self.hq, self.d).to(torch.float64).cpu()[keep]  # [q', Hq, D]
            self.qsum[i] += q.sum(dim=0)
            self.qouter[i] += torch.einsum("thd,the->hde", q, q)
        self.count += int(keep.sum())
        self.captured = [None] * len(self.projs)

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


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


def _check_model(model) -> None:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "eager":
        raise ValueError(
            f"oracle_generate: model attention implementation is {impl!r}; the oracle needs 'eager' "
            "(load with attn_implementation='eager', e.g. vtoken.oracle.load_oracle_model)"
        )


def _evict(cache, keep: torch.Tensor) -> None:
    """Keep only slots ``keep`` (int64 ascending, on the cache's device) in every layer."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, keep)
        layer.values = layer.values.index_select(-2, keep)


def _evict_sets(cache, keeps: list[torch.Tensor], set_of: np.ndarray) -> None:
    """Per KV head: keep slots ``keeps[set_of[l, g]]`` (int64 ascending, equal lengths, on the
    cache's device) of (layer ``l``, KV head ``g``); a gather along the sequence axis."""
    for l, layer in enumerate(cache.layers):
        idx = torch.stack([keeps[int(s)] for s in set_of[l]])  # [Hkv, n_keep]
        for name in ("keys", "values"):
            t = getattr(layer, name)  # [1, Hkv, T, hd]
            if t.shape[1] != idx.shape[0]:
                raise RuntimeError(f"oracle_generate: layer {l} {name} have {t.shape[1]} KV heads, "
                                   f"the model config {idx.shape[0]}")
            setattr(layer, name, torch.gather(t, 2, idx[None, :, :, None].expand(t.shape[0], -1, -1, t.shape[3])))


def _cache_len(cache) -> int:
    lens = {int(layer.keys.shape[-2]) for layer in cache.layers}
    if len(lens) != 1:
        raise RuntimeError(f"oracle_generate: cache layers hold different lengths {sorted(lens)}")
    return lens.pop()


def prefill_points(prompt_len: int, cfg: Optional[VTokenConfig]) -> list[int]:
    """The prompt's prefill chunks (token counts, summing to ``prompt_len``): cut at the multiples
    of ``cfg.prefill_eviction_every`` under ``prefill_eviction: chunks``, else one chunk."""
    if cfg is None or cfg.resolved_prefill_eviction() != "chunks":
        return [prompt_len]
    every = cfg.prefill_eviction_every
    return [min(every, prompt_len - s) for s in range(0, prompt_len, every)]


def oracle_generate(
    model,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    cfg: Optional[VTokenConfig],
    *,
    eos_token_id: Union[int, Sequence[int], None] = None,
    ignore_eos: bool = True,
    return_logits: bool = False,
    policy: Optional[EvictionPolicy] = None,
    protected_prefix: int = 0,
    evict_schedule: Optional[dict[int, int]] = None,
    prefill_evict_schedule: Optional[dict[int, int]] = None,
) -> OracleResult:
    """Greedy generation with token-level KV eviction on a dense, logical-order cache.

    Args:
        model: a ``transformers`` causal LM (e.g. ``LlamaForCausalLM``) loaded with
            ``attn_implementation="eager"``, in eval mode; its dtype is used as is
            (tests use float32). Full-attention layers only (no sliding window).
        prompt_ids: the prompt's token ids, ``len >= 1``.
        max_new_tokens: tokens to generate, ``>= 1``.
        cfg: eviction settings; ``None`` turns eviction off (plain greedy, dense cache).
            The budget is ``effective_budget(cfg, prompt_len)``, the slack
            ``cfg.resolved_slack()``; the policy is built once per request with
            ``cfg.make_policy(budget)``; the token sets follow
            ``cfg.resolved_granularity()`` (module docstring), each with its own
            ``policy.init_state()``.
        eos_token_id: EOS id(s); only used when ``ignore_eos`` is False.
        ignore_eos: keep generating after EOS (the default, like vLLM's ``ignore_eos``).
        return_logits: also return each step's float32 next-token logits.
        policy: an already built policy to use instead of the one ``cfg`` names
            (budget and slack still come from ``cfg``, which must then be given).
        protected_prefix: the first ``protected_prefix`` logical positions are never evicted
            (tokens, >= 0): the engine's prefix-caching rule for this request (its cached or
            shared prefix blocks, ``RequestState.protected``; docs/integration.md, "Prefix
            caching"). 0: none (prefix caching off).
        evict_schedule: decode step -> tokens to ask the policy to evict, replacing the
            ``budget + slack`` rule (pressure pacing decides amounts from pool state; the
            engine records them, ``RequestState.evict_log``, and the oracle replays them;
            the victims are still the policy's choice).
        prefill_evict_schedule: with prefill eviction ``"chunks"``, eviction point ``c``
            (``1 <= c < len(chunks)``, at logical position ``c * cfg.prefill_eviction_every``) ->
            tokens to ask the policy to evict there, replacing the ``budget + slack`` rule, as
            ``evict_schedule`` replaces it in decode (pressure pacing evicts at a point only when
            the pool is short; the engine logs ``RequestState.prefill_evict_log``). A point not in
            it evicts nothing.

    The prompt's prefill: with ``cfg.resolved_prefill_eviction() == "chunks"`` it is cut at its
    eviction points, the logical positions that are multiples of ``cfg.prefill_eviction_every``
    (the engine never schedules a chunk across one, whatever its load); otherwise it is one
    chunk. Each chunk attends over the live tokens of the chunks before it and itself (causal)
    and is scored in full, its last query row included. With ``"chunks"``, at each point the
    request evicts ``num_to_evict(live, budget, slack)`` tokens, as a decode step would; their
    positions are in ``OracleResult.prefill_evicted_positions``.

    Returns:
        :class:`OracleResult`.

    Raises:
        ValueError: empty prompt, ``max_new_tokens < 1``, a non-eager model, a
            sliding-window cache layer, ``policy`` without ``cfg``,
            ``protected_prefix < 0``, or a ``prefill_evict_schedule`` key that is not an
            eviction point inside the prompt.
        RuntimeError: the policy returned invalid victims (out of range, duplicates), or
            the token sets evicted different counts.
    """
    _check_model(model)
    prompt = [int(t) for t in prompt_ids]
    P = len(prompt)
    if P < 1:
        raise ValueError("oracle_generate: prompt_ids is empty; allowed: at least 1 token")
    if max_new_tokens < 1:
        raise ValueError(f"oracle_generate: max_new_tokens = {max_new_tokens}; allowed: >= 1")
    if protected_prefix < 0:
        raise ValueError(f"oracle_generate: protected_prefix = {protected_prefix}; allowed: >= 0")
    if policy is not None and cfg is None:
        raise ValueError("oracle_generate: policy given without cfg (budget and slack come from cfg)")
    chunks = prefill_points(P, cfg)
    if prefill_evict_schedule is not None and any(not 1 <= int(c) < len(chunks) for c in prefill_evict_schedule):
        raise ValueError(f"oracle_generate: prefill_evict_schedule keys {sorted(prefill_evict_schedule)}; allowed: "
                         f"eviction points 1 .. {len(chunks) - 1} (the prompt of {P} tokens has {len(chunks)} chunks)")
    if eos_token_id is None:
        eos_set: set[int] = set()
    elif isinstance(eos_token_id, int):
        eos_set = {eos_token_id}
    else:
        eos_set = {int(e) for e in eos_token_id}

    from transformers import DynamicCache

    budget = slack = None
    policy_on = cfg is not None
    granularity = "request"
    need = AttentionNeed.NONE
    score_every = 1
    if cfg is not None:
        granularity = cfg.resolved_granularity()
        budget = effective_budget(cfg, P)
        slack = cfg.resolved_slack()
        if policy is None:
            policy = cfg.make_policy(budget)
        need = policy.needs
        score_every = cfg.score_every

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise ValueError("oracle_generate: sliding-window attention layers are not supported")
    per_set = granularity != "request"
    if per_set:
        num_layers = int(model.config.num_hidden_layers)
        # multi-head families (GPT-NeoX, GPT-J, GPT-2) name no KV-head count: one KV head per query head
        num_kv_heads = int(getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads)
        if len(cache.layers) != num_layers:  # pragma: no cover - a transformers change
            raise RuntimeError(f"oracle_generate: the cache has {len(cache.layers)} layers, the config {num_layers}")
    else:
        num_layers, num_kv_heads = max(len(cache.layers), 1), 1
    set_of = set_index_map(granularity, num_layers, num_kv_heads)  # [L, Hkv] -> token set
    S = int(set_of.max()) + 1
    # per token set: the policy state, slot -> logical position
    states: list["SlotState"] = [policy.init_state() for _ in range(S)] if policy_on else []

    pos = [np.arange(P, dtype=np.int64) for _ in range(S)]  # per set: cache slot -> logical position
    num_logical = P
    out_tokens: list[int] = []
    res_live: list[int] = []
    res_logical: list[int] = []
    res_evicted: list[np.ndarray] = []
    res_evicted_sets: Optional[list[list[np.ndarray]]] = [] if per_set else None
    res_logits: Optional[list[torch.Tensor]] = [] if return_logits else None
    stop_reason = "length"
    empty = np.zeros(0, dtype=np.int64)
    res_prefill_evicted: list[np.ndarray] = []

    qmom = QueryMoments(model) if policy_on and need & AttentionNeed.QUERY_MOMENTS else None

    def view_of(s: int) -> TokenView:
        return TokenView(logical_pos=pos[s].copy(), num_logical=num_logical, prompt_len=P,
                         protected_prefix=protected_prefix)

    def forward(ids: list[int], positions: np.ndarray, scored: bool) -> torch.Tensor:
        n_before = _cache_len(cache) if cache.get_seq_length() > 0 else 0
        q = len(ids)
        want_attn = scored and bool(need & (AttentionNeed.COL_SUM | AttentionNeed.LAST_ROW))
        out = model(
            input_ids=torch.tensor([ids], dtype=torch.long, device=device),
            position_ids=torch.from_numpy(positions).to(device).unsqueeze(0),
            attention_mask=torch.ones((1, n_before + q), dtype=torch.long, device=device),
            past_key_values=cache,
            use_cache=True,
            output_attentions=want_attn,
            logits_to_keep=1,
        )
        if _cache_len(cache) != n_before + q:  # pragma: no cover - a transformers change
            raise RuntimeError("oracle_generate: the cache did not grow by the step's tokens")
        if qmom is not None:  # every forward's queries (score_every is 1 for this policy)
            qmom.add(positions)
        if states and (want_attn or (scored and need & AttentionNeed.KEY_NORM)):
            stats = (attention_stats_sets(out.attentions, need, granularity, num_kv_heads,
                                          getattr(policy, "window", None)) if want_attn
                     else [AttentionStats() for _ in range(S)])
            if need & AttentionNeed.KEY_NORM:
                for s, kn in enumerate(key_norm_sets(cache, q, set_of)):
                    row = np.full(len(pos[s]), np.nan)
                    row[len(pos[s]) - q:] = kn
                    stats[s] = AttentionStats(col_sum=stats[s].col_sum, last_row=stats[s].last_row, key_norm=row)
            for s in range(S):  # folded in now: the state the next decision sees
                policy.observe(states[s], len(pos[s]), stats[s], view_of(s))
        elif states and need == AttentionNeed.NONE:
            for s in range(S):
                policy.observe(states[s], len(pos[s]), AttentionStats(), view_of(s))
        return out.logits[0, -1]

    def select(s: int, k: int) -> np.ndarray:
        n = len(pos[s])
        victims = np.asarray(policy.select_victims(states[s], view_of(s), k), dtype=np.int64)
        if victims.ndim != 1 or len(victims) > k or len(np.unique(victims)) != len(victims) or (
            len(victims) and (victims.min() < 0 or victims.max() >= n)
        ):
            raise RuntimeError(
                f"oracle_generate: policy {policy.name!r} returned invalid victims {victims!r} "
                f"for k={k}, num_live={n}" + (f" (token set {s})" if per_set else "")
                + f"; allowed: up to k distinct slots in [0, {n})"
            )
        return victims

    def evict(k: int, n: int) -> list[np.ndarray]:
        """Evict up to ``k`` of the ``n`` live tokens in every token set (the same count in each);
        returns each set's evicted logical positions."""
        evicted = [empty] * S
        if policy.eviction_keys:  # KeyDiff, Expected Attention: the cached keys, now
            sims = (expected_attention_sets(cache, model, qmom, num_logical, policy.n_future, granularity)
                    if qmom is not None else key_sim_sets(cache, granularity))
            for s, sim in enumerate(sims):
                policy.observe(states[s], n, AttentionStats(key_sim=sim), view_of(s))
        victims = [select(s, k) for s in range(S)]
        counts = sorted({len(v) for v in victims})
        if len(counts) != 1:
            raise RuntimeError(
                f"oracle_generate: the token sets evict different counts {[len(v) for v in victims]} "
                f"for k={k} (granularity {granularity!r}); every set must evict the same number")
        if counts[0]:
            keeps = []
            for s in range(S):
                mask = np.ones(n, dtype=bool)
                mask[victims[s]] = False
                keeps.append(np.flatnonzero(mask).astype(np.int64))
                evicted[s] = np.sort(pos[s][victims[s]])
            if per_set:
                _evict_sets(cache, [torch.from_numpy(kp).to(device) for kp in keeps], set_of)
            else:
                _evict(cache, torch.from_numpy(keeps[0]).to(device))
            for s in range(S):
                states[s].compact(keeps[s])
                pos[s] = pos[s][keeps[s]]
        return evicted

    def sample(logits: torch.Tensor) -> int:
        if res_logits is not None:
            res_logits.append(logits.detach().to(torch.float32).cpu().clone())
        return int(torch.argmax(logits).item())

    def record(tok: int, evicted: list[np.ndarray]) -> None:
        out_tokens.append(tok)
        res_live.append(len(pos[0]))
        res_logical.append(num_logical)
        res_evicted.append(evicted[0])
        if res_evicted_sets is not None:
            res_evicted_sets.append(evicted)

    with torch.inference_mode():
        # ---- prefill: chunk by chunk (one chunk by default); with prefill_eviction "chunks"
        # the request evicts down to its budget before each chunk but the first ----
        chunked_evict = bool(states) and len(chunks) > 1 and cfg.resolved_prefill_eviction() == "chunks"
        pos = [empty.copy() for _ in range(S)]
        start = 0
        for ci, q in enumerate(chunks):
            n = len(pos[0])
            if ci and chunked_evict:
                k = (num_to_evict(n, budget, slack) if prefill_evict_schedule is None
                     else min(int(prefill_evict_schedule.get(ci, 0)), n))
                ev = evict(k, n) if k > 0 else [empty] * S
                res_prefill_evicted.append(ev[0])
                n = len(pos[0])
            for st in states:
                st.reset_slots(n, n + q)
            chunk_pos = np.arange(start, start + q, dtype=np.int64)
            for s in range(S):
                pos[s] = np.concatenate([pos[s], chunk_pos])
            num_logical = start + q
            # every chunk's statistics in full, its last row included: decide_on worker scores each
            # chunk's last query row whether or not the chunk samples
            logits = forward(prompt[start:start + q], chunk_pos, scored=True)
            start += q
        tok = sample(logits)
        record(tok, [empty] * S)

        for d in range(1, max_new_tokens):
            if not ignore_eos and tok in eos_set:
                stop_reason = "eos"
                break
            evicted = [empty] * S
            n = len(pos[0])
            if states:
                if evict_schedule is not None:
                    k = min(int(evict_schedule.get(d, 0)), n)
                else:
                    k = num_to_evict(n, budget, slack)
                if k > 0:
                    evicted = evict(k, n)
                n = len(pos[0])
                for st in states:
                    st.reset_slots(n, n + 1)
            new_pos = np.array([num_logical], dtype=np.int64)
            for s in range(S):
                pos[s] = np.concatenate([pos[s], new_pos])
            num_logical += 1
            scored = d % score_every == 0
            tok = sample(forward([tok], new_pos, scored=scored))
            record(tok, evicted)
        else:
            if not ignore_eos and tok in eos_set:
                stop_reason = "eos"
    if qmom is not None:
        qmom.close()

    return OracleResult(
        token_ids=out_tokens,
        num_live=res_live,
        num_logical=res_logical,
        evicted_positions=res_evicted,
        live_positions=pos[0].copy(),
        prompt_len=P,
        budget=budget,
        slack=slack,
        stop_reason=stop_reason,
        logits=res_logits,
        live_positions_sets=[p.copy() for p in pos] if per_set else None,
        evicted_positions_sets=res_evicted_sets,
        prefill_evicted_positions=res_prefill_evicted,
    )
