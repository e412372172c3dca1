"""vToken inside a real vLLM engine (CPU), against the dense oracle and stock vLLM, on every
execution path vLLM can pick (``tests/execution_paths.py``): the V1 runner with sync
scheduling, Model Runner V2 with sync scheduling, and Model Runner V2 with async scheduling
(vLLM's default on GPUs). Async scheduling decides exactly as sync: one oracle for every path.

Engines are expensive (~10-30 s each), so each fixture runs one engine over a whole
batch of requests in a subprocess (``drivers.harness``) and the tests
read its output. Every vToken run has ``VTOKEN_CHECK=1``: after every schedule() the
scheduler asserts that each scheduled request holds exactly ceil(live/B) blocks
(vtoken) or the Naive-Evict count (naive), that no block is owned twice and that
free + held blocks == pool size; a violation fails the run.
"""

from __future__ import annotations

import itertools

import pytest

from vtoken.assets.paths import ensure_tiny_model
from vtoken.config import parse_config, parse_request_overrides
from drivers.harness import run_in_subprocess

from execution_paths import EXPECTED, PATHS, path_env

pytestmark = pytest.mark.engine

POLICIES = ["h2o", "tova", "scissorhands", "random", "streaming"]
BUDGETS = [29, 45, 64]  # not multiples of the block size (32) except 64
BLOCK = 32
NEW_TOKENS = 64
BASE_VTOKEN = {"policy": "h2o", "budget": 45}


def _prompt(i: int, n: int) -> list[int]:
    # byte-range ids (the tiny tokenizer's real tokens), deterministic, varied
    return [((i + 3) * 37 + j * (11 + i % 5)) % 250 + 1 for j in range(n)]


def _engine(model: str, **kw) -> dict:
    e = dict(model=model, dtype="float32", max_model_len=1024, block_size=BLOCK, enforce_eager=True,
             gpu_memory_utilization=0.1, num_gpu_blocks_override=512, skip_tokenizer_init=True)
    e.update(kw)
    return e


def _eviction_requests() -> list[dict]:
    """policy x budget x {shorter, longer than the budget}: one mixed batch."""
    reqs = []
    for k, (pol, budget, plen) in enumerate(itertools.product(POLICIES, BUDGETS, [20, 100])):
        reqs.append(dict(id=f"{pol}-{budget}-{plen}", prompt_token_ids=_prompt(k, plen), max_tokens=NEW_TOKENS,
                         extra_args={"vtoken_policy": pol, "vtoken_budget": budget}))
    return reqs


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(ensure_tiny_model())


@pytest.fixture(scope="module", params=PATHS)
def path(request) -> str:
    """The execution path of the engine runs below (module-scoped: one set of engines per path)."""
    return request.param


_oracle_cache: dict = {}


def _oracle_tokens(tiny: str, prompt: list[int], new_tokens: int, cfg) -> list[int]:
    """Greedy tokens of the dense oracle (cached across paths; it cuts the prompt at the
    request's own eviction points, never at the chunks the engine happened to schedule)."""
    import torch

    from reference.oracle import load_oracle_model, oracle_generate

    key = (tuple(prompt), new_tokens, cfg.model_dump_json())
    if key not in _oracle_cache:
        if "model" not in _oracle_cache:
            torch.set_num_threads(2)
            _oracle_cache["model"] = load_oracle_model(tiny)
        ref = oracle_generate(_oracle_cache["model"], prompt, new_tokens, cfg)
        _oracle_cache[key] = list(ref.token_ids)
    return _oracle_cache[key]


@pytest.fixture(scope="module")
def plain_requests() -> list[dict]:
    return [dict(id=f"p{i}", prompt_token_ids=_prompt(i, n), max_tokens=NEW_TOKENS) for i, n in enumerate([5, 33, 70, 150])]


@pytest.fixture(scope="module")
def stock_run(tiny, plain_requests):
    """vLLM with the plugin not loaded at all (V1 runner, sync scheduling)."""
    return run_in_subprocess(dict(engine=_engine(tiny), vtoken=None, requests=plain_requests, check=False),
                             env={"VLLM_PLUGINS": ""})


@pytest.fixture(scope="module")
def eviction_run(tiny, path):
    return run_in_subprocess(dict(engine=_engine(tiny), vtoken=BASE_VTOKEN, requests=_eviction_requests()),
                             env=path_env(path))


@pytest.fixture(scope="module")
def naive_run(tiny, path):
    return run_in_subprocess(dict(engine=_engine(tiny), vtoken=dict(BASE_VTOKEN, mode="naive"),
                                  requests=_eviction_requests()), env=path_env(path))


