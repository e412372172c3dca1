"""One request's replay state on the oracle's dense cache (:class:`Replay`) and its steps: the forward
over the live tokens (statistics folded in right after it) and an eviction (victims, then the gather)."""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch

from vtoken.config import VTokenConfig
from reference.oracle.moments import QueryMoments
from reference.oracle.stats import (attention_stats_sets, expected_attention_sets, key_norm_sets, key_sim_sets,
                                 set_index_map)
from reference.policies import AttentionStats, TokenView, reference
from vtoken.policies.base import AttentionNeed, EvictionPolicy

_EMPTY = np.zeros(0, dtype=np.int64)


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


def _check_model(model) -> None:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "eager":
        raise ValueError(
            f"oracle_generate: model attention implementation is {impl!r}; the oracle needs 'eager' "
            "(load with attn_implementation='eager', e.g. reference.oracle.load_oracle_model)"
        )


class Replay:
    """One request's replay state (:func:`reference.oracle.oracle_generate`): the model and its dense cache
    (``cache``: per layer keys and values ``[1, Hkv, T, hd]``), the policy with one state per token set
    (``states``; none without eviction), each set's live logical positions in slot order (``pos``),
    and what the result records (one entry per generated token).

    Raises:
        ValueError: a sliding-window cache layer.
    """

    def __init__(self, model, P: int, cfg: Optional[VTokenConfig], policy: Optional[EvictionPolicy],
                 protected_prefix: int, return_logits: bool):
        from transformers import DynamicCache

        self.model, self.prompt_len, self.protected_prefix = model, P, protected_prefix
        self.budget = self.slack = None
        self.granularity, self.need = "request", AttentionNeed.NONE
        if cfg is not None:
            plan = cfg.plan(P)  # as the engine resolves the request (vtoken.config.RequestPlan)
            self.granularity, self.budget, self.slack = plan.granularity, plan.budget, plan.slack
            if policy is None:
                policy = plan.policy
            self.need = policy.needs
        self.policy = None if policy is None else reference(policy)  # its numpy form (reference/policies.py)
        policy = self.policy
        self.device = next(model.parameters()).device
        self.cache = cache = DynamicCache(config=model.config)
        if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
            raise ValueError("oracle_generate: sliding-window attention layers are not supported")
        self.per_set = self.granularity != "request"
        if self.per_set:
            num_layers = int(model.config.num_hidden_layers)
            # multi-head families (GPT-NeoX, GPT-J, GPT-2) name no KV-head count: one KV head per query head
            num_kv_heads = int(getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads)
            if len(cache.layers) != num_layers:  # pragma: no cover - a transformers change
                raise RuntimeError(f"oracle_generate: the cache has {len(cache.layers)} layers, the config {num_layers}")
        else:
            num_layers, num_kv_heads = max(len(cache.layers), 1), 1
        self.num_kv_heads = num_kv_heads
        self.set_of = set_index_map(self.granularity, num_layers, num_kv_heads)  # [L, Hkv] -> set
        self.S = int(self.set_of.max()) + 1
        self.states = [policy.init_state() for _ in range(self.S)] if cfg is not None else []
        self.pos = [_EMPTY.copy() for _ in range(self.S)]  # per token set: cache slot -> logical position
        self.num_logical = 0
        self.qmom = QueryMoments(model) if cfg is not None and self.need & AttentionNeed.QUERY_MOMENTS else None
        self.logits: Optional[list[torch.Tensor]] = [] if return_logits else None
        self.evicted_sets: Optional[list[list[np.ndarray]]] = [] if self.per_set else None
        self.tokens, self.live, self.logical, self.evicted, self.prefill_evicted = [], [], [], [], []

    def view(self, s: int) -> TokenView:
        return TokenView(logical_pos=self.pos[s].copy(), num_logical=self.num_logical, prompt_len=self.prompt_len,
                         protected_prefix=self.protected_prefix)

    def append(self, positions: np.ndarray) -> None:
        """Slots for the step's tokens at logical ``positions`` (int64, ascending) in every set, reset."""
        n = len(self.pos[0])
        for st in self.states:
            st.reset_slots(n, n + len(positions))
        for s in range(self.S):
            self.pos[s] = np.concatenate([self.pos[s], positions])
        self.num_logical = int(positions[-1]) + 1

    def forward(self, ids: list[int], positions: np.ndarray, scored: bool) -> torch.Tensor:
        """Forward ``ids`` (already appended) over the live tokens and fold the step's statistics into
        every set's state; returns the next-token logits."""
        cache, need, policy, states, pos = self.cache, self.need, self.policy, self.states, self.pos
        n_before = _cache_len(cache) if cache.get_seq_length() > 0 else 0
        q = len(ids)
        want_attn = scored and bool(need & (AttentionNeed.COL_SUM | AttentionNeed.LAST_ROW))
        out = self.model(input_ids=torch.tensor([ids], dtype=torch.long, device=self.device),
                         position_ids=torch.from_numpy(positions).to(self.device).unsqueeze(0),
                         attention_mask=torch.ones((1, n_before + q), dtype=torch.long, device=self.device),
                         past_key_values=cache, use_cache=True, output_attentions=want_attn, logits_to_keep=1)
        if _cache_len(cache) != n_before + q:  # pragma: no cover - a transformers change
            raise RuntimeError("oracle_generate: the cache did not grow by the step's tokens")
        if self.qmom is not None:  # every forward's queries (score_every is 1 for this policy)
            self.qmom.add(positions)
        if states and (want_attn or (scored and need & AttentionNeed.KEY_NORM)):
            stats = (attention_stats_sets(out.attentions, need, self.granularity, self.num_kv_heads,
                                          getattr(policy, "window", None)) if want_attn
                     else [AttentionStats() for _ in range(self.S)])
            if need & AttentionNeed.KEY_NORM:
                for s, kn in enumerate(key_norm_sets(cache, q, self.set_of)):
                    row = np.full(len(pos[s]), np.nan)
                    row[len(pos[s]) - q:] = kn
                    stats[s] = AttentionStats(col_sum=stats[s].col_sum, last_row=stats[s].last_row, key_norm=row)
            for s in range(self.S):  # folded in now: the state the next decision sees
                policy.observe(states[s], len(pos[s]), stats[s], self.view(s))
        elif states and need == AttentionNeed.NONE:
            for s in range(self.S):
                policy.observe(states[s], len(pos[s]), AttentionStats(), self.view(s))
        return out.logits[0, -1]

    def select(self, s: int, k: int) -> np.ndarray:
        n = len(self.pos[s])
        victims = np.asarray(self.policy.select_victims(self.states[s], self.view(s), k), dtype=np.int64)
        if victims.ndim != 1 or len(victims) > k or len(np.unique(victims)) != len(victims) or (
            len(victims) and (victims.min() < 0 or victims.max() >= n)
        ):
            raise RuntimeError(
                f"oracle_generate: policy {self.policy.name!r} returned invalid victims {victims!r} "
                f"for k={k}, num_live={n}" + (f" (token set {s})" if self.per_set else "")
                + f"; allowed: up to k distinct slots in [0, {n})"
            )
        return victims

    def evict(self, k: int, n: int) -> list[np.ndarray]:
        """Evict up to ``k`` of the ``n`` live tokens in every token set (the same count in each);
        returns each set's evicted logical positions."""
        policy, states, S = self.policy, self.states, self.S
        evicted = [_EMPTY] * S
        if policy.eviction_keys:  # KeyDiff, Expected Attention: the cached keys, now
            sims = (expected_attention_sets(self.cache, self.model, self.qmom, self.num_logical, policy.n_future,
                                            self.granularity)
                    if self.qmom is not None else key_sim_sets(self.cache, self.granularity))
            for s, sim in enumerate(sims):
                policy.observe(states[s], n, AttentionStats(key_sim=sim), self.view(s))
        victims = [self.select(s, k) for s in range(S)]
        counts = sorted({len(v) for v in victims})
        if len(counts) != 1:
            raise RuntimeError(
                f"oracle_generate: the token sets evict different counts {[len(v) for v in victims]} "
                f"for k={k} (granularity {self.granularity!r}); every set must evict the same number")
        if counts[0]:
            keeps = []
            for s in range(S):
                mask = np.ones(n, dtype=bool)
                mask[victims[s]] = False
                keeps.append(np.flatnonzero(mask).astype(np.int64))
                evicted[s] = np.sort(self.pos[s][victims[s]])
            if self.per_set:
                _evict_sets(self.cache, [torch.from_numpy(kp).to(self.device) for kp in keeps], self.set_of)
            else:
                _evict(self.cache, torch.from_numpy(keeps[0]).to(self.device))
            for s in range(S):
                states[s].compact(keeps[s])
                self.pos[s] = self.pos[s][keeps[s]]
        return evicted

    def sample(self, logits: torch.Tensor) -> int:
        if self.logits is not None:
            self.logits.append(logits.detach().to(torch.float32).cpu().clone())
        return int(torch.argmax(logits).item())

    def record(self, tok: int, evicted: list[np.ndarray]) -> None:
        self.tokens.append(tok)
        self.live.append(len(self.pos[0]))
        self.logical.append(self.num_logical)
        self.evicted.append(evicted[0])
        if self.evicted_sets is not None:
            self.evicted_sets.append(evicted)


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
