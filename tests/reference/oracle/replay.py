"""The protocol replay: :func:`oracle_generate` runs one request's steps in the engine's order
(:mod:`reference.oracle`, "Step order"): the prefill (:mod:`reference.oracle.chunks`), then per decode
step the eviction, the token's forward and the greedy sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from vtoken.config import VTokenConfig, num_to_evict
from reference.oracle.chunks import prefill, prefill_points
from reference.oracle.forward import _EMPTY, Replay, _check_model
from vtoken.policies.base import EvictionPolicy


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
            The request's plan is ``cfg.plan(prompt_len)`` (:class:`vtoken.config.RequestPlan`: budget,
            slack, policy, token sets), as the engine resolves it; each token set
            (:mod:`reference.oracle`) has its own ``init_state()``.
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
    eos_set: set[int] = (set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int)
                         else {int(e) for e in eos_token_id})

    r = Replay(model, P, cfg, policy, protected_prefix, return_logits)
    with torch.inference_mode():
        tok = r.sample(prefill(r, prompt, chunks, cfg, prefill_evict_schedule))
        r.record(tok, [_EMPTY] * r.S)
        stop_reason = _decode(r, tok, max_new_tokens, cfg.score_every if cfg is not None else 1, evict_schedule,
                              eos_set if not ignore_eos else None)
    if r.qmom is not None:
        r.qmom.close()
    return OracleResult(token_ids=r.tokens, num_live=r.live, num_logical=r.logical, evicted_positions=r.evicted,
                        live_positions=r.pos[0].copy(), prompt_len=P, budget=r.budget, slack=r.slack,
                        stop_reason=stop_reason, logits=r.logits,
                        live_positions_sets=[p.copy() for p in r.pos] if r.per_set else None,
                        evicted_positions_sets=r.evicted_sets, prefill_evicted_positions=r.prefill_evicted)


def _decode(r: Replay, tok: int, max_new_tokens: int, score_every: int, evict_schedule: Optional[dict[int, int]],
            eos_set: Optional[set[int]]) -> str:
    """The decode steps after the prefill's token ``tok``: evict (``num_to_evict``, or
    ``evict_schedule[d]`` tokens at decode step ``d``), forward the last token, sample. Stops at
    ``max_new_tokens`` or at a token in ``eos_set`` (None: never); returns ``"length"`` or ``"eos"``."""
    for d in range(1, max_new_tokens):
        if eos_set is not None and tok in eos_set:
            return "eos"
        evicted = [_EMPTY] * r.S
        n = len(r.pos[0])
        if r.states:
            k = num_to_evict(n, r.budget, r.slack) if evict_schedule is None else min(int(evict_schedule.get(d, 0)), n)
            if k > 0:
                evicted = r.evict(k, n)
        new_pos = np.array([r.num_logical], dtype=np.int64)
        r.append(new_pos)
        tok = r.sample(r.forward([tok], new_pos, scored=d % score_every == 0))
        r.record(tok, evicted)
    return "eos" if eos_set is not None and tok in eos_set else "length"
