"""Without a ``vtoken`` key the plugin is inert: stock vLLM, no ``vtoken:`` metrics, no vToken log line.

The server is ``python -m vllm.entrypoints.openai.api_server`` with the vToken package
installed (its ``vllm.general_plugins`` entry point is loaded) but no ``--additional-config``.
"""

from __future__ import annotations

import pytest

from e2e_server import run_server
from reference.oracle import oracle_generate

pytestmark = pytest.mark.engine

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def stock_server(tiny_model, tmp_path_factory):
    with run_server(tiny_model, tmp_path_factory.mktemp("stock_server") / "server.log", None) as srv:
        yield srv


def test_no_vtoken_metrics_and_no_vtoken_log(stock_server, sharegpt_prompts, oracle_model):
    pids, toks = stock_server.generate("completion", sharegpt_prompts[4], MAX_TOKENS)
    # stock greedy decoding equals the dense oracle (no eviction): the same reference the
    # vToken server's `vtoken_enable: false` requests are checked against
    assert toks == oracle_generate(oracle_model, pids, MAX_TOKENS, None).token_ids

    text = stock_server.metrics_text()
    assert "vtoken:" not in text
    # vLLM's own metrics, from the single-process registry (the multiprocess bridge is off:
    # the default process collectors are only there without PROMETHEUS_MULTIPROC_DIR)
    m = stock_server.metrics()
    assert m["vllm:generation_tokens_total"] == MAX_TOKENS
    assert m["vllm:request_success_total"] == 1
    assert "python_gc_objects_collected_total" in m

    log = stock_server.log()
    assert "vToken" not in log  # every vToken log line says "vToken"
    assert "VTokenScheduler" not in log and "VTokenCPUWorker" not in log
    assert "vtoken_prom_" not in log