def test_runs_on_the_requested_path(path, eviction_run, naive_run):
    """vToken follows vLLM's choice: the scheduler and runner classes match the path, nothing forced."""
    assert eviction_run["paths"] == EXPECTED[path]
    assert naive_run["paths"] == EXPECTED[path]


def test_plugin_inert_without_vtoken_key(tiny, plain_requests, stock_run):
    out = run_in_subprocess(dict(engine=_engine(tiny), vtoken=None, requests=plain_requests, check=False))
    assert "vtoken" not in out  # the stock scheduler ran
    assert out["tokens"] == stock_run["tokens"]


@pytest.mark.parametrize("on_path", ["v1-sync", "mrv2-async"])
def test_budget_above_every_length_is_stock(tiny, plain_requests, stock_run, on_path):
    out = run_in_subprocess(dict(engine=_engine(tiny), vtoken={"policy": "h2o", "budget": 100000},
                                 requests=plain_requests), env=path_env(on_path))
    assert out["paths"] == EXPECTED[on_path]
    assert out["vtoken"]["stats"]["evicted_tokens"] == 0
    assert out["tokens"] == stock_run["tokens"]
    assert len(out["tokens"]["p3"]) == NEW_TOKENS


def test_eviction_matches_dense_oracle(tiny, path, eviction_run):
    """5 policies x budgets 29/45/64 x prompts shorter/longer than the budget, one mixed batch."""
    base = parse_config(BASE_VTOKEN)
    stats = eviction_run["vtoken"]["stats"]
    assert stats["evicted_tokens"] > 0 and stats["moved_tokens"] > 0 and stats["freed_blocks"] > 0
    assert stats["request_faults"] == 0
    mismatches = []
    for r in _eviction_requests():
        cfg = parse_request_overrides(r["extra_args"]).apply(base)
        ref = _oracle_tokens(tiny, r["prompt_token_ids"], NEW_TOKENS, cfg)
        got = eviction_run["tokens"][r["id"]]
        assert len(got) == NEW_TOKENS
        if got != ref:
            first = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
            mismatches.append(f"{r['id']}: first difference at token {first}")
    assert not mismatches, mismatches


def test_live_below_prompt_length_keeps_every_sampled_token(tiny, path, eviction_run):
    """Model Runner V2's seq_lens trap: its sampler treats ``seq_len < prefill_len`` as a chunked
    prefill and drops the sampled token. Requests with a 100-token prompt and budget 29/45/64
    decode with fewer live tokens than prompt tokens; every one must still produce all its
    tokens, equal to the oracle's (attention must see physical lengths, the sampler logical ones)."""
    base = parse_config(BASE_VTOKEN)
    # vLLM appends "-<suffix>" to request ids internally
    finished = {f["req_id"].rsplit("-", 1)[0]: f for f in eviction_run["vtoken"]["finished"]}
    long_reqs = [r for r in _eviction_requests() if len(r["prompt_token_ids"]) == 100]
    assert len(long_reqs) == 15
    for r in long_reqs:
        f = finished[r["id"]]
        assert f["num_live"] < f["prompt_len"] == 100, r["id"]
        got = eviction_run["tokens"][r["id"]]
        assert len(got) == NEW_TOKENS, r["id"]
        cfg = parse_request_overrides(r["extra_args"]).apply(base)
        assert got == _oracle_tokens(tiny, r["prompt_token_ids"], NEW_TOKENS, cfg), r["id"]


def test_naive_mode_same_tokens_more_blocks(eviction_run, naive_run):
    assert naive_run["tokens"] == eviction_run["tokens"]
    v, n = eviction_run["vtoken"]["finished"], naive_run["vtoken"]["finished"]
    avg_v = sum(f["avg_blocks"] for f in v) / len(v)
    avg_n = sum(f["avg_blocks"] for f in n) / len(n)
    assert avg_v < avg_n  # same decisions, Naive-Evict keeps partly dead blocks
    for f in v:  # vToken ends each request at ceil(live/B) blocks (+1 for the unsampled next token at most)
        assert f["evicted"] + f["num_live"] == f["num_logical"]


def test_pool_free_count_returns(path, eviction_run, naive_run):
    for out in (eviction_run, naive_run):
        assert out["free_blocks_end"] == out["free_blocks_start"] == out["num_blocks"] - 1


