"""Preemption of an evicting request (issue 15, item 8): it resumes by re-prefilling only its live
tokens, at their logical positions, into dense slots (``docs/integration.md``, "Preemption").

One engine per run (V1 sync; MRV2 async, with the re-prefill whole and chunked): a pool of 9 usable blocks (block size 32). ``off`` (eviction off,
150-token prompt, 100 new tokens) grows from 5 to 8 blocks; ``v`` (h2o, budget 40, slack 0,
100-token prompt, admitted one step later) is cut to 2 blocks at its first decode step, then
preempted when ``off`` needs its 8th block (FCFS: the last admitted request goes), with about
175 logical tokens: a full re-prefill would need 6 blocks, which the pool only has once ``off``
is done. Resuming with the live tokens only needs ceil((budget + slack + 1)/B) = 2 blocks.
The engine records the decode step each preemption replaced (``preempt_log``); the dense oracle
replays it (``oracle_generate(preempt_at=...)``) and the tokens must be equal.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from vtoken.assets.paths import ensure_tiny_model
from vtoken.config import parse_config, parse_request_overrides
from vtoken.integrations.vllm.harness import run_in_subprocess

from execution_paths import EXPECTED, SCORE_LAG, path_env

pytestmark = pytest.mark.engine

B = 32
VT = {"policy": "h2o", "budget": 40, "slack": 0}
NEW_V = 120


def _prompt(i: int, n: int) -> list[int]:
    return [((i + 3) * 37 + j * (11 + i % 5)) % 250 + 1 for j in range(n)]


def _requests() -> list[dict]:
    return [dict(id="off", prompt_token_ids=_prompt(5, 150), max_tokens=100, extra_args={"vtoken_enable": False}),
            dict(id="v", prompt_token_ids=_prompt(6, 100), max_tokens=NEW_V, arrive_at_step=1)]


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(ensure_tiny_model())


#: (execution path, max_num_batched_tokens): with 32 the re-prefill of the 41 live tokens (and
#: the prompts) is chunked, under async scheduling
RUNS = [("v1-sync", None), ("mrv2-async", None), ("mrv2-async", 32)]


@pytest.fixture(scope="module", params=RUNS, ids=[f"{p}-{c or 'whole'}" for p, c in RUNS])
def run(request, tiny):
    path, chunk = request.param
    eng = dict(model=tiny, dtype="float32", max_model_len=288, block_size=B, enforce_eager=True,
               gpu_memory_utilization=0.1, num_gpu_blocks_override=10, skip_tokenizer_init=True)
    if chunk:
        eng["max_num_batched_tokens"] = chunk
    hooks = f"{Path(__file__).resolve().parent / '_preempt_hooks.py'}:PreemptProbe"
    out = run_in_subprocess(dict(engine=eng, vtoken=VT, requests=_requests(), hooks=hooks), env=path_env(path))
    return path, chunk, out


def _finished(out: dict, ext_id: str) -> dict:
    return next(f for f in out["vtoken"]["finished"] if f["req_id"].startswith(ext_id))


def test_all_finish_and_the_pool_returns(run):
    path, _, out = run
    assert out["paths"] == EXPECTED[path]
    assert out["finish"] == {"off": "length", "v": "length"}
    assert len(out["tokens"]["off"]) == 100 and len(out["tokens"]["v"]) == NEW_V
    assert out["free_blocks_end"] == out["free_blocks_start"] == 9
    assert out["vtoken"]["stats"]["preemption_resets"] >= 1


def test_resume_holds_live_blocks_only(run):
    """Measured in vLLM's KV manager right after the step that resumed ``v``: it holds at most
    ceil((budget + slack + 1)/B) blocks, far below the ceil(logical/B) a full re-prefill takes."""
    _, chunk, out = run
    assert out["preempted_steps"].get("v"), "v was not preempted: the scenario no longer forces a preemption"
    assert "off" not in out["preempted_steps"]
    resumes = [r for r in out["resumes"] if r["req"] == "v"]
    assert len(resumes) == len(out["preempted_steps"]["v"])
    bound = math.ceil((VT["budget"] + VT["slack"] + 1) / B)
    for r in resumes:
        assert r["blocks"] <= bound, r
        assert math.ceil(r["num_tokens"] / B) >= bound + 3, r  # a full re-prefill would need far more
    # the scheduler's own record (blocks when the re-prefill's last chunk was scheduled)
    log = _finished(out, "v")["preempt_log"]
    assert len(log) == len(resumes) and all(b == bound for _, b in log), log
    if chunk:  # the first chunk re-prefilled 32 of the 41 live tokens: one block so far
        assert resumes[0]["blocks"] == 1, resumes


def test_tokens_equal_oracle_replaying_the_preemption(run, tiny):
    path, _, out = run
    import torch

    from vtoken.oracle import load_oracle_model, oracle_generate

    torch.set_num_threads(2)
    model = load_oracle_model(tiny)
    f = _finished(out, "v")
    r = _requests()[1]
    cfg = parse_config(VT)
    ref = oracle_generate(model, r["prompt_token_ids"], NEW_V, cfg, score_lag=SCORE_LAG[path],
                          preempt_at=[d for d, _ in f["preempt_log"]])
    assert out["tokens"]["v"] == list(ref.token_ids)
    assert ref.num_evicted == f["evicted"]
    # the replay matters: without it the oracle's tokens differ (the re-prefilled KV is new)
    plain = oracle_generate(model, r["prompt_token_ids"], NEW_V, cfg, score_lag=SCORE_LAG[path])
    assert list(plain.token_ids) != list(ref.token_ids)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
