"""ShareGPT multi-turn chats through the OpenAI server with prefix caching on, vToken off and on
(issues 12, 24).

Two ShareGPT conversations, three user turns each (cut to 120 characters), a shared system
prompt, the whole history resent each turn (``/v1/chat/completions``), 16 greedy output tokens.
The turns run one at a time, interleaved across the two conversations, so the prefix cache's
content before each request is a function of the earlier requests alone. Two servers (tiny
model, prefix caching on, ``--enable-prompt-tokens-details``): stock vLLM and vToken (H2O,
budget 96, slack 0, 64 attention-sink tokens so the system prompt stays, the default rule
``protect_cached_prefix: false``).

References, independent of the engine:

* **Stock hits.** vLLM caches the full blocks of each request's computed tokens (prompt plus
  output, less the last sampled token) and a request hits the longest run of whole blocks its
  prompt shares with a cached sequence, at most ``prompt - 1`` tokens.
* **vToken hits and tokens.** The same, except that a request's cached blocks stop at the tokens
  it computed before its first eviction (vLLM hashes its blocks as they fill until then): each
  request is replayed through the dense oracle with its protected prefix = its hit (H2O needs
  the statistics of the prompt, which a hit skips, so it keeps the hit), its tokens must equal
  the oracle's, and the oracle's first evicting step gives the blocks it leaves in the cache
  for the next requests.
* ``vllm:prefix_cache_hits_total`` / ``queries_total`` deltas equal the per-request sums; the
  pool and vToken's gauges return to idle.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from e2e_server import BLOCK_SIZE, MODEL_NAME, SERVER_ARGS, Server
from vtoken.config import parse_config
from drivers import launcher
from reference.oracle import oracle_generate

pytestmark = pytest.mark.engine

VT = {"policy": "h2o", "budget": 96, "slack": 0, "sink_tokens": 64, "prefix_hits": "protect"}  # (hits read and kept)
MAX_TOKENS = 16
TURNS = 3
SYSTEM = "You are a helpful assistant. Answer briefly and precisely, and say so when you do not know."
ARGS = [a for a in SERVER_ARGS if a != "--no-enable-prefix-caching"] + ["--enable-prefix-caching",
                                                                         "--enable-prompt-tokens-details"]


@pytest.fixture(scope="module")
def chats() -> list[list[str]]:
    """The user turns of the first two ASCII ShareGPT conversations with >= 3 user turns of
    >= 40 characters each, cut to 120 characters."""
    from vtoken.assets.paths import ensure_sharegpt

    out = []
    for conv in json.loads(Path(ensure_sharegpt()).read_text()):
        turns = [" ".join(t.get("value", "").split()) for t in conv.get("conversations") or []
                 if t.get("from") == "human"]
        turns = [t for t in turns if len(t) >= 40 and t.isascii()]
        if len(turns) >= TURNS:
            out.append([t[:120] for t in turns[:TURNS]])
        if len(out) == 2:
            return out
    raise AssertionError("ShareGPT has fewer than 2 usable multi-turn conversations")


def _run(model: str, log: Path, chats: list[list[str]], additional_config) -> dict:
    """Serve the chats turn by turn (c0t0, c1t0, c0t1, ...); per request: prompt and output
    token ids and cached tokens; the prefix-cache counter deltas and the idle state after."""
    with launcher.run_server(model, log, ARGS, additional_config, served_model_name=MODEL_NAME,
                             env=dict(OMP_NUM_THREADS="2", VLLM_LOGGING_LEVEL="INFO"),
                             start_timeout_s=600, server_cls=Server) as srv:
        m0 = srv.metrics()
        history: list[list[dict]] = [[{"role": "system", "content": SYSTEM}] for _ in chats]
        reqs = []
        for t in range(TURNS):
            for c, turns in enumerate(chats):
                history[c].append({"role": "user", "content": turns[t]})
                r = srv.post("/v1/chat/completions", dict(
                    model=MODEL_NAME, messages=history[c], max_tokens=MAX_TOKENS, temperature=0.0,
                    ignore_eos=True, return_token_ids=True))
                assert r.status_code == 200, r.text
                js = r.json()
                ch = js["choices"][0]
                history[c].append({"role": "assistant", "content": ch["message"]["content"]})
                reqs.append(dict(conv=c, turn=t, prompt=list(js.get("prompt_token_ids") or ch["prompt_token_ids"]),
                                 output=list(ch["token_ids"]),
                                 cached=(js["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)))
        deadline = time.monotonic() + 30
        while True:
            m1 = srv.metrics()
            if m1.get("vllm:num_requests_running", 0) == 0 and m1.get("vllm:kv_cache_usage_perc", 0) == 0:
                break
            assert time.monotonic() < deadline, "the server did not go idle"
            time.sleep(0.2)
    d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")}
    return dict(requests=reqs, metrics_delta=d, idle=m1)


def _hit(prompt: list[int], cached: list[tuple[int, ...]]) -> int:
    """The longest whole-block prefix of ``prompt`` (at most ``len(prompt) - 1`` tokens) that is
    a prefix of a cached sequence's full blocks."""
    best = 0
    for seq in cached:
        k = 0
        limit = min(len(seq), len(prompt) - 1) // BLOCK_SIZE
        while k < limit and tuple(prompt[k * BLOCK_SIZE:(k + 1) * BLOCK_SIZE]) == seq[k * BLOCK_SIZE:(k + 1) * BLOCK_SIZE]:
            k += 1
        best = max(best, k * BLOCK_SIZE)
    return best


