"""Never silently wrong (issue 15): refusals by name, request errors naming the field, warnings.

Part 1, no engine (one subprocess, ``_startup_probe.py``): ``EngineArgs.create_engine_config``
with the plugin, then checks in the same (front-end) process:

* item 1: ``SamplingParams`` whose ``vtoken_budget`` contradicts the engine config
  (``sink_tokens = 4``) is a ``ValueError`` naming ``vllm_xargs.vtoken_budget``;
* item 2: ``vtoken_budget = True`` is refused with the start-up message shape;
* item 4: tiny model directories (config and tokenizer only, no weights) with ALiBi (Falcon,
  BLOOM), attention soft-capping (Gemma 2) and learned sinks (gpt-oss) are refused naming the
  feature; the tiny Llama is accepted;
* item 5: KV-cache dtypes outside the allowlist (``fp8_e5m2``, ``turboquant_k8v4``) are refused
  naming ``--kv-cache-dtype`` and the allowed values; ``bfloat16`` and fp16 models are accepted;
* item 6: a streaming-input (resumable) request is refused by name;
* item 10: vToken changes no vLLM setting (prefix caching stays as the user set it, issue 12):
  compared with stock on the same arguments, no ``EngineArgs`` field or environment variable
  differs and start-up logs no vToken warning, with prefix caching on or off.

Part 2, one OpenAI server (``tests/e2e/e2e_server.run_server``) started with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` inherited (the API server still runs its EngineCore in
its own process) and engine config ``{"policy": "h2o", "budget": 64, "sink_tokens": 4}``:

* item 1: ``vllm_xargs: {"vtoken_budget": 1}`` is HTTP 400 naming the field (completions and
  chat), a consistent override is served;
* item 2: ``vllm_xargs: {"vtoken_budget": true}`` is HTTP 400 with the start-up message shape,
  ``"vtoken_enable": false`` (a JSON boolean too) is served;
* item 9: ``/metrics`` shows the EngineCore's ``vtoken:`` metrics, and they moved;
* item 10: the server log holds no vToken warning.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_server import MODEL_NAME, run_server

from vtoken.config import VTokenConfigError, parse_config
from vtoken.integrations.vllm.frontend.refusals import REFUSALS

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.engine

ENGINE_VT = {"policy": "h2o", "budget": 64, "sink_tokens": 4}


def _start_up_msg(vt: dict) -> str:
    """The start-up error for engine config ``vt`` (the reference the request path must match)."""
    with pytest.raises(VTokenConfigError) as ei:
        parse_config(vt)
    return str(ei.value)


def _contradicts(b: int) -> str:
    # the request names its field, then the engine rule its effective config breaks, verbatim
    return (f"vllm_xargs.vtoken_budget = {b}: contradicts the engine's vtoken config: "
            + _start_up_msg(dict(ENGINE_VT, budget=b)))


# the start-up message for budget: true, with the request's field name
BOOL_BUDGET = _start_up_msg({"budget": True}).replace("vtoken.budget = ", "vllm_xargs.vtoken_budget = ", 1)
assert BOOL_BUDGET.startswith("vllm_xargs.vtoken_budget = True: ") and "not a boolean" in BOOL_BUDGET
STREAMING = next(r for r in REFUSALS if r.key == "streaming_input")
STREAMING_MSG = (f"vToken does not support {STREAMING.option} yet: {STREAMING.reason}; send each turn as its own "
                 "request, or set vllm_xargs.vtoken_enable = false for this request")


def _row(key):
    return next(r for r in REFUSALS if r.key == key)


# ---------------------------------------------------------------------- part 1: start-up probe
def _model_dirs(tiny: str, root: Path) -> dict[str, str]:
    """Config + tokenizer directories (no weights: the refusal comes before any weight loads)."""
    from transformers import BloomConfig, FalconConfig, Gemma2Config, GptOssConfig

    small = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=2)
    full = dict(sliding_window=None, layer_types=["full_attention"] * 2)
    cfgs = {
        "falcon_alibi": FalconConfig(**small, alibi=True, architectures=["FalconForCausalLM"]),
        "bloom": BloomConfig(vocab_size=512, hidden_size=128, n_layer=2, n_head=2, architectures=["BloomForCausalLM"]),
        "gemma2_softcap": Gemma2Config(**small, intermediate_size=256, num_key_value_heads=1, head_dim=64, **full,
                                       attn_logit_softcapping=50.0, architectures=["Gemma2ForCausalLM"]),
        "gpt_oss_sinks": GptOssConfig(**small, intermediate_size=256, num_key_value_heads=1, head_dim=64,
                                      num_local_experts=4, **full, architectures=["GptOssForCausalLM"]),
    }
    out = {}
    for name, cfg in cfgs.items():
        d = root / name
        d.mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            if (Path(tiny) / f).exists():
                shutil.copy(Path(tiny) / f, d / f)
        (d / "config.json").write_text(cfg.to_json_string())
        out[name] = str(d)
    return out


def _engine(model: str, vt=ENGINE_VT, **extra) -> dict:
    e = dict(model=model, dtype="float32", block_size=32, gpu_memory_utilization=0.1, num_gpu_blocks_override=64,
             max_model_len=256, enforce_eager=True)
    if vt is not None:
        e["additional_config"] = {"vtoken": vt}
    e.update(extra)
    return e


SP_CHECKS = [
    ({"vtoken_budget": 1}, _contradicts(1)),
    ({"vtoken_budget": 3}, _contradicts(3)),
    ({"vtoken_budget": 4}, None),
    ({"vtoken_budget": 1, "vtoken_enable": False}, None),  # eviction off: nothing to contradict
    ({"vtoken_budget": True}, BOOL_BUDGET),
    ({"vtoken_policy": "tova", "vtoken_budget": 40}, None),
]
STREAM_CHECKS = [({}, STREAMING_MSG), ({"vtoken_enable": False}, None)]
# issue 28: values that slipped through (engine max_model_len 256)
SP_CHECKS += [
    ({"vtoken_budget": "64"}, "vllm_xargs.vtoken_budget = '64': Input should be a valid integer; allowed: a JSON "
                              "integer (not a string, a float or a boolean)"),
    ({"vtoken_budget": 64.0}, "vllm_xargs.vtoken_budget = 64.0: Input should be a valid integer; allowed: a JSON "
                              "integer (not a string, a float or a boolean)"),
    ({"vtoken_budget": 256}, None),
    ({"vtoken_budget": 257}, "vllm_xargs.vtoken_budget = 257: above max_model_len, so it would never evict; "
                             "allowed: 1..256 (set vllm_xargs.vtoken_enable = false to turn eviction off for this "
                             "request)"),
]
BEAM = next(r for r in REFUSALS if r.key == "beam_search")
OFFLINE_BEAM_MSG = (f"LLM.beam_search: vToken does not support beam search yet: {BEAM.reason}; build this LLM "
                    "without the vtoken key of additional_config to run beam search")


@pytest.fixture(scope="module")
def probe(tiny_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("startup")
    models = _model_dirs(tiny_path, d)
    then = [{"sampling_params": x} for x, _ in SP_CHECKS] + [{"streaming_input": x} for x, _ in STREAM_CHECKS]
    then += [{"streaming_add_request": {}}, {"offline_beam_search": True}]
    cases = [
        dict(id="base", engine=_engine(tiny_path), then=then, compare_stock=True),
        dict(id="prefix_off", engine=_engine(tiny_path, enable_prefix_caching=False), compare_stock=True),
        dict(id="inert", engine=_engine(tiny_path, vt=None),
             then=[{"sampling_params": {"vtoken_budget": 1}}, {"streaming_input": {}}, {"offline_beam_search": True}]),
        dict(id="kv_fp8_e5m2", engine=_engine(tiny_path, kv_cache_dtype="fp8_e5m2")),
        dict(id="kv_turboquant", engine=_engine(tiny_path, kv_cache_dtype="turboquant_k8v4")),
        dict(id="kv_bf16", engine=_engine(tiny_path, dtype="bfloat16", kv_cache_dtype="bfloat16")),
        dict(id="model_fp16", engine=_engine(tiny_path, dtype="float16")),
    ] + [dict(id=name, engine=_engine(path)) for name, path in models.items()]
    (d / "cases.json").write_text(json.dumps(cases))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    p = subprocess.run([sys.executable, str(HERE / "_startup_probe.py"), str(d / "cases.json"), str(d / "out.json")],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    out = json.loads((d / "out.json").read_text())
    out["_models"] = models
    return out


def test_sampling_params_checked_against_engine_config(probe):
    r = probe["base"]
    assert r["ok"], r
    got = r["then"][:len(SP_CHECKS)]
    for (xargs, msg), g in zip(SP_CHECKS, got):
        if msg is None:
            assert g == {"ok": True}, (xargs, g)
        else:
            assert (g["ok"], g["type"], g["msg"]) == (False, "ValueError", msg), (xargs, g)


def test_streaming_input_refused_by_name(probe):
    got = probe["base"]["then"][len(SP_CHECKS):]
    assert got[0]["ok"] is False and got[0]["type"] == "VLLMValidationError", got[0]
    assert got[0]["msg"] == STREAMING_MSG
    assert got[1] == {"ok": True}  # vtoken_enable false: vToken keeps out of it
    # through vLLM's streaming-input API (AsyncLLM.add_request with an async generator)
    assert (got[2]["ok"], got[2].get("type"), got[2].get("msg")) == (False, "VLLMValidationError", STREAMING_MSG)


def test_offline_beam_search_refused_by_name(probe):
    got = probe["base"]["then"][-1]
    assert (got["ok"], got.get("type"), got.get("msg")) == (False, "ValueError", OFFLINE_BEAM_MSG), got
    # without vToken the stock method runs (and fails on the probe's bare object, past any refusal)
    got = probe["inert"]["then"][-1]
    assert got["ok"] is False and got["type"] == "AttributeError", got


def test_inert_engine_checks_nothing(probe):
    r = probe["inert"]
    assert r["ok"] and r["warnings"] == [] and r["then"][:2] == [{"ok": True}, {"ok": True}], r


def test_start_up_changes_no_setting(probe):
    """vToken changes no vLLM setting (issue 12: prefix caching follows the user's choice):
    compared with stock vLLM on the same arguments, no EngineArgs field (enable_prefix_caching
    included) and no environment variable differs, and start-up logs no vToken warning."""
    for case in ("base", "prefix_off"):
        r = probe[case]
        assert r["ok"] and r["warnings"] == [], r
        assert r["changed_fields"] == [] and r["changed_env"] == [], (case, r["changed_fields"], r["changed_env"])
        assert r["prefix_caching"] == r["stock_prefix_caching"], (case, r)
    # resolved as stock resolves it: on by default, off when the user turns it off
    assert (probe["base"]["prefix_caching"], probe["prefix_off"]["prefix_caching"]) == (True, False)
    # no prefix-caching refusal is left (it used to be refused, and before that turned off; its
    # combination with decide_on: worker was refused until a hit became read-only for its sharer)
    assert all("prefix" not in r.option for r in REFUSALS)


@pytest.mark.parametrize("case, value", [("kv_fp8_e5m2", "fp8_e5m2"), ("kv_turboquant", "turboquant_k8v4")])
def test_kv_cache_dtype_outside_allowlist_refused(probe, case, value):
    r = probe[case]
    assert not r["ok"] and r["type"] == "VTokenConfigError", r
    assert r["msg"] == f"--kv-cache-dtype = {value!r}: vToken does not support it yet ({_row('kv_cache_dtype').reason})"
    assert "allowed: auto, bfloat16, float16" in r["msg"]


@pytest.mark.parametrize("case", ["kv_bf16", "model_fp16"])
def test_tested_kv_dtypes_accepted(probe, case):
    assert probe[case]["ok"], probe[case]


@pytest.mark.parametrize("case, key, evidence", [
    ("falcon_alibi", "alibi", "alibi=True"),
    ("bloom", "alibi", "model_type='bloom' (always ALiBi)"),
    ("gemma2_softcap", "softcap", "attn_logit_softcapping=50.0"),
    ("gpt_oss_sinks", "sinks", "model_type='gpt_oss' (learned per-head sinks)"),
])
def test_model_feature_refused_by_name(probe, case, key, evidence):
    r = probe[case]
    assert not r["ok"] and r["type"] == "VTokenConfigError", r
    row = _row(key)
    assert r["msg"] == (f"--model = {probe['_models'][case]!r}: vToken does not support it yet ({row.option}; "
                        f"{evidence}: {row.reason})")


# ---------------------------------------------------------------------- part 2: the OpenAI server
@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory, probe):  # after the probe: one vLLM process at a time
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        with run_server(tiny_path, tmp_path_factory.mktemp("never_silent") / "server.log", {"vtoken": ENGINE_VT}) as s:
            yield s
    finally:
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


def _post(server, kind: str, xargs, max_tokens: int = 4, prompt: str = "hello"):
    body = dict(model=MODEL_NAME, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, vllm_xargs=xargs)
    if kind == "completion":
        return server.post("/v1/completions", dict(body, prompt=prompt), timeout=120)
    return server.post("/v1/chat/completions", dict(body, messages=[{"role": "user", "content": prompt}]),
                       timeout=120)


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("xargs, msg", [
    ({"vtoken_budget": 1}, _contradicts(1)),
    ({"vtoken_budget": 3, "vtoken_enable": True}, _contradicts(3)),
    ({"vtoken_budget": True}, BOOL_BUDGET),
])
def test_server_bad_override_is_400_naming_the_field(server, kind, xargs, msg):
    r = _post(server, kind, xargs)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == msg, r.text
    assert server.proc.poll() is None


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("xargs", [{"vtoken_budget": 4}, {"vtoken_enable": False, "vtoken_budget": 1},
                                   {"vtoken_policy": "tova", "vtoken_budget": 40}])
def test_server_consistent_override_served(server, kind, xargs):
    r = _post(server, kind, xargs)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_server_metrics_with_multiprocessing_variable_off(server):
    """VLLM_ENABLE_V1_MULTIPROCESSING=0 inherited: the EngineCore still runs in its own process,
    and its vtoken: metrics reach /metrics."""
    before = server.metrics()
    assert "vtoken:evicted_tokens_total" in before, sorted(k for k in before if k.startswith("vtoken"))
    # a 200-token prompt (byte-level tokenizer) over budget 64: evicts at its first decode step
    r = _post(server, "completion", None, max_tokens=8, prompt="a quick brown fox jumps over the lazy dog " * 5)
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 64 + 8
    after = server.metrics()
    # The prefill samples token 1; 7 decode steps each write one token (the 8th sampled token is
    # never written): P + 7 tokens enter the cache. Slack 0: before each decode step the live set
    # is cut to the budget (64) and the step adds its token, so 65 are live at the end.
    evicted = after["vtoken:evicted_tokens_total"] - before["vtoken:evicted_tokens_total"]
    assert evicted == prompt_tokens + 7 - 65, (evicted, prompt_tokens)


def test_server_log_has_no_vtoken_warnings(server):
    lines = [ln for ln in server.log().splitlines() if " WARNING " in ln and "vToken" in ln]
    msgs = [re.sub(r"^.*? WARNING .*?\] ", "", ln) for ln in lines]
    assert msgs == [], lines
