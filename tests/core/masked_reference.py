"""An independent per-head reference for the oracle's token sets (tests only, not shipped).

The model runs with a FULL KV cache that is never compacted: every token's K/V stays at its
logical index. Each token set has a boolean mask of its evicted logical positions; a custom
attention function (registered as ``"vtoken_masked"``) computes, per query head ``h`` of
layer ``l``, ``softmax(q . k * scale + mask) @ v`` over KV head ``g = h // G`` with ``-inf`` on
the causal future and on the keys evicted by the set covering (``l``, ``g``). It shares no
gather, compaction or statistics code with :mod:`reference.oracle`: only the policies, the
pacing (:func:`vtoken.config.num_to_evict`) and the config.

Decisions: the same policy code per set, on statistics restricted to that set's live keys
(ascending logical order), computed here from this function's own probabilities. Greedy
decode, fixed pacing (or a replayed ``evict_schedule``), the prompt in one prefill, sync
statistics (no score lag), ``cfg.score_every`` as the oracle's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from vtoken.config import VTokenConfig, effective_budget, num_to_evict
from reference.policies import AttentionStats, TokenView, reference
from vtoken.policies.base import AttentionNeed

IMPL = "vtoken_masked"


@dataclass
class MaskedResult:
    """token_ids: greedy tokens; evicted_sets: per step, per set, the logical positions
    evicted before it (ascending); live_sets: per set, the live positions after the last step."""

    token_ids: list[int]
    evicted_sets: list[list[np.ndarray]]
    live_sets: list[np.ndarray]


def set_of(granularity: str, layer: int, kv_head: int, num_layers: int, num_kv_heads: int) -> int:
    """Token set of (layer, KV head), written out from the table in docs/granularity.md."""
    if granularity == "request":
        return 0
    if granularity == "layer":
        return layer
    if granularity == "head":
        return layer * num_kv_heads + kv_head
    if granularity == "head_shared":
        return kv_head
    raise ValueError(granularity)


def masked_generate(model, prompt: list[int], max_new_tokens: int, cfg: VTokenConfig,
                    evict_schedule: Optional[dict[int, int]] = None) -> MaskedResult:
    """Greedy decode with eviction by masking; ``evict_schedule`` (decode step -> k) replaces
    the ``budget + slack`` pacing, as ``oracle_generate``'s."""
    from transformers import AttentionInterface, DynamicCache

    c = model.config
    L, Hq, Hkv = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
    G = Hq // Hkv
    gran = cfg.resolved_granularity()
    S = 1 + max(set_of(gran, l, g, L, Hkv) for l in range(L) for g in range(Hkv))
    P = len(prompt)
    dead = np.zeros((S, P + max_new_tokens), dtype=bool)  # per set: evicted logical positions
    probs: dict[int, torch.Tensor] = {}  # layer -> [Hq, q, t] of the last forward

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        l = module.layer_idx
        q_len, t = query.shape[2], key.shape[2]
        future = torch.arange(t)[None, :] > torch.arange(t - q_len, t)[:, None]  # [q, t]
        outs, ps = [], []
        for h in range(Hq):
            g = h // G
            hidden = future | torch.from_numpy(dead[set_of(gran, l, g, L, Hkv), :t])[None, :]
            logits = (query[0, h] @ key[0, g].T) * scaling
            p = torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1)
            ps.append(p)
            outs.append(p @ value[0, g])  # [q, hd]
        probs[l] = torch.stack(ps)
        return torch.stack(outs, dim=1)[None], None  # [1, q, Hq, hd]

    def live(s: int, t: int) -> np.ndarray:
        return np.flatnonzero(~dead[s, :t]).astype(np.int64)

    def set_stats(s: int, t: int) -> AttentionStats:
        """Mean over the (layer, query head) pairs of set s, on its live keys, float64."""
        keys = live(s, t)
        pairs = [(l, h) for l in range(L) for h in range(Hq) if set_of(gran, l, h // G, L, Hkv) == s]
        mean = sum(probs[l][h].double().numpy()[:, keys] for l, h in pairs) / len(pairs)  # [q, n]
        return AttentionStats(col_sum=mean.sum(axis=0) if need & AttentionNeed.COL_SUM else None,
                              last_row=mean[-1].copy() if need & AttentionNeed.LAST_ROW else None)

    budget = effective_budget(cfg, P)
    slack = cfg.resolved_slack()
    policy = reference(cfg.make_policy(budget))
    need = policy.needs
    states = [policy.init_state() for _ in range(S)]
    cache = DynamicCache(config=c)
    tokens: list[int] = []
    evicted_sets: list[list[np.ndarray]] = []

    def step(ids: list[int], first_pos: int, scored: bool, num_logical: int) -> int:
        out = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(first_pos, num_logical)[None],
                    past_key_values=cache, use_cache=True)
        for s in range(S):
            view = TokenView(logical_pos=live(s, num_logical), num_logical=num_logical, prompt_len=P)
            if need == AttentionNeed.NONE:
                policy.observe(states[s], view.num_live, AttentionStats(), view)
            elif scored:
                policy.observe(states[s], view.num_live, set_stats(s, num_logical), view)
        return int(out.logits[0, -1].argmax())

    AttentionInterface.register(IMPL, attention)
    old_impl = c._attn_implementation
    c._attn_implementation = IMPL
    try:
        with torch.inference_mode():
            for st in states:
                st.reset_slots(0, P)
            tokens.append(step(prompt, 0, True, P))
            evicted_sets.append([np.zeros(0, dtype=np.int64)] * S)
            for d in range(1, max_new_tokens):
                num_logical = P + d - 1  # tokens whose K/V is cached
                n = len(live(0, num_logical))
                assert all(len(live(s, num_logical)) == n for s in range(S))
                k = num_to_evict(n, budget, slack) if evict_schedule is None else min(evict_schedule.get(d, 0), n)
                ev = []
                for s in range(S):
                    pos = live(s, num_logical)
                    if k > 0:
                        view = TokenView(logical_pos=pos, num_logical=num_logical, prompt_len=P)
                        victims = policy.select_victims(states[s], view, k)
                        dead[s, pos[victims]] = True
                        states[s].compact(np.setdiff1d(np.arange(n), victims))
                        ev.append(np.sort(pos[victims]))
                    else:
                        ev.append(np.zeros(0, dtype=np.int64))
                    n_s = len(live(s, num_logical))
                    states[s].reset_slots(n_s, n_s + 1)
                evicted_sets.append(ev)
                tokens.append(step([tokens[-1]], num_logical, d % cfg.score_every == 0, num_logical + 1))
    finally:
        c._attn_implementation = old_impl
    end = P + max_new_tokens - 1
    return MaskedResult(tokens, evicted_sets, [live(s, end) for s in range(S)])
