"""Tiny random models of each model family (``vtoken/assets/families.py``): shapes, rebuilds,
and attention peaked enough that eviction decisions are not near-ties (measured on the
transformers model itself, ``output_attentions``)."""

import json

import pytest

from vtoken.assets import families
from vtoken.assets._common import MANIFEST_NAME, sha256_file
from vtoken.assets.paths import ensure_family_model

NAMES = list(families.FAMILIES)


@pytest.fixture(scope="module", params=NAMES)
def fam_path(request):
    return request.param, ensure_family_model(request.param)


#: the families built to be refused (tests/drivers/model_families.py REFUSED) and the feature each has
REFUSED_FEATURE = {"gemma2": "attn_logit_softcapping", "mistral_swa": "sliding_window"}


def test_shapes(fam_path):
    name, path = fam_path
    cfg = json.loads((path / "config.json").read_text())
    assert cfg.get("num_hidden_layers", cfg.get("n_layer")) == 2 and cfg["vocab_size"] == 512
    assert cfg["dtype"] == "float32"
    features = {k for k in ("sliding_window", "attn_logit_softcapping") if cfg.get(k)}
    assert features == ({REFUSED_FEATURE[name]} if name in REFUSED_FEATURE else set()) | (
        {"sliding_window"} if name == "gemma2" else set()), (name, features)


def test_gqa_ratios_and_head_dims_covered():
    ratios, dims = set(), set()
    for fam in families.FAMILIES.values():
        cfg = families.make_config(fam)
        hq, hkv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        ratios.add(hq // hkv)
        dims.add(getattr(cfg, "head_dim", None) or cfg.hidden_size // hq)
    assert {1, 4, 8} <= ratios and {64, 128, 256} <= dims


def test_attention_is_peaked(fam_path):
    """Random 200-token prompt: the mean max attention probability is far above uniform (1/200)
    and the next-token logits are spread (no near-ties by construction)."""
    name, path = fam_path
    check = json.loads((path / MANIFEST_NAME).read_text())["check"]
    assert check["max_attn_prob"] > 0.4, (name, check)
    assert check["attn_entropy_frac"] < 0.5, (name, check)
    assert check["logit_std"] > 2.0, (name, check)


def test_rebuild_is_byte_identical(tmp_path):
    fam = families.FAMILIES["qwen3"]
    a = families.build(fam, tmp_path / "a")
    cached = json.loads((ensure_family_model("qwen3") / MANIFEST_NAME).read_text())["files"]
    assert cached["model.safetensors"] == sha256_file(a / "model.safetensors")
