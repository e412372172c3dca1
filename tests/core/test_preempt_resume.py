"""The core of resuming a preempted evicting request with its live tokens only (issue 15, item 8):
``TokenTable.sort_by_position``, ``ScoreLagQueue.clear`` and the dense oracle's replay of a
preemption (``oracle_generate(preempt_at=...)``): at decode step d the cache is dropped and the
step is a fresh prefill of the live tokens (logical order, logical positions) plus the new token.
The oracle's replay is checked against an independent re-implementation on the raw model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vtoken.config import VTokenConfig
from vtoken.oracle import oracle_generate
from vtoken.policies.base import AttentionStats
from vtoken.score_lag import ScoreLagQueue
from vtoken.token_table import TokenTable


def _llama(num_layers: int = 2, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
                      initializer_range=0.1, attn_implementation="eager", bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    return LlamaForCausalLM(cfg).to(torch.float32).eval()


@pytest.fixture(scope="module")
def model():
    return _llama()


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g).tolist()


def test_sort_by_position_permutes_slots_and_keeps_invariants():
    t = TokenTable(4)
    t.append(10)
    t.evict_slots(np.array([1, 2, 7]))  # moves 8->1, 9->2 (module docstring of token_table)
    before = t.logical_pos.copy()
    assert before.tolist() == [0, 8, 9, 3, 4, 5, 6]
    order = t.sort_by_position()
    assert t.logical_pos.tolist() == [0, 3, 4, 5, 6, 8, 9]
    assert np.array_equal(before[order], t.logical_pos)
    assert (t.num_live, t.num_logical, t.offset) == (7, 10, 3)
    t.check_invariants()
    assert t.slot_of(8) == 5 and t.slot_of(1) == -1
    t.append(2)  # new tokens go on after the sorted live ones
    assert t.logical_pos.tolist()[-2:] == [10, 11]
    t.check_invariants()


def test_score_lag_clear_drops_pending_entries():
    q = ScoreLagQueue(1)
    q.expect(3, np.arange(4), sampled=True)
    q.deliver(3, AttentionStats(col_sum=np.ones(4)))
    q.expect(4, np.arange(5), sampled=True)
    q.clear()
    assert len(q) == 0 and q.ready(100) == [] and q.deliver(4, AttentionStats(col_sum=np.ones(5))) is False


def test_preempt_without_eviction_equals_plain_greedy(model):
    """With nothing evicted the re-prefill recomputes every token's KV from the full context:
    the same tokens as never preempting."""
    p = _prompt(20)
    plain = oracle_generate(model, p, 24, None)
    pre = oracle_generate(model, p, 24, None, preempt_at=[5, 17])
    assert pre.token_ids == plain.token_ids
    assert pre.num_live == plain.num_live


def _manual(model, prompt, cfg, new_tokens, preempt_d):
    """An independent replay for the streaming policy (sink + recent window, score-free): keep
    the live set as logical positions; at the preemption step recompute from scratch by a full
    forward over [live tokens, new token] and keep decoding on that cache."""
    from transformers import DynamicCache

    from vtoken.config import effective_budget, num_to_evict

    budget = effective_budget(cfg, len(prompt))
    slack = cfg.resolved_slack()
    sink = cfg.sink_tokens
    ids_all = list(prompt)
    live = list(range(len(prompt)))

    def run(tok_ids, positions, cache):
        out = model(input_ids=torch.tensor([tok_ids]), position_ids=torch.tensor([positions]),
                    past_key_values=cache, use_cache=True)
        return int(out.logits[0, -1].argmax())

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        tok = run(ids_all, live, cache)
        out = [tok]
        for d in range(1, new_tokens):
            k = num_to_evict(len(live), budget, slack)
            if k > 0:  # streaming: keep the sinks and the most recent tokens
                keep_idx = list(range(sink)) + list(range(sink + k, len(live)))
                for layer in cache.layers:
                    sel = torch.tensor(keep_idx)
                    layer.keys = layer.keys.index_select(-2, sel)
                    layer.values = layer.values.index_select(-2, sel)
                live = [live[i] for i in keep_idx]
            pos = len(ids_all)
            ids_all.append(tok)
            if d == preempt_d:
                cache = DynamicCache(config=model.config)
                tok = run([ids_all[p] for p in live] + [tok], live + [pos], cache)
            else:
                tok = run([tok], [pos], cache)
            live.append(pos)
            out.append(tok)
    return out


def test_preempt_replay_matches_an_independent_replay(model):
    """Streaming (score-free, deterministic victims) with a preemption at decode step 9: the
    oracle's tokens equal a hand-written replay, and differ from never preempting."""
    cfg = VTokenConfig(policy="streaming", budget=16, sink_tokens=4, slack=0)
    p = _prompt(30, seed=3)
    ref = oracle_generate(model, p, 20, cfg, preempt_at=[9])
    assert ref.token_ids == _manual(model, p, cfg, 20, 9)
    assert ref.num_live[9] == 17  # the re-prefill covers budget + 1 tokens
    assert ref.token_ids != oracle_generate(model, p, 20, cfg).token_ids


def test_preempt_at_must_be_decode_steps(model):
    with pytest.raises(ValueError, match="preempt_at"):
        oracle_generate(model, _prompt(5), 4, None, preempt_at=[0])
