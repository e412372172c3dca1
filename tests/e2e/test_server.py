"""The OpenAI server with vToken on (tiny model, H2O, budget 48 tokens, slack 0).

References, all independent of the engine: the dense oracle (``reference.oracle``: greedy
Hugging Face generation with the same eviction on a logical-order cache) for the tokens
and for every eviction count; the same requests served one at a time (solo) for the
batched results; block counts replayed from the oracle's per-step live counts.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from e2e_server import BLOCK_SIZE, HTTP_TIMEOUT_S, MODEL_NAME, expected_counters, run_server
from vtoken.config import parse_config, parse_request_overrides
from reference.oracle import oracle_generate

pytestmark = pytest.mark.engine

BUDGET = 48  # not a multiple of BLOCK_SIZE: a request settles at ceil(49/32) = 2 blocks
VT = {"policy": "h2o", "budget": BUDGET, "slack": 0}
MAX_TOKENS = 16
COUNTERS = ["evicted_tokens", "moved_tokens", "freed_blocks", "evictions", "repack_seconds", "preemption_resets"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with run_server(tiny_model, tmp_path_factory.mktemp("vtoken_server") / "server.log", {"vtoken": VT}) as srv:
        yield srv


@pytest.fixture(scope="module")
def base_cfg():
    return parse_config(VT)


_expect = expected_counters


def _vt(m: dict[str, float], name: str) -> float:
    suffix = "" if name in ("live_tokens", "logical_tokens", "retained_blocks", "naive_retained_blocks",
                            "dense_blocks", "evicting_requests") else "_total"
    return m.get(f"vtoken:{name}{suffix}", 0.0)


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {c: _vt(after, c) - _vt(before, c) for c in COUNTERS}


def _wait_idle(server, deadline_s: float = 30.0) -> dict[str, float]:
    """Scrape until no request runs and vToken tracks no token (bounded)."""
    end = time.monotonic() + deadline_s
    while True:
        m = server.metrics()
        if m.get("vllm:num_requests_running", 0) == 0 and _vt(m, "retained_blocks") == 0:
            return m
        assert time.monotonic() < end, f"server not idle: {m}"
        time.sleep(0.2)


# (kind, stream) per request: both endpoints, streaming and not
SHAPES = [("completion", False), ("completion", True), ("chat", False), ("chat", True)]


def test_metrics_exposed_with_labels(server):
    text = server.metrics_text()
    for name in ["live_tokens", "retained_blocks", "naive_retained_blocks", "dense_blocks"]:
        assert f"# TYPE vtoken:{name} gauge" in text
        assert f'vtoken:{name}{{engine="0",model_name="{MODEL_NAME}"}}' in text
    assert "# TYPE vtoken:request_peak_blocks histogram" in text
    assert f'vtoken:request_peak_blocks_bucket{{engine="0",le="8.0",model_name="{MODEL_NAME}"}}' in text
    for name in COUNTERS:
        assert f"# TYPE vtoken:{name}_total counter" in text
        assert f'vtoken:{name}_total{{engine="0",model_name="{MODEL_NAME}"}}' in text
    # vLLM's own metrics still reach /metrics through the multiprocess registry
    assert "# TYPE vllm:num_requests_running gauge" in text
    assert "# TYPE vllm:generation_tokens_total counter" in text


def test_batch_equals_solo_and_oracle(server, sharegpt_prompts, oracle_model, base_cfg):
    prompts = sharegpt_prompts[:4]
    m0 = _wait_idle(server)
    with ThreadPoolExecutor(max_workers=len(prompts)) as ex:
        futs = [ex.submit(server.generate, kind, p, MAX_TOKENS, stream=stream)
                for p, (kind, stream) in zip(prompts, SHAPES)]
        batch = [f.result(timeout=HTTP_TIMEOUT_S) for f in futs]
    m1 = _wait_idle(server)
    solo = [server.generate(kind, p, MAX_TOKENS, stream=stream) for p, (kind, stream) in zip(prompts, SHAPES)]
    m2 = _wait_idle(server)

    want = {c: 0 for c in ("evicted_tokens", "evictions", "freed_blocks")}
    peak_blocks = 0  # vtoken:request_peak_blocks: each request's most blocks (prompt or a decode step)
    for (kind, stream), (pids, toks), (spids, stoks) in zip(SHAPES, batch, solo):
        assert pids == spids
        assert len(pids) > BUDGET + 16, "prompt too short to evict"
        res = oracle_generate(oracle_model, pids, MAX_TOKENS, base_cfg)
        assert toks == stoks, f"{kind} stream={stream}: batched != solo"
        assert toks == res.token_ids, f"{kind} stream={stream}: server != dense oracle with H2O eviction"
        for k, v in _expect(res).items():
            want[k] += v
        peak_blocks += max(_cdiv(n, BLOCK_SIZE) for n in res.num_live)
    assert want["evicted_tokens"] > 0 and want["freed_blocks"] > 0

    for before, after in ((m0, m1), (m1, m2)):
        d = _delta(before, after)
        for k, v in want.items():
            assert d[k] == v, f"vtoken:{k}_total moved by {d[k]}, expected {v}"
        assert 0 < d["moved_tokens"] <= d["evicted_tokens"]
        assert d["repack_seconds"] > 0
        assert d["preemption_resets"] == 0
        # one histogram observation per finished request, its peak blocks (from the oracle's live counts)
        hist = {x: after[f"vtoken:request_peak_blocks_{x}"] - before.get(f"vtoken:request_peak_blocks_{x}", 0.0)
                for x in ("count", "sum")}
        assert hist == {"count": 4, "sum": peak_blocks}, (hist, peak_blocks)
        # vLLM's own counters keep working next to ours
        assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 4 * MAX_TOKENS
        assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == 4
    for g in ("live_tokens", "logical_tokens", "retained_blocks", "naive_retained_blocks", "dense_blocks",
              "evicting_requests"):
        assert _vt(m2, g) == 0, g


def test_gauges_in_flight_then_zero_when_idle(server, sharegpt_prompts):
    """Mid-stream the gauges show one request at its budget; once it ends (or the client
    drops the stream: abort), they return to zero."""
    _wait_idle(server)
    body = dict(model=MODEL_NAME, prompt=sharegpt_prompts[5], max_tokens=1800, temperature=0.0, ignore_eos=True,
                stream=True)
    seen = None
    for _attempt in range(8):  # the tiny model may finish 1800 tokens before a scrape; retry (bounded)
        gen0 = _wait_idle(server).get("vllm:generation_tokens_total", 0.0)
        with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=HTTP_TIMEOUT_S) as r:
            assert r.status_code == 200
            # (the line iterator stays referenced while we poll: a generator dropped after `break`
            # is closed, which closes the connection, and the server aborts the request)
            lines = r.iter_lines(decode_unicode=True)
            for n, line in enumerate(lines):
                if line and line.startswith("data: ") or n > 10:
                    break
            # Poll while the request runs: vToken publishes its gauges at most every 50 ms from
            # schedule() (the first publication may be the prefill step's, nothing evicted yet).
            # Finished: all its tokens counted by vLLM.
            end = time.monotonic() + 10.0
            while time.monotonic() < end:
                m = server.metrics()
                if _vt(m, "evicting_requests") == 1:
                    seen = m
                    break
                if m.get("vllm:generation_tokens_total", 0.0) - gen0 >= body["max_tokens"]:
                    break
                time.sleep(0.02)
        if seen is not None:
            break
    assert seen is not None, "never caught the request in flight"
    m = seen
    # after schedule(): evicted down to the budget, then this step's token appended
    assert _vt(m, "live_tokens") == BUDGET + 1
    assert _vt(m, "retained_blocks") == _vt(m, "dense_blocks") == _cdiv(BUDGET + 1, BLOCK_SIZE)
    assert _vt(m, "naive_retained_blocks") >= _vt(m, "retained_blocks")
    assert _vt(m, "logical_tokens") > BUDGET + 1
    m = _wait_idle(server)
    for g in ("live_tokens", "logical_tokens", "retained_blocks", "naive_retained_blocks", "dense_blocks",
              "evicting_requests"):
        assert _vt(m, g) == 0, g


@pytest.mark.parametrize(
    "xargs, no_eviction",
    [
        ({"vtoken_enable": False}, True),  # JSON false arrives as 0 (vllm_xargs: str | int | float)
        ({"vtoken_enable": "false"}, True),
        ({"vtoken_budget": 2048}, True),  # max_model_len: above any request's length (more is refused)
        ({"vtoken_budget": 80}, False),
        ({"vtoken_policy": "streaming"}, False),
        ({"vtoken_enable": True, "vtoken_budget": 72, "vtoken_policy": "tova"}, False),
    ],
)
def test_per_request_overrides(server, sharegpt_prompts, oracle_model, base_cfg, xargs, no_eviction):
    m0 = _wait_idle(server)
    pids, toks = server.generate("completion", sharegpt_prompts[4], MAX_TOKENS, xargs=xargs)
    m1 = _wait_idle(server)
    ov = parse_request_overrides(xargs)
    cfg = None if no_eviction else ov.apply(base_cfg)
    res = oracle_generate(oracle_model, pids, MAX_TOKENS, cfg)
    assert toks == res.token_ids
    d = _delta(m0, m1)
    if no_eviction:
        assert d["evicted_tokens"] == d["freed_blocks"] == d["evictions"] == 0
        assert toks == oracle_generate(oracle_model, pids, MAX_TOKENS, None).token_ids
    else:
        exp = _expect(res)
        assert exp["evicted_tokens"] > 0
        for k, v in exp.items():
            assert d[k] == v, f"vtoken:{k}_total moved by {d[k]}, expected {v}"


def _post_hello(server, kind: str, **fields):
    """POST "hello" (4 tokens, greedy) to the completion or chat endpoint with extra body fields."""
    body = dict(model=MODEL_NAME, max_tokens=4, temperature=0.0, **fields)
    if kind == "completion":
        return server.post("/v1/completions", dict(body, prompt="hello"))
    return server.post("/v1/chat/completions", dict(body, messages=[{"role": "user", "content": "hello"}]))


@pytest.mark.parametrize(
    "kind, xargs, field",
    [
        ("completion", {"vtoken_budget": -3}, "vtoken_budget"),
        ("completion", {"vtoken_budget": "abc"}, "vtoken_budget"),
        ("completion", {"vtoken_policy": "nope"}, "vtoken_policy"),
        ("completion", {"vtoken_foo": 1}, "vtoken_foo"),
        ("completion", {"vtoken_enable": "maybe"}, "vtoken_enable"),
        ("chat", {"vtoken_budget": -3}, "vtoken_budget"),
        ("chat", {"vtoken_policy": "nope"}, "vtoken_policy"),
    ],
)
def test_bad_override_is_400_and_server_keeps_serving(server, kind, xargs, field):
    r = _post_hello(server, kind, vllm_xargs=xargs)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"], r.text
    pids, toks = server.generate(kind, "hello again", 4)
    assert len(toks) == 4


# Issue 28: values that slipped through vllm_xargs, and beam search. Each message is exactly one
# line in the start-up format; the server's max_model_len is 2048.
_INT = "Input should be a valid integer; allowed: a JSON integer (not a string, a float or a boolean)"


def _above(v: int) -> str:
    return (f"vllm_xargs.vtoken_budget = {v}: above max_model_len, so it would never evict; allowed: 1..2048 "
            "(set vllm_xargs.vtoken_enable = false to turn eviction off for this request)")


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize(
    "xargs, message",
    [
        ({"vtoken_budget": "64"}, f"vllm_xargs.vtoken_budget = '64': {_INT}"),
        ({"vtoken_budget": None}, "vllm_xargs.vtoken_budget = None: expected an integer >= 1; leave the key out "
                                  "to use the engine's budget"),
        ({"vtoken_budget": 1e30}, f"vllm_xargs.vtoken_budget = 1e+30: {_INT}"),
        ({"vtoken_budget": 2**64}, _above(2**64)),
        ({"vtoken_budget": 2**63}, _above(2**63)),
        ({"vtoken_budget": 2049}, _above(2049)),
    ],
    ids=["string", "null", "1e30", "2**64", "2**63", "max_model_len+1"],
)
def test_xargs_values_that_slipped_through_are_400(server, kind, xargs, message):
    r = _post_hello(server, kind, vllm_xargs=xargs)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] == message, err
    assert err["param"] == "vllm_xargs.vtoken_budget", err


def test_budget_at_max_model_len_is_accepted(server):
    r = server.post("/v1/completions", dict(model=MODEL_NAME, prompt="hello", max_tokens=4, temperature=0.0,
                                            vllm_xargs={"vtoken_budget": 2048}))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_beam_search_refused_by_name(server, kind):
    from vtoken.integrations.vllm.frontend.requests import BEAM_SEARCH_REFUSAL

    body = dict(model=MODEL_NAME, max_tokens=4, temperature=0.0, use_beam_search=True, n=3)
    if kind == "completion":
        path, body["prompt"] = "/v1/completions", "hello"
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "hello"}]
    before = _wait_idle(server)
    for xargs in (None, {"vtoken_budget": 64}, {"vtoken_enable": True}):
        b = dict(body, vllm_xargs=xargs) if xargs else body
        r = server.post(path, b)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == BEAM_SEARCH_REFUSAL, r.text
        assert r.json()["error"]["param"] == "use_beam_search"
    # eviction off for the request: beam search runs as in stock vLLM, 3 beams of 4 tokens
    r = server.post(path, dict(body, vllm_xargs={"vtoken_enable": False}))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    d = _delta(before, _wait_idle(server))
    assert d.get("evicted_tokens", 0) == 0 and d.get("evictions", 0) == 0, d
