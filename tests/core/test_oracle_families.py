"""The dense oracle on model families other than Llama (issue 43): configs without
``num_key_value_heads`` (multi-head GPT-NeoX, GPT-2) get one token set per (layer, head) under
``head`` token sets, read from the family's own cache and attention. The engine side of the same
families: tests/integration/test_model_families.py."""

from __future__ import annotations

import pytest
import torch

from vtoken.config import parse_config
from reference.oracle import load_oracle_model, oracle_generate

torch.set_num_threads(1)


@pytest.mark.parametrize("family", ["gpt_neox", "gpt2"])
def test_head_sets_on_a_config_without_kv_head_count(family):
    from vtoken.assets.paths import ensure_family_model

    model = load_oracle_model(str(ensure_family_model(family)))
    assert not hasattr(model.config, "num_key_value_heads")
    prompt = [(j * 13 + 5) % 250 + 1 for j in range(80)]
    cfg = parse_config({"policy": "h2o", "budget": 32, "granularity": "head"})
    res = oracle_generate(model, prompt, 8, cfg)
    L, H = model.config.num_hidden_layers, model.config.num_attention_heads
    assert len(res.live_positions_sets) == L * H
    assert all(len(p) == len(res.live_positions_sets[0]) for p in res.live_positions_sets)
    # the heads keep different tokens (per-head sets are really separate)
    assert len({tuple(p) for p in res.live_positions_sets}) > 1
    # request sets: one set, and a different choice than some head's
    req = oracle_generate(model, prompt, 8, parse_config({"policy": "h2o", "budget": 32, "granularity": "request"}))
    assert req.live_positions_sets is None and len(req.live_positions) == len(res.live_positions_sets[0])
