"""Expected Attention needs the model's RoPE: the start-up check from the model's config
(``refusals.rope_problem``), the request-time refusal (HTTP 400 for that request only) and the
worker's check of the loaded layers (``WorkerStep.find_rope``). No engine is started."""

from __future__ import annotations

import json

import pytest
import torch

from vtoken.assets.paths import ensure_tiny_model
from vtoken.config import VTokenConfig, VTokenConfigError
from vtoken.integrations.vllm.frontend import requests as frontend
from vtoken.integrations.vllm.frontend.refusals import rope_problem
from vtoken.integrations.vllm.worker.step import WorkerStep


def test_rope_problem_reads_the_model_config():
    cfg = json.loads((ensure_tiny_model() / "config.json").read_text())
    assert rope_problem(cfg) is None  # the tests' Llama: plain RoPE
    assert rope_problem(dict(cfg, partial_rotary_factor=0.5)) == "partial_rotary_factor = 0.5"
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    assert rope_problem(dict(cfg, rope_parameters=yarn, rope_scaling=yarn)) == "rope_type = 'yarn'"
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    assert rope_problem(dict(cfg, rope_parameters=llama3, rope_scaling=llama3)) is None
    none = {k: v for k, v in cfg.items() if not k.startswith("rope")}
    assert rope_problem(none) == "no rotary position embedding (rope_theta)"


def test_a_request_is_refused_alone_on_a_model_without_rope():
    frontend.set_engine_config(VTokenConfig(policy="keydiff", budget=64))
    try:
        frontend.check_request({"vtoken_policy": "expected_attention"})  # the model has RoPE: fine
        frontend.set_rope_problem("partial_rotary_factor = 0.5")
        with pytest.raises(VTokenConfigError, match=r"vllm_xargs.vtoken_policy = 'expected_attention': .*"
                           r"partial_rotary_factor = 0.5; allowed here: another policy"):
            frontend.check_request({"vtoken_policy": "expected_attention"})
        frontend.check_request({"vtoken_policy": "knorm"})  # other policies are not concerned
    finally:
        frontend.set_engine_config(None)


class RotaryEmbedding(torch.nn.Module):  # the attributes vLLM's RotaryEmbedding carries
    def __init__(self, head_size=8, rotary_dim=8, neox=True):
        super().__init__()
        self.head_size, self.rotary_dim, self.is_neox_style = head_size, rotary_dim, neox
        self.cos_sin_cache = torch.arange(32 * rotary_dim, dtype=torch.float32).view(32, rotary_dim)


class YaRNScalingRotaryEmbedding(RotaryEmbedding):
    pass


def _model(*ropes):
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList(torch.nn.Module() for _ in ropes)
    for layer, r in zip(m.layers, ropes):
        layer.rotary_emb = r
    return m


def test_find_rope_checks_the_loaded_layers():
    core = WorkerStep({}, layout_for=None)
    shared = RotaryEmbedding(neox=False)
    core.find_rope(_model(shared, shared), "expected_attention")
    cos_sin, a, b = core.rope
    assert cos_sin is shared.cos_sin_cache and a.tolist() == [0, 2, 4, 6] and b.tolist() == [1, 3, 5, 7]
    for model, why in ((_model(YaRNScalingRotaryEmbedding()), "YaRNScalingRotaryEmbedding"),
                       (_model(RotaryEmbedding(rotary_dim=4)), "rotary_dim < head_size"),
                       (_model(RotaryEmbedding(), RotaryEmbedding(neox=False)), "different rotary embeddings"),
                       (_model(), "no rotary position embedding")):
        core.find_rope(model, "keydiff")  # another policy: recorded, not refused
        assert core.rope is None and why in core.rope_missing
        with pytest.raises(VTokenConfigError, match=r"^vtoken.policy = 'expected_attention': vToken does not support"):
            core.find_rope(model, "expected_attention")
