"""Bad configuration stops start-up with a message naming the field and what is allowed.

Most cases call ``EngineArgs(...).create_engine_config()`` with the plugin registered, all
in one subprocess (``_config_probe.py``; no engine starts). Each must raise vToken's
``VTokenConfigError`` (a ``ValueError``) whose message names the field and what is allowed,
raised from vToken's code (never from deep inside vLLM). One case goes through the real
CLI (``vllm.entrypoints.openai.api_server``): non-zero exit, and the final error line of
stderr names the field.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.engine

GOOD = {"policy": "h2o", "budget": 64}

# id -> (engine kwargs beyond the base, vtoken dict (None: keep GOOD), substrings the message must hold)
CASES: dict[str, tuple[dict, object, list[str]]] = {
    # wrong types
    "budget_str": ({}, {"budget": "abc"}, ["vtoken.budget", "'abc'", "valid integer"]),
    "budget_float": ({}, {"budget": 1.5}, ["vtoken.budget", "1.5", "valid integer"]),
    "budget_bool": ({}, {"budget": True}, ["vtoken.budget", "True", "not a boolean"]),
    "budget_numeric_str": ({}, {"budget": "64"}, ["vtoken.budget = '64'", "valid integer",
                                                 "allowed: a JSON integer (not a string, a float or a boolean)"]),
    "budget_integral_float": ({}, {"budget": 64.0}, ["vtoken.budget = 64.0", "valid integer"]),
    "budget_null": ({}, {"budget": None}, ["vtoken.budget", "None", "valid integer"]),
    "policy_int": ({}, {"policy": 5}, ["vtoken.policy", "5", "valid string"]),
    "policy_args_str": ({}, {"policy_args": "window=3"}, ["vtoken.policy_args", "valid dictionary"]),
    "log_stats_removed": ({}, {"log_stats": True}, ["vtoken.log_stats", "removed option", "allowed: ['budget'"]),
    "vtoken_list": ({}, [1, 2], ["additional_config.vtoken", "expected an object"]),
    "vtoken_bad_json": ({}, "{budget: 3", ["additional_config.vtoken", "not valid JSON"]),
    # negative or zero budgets and friends
    "budget_neg": ({}, {"budget": -1}, ["vtoken.budget", "-1", "greater than or equal to 1"]),
    "budget_zero": ({}, {"budget": 0}, ["vtoken.budget", "0", "greater than or equal to 1"]),
    "budget_ratio_zero": ({}, {"budget_ratio": 0}, ["vtoken.budget_ratio", "greater than 0"]),
    "budget_ratio_big": ({}, {"budget_ratio": 1.5}, ["vtoken.budget_ratio", "less than or equal to 1"]),
    "slack_neg": ({}, {"slack": -1}, ["vtoken.slack", "greater than or equal to 0"]),
    "sinks_neg": ({}, {"sink_tokens": -4}, ["vtoken.sink_tokens", "greater than or equal to 0"]),
    "score_every_zero": ({}, {"score_every": 0}, ["vtoken.score_every", "greater than or equal to 1"]),
    # sinks + recent window larger than the budget
    "sinks_recent_over_budget": ({}, {"budget": 10, "sink_tokens": 4, "recent_tokens": 8},
                                 ["vtoken.sink_tokens", "vtoken.recent_tokens", "vtoken.budget = 10",
                                  "sink_tokens + recent_tokens <= budget"]),
    "sinks_over_budget": ({}, {"budget": 64, "sink_tokens": 65}, ["vtoken.sink_tokens", "exceeds vtoken.budget = 64"]),
    # unknown policies, keys, bad policy_args, bad mode
    "policy_unknown": ({}, {"policy": "lru"}, ["vtoken.policy", "'lru'", "unknown policy", "h2o", "tova"]),
    "key_unknown": ({}, {"budgt": 64}, ["vtoken.budgt = 64", "unknown key", "allowed: ['budget', 'budget_ratio'"]),
    "policy_args_unknown": ({}, {"policy": "h2o", "policy_args": {"window": 4}},
                            ["vtoken.policy_args.window", "unknown argument", "'h2o'", "allowed"]),
    "policy_args_bad_value": ({}, {"policy": "scissorhands", "policy_args": {"window": -1}},
                              ["vtoken.policy_args.window", "-1", "allowed: an integer >= 1"]),
    "policy_args_bad_type": ({}, {"policy": "scissorhands", "policy_args": {"window": "x"}},
                             ["vtoken.policy_args.window", "'x'", "allowed: an integer >= 1"]),
    "mode_bad": ({}, {"mode": "fast"}, ["vtoken.mode", "'fast'", "'vtoken' or 'naive'"]),
    # block sizes the CPU backend rejects (stock vLLM fails later, inside the worker)
    "block_size_16": ({"block_size": 16}, None, ["--block-size = 16", "multiple of 32"]),
    "block_size_48": ({"block_size": 48}, None, ["--block-size = 48", "multiple of 32"]),
    # refused features
    "speculative": ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}},
                    None, ["--speculative-config", "does not support"]),
    "pipeline_parallel_2": ({"pipeline_parallel_size": 2}, None, ["--pipeline-parallel-size = 2", "does not support"]),
    "kv_cache_fp8": ({"kv_cache_dtype": "fp8"}, None, ["--kv-cache-dtype = 'fp8'", "does not support",
                                                        "fp32/bf16/fp16"]),
    # decide_on left the options: the removed scheduler path is refused by name, never silently switched
    "decide_on_scheduler": ({}, {"decide_on": "scheduler"}, ["vtoken.decide_on = 'scheduler'",
                                                             "the scheduler-side eviction path was removed",
                                                             "allowed: leave decide_on out"]),
    "decide_on_bad": ({}, {"decide_on": "gpu"}, ["vtoken.decide_on = 'gpu'", "the option was removed",
                                                 "allowed: leave decide_on out"]),
}
OK_CASES = {"good": ({}, None), "block_size_64": ({"block_size": 64}, None),
            "worker": ({}, {"policy": "h2o", "budget": 64}),
            # the old name of the one path still starts (with one deprecation line)
            "decide_on_worker_deprecated": ({}, {"decide_on": "worker", "policy": "h2o", "budget": 64}),
            # Naive-Evict with worker decisions (refused until the worker returned its dead-block counts)
            "worker_naive": ({}, {"mode": "naive", "policy": "h2o", "budget": 64}),
            # prefix caching with worker decisions (refused until a hit became read-only for its sharer)
            "worker_prefix_caching": ({"enable_prefix_caching": True}, {"policy": "h2o",
                                                                        "budget": 64})}


def _engine(model: str, extra: dict, vt) -> dict:
    e = dict(model=model, dtype="float32", block_size=32, gpu_memory_utilization=0.1, num_gpu_blocks_override=64,
             max_model_len=256, enforce_eager=True, enable_prefix_caching=False,
             additional_config={"vtoken": GOOD if vt is None else vt})
    e.update(extra)
    return e


@pytest.fixture(scope="module")
def probe(tiny_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("cfg")
    cases = [dict(id=k, engine=_engine(tiny_path, ex, vt)) for k, (ex, vt, _) in CASES.items()]
    cases += [dict(id=k, engine=_engine(tiny_path, ex, vt)) for k, (ex, vt) in OK_CASES.items()]
    (d / "cases.json").write_text(json.dumps(cases))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    p = subprocess.run([sys.executable, str(HERE / "_config_probe.py"), str(d / "cases.json"), str(d / "out.json")],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return json.loads((d / "out.json").read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_bad_config_refused_naming_field(probe, case):
    want = CASES[case][2]
    r = probe[case]
    assert not r["ok"], f"{case}: accepted"
    assert r["type"] == "VTokenConfigError" and r["module"] == "vtoken.config", r
    # raised by vToken (config validation or the plugin), not from inside vLLM
    assert "/vtoken/" in r["raised_in"] and "site-packages/vllm/" not in r["raised_in"], r
    for s in want:
        assert s in r["msg"], f"{case}: {s!r} not in {r['msg']!r}"
    assert "Traceback" not in r["msg"] and "\n" not in r["msg"]


@pytest.mark.parametrize("case", list(OK_CASES))
def test_good_config_accepted(probe, case):
    assert probe[case] == {"ok": True}


def test_cli_bad_budget_exits_naming_field(tiny_path, tmp_path):
    """The real OpenAI server CLI: exit code non-zero, the last error line names vtoken.budget."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_path,
            "--host", "127.0.0.1", "--port", "1", "--dtype", "float32", "--block-size", "32",
            "--gpu-memory-utilization", "0.1", "--num-gpu-blocks-override", "64", "--max-model-len", "256",
            "--enforce-eager", "--additional-config", json.dumps({"vtoken": {"budget": -1}})]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL,
                       start_new_session=True)
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    last = lines[-1]
    assert last.startswith("vtoken.config.VTokenConfigError: "), p.stderr[-3000:]
    assert "vtoken.budget = -1" in last and "greater than or equal to 1" in last, last
    # the frame that raised is vToken's, not a deep vLLM frame
    frames = [ln for ln in lines if ln.lstrip().startswith("File ")]
    assert frames and "/vtoken/" in frames[-1] and "site-packages/vllm/" not in frames[-1], frames[-3:]
    # nothing started listening: the server never came up
    assert "Starting vLLM API server" not in p.stdout + p.stderr
