"""The model-free scheduler driver of ``benchmarks/bench_scheduler.py`` on one tiny cell.

4 requests x 64 live tokens (prompt 128, budget 64, block size 32), 3 timed decode steps, arms
``stock`` and ``h2o``, prefill in chunks of 96 tokens so partial prefill chunks (no sampled
token, H2O scores for a partial prompt) happen too. Checks exact facts of every timed step:
every request is scheduled with 1 token; vToken keeps the budget (its live count is the budget
plus this step's token, ``ceil(live/32)`` blocks, one eviction per request and step); the stock
scheduler holds ``ceil(tokens/32)`` blocks per request. A few seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_scheduler as bs  # noqa: E402

R, LIVE, STEPS, WARMUP, CHUNK = 4, 64, 3, 1, 96


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def cell():
    seen: dict[str, list] = {"stock": [], "h2o": []}
    partial_prefill = {"stock": 0, "h2o": 0}

    def on_step(driver, out, timed):
        sched = driver.sched
        if not timed:
            # a prefill step that did not complete a request's prompt samples nothing for it
            partial_prefill[driver.arm] += sum(
                1 for rid in out.num_scheduled_tokens
                if sched.requests[rid].num_output_tokens == 0)
            return
        rec = dict(scheduled=dict(out.num_scheduled_tokens), reqs={})
        snap = sched.vt_snapshot() if driver.vtoken else None
        for req in sched.running:
            rid = req.request_id
            blocks = len(sched.kv_cache_manager.get_block_ids(rid)[0])
            r = dict(blocks=blocks, computed=req.num_computed_tokens, tokens=req.num_tokens,
                     outputs=req.num_output_tokens)
            if snap is not None:
                r.update(num_live=snap["requests"][rid]["num_live"], vt_blocks=snap["requests"][rid]["blocks"])
            rec["reqs"][rid] = r
        if snap is not None:
            rec["evictions"] = snap["stats"]["evictions"]
            rec["faults"] = snap["stats"]["request_faults"]
        seen[driver.arm].append(rec)

    res = bs.run_cell(R, LIVE, arms=("stock", "h2o"), steps=STEPS, warmup=WARMUP, chunk=CHUNK, seed=0,
                      on_step=on_step)
    return res, seen, partial_prefill


def test_cell_result(cell):
    res, _, partial = cell
    assert res["prompt_len"] == 2 * LIVE and res["budget"] == LIVE
    for arm in ("stock", "h2o"):
        a = res["arms"][arm]
        assert a["steps"] == STEPS
        assert a["checks_ok"], a["check_failures"]
        assert a["prefill_steps"] >= cdiv(R * 2 * LIVE, CHUNK)  # chunked: several prefill steps
        assert a["total"]["median_ms"] > 0
        assert partial[arm] > 0  # some prefill chunks were partial
    assert res["arms"]["h2o"]["faults"] == 0  # the fake scores had the right lengths


def test_every_request_scheduled_one_token(cell):
    _, seen, _ = cell
    for arm in ("stock", "h2o"):
        assert len(seen[arm]) == STEPS
        for rec in seen[arm]:
            assert sorted(rec["scheduled"]) == [f"req-{i}" for i in range(R)]
            assert set(rec["scheduled"].values()) == {1}
            assert sorted(rec["reqs"]) == sorted(rec["scheduled"])  # all running, none preempted


def test_vtoken_keeps_the_budget(cell):
    _, seen, _ = cell
    prev_evictions = None
    for rec in seen["h2o"]:
        assert rec["faults"] == 0
        for rid, r in rec["reqs"].items():
            # after the step: the budget kept by this step's eviction plus the token it appended
            assert r["num_live"] == LIVE + 1, (rid, r)
            assert r["blocks"] == r["vt_blocks"] == cdiv(LIVE + 1, bs.BLOCK_SIZE) == 3, (rid, r)
            # vLLM's own count runs on: the logical context keeps growing
            assert r["computed"] == r["tokens"] - 1 > 2 * LIVE
        if prev_evictions is not None:
            assert rec["evictions"] - prev_evictions == R  # every request evicted in every step
        prev_evictions = rec["evictions"]


def test_stock_blocks_follow_tokens(cell):
    _, seen, _ = cell
    outputs = None
    for rec in seen["stock"]:
        for rid, r in rec["reqs"].items():
            assert r["computed"] == r["tokens"] - 1  # the token just sampled has no KV yet
            assert r["blocks"] == cdiv(r["computed"], bs.BLOCK_SIZE), (rid, r)
        outs = {rid: r["outputs"] for rid, r in rec["reqs"].items()}
        if outputs is not None:
            assert all(outs[rid] == outputs[rid] + 1 for rid in outs)  # one token per request per step
        outputs = outs


def test_worker_select_timing():
    why = bs.select_available()
    if why:
        pytest.skip(why)
    s = bs.time_select(R, LIVE + 1, reps=2, recent=LIVE // 2)
    assert s["num_requests"] == R and s["num_live"] == LIVE + 1 and s["median_ms"] > 0
