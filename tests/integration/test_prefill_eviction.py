"""Eviction during the prefill and prompts longer than the KV pool (issue 25, items 1-3;
``prefill_eviction: chunks``), at fixed eviction points (issue 41, item 1).

A request evicts during its prefill only at its eviction points, the logical positions that are
multiples of ``prefill_eviction_every`` (64 here), down to its budget, from the statistics of the
prompt so far; vLLM's chunked prefill (``max_num_batched_tokens`` = 72, or 40: not multiples of
the point distance) never schedules a chunk across a point. It never holds more than
``cdiv(budget + every + 1, B)`` blocks however long its prompt. Every policy, one mixed batch
(requests share the step's token budget, so the chunks vLLM schedules differ from request to
request and from load to load): each request's tokens equal the dense oracle cutting the prompt
at the points only (it never sees the engine's chunks), on V1 sync and on Model Runner V2 async,
and the same at another load. ``VTOKEN_CHECK=1``.
"""

from __future__ import annotations

import pytest

from vtoken.policies import available_policies
from vtoken.assets.paths import ensure_tiny_model
from vtoken.config import parse_config, parse_request_overrides
from drivers.harness import run_in_subprocess

from execution_paths import EXPECTED, path_env

pytestmark = pytest.mark.engine

B = 32
CHUNK = 72
EVERY = 64
BUDGET = 64
NEW = 24
VT = {"policy": "h2o", "budget": BUDGET, "slack": 0, "prefill_eviction": "chunks", "prefill_eviction_every": EVERY}
POLICIES = sorted(available_policies())  # every registered policy, a new one included


def _prompt(i: int, n: int) -> list[int]:
    return [((i + 5) * 31 + j * (7 + i % 6)) % 250 + 1 for j in range(n)]


REQUESTS = [dict(id=f"{pol}-{n}", prompt_token_ids=_prompt(k, n), max_tokens=NEW,
                 extra_args={"vtoken_policy": pol})
            for k, (pol, n) in enumerate((p, n) for p in POLICIES for n in (300, 130))]


def _engine(model: str) -> dict:
    return dict(model=model, dtype="float32", max_model_len=512, block_size=B, enforce_eager=True,
                gpu_memory_utilization=0.1, num_gpu_blocks_override=256, skip_tokenizer_init=True,
                enable_prefix_caching=False, max_num_batched_tokens=CHUNK, max_num_seqs=8,
                enable_chunked_prefill=True)


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(ensure_tiny_model())


@pytest.fixture(scope="module")
def oracle_model(tiny):
    import torch

    from reference.oracle import load_oracle_model

    torch.set_num_threads(2)
    return load_oracle_model(tiny)


@pytest.fixture(scope="module")
def oracle(oracle_model):
    from reference.oracle import oracle_generate

    return lambda prompt, cfg: oracle_generate(oracle_model, prompt, NEW, cfg)