def test_aborts_and_preemption_lose_no_block(tiny, path):
    """A pool of 10 blocks: an eviction-off request grows and preempts the vToken requests
    admitted after it (they resume with their saved K/V, and their tokens equal the oracle's
    without preemption); aborts at several phases (before prefill, mid-prefill
    of a long prompt, right after an eviction)."""
    reqs = [dict(id="off", prompt_token_ids=_prompt(19, 40), max_tokens=200, extra_args={"vtoken_enable": False})]
    reqs += [dict(id=f"q{i}", prompt_token_ids=_prompt(20 + i, 60 + 17 * i), max_tokens=80, arrive_at_step=1,
                  extra_args={"vtoken_policy": POLICIES[i], "vtoken_budget": 40}) for i in range(4)]
    reqs += [
        dict(id="a-wait", prompt_token_ids=_prompt(40, 50), max_tokens=50, abort_after_steps=0),
        dict(id="a-prefill", prompt_token_ids=_prompt(41, 250), max_tokens=50, abort_after_steps=1),
        dict(id="a-evict", prompt_token_ids=_prompt(42, 90), max_tokens=50, abort_after_steps=4),
    ]
    out = run_in_subprocess(dict(engine=_engine(tiny, num_gpu_blocks_override=10, max_num_batched_tokens=128,
                                                 max_model_len=288),
                                 vtoken={"policy": "h2o", "budget": 40}, requests=reqs), env=path_env(path))
    assert out["paths"] == EXPECTED[path]
    assert out["free_blocks_end"] == out["free_blocks_start"] == 9
    assert out["finish"]["off"] == "length" and len(out["tokens"]["off"]) == 200
    for r in reqs[1:5]:
        assert out["finish"][r["id"]] == "length" and len(out["tokens"][r["id"]]) == 80
    assert out["vtoken"]["stats"]["preemption_resets"] > 0
    # preempted requests resume with their saved K/V (docs/integration.md, "Preemption"): every
    # policy's tokens equal the oracle's for the request alone
    base = parse_config({"policy": "h2o", "budget": 40})
    fin = {f["req_id"].rsplit("-", 1)[0]: f for f in out["vtoken"]["finished"]}
    for r in reqs[1:5]:
        ref = _oracle_tokens(tiny, r["prompt_token_ids"], 80, parse_request_overrides(r["extra_args"]).apply(base))
        assert out["tokens"][r["id"]] == ref, r["id"]


@pytest.mark.parametrize("run_path", ["v1-sync", "mrv2-async"])
def test_request_preempted_in_the_step_of_its_eviction(tiny, run_path):
    """4 usable blocks: "off" (eviction off, 40-token prompt) and "q" (60-token prompt, budget
    40, slack 0: it evicts and repacks at every decode step) hold 2 blocks each. When "off"
    reaches 64 tokens it needs a third block: the stock schedule() preempts "q" (last in the
    running queue) right after vToken counted q's eviction in that schedule(). q's blocks are
    back in the pool (another request may be given them in that step): the worker still applies
    q's eviction in them before any write of the step, saves its live K/V, and restores it when q
    resumes. VTOKEN_CHECK holds every step; q's tokens equal the oracle's without preemption."""
    reqs = [dict(id="off", prompt_token_ids=_prompt(19, 40), max_tokens=80, extra_args={"vtoken_enable": False}),
            dict(id="q", prompt_token_ids=_prompt(21, 60), max_tokens=40, arrive_at_step=1)]
    vt = {"policy": "h2o", "budget": 40, "slack": 0}
    out = run_in_subprocess(dict(engine=_engine(tiny, num_gpu_blocks_override=5, max_model_len=128),
                                 vtoken=vt, requests=reqs), env=path_env(run_path))
    assert out["paths"] == EXPECTED[run_path]
    stats = out["vtoken"]["stats"]
    assert stats["preemption_resets"] == 1 and stats["moves_dropped_preempted"] == 0, stats
    assert out["finish"] == {"off": "length", "q": "length"}
    assert len(out["tokens"]["off"]) == 80 and len(out["tokens"]["q"]) == 40
    assert out["free_blocks_end"] == out["free_blocks_start"] == 4
    assert out["tokens"]["q"] == _oracle_tokens(tiny, reqs[1]["prompt_token_ids"], 40, parse_config(vt))


