"""Preemption of an evicting request: it resumes with the K/V and policy state it had, and
recomputes nothing (``docs/integration.md``, "Preemption").

One engine per run (V1 sync with whole prompts; MRV2 async with prefill chunks of 32): a pool of
10 usable blocks (block size 32), budget 40 with slack 0. ``off`` (eviction off, 150-token prompt,
100 new tokens) grows from 5 to 8 blocks; ``v`` (h2o, 100-token prompt, 60 new tokens) and ``w``
(tova, 70-token prompt, 120 new tokens) are admitted after it and cut to 2 blocks each. When
``off`` needs its 7th block the pool is empty and vLLM preempts the last admitted request, ``w``
(FCFS), with about 110 logical tokens. The worker saves ``w``'s live K/V and side-cache state
(``StepPayload.suspend``); at the resume vLLM schedules only the one token without KV (the last
sampled), into ceil((budget + slack + 1)/B) = 2 blocks, which ``v`` frees when it finishes while
``off`` still runs (a full re-prefill, 4 blocks, would wait for ``off`` to end). Its tokens equal
the dense oracle's without any preemption: the same request gives the same tokens.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from vtoken.assets.paths import ensure_tiny_model
from vtoken.config import parse_config, parse_request_overrides
from drivers.harness import run_in_subprocess

from execution_paths import EXPECTED, path_env

pytestmark = pytest.mark.engine

B = 32
VT = {"policy": "h2o", "budget": 40, "slack": 0}
NUM_BLOCKS = 11  # 10 usable (one is vLLM's null block)
#: (execution path, max_num_batched_tokens): MRV2 async with the prompts chunked
RUNS = [("v1-sync", None), ("mrv2-async", 32)]


def _prompt(i: int, n: int) -> list[int]:
    return [((i + 3) * 37 + j * (11 + i % 5)) % 250 + 1 for j in range(n)]


def _requests() -> list[dict]:
    return [dict(id="off", prompt_token_ids=_prompt(5, 150), max_tokens=100, extra_args={"vtoken_enable": False}),
            dict(id="v", prompt_token_ids=_prompt(6, 100), max_tokens=60, arrive_at_step=1),
            dict(id="w", prompt_token_ids=_prompt(7, 70), max_tokens=120, arrive_at_step=2,
                 extra_args={"vtoken_policy": "tova"})]


EVICTING = [r for r in _requests() if r["id"] != "off"]


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(ensure_tiny_model())


@pytest.fixture(scope="module", params=RUNS, ids=[f"{p}-{c or 'whole'}" for p, c in RUNS])
def run(request, tiny):
    path, chunk = request.param
    eng = dict(model=tiny, dtype="float32", max_model_len=320, block_size=B, enforce_eager=True,
               gpu_memory_utilization=0.1, num_gpu_blocks_override=NUM_BLOCKS, skip_tokenizer_init=True)
    if chunk:
        eng["max_num_batched_tokens"] = chunk
    hooks = f"{Path(__file__).resolve().parent / '_preempt_hooks.py'}:PreemptProbe"
    out = run_in_subprocess(dict(engine=eng, vtoken=VT, requests=_requests(), hooks=hooks), env=path_env(path))
    return path, chunk, out


def _finished(out: dict, ext_id: str) -> dict:
    return next(f for f in out["vtoken"]["finished"] if f["req_id"].startswith(ext_id + "-"))


def test_all_finish_and_the_pool_returns(run):
    """No request waits forever; the pool returns to its start (VTOKEN_CHECK=1 held every step)."""
    path, _, out = run
    assert out["paths"] == EXPECTED[path]
    assert out["finish"] == {r["id"]: "length" for r in _requests()}
    for r in _requests():
        assert len(out["tokens"][r["id"]]) == r["max_tokens"], r["id"]
    assert out["free_blocks_end"] == out["free_blocks_start"] == NUM_BLOCKS - 1
    assert out["vtoken"]["stats"]["preemption_resets"] == sum(map(len, out["preempted_steps"].values()))


def test_resume_holds_live_blocks_only_and_recomputes_nothing(run):
    """Measured in vLLM's KV manager right after the step that resumed ``w``: at most
    ceil((budget + slack + 1)/B) blocks, below the ceil(logical/B) a full re-prefill takes, so it
    resumes while ``off`` still runs; vLLM scheduled one token for it in that step (the last
    sampled one, which has no KV yet): no live token is recomputed."""
    _, chunk, out = run
    assert set(out["preempted_steps"]) == {"w"}, out["preempted_steps"]
    resumes = [r for r in out["resumes"] if r["req"] == "w"]
    assert len(resumes) == len(out["preempted_steps"]["w"]) >= 1
    bound = math.ceil((VT["budget"] + VT["slack"] + 1) / B)
    for r in resumes:
        assert r["blocks"] <= bound, r
        assert math.ceil(r["num_tokens"] / B) >= bound + 2, r  # a full re-prefill needs 4 or more
        assert r["scheduled"] == 1, r
    assert resumes[0]["step"] < out["finished_at"]["off"], (resumes, out["finished_at"])


def test_tokens_equal_the_oracle_without_the_preemption(run, tiny):
    """The same request, the same tokens: a preempted request's tokens equal the dense oracle's
    for the request alone, never preempted (the worker restored its K/V and policy state)."""
    _, _, out = run
    import torch

    from reference.oracle import load_oracle_model, oracle_generate

    torch.set_num_threads(2)
    model = load_oracle_model(tiny)
    base = parse_config(VT)
    for r in EVICTING:
        f = _finished(out, r["id"])
        cfg = parse_request_overrides(r.get("extra_args")).apply(base)
        # (prefill eviction between chunks: the oracle replays the chunking the engine logged)
        ref = oracle_generate(model, r["prompt_token_ids"], r["max_tokens"], cfg)
        assert out["tokens"][r["id"]] == list(ref.token_ids), r["id"]
        before_chunks = sum(len(e) for e in ref.prefill_evicted_positions or ())
        assert ref.num_evicted + before_chunks == f["evicted"], r["id"]


# --------------------------------------------------------------------------------------
# With prefix caching on: ``u`` (streaming, 4 sinks, budget 120, slack 0, 70-token prompt) is
# preempted before its first eviction (``off``, eviction off, needs its 7th block at 193 tokens);
# its full blocks are cached. It resumes with its saved K/V (no prefix-cache lookup: nothing is
# recomputed), evicts inside its first blocks later, copying the hashed ones it writes first
# (docs/integration.md, "Prefix caching"), and its tokens equal the oracle's without preemption.

VT_U = {"policy": "streaming", "budget": 120, "slack": 0, "sink_tokens": 4}
PREFIX_REQUESTS = [dict(id="off", prompt_token_ids=_prompt(5, 150), max_tokens=100, extra_args={"vtoken_enable": False}),
                   dict(id="u", prompt_token_ids=_prompt(8, 70), max_tokens=120, arrive_at_step=1)]


@pytest.fixture(scope="module")
def prefix_run(tiny):
    eng = dict(model=tiny, dtype="float32", max_model_len=320, block_size=B, enforce_eager=True,
               gpu_memory_utilization=0.1, num_gpu_blocks_override=NUM_BLOCKS, skip_tokenizer_init=True,
               enable_prefix_caching=True)
    hooks = f"{Path(__file__).resolve().parent / '_preempt_hooks.py'}:PreemptProbe"
    return run_in_subprocess(dict(engine=eng, vtoken=VT_U, requests=PREFIX_REQUESTS, hooks=hooks),
                             env=path_env("v1-sync"))


def test_resume_with_prefix_caching_keeps_tokens(prefix_run, tiny):
    """``u`` is preempted once, before evicting, and resumes with its saved K/V; it evicts inside
    its first blocks (nothing protected: StreamingLLM needs no statistics of the prompt). Its
    tokens equal the oracle's without preemption. All finish, the pool returns, VTOKEN_CHECK=1
    held every step (no move or copy wrote a shared or hashed block)."""
    import torch

    from reference.oracle import load_oracle_model, oracle_generate

    out = prefix_run
    assert out["finish"] == {"off": "length", "u": "length"}
    assert out["free_blocks_end"] == out["free_blocks_start"] == NUM_BLOCKS - 1
    assert set(out["preempted_steps"]) == {"u"} and len(out["preempted_steps"]["u"]) == 1, out["preempted_steps"]
    assert [r["scheduled"] for r in out["resumes"] if r["req"] == "u"] == [1]
    f = _finished(out, "u")
    assert f["cached_tokens"] == 0  # no hit at its admission
    assert f["protected"] == 0, f
    torch.set_num_threads(2)
    model = load_oracle_model(tiny)
    cfg = parse_config(VT_U)
    u = PREFIX_REQUESTS[1]
    ref = oracle_generate(model, u["prompt_token_ids"], u["max_tokens"], cfg)
    assert out["tokens"]["u"] == list(ref.token_ids)
    assert ref.num_evicted == f["evicted"] > 0
    # it evicted inside its first blocks (hashed before it was preempted: copied, never written)
    assert min(p for step in ref.evicted_positions for p in step) < 64


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
