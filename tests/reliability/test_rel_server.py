"""The OpenAI server with vToken under bad requests and client disconnects.

One server (``tests/e2e/e2e_server.run_server``: 127.0.0.1, its own process group, killed
at teardown; tiny model, 96 blocks of 32, max_model_len 2048), run with ``VTOKEN_CHECK=1``
so an ownership or accounting violation kills the engine (and fails every later check).
Engine default: H2O, budget 48, slack 0.

References: each good request served alone (solo, after the storm of bad requests and
disconnects) must give exactly the tokens it gave while bad requests and disconnecting
clients were in flight next to it. Block accounting: ``vtoken:retained_blocks`` and
``vllm:kv_cache_usage_perc`` return to 0 once idle.

``tests/e2e/test_server.py`` already checks single bad ``vllm_xargs`` (negative budget,
non-integer string, unknown policy, unknown key, bad enable) sent alone; here they and
more (float and zero budgets, a non-string policy, a list value, prompts longer than
max_model_len) arrive while other requests are decoding.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from e2e_server import HTTP_TIMEOUT_S, MODEL_NAME, run_server

pytestmark = pytest.mark.engine

VT = {"policy": "h2o", "budget": 48, "slack": 0}
MAX_TOKENS = 24
PROMPTS = [
    "Explain in detail how a key-value cache speeds up autoregressive decoding in transformer language models, "
    "and what limits its size on a small accelerator.",
    "Write a short story about a lighthouse keeper who discovers that the light has been signalling to ships "
    "that do not exist, and what she decides to do about it.",
    "List the differences between processes and threads in an operating system, with examples of when to "
    "prefer each, and the costs of switching between them.",
    "Summarise the causes of the French Revolution for a high-school student in a few paragraphs, mentioning "
    "the financial crisis, the Estates-General and the Enlightenment.",
]
GOOD_XARGS = [None, {"vtoken_enable": False}, {"vtoken_policy": "tova", "vtoken_budget": 40},
              {"vtoken_policy": "streaming", "vtoken_budget": 56}]
# (vllm_xargs or None, prompt override or None, substrings of the error message)
BAD = [
    ({"vtoken_budget": "abc"}, None, ["vtoken_budget"]),
    ({"vtoken_budget": 1.5}, None, ["vtoken_budget", "valid integer"]),
    ({"vtoken_budget": 0}, None, ["vtoken_budget", "greater than or equal to 1"]),
    ({"vtoken_budget": -7}, None, ["vtoken_budget", "greater than or equal to 1"]),
    ({"vtoken_policy": "lru"}, None, ["vtoken_policy", "unknown policy", "h2o"]),
    ({"vtoken_policy": 3}, None, ["vtoken_policy", "valid string"]),
    ({"vtoken_enable": "maybe"}, None, ["vtoken_enable"]),
    ({"vtoken_enable": 2}, None, ["vtoken_enable"]),
    ({"vtoken_bugdet": 40}, None, ["vllm_xargs.vtoken_bugdet = 40: unknown key; allowed: ['vtoken_budget'"]),
    ({"vtoken_budget": [40]}, None, ["vllm_xargs"]),
    (None, "x" * 3000, ["maximum context length", "2048"]),  # byte-level tokenizer: > max_model_len tokens
    ({"vtoken_budget": 40}, "y" * 4000, ["maximum context length", "2048"]),
]


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    old = os.environ.get("VTOKEN_CHECK")
    os.environ["VTOKEN_CHECK"] = "1"
    try:
        with run_server(tiny_path, tmp_path_factory.mktemp("rel_server") / "server.log", {"vtoken": VT}) as srv:
            yield srv
    finally:
        if old is None:
            os.environ.pop("VTOKEN_CHECK", None)
        else:
            os.environ["VTOKEN_CHECK"] = old


def _alive(server) -> None:
    assert server.proc.poll() is None, f"server died; log tail:\n{server.log()[-4000:]}"
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def _wait_idle(server, deadline_s: float = 60.0) -> dict[str, float]:
    end = time.monotonic() + deadline_s
    while True:
        m = server.metrics()
        if (m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0
                and m.get("vtoken:retained_blocks", 0) == 0 and m.get("vllm:kv_cache_usage_perc", 0) == 0):
            return m
        assert time.monotonic() < end, {k: v for k, v in m.items() if "usage" in k or "retained" in k or "num_req" in k}
        time.sleep(0.25)


def _finished(m: dict[str, float], reason: str) -> float:
    """``vllm:request_success_total`` for one ``finished_reason``."""
    return sum(v for k, v in m.items()
               if k.startswith("vllm:request_success_total{") and f'finished_reason="{reason}"' in k)


def _bad_request(server, kind: str, xargs, prompt) -> requests.Response:
    body = dict(model=MODEL_NAME, max_tokens=8, temperature=0.0)
    if xargs is not None:
        body["vllm_xargs"] = xargs
    text = prompt if prompt is not None else "hello"
    if kind == "completion":
        return server.post("/v1/completions", dict(body, prompt=text), timeout=60)
    return server.post("/v1/chat/completions", dict(body, messages=[{"role": "user", "content": text}]), timeout=60)


def _disconnect(server, prompt: str, xargs, chunks: int) -> int:
    """Open a long streaming request, read ``chunks`` data lines, then drop the connection."""
    body = dict(model=MODEL_NAME, prompt=prompt, max_tokens=1500, temperature=0.0, ignore_eos=True, stream=True)
    if xargs is not None:
        body["vllm_xargs"] = xargs
    got = 0
    r = requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=HTTP_TIMEOUT_S)
    try:
        assert r.status_code == 200, r.text
        for n, line in enumerate(r.iter_lines(decode_unicode=True)):
            if line and line.startswith("data: "):
                got += 1
            if got >= chunks or n > 1000:
                break
    finally:
        r.close()  # closes the socket mid-stream
    return got


def test_bad_requests_and_disconnects_while_others_in_flight(server):
    m0 = _wait_idle(server)
    kinds = ["completion", "chat"]
    goods = [(kinds[i % 2], PROMPTS[i], i % 2 == 1, GOOD_XARGS[i]) for i in range(4)]
    stop = threading.Event()
    bad_results: list[tuple[tuple, int, str]] = []
    disconnects: list[int] = []

    def storm():
        # bad requests and disconnecting clients, bounded in count, while the good ones decode
        for rnd in range(2):
            for j, (xargs, prompt, _want) in enumerate(BAD):
                r = _bad_request(server, kinds[(j + rnd) % 2], xargs, prompt)
                try:
                    msg = r.json()["error"]["message"]
                except Exception:  # noqa: BLE001
                    msg = r.text
                bad_results.append(((xargs, prompt), r.status_code, msg))
            disconnects.append(_disconnect(server, PROMPTS[rnd], GOOD_XARGS[rnd], 3 + rnd))
            if stop.is_set():
                break

    with ThreadPoolExecutor(max_workers=6) as ex:
        storms = [ex.submit(storm) for _ in range(2)]
        time.sleep(0.2)
        futs = [ex.submit(server.generate, kind, p, MAX_TOKENS, stream=stream, xargs=x) for kind, p, stream, x in goods]
        batch = [f.result(timeout=HTTP_TIMEOUT_S) for f in futs]
        stop.set()
        for s in storms:
            s.result(timeout=HTTP_TIMEOUT_S)
    assert len(bad_results) >= 2 * len(BAD) and len(disconnects) >= 2
    for (xargs, prompt), code, msg in bad_results:
        want = next(w for x, p, w in BAD if x == xargs and p == prompt)
        assert code == 400, (xargs, code, msg)
        for s in want:
            assert s in msg, (xargs, s, msg)
    assert all(d >= 3 for d in disconnects)
    _alive(server)
    m1 = _wait_idle(server)
    assert m1["vtoken:retained_blocks"] == 0 and m1["vllm:kv_cache_usage_perc"] == 0
    # the in-flight requests gave exactly what they give alone
    for (kind, p, stream, x), (pids, toks) in zip(goods, batch):
        spids, stoks = server.generate(kind, p, MAX_TOKENS, stream=stream, xargs=x)
        assert pids == spids and len(toks) == MAX_TOKENS
        assert toks == stoks, f"{kind} stream={stream} xargs={x}: in flight != solo"
    _alive(server)
    m2 = _wait_idle(server)
    # every bad request was refused before reaching the engine: only the good ones (in flight,
    # then solo) ran to their length, plus at most the disconnected streams that the fast tiny
    # model finished before the server saw the client go (a race, not an error)
    ran = _finished(m2, "length") - _finished(m0, "length")
    assert 2 * len(goods) <= ran <= 2 * len(goods) + len(disconnects), (ran, len(goods), len(disconnects))


def test_many_disconnects_leave_no_block(server):
    """Clients drop streams after 1..4 chunks, several at once (eviction on and off); once
    idle nothing is retained, and a fresh request equals its earlier solo result."""
    ref = server.generate("completion", PROMPTS[2], MAX_TOKENS, xargs=GOOD_XARGS[2])
    m0 = _wait_idle(server)
    with ThreadPoolExecutor(max_workers=4) as ex:
        got = list(ex.map(lambda i: _disconnect(server, PROMPTS[i % 4], GOOD_XARGS[i % 4], 1 + i % 4), range(8)))
    assert all(g >= 1 for g in got)
    _alive(server)
    m1 = _wait_idle(server)
    assert m1["vtoken:retained_blocks"] == 0 and m1["vllm:kv_cache_usage_perc"] == 0
    assert m1.get("vtoken:live_tokens", 0) == 0 and m1.get("vtoken:logical_tokens", 0) == 0
    # A stream the fast tiny model finishes before the server sees the client go counts as
    # finished (a race, not an error); what matters is that nothing is retained above.
    assert 0 <= _finished(m1, "length") - _finished(m0, "length") <= len(got)
    assert server.generate("completion", PROMPTS[2], MAX_TOKENS, xargs=GOOD_XARGS[2]) == ref
    _alive(server)
