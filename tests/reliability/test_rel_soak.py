"""The soak's short form (``benchmarks/soak.py --minutes 0.5``) as a test.

It starts its own OpenAI server (127.0.0.1, ``VTOKEN_CHECK=1``, process group killed at
the end), drives it with ShareGPT requests from 3 clients (random policies/budgets,
eviction off, bad requests, disconnects) for 30 s, then checks the pool, the gauges,
the server's health and log, and a sentinel request's tokens.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine


def test_soak_short(tmp_path):
    import soak

    res = soak.soak(0.5, model="tiny", clients=3, seed=1, log_dir=tmp_path)
    f = res.get("figures", {})
    assert res["passed"], {k: res.get(k) for k in ("checks", "exception", "failures", "log_problems", "figures")}
    assert f["blocks_leaked"] == 0 and f["retained_blocks_idle"] == 0 and f["kv_cache_usage_perc_idle"] == 0
    assert f["requests_served"] > 0 and f["aborts"] > 0 and f["evictions"] > 0 and f["client_failures"] == 0
    # every request the clients saw finish, plus the two sentinels and the aborted ones, finished in vLLM
    assert f["requests_finished"] >= f["requests_served"] + 2
    assert res["sentinel"]["before"] == res["sentinel"]["after"] and len(res["sentinel"]["before"]) == 32