@pytest.fixture(scope="module")
def stock(tiny_model, chats, tmp_path_factory):
    return _run(tiny_model, tmp_path_factory.mktemp("prefix_multiturn") / "stock.log", chats, None)


@pytest.fixture(scope="module")
def vtoken_run(tiny_model, chats, tmp_path_factory):
    return _run(tiny_model, tmp_path_factory.mktemp("prefix_multiturn") / "vtoken.log", chats, {"vtoken": VT})


def _check_counters(run: dict) -> None:
    reqs = run["requests"]
    assert run["metrics_delta"]["vllm:prefix_cache_hits_total"] == sum(r["cached"] for r in reqs)
    assert run["metrics_delta"]["vllm:prefix_cache_queries_total"] == sum(len(r["prompt"]) for r in reqs)
    assert run["idle"].get("vtoken:retained_blocks", 0) == 0 and run["idle"].get("vtoken:live_tokens", 0) == 0


def test_stock_hits_match_the_block_reference(stock):
    cached: list[tuple[int, ...]] = []
    for r in stock["requests"]:
        assert r["cached"] == _hit(r["prompt"], cached), (r["conv"], r["turn"])
        computed = len(r["prompt"]) + len(r["output"]) - 1
        seq = r["prompt"] + r["output"]
        cached.append(tuple(seq[: computed // BLOCK_SIZE * BLOCK_SIZE]))
    assert sum(r["cached"] > 0 for r in stock["requests"]) >= 4  # every later turn hits its history
    _check_counters(stock)


def test_vtoken_hits_and_tokens_match_the_oracle(vtoken_run, stock, oracle_model, capsys):
    """Each request's tokens equal the dense oracle with its cache hit protected; its hit equals
    the block reference over what the earlier requests computed before their first eviction
    (the oracle's first evicting step)."""
    cfg = parse_config(VT)
    cached: list[tuple[int, ...]] = []
    evicting = 0
    for r, s in zip(vtoken_run["requests"], stock["requests"]):
        where = (r["conv"], r["turn"])
        assert r["cached"] == _hit(r["prompt"], cached), where
        ref = oracle_generate(oracle_model, r["prompt"], MAX_TOKENS, cfg, protected_prefix=r["cached"])
        assert r["output"] == list(ref.token_ids), where
        dead = [int(p) for step in ref.evicted_positions for p in step]
        assert all(p >= r["cached"] for p in dead), where  # the hit is never evicted
        evicting += bool(dead)
        # step 0 is the prefill, step i >= 1 computes output token i - 1: before the first evicting
        # step i1 the request computed its prompt and i1 - 1 output tokens
        first = next((i for i, e in enumerate(ref.evicted_positions) if len(e)), None)
        computed = len(r["prompt"]) + (len(r["output"]) if first is None else first) - 1
        seq = r["prompt"] + r["output"]
        cached.append(tuple(seq[: computed // BLOCK_SIZE * BLOCK_SIZE]))
        if r["turn"] == 0:  # the first turns' prompts equal stock's; later ones hold vToken's replies
            assert r["prompt"] == s["prompt"], where
    assert evicting == len(vtoken_run["requests"])  # every request evicted
    hits = sum(r["cached"] for r in vtoken_run["requests"])
    assert hits > 0  # the histories' blocks were reused
    _check_counters(vtoken_run)
    q = {n: sum(len(r["prompt"]) for r in x["requests"]) for n, x in (("stock", stock), ("vtoken", vtoken_run))}
    h = {n: sum(r["cached"] for r in x["requests"]) for n, x in (("stock", stock), ("vtoken", vtoken_run))}
    with capsys.disabled():
        print(f"\n[prefix multi-turn] hit rate: stock {h['stock'] / q['stock']:.1%}, "
              f"vToken {h['vtoken'] / q['vtoken']:.1%}")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q", "-s"]))