def _crosses_a_point(chunks: list[int], every: int) -> bool:
    ends = [sum(chunks[:i + 1]) for i in range(len(chunks))]
    return any((e - q) // every != (e - 1) // every for e, q in zip(ends, chunks))


def _check(path: str, out: dict, oracle, chunk: int = CHUNK) -> None:
    assert out["paths"] == EXPECTED[path]
    s = out["vtoken"]["stats"]
    assert s["request_faults"] == 0 and s["evicted_tokens"] > 0
    assert out["free_blocks_end"] == out["free_blocks_start"] == out["num_blocks"] - 1
    fin = {f["req_id"].rsplit("-", 1)[0]: f for f in out["vtoken"]["finished"]}
    base = parse_config(VT)
    bad, chunked, events = [], 0, 0
    for r in REQUESTS:
        f = fin[r["id"]]
        chunks = f["prefill_chunks"]
        assert sum(chunks) == len(r["prompt_token_ids"]) and max(chunks) <= chunk, (r["id"], chunks)
        assert not _crosses_a_point(chunks, EVERY), (r["id"], chunks)
        ref = oracle(r["prompt_token_ids"], parse_request_overrides(r["extra_args"]).apply(base))
        if out["tokens"][r["id"]] != list(ref.token_ids):
            bad.append(r["id"])
        # evictions before a prefill chunk are logged at decode step 0, one per chunk boundary that evicted
        between = [k for d, k in f["evict_log"] if d == 0]
        assert len(between) == sum(len(e) > 0 for e in ref.prefill_evicted_positions), r["id"]
        # ... and in prefill_evict_log with the eviction point (logical position // EVERY)
        assert [c for c, _ in f["prefill_evict_log"]] == [
            c + 1 for c, e in enumerate(ref.prefill_evicted_positions) if len(e)], r["id"]
        chunked += bool(between)
        events += len(between)
        # the bound: never more than budget + every (+1: the token sampled last) live tokens
        assert f["peak_blocks"] <= -(-(BUDGET + EVERY + 1) // B), (r["id"], f["peak_blocks"])
    assert not bad, f"{path}: {bad}"
    assert chunked >= len(POLICIES)  # every 300-token prompt evicted at its points
    assert s["prefill_evictions"] == events  # vtoken:prefill_evictions_total
    return {r["id"]: out["tokens"][r["id"]] for r in REQUESTS}, {r["id"]: fin[r["id"]]["prefill_chunks"] for r in REQUESTS}


def test_v1_sync(tiny, oracle):
    out = run_in_subprocess(dict(engine=_engine(tiny), vtoken=VT, requests=REQUESTS), env=path_env("v1-sync"))
    _check("v1-sync", out, oracle)


def test_same_tokens_at_another_load(tiny, oracle):
    """Issue 41, item 1: the same requests under another step budget (40 tokens, 2 running at
    most) are cut into other chunks, and give the same tokens (the oracle's, which never sees the
    chunks). Without the fixed points, the evictions follow the chunks and the tokens differ."""
    eng = dict(_engine(tiny), max_num_batched_tokens=40, max_num_seqs=2)
    out = run_in_subprocess(dict(engine=eng, vtoken=VT, requests=REQUESTS), env=path_env("v1-sync"))
    tokens, chunks = _check("v1-sync", out, oracle, chunk=40)
    assert any(c != [EVERY] * (len(c) - 1) + [c[-1]] for c in chunks.values())  # chunks other than the points


def test_mrv2_async(tiny, oracle):
    out = run_in_subprocess(dict(engine=_engine(tiny), vtoken=VT, requests=REQUESTS), env=path_env("mrv2-async"))
    _check("mrv2-async", out, oracle)


# Compressing the prompt (SnapKV as its paper runs it, approximated with existing settings;
# bench_quality --compress and the budget-512 SLA run): slack = max_tokens and score_every beyond
# max_tokens, so no decode step asks for statistics, and a decode step evicts only once the live
# count passes budget + slack. With eviction points every 72 tokens a 130-token prompt is cut once,
# at the first decode step, to the budget, and keeps all its generated tokens, where it stays within
# budget + slack at its points; otherwise it is also cut at its points, and the tokens after its last
# point count against the slack (so it may evict again late, from the prefill's statistics). Tokens
# equal the dense oracle's either way.
COMPRESS_VT = dict(VT, policy="snapkv", slack=NEW, score_every=1000, prefill_eviction_every=CHUNK)
COMPRESS = [dict(id=f"{pol}-{n}", prompt_token_ids=_prompt(k, n), max_tokens=NEW, extra_args={"vtoken_policy": pol})
            for k, (pol, n) in enumerate((p, n) for p in ("snapkv", "tova", "h2o") for n in (300, 130))]


def test_prompt_compression_with_slack_and_score_every(tiny, oracle):
    out = run_in_subprocess(dict(engine=_engine(tiny), vtoken=COMPRESS_VT, requests=COMPRESS), env=path_env("v1-sync"))
    assert out["vtoken"]["stats"]["request_faults"] == 0
    assert out["free_blocks_end"] == out["free_blocks_start"] == out["num_blocks"] - 1
    fin = {f["req_id"].rsplit("-", 1)[0]: f for f in out["vtoken"]["finished"]}
    base = parse_config(COMPRESS_VT)
    for r in COMPRESS:
        f = fin[r["id"]]
        ref = oracle(r["prompt_token_ids"], parse_request_overrides(r["extra_args"]).apply(base))
        assert out["tokens"][r["id"]] == list(ref.token_ids), r["id"]
        assert f["evicted"] == ref.num_evicted + sum(map(len, ref.prefill_evicted_positions)), r["id"]
    # a 130-token prompt cut once, at the first decode step, to the budget, and every generated token
    # kept, whatever chunks vLLM scheduled for it beside the others
    once = [r["id"] for r in COMPRESS if fin[r["id"]]["evict_log"] == [[1, len(r["prompt_token_ids"]) - BUDGET]]]
    assert once == ["snapkv-130", "tova-130", "h2o-130"], {r["id"]: fin[r["id"]]["evict_log"] for r in COMPRESS}


# Item 1 under pressure pacing: a request evicts at the eviction points of its prompt only when the
# pool is short, as in decode. 33 usable blocks for eight running requests (the 300-token prompts
# alone would need 80 without eviction); the engine logs which points evicted how many
# (prefill_evict_log) and the oracle replays those and the decode steps' counts (the victims are the
# policy's own, as under fixed pacing). Pressure is spread over the requests with the most
# reclaimable blocks, so most points do not evict.
PRESSURE_BLOCKS = 34


def test_pressure_pacing_between_chunks(tiny, oracle_model):
    from reference.oracle import oracle_generate, prefill_points

    vt = dict(VT, pacing="pressure")
    out = run_in_subprocess(dict(engine=dict(_engine(tiny), num_gpu_blocks_override=PRESSURE_BLOCKS), vtoken=vt,
                                 requests=REQUESTS), env=path_env("v1-sync"))
    s = out["vtoken"]["stats"]
    assert s["request_faults"] == 0 and s["preemption_resets"] == 0 and s["pressure_events"] > 0
    assert out["free_blocks_end"] == out["free_blocks_start"] == PRESSURE_BLOCKS - 1
    fin = {f["req_id"].rsplit("-", 1)[0]: f for f in out["vtoken"]["finished"]}
    base = parse_config(vt)
    bad, between, boundaries_over = [], 0, 0
    for r in REQUESTS:
        f = fin[r["id"]]
        pre = {int(c): int(k) for c, k in f["prefill_evict_log"]}
        # the same evictions, in evict_log at decode step 0
        assert [k for d, k in f["evict_log"] if d == 0] == [k for _, k in f["prefill_evict_log"]], r["id"]
        cfg = parse_request_overrides(r["extra_args"]).apply(base)
        points = prefill_points(len(r["prompt_token_ids"]), cfg)
        assert all(1 <= c < len(points) for c in pre), (r["id"], pre)
        ref = oracle_generate(oracle_model, r["prompt_token_ids"], NEW, cfg, prefill_evict_schedule=pre,
                              evict_schedule={int(d): int(k) for d, k in f["evict_log"] if d > 0})
        if out["tokens"][r["id"]] != list(ref.token_ids):
            bad.append(r["id"])
        assert ref.num_evicted + sum(map(len, ref.prefill_evicted_positions)) == f["evicted"], r["id"]
        between += len(pre)
        # the points where fixed pacing would have evicted (live above the budget there)
        live = 0
        for c, q in enumerate(points):
            if c:
                boundaries_over += live > BUDGET
                live -= pre.get(c, 0)
            live += q
    assert not bad, bad
    assert s["prefill_evictions"] == between and 3 <= between < boundaries_over // 2, (between, boundaries_over)


# Item 2: a prompt 4x longer than the KV pool (the 8,192 tokens in 2,048 at budget 512, chunk
# 256, scaled by 1/4 to the tiny model's 4,096 positions): 16 usable blocks of 32 = 512 tokens, a
# 2,048-token prompt, budget 128, eviction points every 64 tokens (and chunks of 64). Stock vLLM refuses to start (max_model_len does not fit).
LONG_ENGINE = dict(max_model_len=2100, num_gpu_blocks_override=17, max_num_batched_tokens=64, max_num_seqs=4)
LONG_VT = dict(VT, budget=128)
LONG = [dict(id="long", prompt_token_ids=_prompt(40, 2048), max_tokens=NEW, extra_args=None)]


def test_prompt_longer_than_the_kv_pool_is_served(tiny, oracle):
    out = run_in_subprocess(dict(engine=dict(_engine(tiny), **LONG_ENGINE), vtoken=LONG_VT, requests=LONG),
                            env=path_env("v1-sync"))
    f, = out["vtoken"]["finished"]
    assert len(out["tokens"]["long"]) == NEW and f["prompt_len"] == 2048
    assert out["num_blocks"] - 1 == 16 and out["vtoken"]["stats"]["preemption_resets"] == 0
    ref = oracle(LONG[0]["prompt_token_ids"], parse_config(LONG_VT))
    assert out["tokens"]["long"] == list(ref.token_ids)
    assert f["peak_blocks"] <= -(-(128 + 64 + 1) // B) == 7
    assert out["free_blocks_end"] == out["free_blocks_start"] == 16


def test_stock_vllm_refuses_that_engine(tiny):
    with pytest.raises(RuntimeError, match="max seq len"):
        run_in_subprocess(dict(engine=dict(_engine(tiny), **LONG_ENGINE), vtoken=None, requests=LONG),
                          env=path_env("v1-sync"))


def test_naive_evict_keeps_stock_admission(tiny, oracle):
    """Naive-Evict frees a block only once every token in it is dead, so its requests get no
    admission bound: with 14 usable blocks two 300-token prompts (10 blocks each) run one after
    the other, as in stock vLLM, never preempted; a prompt longer than the pool is refused at
    start-up by vLLM's own check (vToken's mode admits both at once, bounded at 5 blocks each)."""
    from vtoken.integrations.vllm.sched.admission import engine_bound
    from types import SimpleNamespace

    two = [dict(id=f"n{i}", prompt_token_ids=_prompt(60 + i, 300), max_tokens=NEW, extra_args=None) for i in range(2)]
    runs = {}
    for mode in ("naive", "vtoken"):
        # (a step budget of one point's tokens: the first request takes all of it, as in stock vLLM)
        out = run_in_subprocess(dict(engine=dict(_engine(tiny), num_gpu_blocks_override=15, max_model_len=448,
                                                  max_num_batched_tokens=EVERY), vtoken=dict(VT, mode=mode),
                                     requests=two), env=path_env("v1-sync"))
        assert out["free_blocks_end"] == out["free_blocks_start"] == 14
        runs[mode] = out
    assert runs["naive"]["vtoken"]["stats"]["preemption_resets"] == 0
    for mode, out in runs.items():  # the same decisions as the oracle on each request's own chunks
        fin = {f["req_id"].rsplit("-", 1)[0]: f for f in out["vtoken"]["finished"]}
        for r in two:
            ref = oracle(r["prompt_token_ids"], parse_config(dict(VT, mode=mode)))
            assert out["tokens"][r["id"]] == list(ref.token_ids), (mode, r["id"])
    # vToken runs both at once (bounded), Naive-Evict one after the other (the second waits)
    first = lambda out: {f["req_id"].rsplit("-", 1)[0]: f["prefill_chunks"] for f in out["vtoken"]["finished"]}  # noqa: E731
    assert first(runs["naive"])["n0"] == [EVERY] * 4 + [300 - 4 * EVERY], first(runs["naive"])
    assert first(runs["vtoken"])["n1"] != [EVERY] * 4 + [300 - 4 * EVERY], first(runs["vtoken"])
    cfg = lambda mode: SimpleNamespace(additional_config={"vtoken": dict(VT, mode=mode)},  # noqa: E731
                                       scheduler_config=SimpleNamespace(max_num_batched_tokens=CHUNK))
    assert engine_bound(cfg("vtoken")) == BUDGET + EVERY + 1 and engine_bound(cfg("naive")) is None
    with pytest.raises(RuntimeError, match="max seq len"):
        run_in_subprocess(dict(engine=dict(_engine(tiny), **LONG_ENGINE), vtoken=dict(LONG_VT, mode="naive"),
                               requests=LONG), env=path_env("v1-sync"))


def test_pool_below_one_requests_bound_is_refused_by_vtoken_first(tiny):
    """A pool (16 blocks, 512 tokens) below one request's bound (budget 128 + slack 0 + eviction
    points every 1,024 tokens + 1 = 1,153 tokens, itself below max_model_len 2,100): vToken's
    refusal leads the message, naming the bound, the pool and the options that change them; vLLM's
    own check follows. A bound at or above max_model_len leaves vLLM's own refusal as it is."""
    with pytest.raises(RuntimeError, match=r"ValueError: vToken: the KV cache holds \d+ tokens, below one request's "
                                           r"bound of 1153 tokens \(prefill_eviction chunks: vtoken.budget \+ slack \+ "
                                           r"vtoken.prefill_eviction_every \+ 1\); raise the KV cache "
                                           r"\(--kv-cache-memory-bytes"):
        run_in_subprocess(dict(engine=dict(_engine(tiny), **LONG_ENGINE),
                               vtoken=dict(LONG_VT, prefill_eviction_every=1024), requests=LONG), env=path_env("v1-sync"))
    with pytest.raises(RuntimeError, match="max seq len") as e:
        run_in_subprocess(dict(engine=dict(_engine(tiny), **LONG_ENGINE),
                               vtoken=dict(LONG_VT, prefill_eviction_every=2048), requests=LONG), env=path_env("v1-sync"))
    assert "vToken: the KV cache holds" not in str(e.value)


def test_decide_on_scheduler_is_refused_by_name():
    from vtoken.config import VTokenConfigError

    with pytest.raises((ValueError, VTokenConfigError), match="vtoken.decide_on = 'scheduler': the scheduler-side "
                                                              "eviction path was removed"):
        parse_config(dict(VT, decide_on="scheduler"))
    assert parse_config(dict(VT, decide_on="worker")) == parse_config(VT)  # deprecated, no effect
    assert parse_config(dict(VT, pacing="pressure")).prefill_eviction == "chunks"


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
