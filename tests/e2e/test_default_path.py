"""The OpenAI server on vLLM's default GPU execution path (Model Runner V2 + async scheduling),
reproduced on this CPU with the test shims (``tests/execution_paths.py``), with vToken on.

An evicting chat request gets the dense oracle's tokens (async scheduling decides exactly as
sync), the start-up line names the path vLLM picked (nothing forced), and the
``vtoken:`` counters move by exactly the oracle's eviction counts.
"""

from __future__ import annotations

import pytest

from e2e_server import MODEL_NAME, SERVER_ARGS, START_TIMEOUT_S, Server, expected_counters
from execution_paths import path_env
from vtoken.config import parse_config
from drivers import launcher
from reference.oracle import oracle_generate

pytestmark = pytest.mark.engine

VT = {"policy": "h2o", "budget": 48, "slack": 0}
MAX_TOKENS = 16


def test_mrv2_async_server_serves_an_evicting_chat_request(tiny_model, sharegpt_prompts, oracle_model,
                                                           tmp_path_factory):
    env = dict(path_env("mrv2-async"), OMP_NUM_THREADS="2", VLLM_LOGGING_LEVEL="INFO")
    with launcher.run_server(tiny_model, tmp_path_factory.mktemp("mrv2_async") / "server.log", SERVER_ARGS,
                             {"vtoken": VT}, served_model_name=MODEL_NAME, env=env, start_timeout_s=START_TIMEOUT_S,
                             server_cls=Server) as srv:
        log = srv.log()
        assert "model_runner=v2 scheduling=async" in log, log[-3000:]
        m0 = srv.metrics()
        pids, toks = srv.generate("chat", sharegpt_prompts[1], MAX_TOKENS)
        m1 = srv.metrics()
    res = oracle_generate(oracle_model, pids, MAX_TOKENS, parse_config(VT))
    assert len(pids) > VT["budget"]
    assert toks == res.token_ids, "MRV2 + async server != dense oracle"
    want = expected_counters(res)
    assert want["evicted_tokens"] > 0 and want["freed_blocks"] > 0
    for k in ("evicted_tokens", "evictions"):
        assert m1[f"vtoken:{k}_total"] - m0.get(f"vtoken:{k}_total", 0.0) == want[k], k
    assert m1["vtoken:freed_blocks_total"] - m0.get("vtoken:freed_blocks_total", 0.0) > 0
