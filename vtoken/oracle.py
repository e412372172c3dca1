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

Attention statistics follow :mod:`vtoken.policies.base`: the post-softmax
probabilities ``[1, H, q, k]`` of every layer (``output_attentions=True``) are
summed over layers and query heads in float64 and divided by ``L * H``; ``col_sum``
is the sum over this step's query rows, ``last_row`` the last query row; both
float64 ``[num_live]`` in the cache's (logical) order. Only what ``policy.needs``
asks for is computed.

``score_lag = L`` (async scheduling, :mod:`vtoken.score_lag`): the statistics of step
``k`` (prefill = 0, decode ``d`` = step ``d``) are folded in just before the eviction
decision of step ``k + 1 + L`` (remapped by logical position; tokens appended since get
``NaN``), and a scoring policy starts evicting at decode step ``1 + L``. ``L = 0`` is the
sync behaviour: each step's statistics are folded in before the next decision.

``cfg.score_every = s > 1`` (attention scores every ``s`` decode steps): the
prefill is always scored; decode step ``d`` (``d = 1`` for the first decode
forward) is scored iff ``d % s == 0``. Unscored steps do not call ``observe``
when the policy needs attention; policies with ``needs == NONE`` are observed
every step with empty stats. This convention must be the engine's too.

``preempt_at`` (a preemption, replayed; ``docs/integration.md``, "Preemption"): at decode
step ``d`` in it, after that step's eviction decision, the cache is dropped with every
statistic not yet folded in, and the step's forward is a fresh prefill of the live tokens
(ascending logical order, their token ids at their logical positions) followed by the new
token; it is scored like a prefill. The policy state and the live set are kept. Decoding
then continues as usual; as after the first prefill, eviction resumes at decode step
``d + 1`` (``d + 1 + L`` for a scoring policy, once the re-prefill's statistics are in).

This module never imports vllm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

import numpy as np
import torch

from vtoken.config import VTokenConfig, effective_budget, num_to_evict
from vtoken.policies.base import AttentionNeed, AttentionStats, EvictionPolicy, TokenView
from vtoken.score_lag import ScoreLagQueue, first_evicting_decode_step, remap_stats

if TYPE_CHECKING:  # pragma: no cover
    from vtoken.policies.base import SlotState

__all__ = ["OracleResult", "oracle_generate", "load_oracle_model", "attention_stats"]


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


def attention_stats(attentions: Sequence[torch.Tensor], need: AttentionNeed) -> AttentionStats:
    """Reduce one step's per-layer attention probabilities to :class:`AttentionStats`.

    Args:
        attentions: per layer, post-softmax probabilities ``[1, H, q, k]`` (any float
            dtype; H = query heads, q = this step's query rows, k = live keys incl.
            this step's own tokens).
        need: which statistics to compute.

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
    col_sum = mean.sum(dim=0).cpu().numpy() if need & AttentionNeed.COL_SUM else None
    last_row = mean[-1].cpu().numpy().copy() if need & AttentionNeed.LAST_ROW else None
    return AttentionStats(col_sum=col_sum, last_row=last_row)


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


def _cache_len(cache) -> int:
    lens = {int(layer.keys.shape[-2]) for layer in cache.layers}
    if len(lens) != 1:
        raise RuntimeError(f"oracle_generate: cache layers hold different lengths {sorted(lens)}")
    return lens.pop()


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
    score_lag: int = 0,
    protected_prefix: int = 0,
    evict_schedule: Optional[dict[int, int]] = None,
    preempt_at: Optional[Sequence[int]] = None,
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
            ``cfg.make_policy(budget)``.
        eos_token_id: EOS id(s); only used when ``ignore_eos`` is False.
        ignore_eos: keep generating after EOS (the default, like vLLM's ``ignore_eos``).
        return_logits: also return each step's float32 next-token logits.
        policy: an already built policy to use instead of the one ``cfg`` names
            (budget and slack still come from ``cfg``, which must then be given).
        score_lag: request-steps by which attention statistics reach the policy late
            (0: sync scheduling; 1: vLLM's async scheduling); see the module docstring.
        protected_prefix: the first ``protected_prefix`` logical positions are never evicted
            (tokens, >= 0): the engine's prefix-caching rule for this request (its cached or
            shared prefix blocks, ``RequestState.protected``; docs/integration.md, "Prefix
            caching"). 0: none (prefix caching off).
        evict_schedule: decode step -> tokens to ask the policy to evict, replacing the
            ``budget + slack`` rule (pressure pacing decides amounts from pool state; the
            engine records them, ``RequestState.evict_log``, and the oracle replays them;
            the victims are still the policy's choice).
        preempt_at: decode steps (``d >= 1``) at which the request is preempted after its
            eviction decision and resumes by re-prefilling its live tokens (module
            docstring); the engine records them (``RequestState.preempt_log``).

    Returns:
        :class:`OracleResult`.

    Raises:
        ValueError: empty prompt, ``max_new_tokens < 1``, a non-eager model, a
            sliding-window cache layer, ``policy`` without ``cfg``, ``score_lag < 0`` or
            ``protected_prefix < 0``.
        RuntimeError: the policy returned invalid victims (out of range, duplicates).
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
    preempt_set = {int(d) for d in (preempt_at or ())}
    if any(d < 1 for d in preempt_set):
        raise ValueError(f"oracle_generate: preempt_at = {sorted(preempt_set)}; allowed: decode steps >= 1")
    if eos_token_id is None:
        eos_set: set[int] = set()
    elif isinstance(eos_token_id, int):
        eos_set = {eos_token_id}
    else:
        eos_set = {int(e) for e in eos_token_id}

    from transformers import DynamicCache

    budget = slack = None
    state: Optional["SlotState"] = None
    need = AttentionNeed.NONE
    score_every = 1
    lagq = ScoreLagQueue(score_lag)
    first_evict = 1
    if cfg is not None:
        budget = effective_budget(cfg, P)
        slack = cfg.resolved_slack()
        if policy is None:
            policy = cfg.make_policy(budget)
        state = policy.init_state()
        need = policy.needs
        score_every = cfg.score_every
        first_evict = first_evicting_decode_step(need, score_lag)

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise ValueError("oracle_generate: sliding-window attention layers are not supported")

    logical_pos = np.arange(P, dtype=np.int64)  # cache slot -> logical position
    num_logical = P
    out_tokens: list[int] = []
    res_live: list[int] = []
    res_logical: list[int] = []
    res_evicted: list[np.ndarray] = []
    res_logits: Optional[list[torch.Tensor]] = [] if return_logits else None
    stop_reason = "length"
    empty = np.zeros(0, dtype=np.int64)

    def forward(ids: list[int], positions: np.ndarray, scored: bool, step: int) -> torch.Tensor:
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
        if state is not None and want_attn:
            lagq.expect(step, logical_pos, sampled=True)
            lagq.deliver(step, attention_stats(out.attentions, need))
            if score_lag == 0:  # sync: fold in now (same state as just before the next decision)
                fold_lagged(step + 1)
        elif state is not None and need == AttentionNeed.NONE:
            view = TokenView(logical_pos=logical_pos.copy(), num_logical=num_logical, prompt_len=P,
                             protected_prefix=protected_prefix)
            policy.observe(state, len(logical_pos), AttentionStats(), view)
        return out.logits[0, -1]

    def fold_lagged(step: int) -> None:
        for e in lagq.ready(step):
            view = TokenView(logical_pos=logical_pos.copy(), num_logical=num_logical, prompt_len=P,
                             protected_prefix=protected_prefix)
            stats = remap_stats(e.stats, e.logical_pos, logical_pos, num_logical)
            policy.observe(state, len(logical_pos), stats, view)

    def sample(logits: torch.Tensor) -> int:
        if res_logits is not None:
            res_logits.append(logits.detach().to(torch.float32).cpu().clone())
        return int(torch.argmax(logits).item())

    with torch.inference_mode():
        # ---- prefill: the whole prompt, no eviction ----
        if state is not None:
            state.reset_slots(0, P)
        tok = sample(forward(prompt, logical_pos.copy(), scored=True, step=0))
        out_tokens.append(tok)
        res_live.append(len(logical_pos))
        res_logical.append(num_logical)
        res_evicted.append(empty)

        for d in range(1, max_new_tokens):
            if not ignore_eos and tok in eos_set:
                stop_reason = "eos"
                break
            evicted = empty
            n = len(logical_pos)
            if state is not None:
                fold_lagged(d)
                if evict_schedule is not None:
                    k = min(int(evict_schedule.get(d, 0)), n)
                else:
                    k = num_to_evict(n, budget, slack) if d >= first_evict else 0
                if k > 0:
                    view = TokenView(logical_pos=logical_pos.copy(), num_logical=num_logical, prompt_len=P,
                                     protected_prefix=protected_prefix)
                    victims = np.asarray(policy.select_victims(state, view, k), dtype=np.int64)
                    if victims.ndim != 1 or len(victims) > k or len(np.unique(victims)) != len(victims) or (
                        len(victims) and (victims.min() < 0 or victims.max() >= n)
                    ):
                        raise RuntimeError(
                            f"oracle_generate: policy {policy.name!r} returned invalid victims {victims!r} "
                            f"for k={k}, num_live={n}; allowed: up to k distinct slots in [0, {n})"
                        )
                    if len(victims):
                        mask = np.ones(n, dtype=bool)
                        mask[victims] = False
                        keep = np.flatnonzero(mask).astype(np.int64)
                        evicted = np.sort(logical_pos[victims])
                        _evict(cache, torch.from_numpy(keep).to(device))
                        state.compact(keep)
                        logical_pos = logical_pos[keep]
                n = len(logical_pos)
                state.reset_slots(n, n + 1)
            new_pos = np.array([num_logical], dtype=np.int64)
            if d in preempt_set:
                # preempted: the cache and pending statistics are gone; re-prefill the live
                # tokens (logical order, logical positions) and the new token
                cache = DynamicCache(config=model.config)
                lagq.clear()
                if state is not None:
                    first_evict = d + first_evicting_decode_step(need, score_lag)
                ids = [prompt[p] if p < P else out_tokens[p - P] for p in logical_pos.tolist()] + [tok]
                positions = np.concatenate([logical_pos, new_pos])
                logical_pos = positions.copy()
                num_logical += 1
                tok = sample(forward(ids, positions, scored=True, step=d))
                out_tokens.append(tok)
                res_live.append(len(logical_pos))
                res_logical.append(num_logical)
                res_evicted.append(evicted)
                continue
            logical_pos = np.concatenate([logical_pos, new_pos])
            num_logical += 1
            scored = d % score_every == 0
            tok = sample(forward([tok], new_pos, scored=scored, step=d))
            out_tokens.append(tok)
            res_live.append(len(logical_pos))
            res_logical.append(num_logical)
            res_evicted.append(evicted)
        else:
            if not ignore_eos and tok in eos_set:
                stop_reason = "eos"

    return OracleResult(
        token_ids=out_tokens,
        num_live=res_live,
        num_logical=res_logical,
        evicted_positions=res_evicted,
        live_positions=logical_pos.copy(),
        prompt_len=P,
        budget=budget,
        slack=slack,
        stop_reason=stop_reason,
        logits=res_logits,
    )
