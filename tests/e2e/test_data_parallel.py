"""``vllm serve --data-parallel-size 2`` with vToken on (issue 45, item 1; docs/scaling.md).

Two DP ranks, each its own EngineCore with its own vToken scheduler, KV cache and worker; the
front end spreads the requests. Eight greedy requests of mixed per-request policies and budgets
arrive together. References, independent of the engine: the dense oracle (what a DP=1 server
gives for each request: ``test_server.py`` checks that) for every request's tokens and eviction
counts; each rank's own ``engine`` label on the ``vtoken:`` metrics.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from drivers import launcher
from e2e_server import (BLOCK_SIZE, HTTP_TIMEOUT_S, MODEL_NAME, SERVER_ARGS, START_TIMEOUT_S, Server,
                        expected_counters)
from vtoken.config import parse_config, parse_request_overrides
from reference.oracle import oracle_generate

pytestmark = pytest.mark.engine

VT = {"policy": "h2o", "budget": 48, "slack": 0}
MAX_TOKENS = 16
XARGS = [None, {"vtoken_policy": "tova"}, {"vtoken_policy": "streaming", "vtoken_budget": 40},
         {"vtoken_policy": "scissorhands", "vtoken_budget": 64}, {"vtoken_budget": 56},
         {"vtoken_policy": "tova", "vtoken_budget": 72}, {"vtoken_policy": "random"}, None]


@pytest.fixture(scope="module")
def dp_server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("vtoken_dp") / "server.log"
    with launcher.run_server(tiny_model, log, SERVER_ARGS + ["--data-parallel-size", "2"], {"vtoken": VT},
                             served_model_name=MODEL_NAME, env=dict(OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="INFO"),
                             start_timeout_s=START_TIMEOUT_S, server_cls=Server) as srv:
        yield srv


def _by_engine(m: dict[str, float], name: str) -> dict[str, float]:
    """``{engine label: value}`` of one metric."""
    out = {}
    for k, v in m.items():
        if k.startswith(name + "{"):
            got = re.search(r'engine="([^"]+)"', k)
            if got:
                out[got.group(1)] = out.get(got.group(1), 0.0) + v
    return out


def _idle(server, deadline_s: float = 60.0) -> dict[str, float]:
    import time

    end = time.monotonic() + deadline_s
    while True:
        m = server.metrics()
        if (not any(_by_engine(m, "vllm:num_requests_running").values())
                and not any(_by_engine(m, "vtoken:retained_blocks").values())):
            return m
        assert time.monotonic() < end, "server not idle"
        time.sleep(0.2)


def test_each_rank_evicts_and_tokens_equal_the_oracle(dp_server, sharegpt_prompts, oracle_model):
    prompts = sharegpt_prompts[:len(XARGS)]
    m0 = _idle(dp_server)
    with ThreadPoolExecutor(max_workers=len(prompts)) as ex:
        futs = [ex.submit(dp_server.generate, "completion", p, MAX_TOKENS, xargs=x) for p, x in zip(prompts, XARGS)]
        got = [f.result(timeout=HTTP_TIMEOUT_S) for f in futs]
    m1 = _idle(dp_server)
    base = parse_config(VT)
    want = {"evicted_tokens": 0, "evictions": 0, "freed_blocks": 0}
    for (pids, toks), x in zip(got, XARGS):
        cfg = parse_request_overrides(x).apply(base) if x else base
        res = oracle_generate(oracle_model, pids, MAX_TOKENS, cfg)
        assert toks == list(res.token_ids), x
        for k in want:
            want[k] += expected_counters(res, BLOCK_SIZE)[k]
    assert want["evicted_tokens"] > 0
    # each rank evicted, under its own engine label; the two add up to the oracle's counts
    for k, v in want.items():
        before, after = _by_engine(m0, f"vtoken:{k}_total"), _by_engine(m1, f"vtoken:{k}_total")
        delta = {e: after[e] - before.get(e, 0.0) for e in after}
        assert sorted(delta) == ["0", "1"], delta
        assert sum(delta.values()) == v, (k, delta, v)
        if k == "evictions":
            assert all(d > 0 for d in delta.values()), delta
    # both ranks back to zero: vToken's gauges and vLLM's own KV-cache usage
    for g in ("live_tokens", "logical_tokens", "retained_blocks", "naive_retained_blocks", "evicting_requests"):
        assert _by_engine(m1, f"vtoken:{g}") == {"0": 0.0, "1": 0.0}, g
    assert set(_by_engine(m1, "vllm:kv_cache_usage_perc").values()) == {0.0}
