"""``decide_on: worker`` inside a real engine (issue 22): the scheduler says how many, the worker
says which. On every execution path (V1 sync, Model Runner V2 sync and async) the tokens equal
the dense oracle with **no** score lag: under async scheduling the worker folds each step's
statistics before the next step's decision, so async decides exactly as sync, for every policy.
Pressure pacing (amounts from pool state) is replayed in the oracle from the engine's log.
Every run has ``VTOKEN_CHECK=1`` (block accounting after every schedule())."""

from __future__ import annotations

import pytest

from vtoken.assets.paths import ensure_tiny_model
from vtoken.config import parse_config, parse_request_overrides
from drivers.harness import run_in_subprocess

from execution_paths import EXPECTED, PATHS, path_env

pytestmark = pytest.mark.engine

POLICIES = ["h2o", "tova", "scissorhands", "random", "streaming", "knorm", "keydiff", "snapkv"]
BUDGETS = [29, 45, 64]
NEW = 64
BASE = {"policy": "h2o", "budget": 45, "decide_on": "worker"}


def _prompt(i: int, n: int) -> list[int]:
    return [((i + 3) * 37 + j * (11 + i % 5)) % 250 + 1 for j in range(n)]


def _engine(model: str, **kw) -> dict:
    e = dict(model=model, dtype="float32", max_model_len=1024, block_size=32, enforce_eager=True,
             gpu_memory_utilization=0.1, num_gpu_blocks_override=512, skip_tokenizer_init=True,
             enable_prefix_caching=False)
    e.update(kw)
    return e


def _requests() -> list[dict]:
    return [dict(id=f"{pol}-{b}-{n}", prompt_token_ids=_prompt(k, n), max_tokens=NEW,
                 extra_args={"vtoken_policy": pol, "vtoken_budget": b})
            for k, (pol, b, n) in enumerate((p, b, n) for p in POLICIES for b in BUDGETS for n in (20, 100))]


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(ensure_tiny_model())


@pytest.fixture(scope="module")
def oracle(tiny):
    import torch

    from vtoken.oracle import load_oracle_model, oracle_generate

    torch.set_num_threads(2)
    model = load_oracle_model(tiny)
    cache: dict = {}

    def tokens(prompt, cfg, new=NEW, **kw) -> list[int]:
        key = (tuple(prompt), cfg.model_dump_json(), new, tuple(sorted(kw.get("evict_schedule", {}).items())))
        if key not in cache:
            cache[key] = list(oracle_generate(model, prompt, new, cfg, score_lag=0, **kw).token_ids)
        return cache[key]

    return tokens


_runs: dict = {}


@pytest.fixture(scope="module", params=PATHS)
def run(request, tiny):
    path = request.param
    _runs[path] = run_in_subprocess(dict(engine=_engine(tiny), vtoken=BASE, requests=_requests()), env=path_env(path))
    return path, _runs[path]


def test_tokens_equal_the_oracle_without_lag(run, oracle):
    """5 policies x budgets 29/45/64 x prompts shorter/longer than the budget, one mixed batch."""
    path, out = run
    assert out["paths"] == EXPECTED[path]
    s = out["vtoken"]["stats"]
    assert s["evicted_tokens"] > 0 and s["freed_blocks"] > 0 and s["request_faults"] == 0
    assert s["moved_tokens"] == 0  # the worker moves; the scheduler's payload carries counts only
    assert out["free_blocks_end"] == out["free_blocks_start"] == out["num_blocks"] - 1
    base = parse_config(BASE)
    bad = []
    for r in _requests():
        got = out["tokens"][r["id"]]
        assert len(got) == NEW
        if got != oracle(r["prompt_token_ids"], parse_request_overrides(r["extra_args"]).apply(base)):
            bad.append(r["id"])
    assert not bad, f"{path}: {bad}"
    by_id = {r["id"]: r for r in _requests()}
    for f in out["vtoken"]["finished"]:
        cfg = parse_request_overrides(by_id[f["req_id"].rsplit("-", 1)[0]]["extra_args"]).apply(base)
        assert f["evicted"] + f["num_live"] == f["num_logical"]
        # fixed pacing: at most budget + slack live after a step (+1: the token appended last)
        assert f["num_live"] <= max(cfg.budget + cfg.resolved_slack(), f["prompt_len"]) + 1, f


def test_async_equals_sync_token_for_token(run):
    """Once every path ran: identical tokens and identical eviction amounts on all of them."""
    path, out = run
    if len(_runs) < len(PATHS):
        pytest.skip("runs after the other paths' fixtures")
    ref = _runs["v1-sync"]
    for p, o in _runs.items():
        assert o["tokens"] == ref["tokens"], p
        fin = {f["req_id"].rsplit("-", 1)[0]: f["evict_log"] for f in o["vtoken"]["finished"]}
        want = {f["req_id"].rsplit("-", 1)[0]: f["evict_log"] for f in ref["vtoken"]["finished"]}
        assert fin == want, p


@pytest.mark.parametrize("path", ["v1-sync", "mrv2-async"])
def test_pressure_pacing_replayed_in_the_oracle(tiny, oracle, path):
    """21 usable blocks for 28 blocks of demand: pressure pacing evicts instead of preempting; the
    tokens equal the oracle replaying the engine's (decode step, tokens) eviction log."""
    cfg = {"policy": "h2o", "budget": 40, "pacing": "pressure", "decide_on": "worker"}
    reqs = [dict(id=f"p{i}-{pol}", prompt_token_ids=_prompt(90 + i, 100), max_tokens=120,
                 extra_args={"vtoken_policy": pol}) for i, pol in enumerate(["h2o", "tova", "streaming", "random"])]
    out = run_in_subprocess(dict(engine=_engine(tiny, num_gpu_blocks_override=22, max_model_len=256), vtoken=cfg,
                                 requests=reqs), env=path_env(path))
    s = out["vtoken"]["stats"]
    assert s["preemption_resets"] == 0 and s["pressure_evictions"] > 0
    assert out["free_blocks_end"] == out["free_blocks_start"] == 21
    fin = {f["req_id"].rsplit("-", 1)[0]: f for f in out["vtoken"]["finished"]}
    base = parse_config(cfg)
    for r in reqs:
        sched = {int(d): int(k) for d, k in fin[r["id"]]["evict_log"]}
        want = oracle(r["prompt_token_ids"], parse_request_overrides(r["extra_args"]).apply(base), 120,
                      evict_schedule=sched)
        assert out["tokens"][r["id"]] == want, r["id"]
