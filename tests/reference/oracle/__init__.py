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
``vtoken/side_cache.py``, ``vtoken/select.py``):

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

This package never imports vllm.
"""

from reference.oracle.chunks import prefill_points
from reference.oracle.forward import load_oracle_model
from reference.oracle.moments import QueryMoments
from reference.oracle.replay import OracleResult, oracle_generate
from reference.oracle.stats import (GRANULARITIES, attention_stats, attention_stats_sets, expected_attention_sets,
                                 key_norm_sets, key_sim_sets, set_index_map)

__all__ = ["OracleResult", "oracle_generate", "prefill_points", "load_oracle_model", "attention_stats", "attention_stats_sets",
           "key_norm_sets", "key_sim_sets", "expected_attention_sets", "QueryMoments", "GRANULARITIES", "set_index_map"]
