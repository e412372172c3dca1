"""What vToken refuses (issue 15, items 4, 5 and the README list), without an engine.

* the "What vToken refuses" block of docs/configuration.md (README links to it) is exactly the one generated from
  ``refusals.REFUSALS``, and its rows parse back to the same set;
* every start-up refusal in the table is raised somewhere in the code through
  :func:`refusals.refuse` (and nothing refuses outside the table);
* model attention features the scorer does not reproduce (ALiBi, attention logit
  soft-capping, learned sinks) are found from tiny Hugging Face configs of real model
  families, and ordinary configs (Llama, the LM-head-only soft cap) are not refused;
* the KV-cache dtype allowlist is exactly what ``test_kv_layout.py`` covers.

The same refusals through ``EngineArgs.create_engine_config`` are in
``tests/reliability/test_never_silent.py``.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from vtoken.config import VTokenConfigError
from vtoken.integrations.vllm.frontend import refusals
from vtoken.integrations.vllm.frontend.refusals import REFUSALS, model_attention_features

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------- README <-> table
def _readme_block() -> str:
    text = (ROOT / refusals.REFUSALS_PAGE).read_text()
    i = text.index(refusals.README_BEGIN)
    j = text.index(refusals.README_END) + len(refusals.README_END)
    return text[i:j]


def test_readme_block_is_generated_from_the_table():
    assert _readme_block() == refusals.readme_block(), (
        f"{refusals.REFUSALS_PAGE}'s refusals block is stale: run `python -m vtoken.integrations.vllm.frontend.refusals`")


def test_readme_rows_parse_to_the_table():
    rows = [ln for ln in _readme_block().splitlines() if ln.startswith("| ") and not ln.startswith("| vToken ")]
    cells = [tuple(c.strip() for c in ln.strip("|").split(" | ")) for ln in rows]
    want = {(r.option, r.when, r.reason) for r in REFUSALS}
    assert set(cells) == want and len(cells) == len(want)


def _code() -> str:
    d = ROOT / "vtoken" / "integrations" / "vllm"
    return "\n".join(p.read_text() for p in sorted(d.rglob("*.py")))


def test_every_refusal_in_the_table_is_raised_by_the_code_and_none_outside():
    code = _code()
    # refuse("key", ...) directly, or a model feature key that check_model passes to refuse
    raised = set(re.findall(r"refuse\(\s*\"(\w+)\"", code)) | set(re.findall(r"found\.append\(\(\"(\w+)\"", code))
    start_up = {r.key for r in REFUSALS if r.when == "start-up"}
    assert raised == start_up, f"in the table, never raised: {start_up - raised}; raised, not in the table: " \
                               f"{raised - start_up}"
    # the request-time refusals (streaming input, beam search) are raised by frontend/requests.py from their rows
    assert {r.key for r in REFUSALS if r.when == "request"} == {"streaming_input", "beam_search"}
    frontend = (ROOT / "vtoken/integrations/vllm/frontend/requests.py").read_text()
    assert 'r.key == "streaming_input"' in frontend and 'r.key == "beam_search"' in frontend
    # no refusal message built outside refusals.refuse / the table
    assert len(re.findall(r'raise VTokenConfigError\(f"[^"]*vToken does not support it yet', code)) == 2, "a refusal bypasses refusals.refuse"
    assert code.count('f"vToken does not support') == 1  # frontend/requests.py's streaming-input message, from its row


def test_refuse_unknown_key_is_an_error():
    with pytest.raises(KeyError):
        refusals.refuse("not_in_the_table", 1)


# ---------------------------------------------------------------------- model features
def _cfgs():
    from transformers import BloomConfig, FalconConfig, Gemma2Config, GptOssConfig, LlamaConfig

    small = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=2)
    full = dict(sliding_window=None, layer_types=["full_attention"] * 2)
    return {
        "falcon_alibi": (FalconConfig(**small, alibi=True, architectures=["FalconForCausalLM"]),
                         [("alibi", "alibi=True")]),
        "falcon_rope": (FalconConfig(**small, alibi=False, architectures=["FalconForCausalLM"]), []),
        "bloom": (BloomConfig(vocab_size=512, hidden_size=128, n_layer=2, n_head=2, architectures=["BloomForCausalLM"]),
                  [("alibi", "model_type='bloom' (always ALiBi)")]),
        "gemma2_softcap": (Gemma2Config(**small, intermediate_size=256, num_key_value_heads=1, head_dim=64, **full,
                                        attn_logit_softcapping=50.0, architectures=["Gemma2ForCausalLM"]),
                           [("softcap", "attn_logit_softcapping=50.0")]),
        # the LM head's soft cap is not attention: allowed
        "gemma2_head_cap_only": (Gemma2Config(**small, intermediate_size=256, num_key_value_heads=1, head_dim=64,
                                              **full, attn_logit_softcapping=None, final_logit_softcapping=30.0,
                                              architectures=["Gemma2ForCausalLM"]), []),
        "gpt_oss_sinks": (GptOssConfig(**small, intermediate_size=256, num_key_value_heads=1, head_dim=64,
                                       num_local_experts=4, **full, architectures=["GptOssForCausalLM"]),
                          [("sinks", "model_type='gpt_oss' (learned per-head sinks)")]),
        "llama": (LlamaConfig(**small, architectures=["LlamaForCausalLM"]), []),
        "llama_sinks_flag": (LlamaConfig(**small, attention_sinks=True), [("sinks", "attention_sinks=True")]),
        "jais_style": ({"model_type": "jais", "position_embedding_type": "alibi"},
                       [("alibi", "position_embedding_type='alibi'")]),
        "mpt_style": ({"model_type": "mpt", "attn_config": {"alibi": True}}, [("alibi", "attn_config.alibi=True")]),
    }


@pytest.mark.parametrize("name", list(_cfgs()))
def test_model_attention_features(name):
    cfg, want = _cfgs()[name]
    assert model_attention_features(cfg) == want


@pytest.mark.parametrize("name", ["falcon_alibi", "bloom", "gemma2_softcap", "gpt_oss_sinks"])
def test_check_model_refuses_naming_the_feature(name):
    cfg, want = _cfgs()[name]
    vcfg = SimpleNamespace(model_config=SimpleNamespace(model=f"/m/{name}", hf_config=cfg, hf_text_config=cfg))
    with pytest.raises(VTokenConfigError) as ei:
        refusals.check_model(vcfg)
    row = next(r for r in REFUSALS if r.key == want[0][0])
    assert str(ei.value) == (f"--model = '/m/{name}': vToken does not support it yet ({row.option}; {want[0][1]}: "
                             f"{row.reason})")


@pytest.mark.parametrize("impl, key, detail", [
    (dict(alibi_slopes=[0.5, 0.25], logits_soft_cap=None, sinks=None), "alibi", "layer l1: alibi_slopes"),
    (dict(alibi_slopes=None, logits_soft_cap=30.0, sinks=None), "softcap", "layer l1: logits_soft_cap=30.0"),
    (dict(alibi_slopes=None, logits_soft_cap=0, sinks=[0.1, 0.2]), "sinks", "layer l1: sinks"),
    (dict(alibi_slopes=None, logits_soft_cap=None, sinks=None), None, None),
])
def test_check_attention_layers(impl, key, detail):
    plain = SimpleNamespace(impl=SimpleNamespace(alibi_slopes=None, logits_soft_cap=None, sinks=None))
    layers = {"l0": plain, "l1": SimpleNamespace(impl=SimpleNamespace(**impl)), "other": SimpleNamespace()}
    if key is None:
        refusals.check_attention_layers("m", layers)
        return
    with pytest.raises(VTokenConfigError) as ei:
        refusals.check_attention_layers("m", layers)
    row = next(r for r in REFUSALS if r.key == key)
    assert str(ei.value) == f"--model = 'm': vToken does not support it yet ({row.option}; {detail}: {row.reason})"


# ---------------------------------------------------------------------- KV-cache dtype
def _kv_layout_dtypes() -> set[str]:
    spec = importlib.util.spec_from_file_location("_kv_layout_test", ROOT / "tests/integration/test_kv_layout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {str(d).removeprefix("torch.") for d, isa in mod._cases() if isa == "vec"}


def test_kv_dtype_allowlist_is_what_the_layout_test_covers():
    pytest.importorskip("vllm._custom_ops")
    assert set(refusals.MODEL_DTYPES) == _kv_layout_dtypes()
    assert set(refusals.KV_CACHE_DTYPES) == {"auto"} | (set(refusals.MODEL_DTYPES) - {"float32"})


@pytest.mark.parametrize("cache_dtype, model_dtype, refused", [
    ("auto", "torch.float32", None), ("auto", "torch.bfloat16", None), ("auto", "torch.float16", None),
    ("bfloat16", "torch.bfloat16", None), ("float16", "torch.float16", None),
    ("auto", "torch.float64", "--kv-cache-dtype = 'auto': vToken does not support it yet ({reason}; "
                              "resolves to the model dtype float64)"),
    ("fp8_e5m2", "torch.bfloat16", "--kv-cache-dtype = 'fp8_e5m2': vToken does not support it yet ({reason})"),
    ("turboquant_k8v4", "torch.bfloat16", "--kv-cache-dtype = 'turboquant_k8v4': vToken does not support it yet ({reason})"),
])
def test_kv_cache_dtype_allowlist(cache_dtype, model_dtype, refused):
    vcfg = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache_dtype),
                           model_config=SimpleNamespace(dtype=model_dtype))
    if refused is None:
        refusals.check_kv_cache_dtype(vcfg)
        return
    with pytest.raises(VTokenConfigError) as ei:
        refusals.check_kv_cache_dtype(vcfg)
    reason = next(r for r in REFUSALS if r.key == "kv_cache_dtype").reason
    assert str(ei.value) == refused.format(reason=reason)
    assert "allowed: auto, bfloat16, float16 (auto: a model dtype of float32, bfloat16, float16)" in str(ei.value)