def test_score_every_matches_dense_oracle(tiny, path):
    """Scores every 3rd decode step (and every prefill): same convention as the oracle."""
    vt = {"policy": "h2o", "budget": 37, "score_every": 3}
    reqs = [dict(id=f"s{i}", prompt_token_ids=_prompt(50 + i, n), max_tokens=NEW_TOKENS,
                 extra_args={"vtoken_policy": pol}) for i, (n, pol) in enumerate([(80, "h2o"), (60, "tova"), (20, "scissorhands")])]
    out = run_in_subprocess(dict(engine=_engine(tiny), vtoken=vt, requests=reqs), env=path_env(path))
    assert out["paths"] == EXPECTED[path]
    base = parse_config(vt)
    for r in reqs:
        ref = _oracle_tokens(tiny, r["prompt_token_ids"], NEW_TOKENS,
                             parse_request_overrides(r["extra_args"]).apply(base))
        assert out["tokens"][r["id"]] == ref, r["id"]


def test_freed_blocks_reused_in_the_same_step_keep_tokens_exact(tiny, path):
    """A pool of 8 usable blocks: a 90-token prompt takes 3 blocks and, once evicted to budget 40,
    2. Two requests fill 6 blocks and the next ones wait; when the running ones evict, the blocks
    they free in schedule() admit a waiting request in that same schedule(), which writes them in
    that step, while (under async scheduling) the previous step, which read them, may still be in
    flight. Tokens must equal the oracle's (running requests never grow past their prefill blocks,
    so nothing is preempted) and VTOKEN_CHECK holds every step."""
    vt = {"policy": "h2o", "budget": 40, "slack": 0}
    reqs = [dict(id=f"t{i}", prompt_token_ids=_prompt(70 + i, 90), max_tokens=40,
                 extra_args={"vtoken_policy": POLICIES[i % len(POLICIES)]}) for i in range(8)]
    out = run_in_subprocess(dict(engine=_engine(tiny, num_gpu_blocks_override=9, max_num_seqs=4, max_model_len=256), vtoken=vt,
                                 requests=reqs), env=path_env(path))
    assert out["paths"] == EXPECTED[path]
    stats = out["vtoken"]["stats"]
    assert stats["preemption_resets"] == 0
    assert stats["freed_blocks_reused_same_step"] > 0
    base = parse_config(vt)
    for r in reqs:
        ref = _oracle_tokens(tiny, r["prompt_token_ids"], 40, parse_request_overrides(r["extra_args"]).apply(base))
        assert out["tokens"][r["id"]] == ref, r["id"]
    assert out["free_blocks_end"] == out["free_blocks_start"] == 8


@pytest.mark.parametrize("on_path", ["v1-sync", "mrv2-async"])
def test_fault_confined_to_one_request(tiny, on_path):
    """The worker's eviction raises for one request (its group is retried request by request) and
    another's statistics are NaN: both end with an error (``finish_reason`` error), each named in
    an error log line and counted in ``request_faults``; every other request, in the same policy
    group as the first, runs to its length with the oracle's tokens, and no block leaks."""
    from pathlib import Path

    hooks = f"{Path(__file__).resolve().parent / '_fault_hooks.py'}:FaultInjection"
    reqs = [dict(id="boom", prompt_token_ids=_prompt(80, 90), max_tokens=32, extra_args={"vtoken_budget": 40}),
            dict(id="nan-tova", prompt_token_ids=_prompt(81, 90), max_tokens=32,
                 extra_args={"vtoken_policy": "tova", "vtoken_budget": 40})]
    reqs += [dict(id=f"ok-{pol}", prompt_token_ids=_prompt(82 + i, 90), max_tokens=32,
                  extra_args={"vtoken_policy": pol, "vtoken_budget": 40}) for i, pol in enumerate(POLICIES)]
    out = run_in_subprocess(dict(engine=_engine(tiny), vtoken=BASE_VTOKEN, requests=reqs, hooks=hooks),
                            env=path_env(on_path))
    assert out["paths"] == EXPECTED[on_path]
    assert out["vtoken"]["stats"]["request_faults"] == 2
    errors = [line for line in out["vtoken_log"] if line.startswith("ERROR")]
    assert len(errors) == 2, errors
    assert any("boom" in e and "injected policy fault" in e for e in errors), errors
    assert any("nan-tova" in e and "non-finite attention statistics" in e for e in errors), errors
    base = parse_config(BASE_VTOKEN)
    for r in reqs:
        got = out["tokens"][r["id"]]
        if r["id"] in ("boom", "nan-tova"):
            assert out["finish"][r["id"]] == "error" and len(got) < 32, (r["id"], out["finish"][r["id"]], len(got))
            continue
        assert out["finish"][r["id"]] == "length" and len(got) == 32, r["id"]
        ref = _oracle_tokens(tiny, r["prompt_token_ids"], 32, parse_request_overrides(r["extra_args"]).apply(base))
        assert got == ref, r["id"]
    assert out["free_blocks_end"] == out["free_blocks_start"]
