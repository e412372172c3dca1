"""The model-free scheduler driver of ``benchmarks/bench_scheduler.py`` on one tiny cell.

4 requests x 64 live tokens (prompt 128, budget 64, block size 32), 3 timed decode steps, arms
``stock``, ``h2o`` and ``random`` (vToken's default config apart from budget and slack), prefill in
chunks of 96 tokens so partial prefill chunks (no sampled token; ``prefill_eviction: chunks``
evicting between them) happen too. Checks exact facts of every timed step: every request is
scheduled with 1 token; vToken keeps the budget (its live count is the budget plus this step's
token, ``ceil(live/32)`` blocks, one eviction per request and step); the payload carries counts
only (``evict == {rid: 1}`` for every request; H2O asks the worker for its statistics, Random for
none); the stock scheduler holds ``ceil(tokens/32)`` blocks per request. Then the worker-side
timing (``WorkerStep``/``time_worker``: DeviceDecider observe + evict + append) on a tiny size. A
few seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_scheduler as bs  # noqa: E402

R, LIVE, STEPS, WARMUP, CHUNK = 4, 64, 3, 1, 96
ARMS = ("stock", "h2o", "random")
VT_ARMS = ("h2o", "random")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def cell():
    seen: dict[str, list] = {arm: [] for arm in ARMS}
    partial_prefill = {arm: 0 for arm in ARMS}

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
        mgr = sched.kv_cache_manager.coordinator.single_type_managers[0]
        for req in sched.running:
            rid = req.request_id
            blocks = len(sched.kv_cache_manager.get_block_ids(rid)[0])
            r = dict(blocks=blocks, mgr_blocks=len(mgr.req_to_blocks[rid]), computed=req.num_computed_tokens,
                     tokens=req.num_tokens, outputs=req.num_output_tokens)
            if snap is not None:
                r.update(num_live=snap["requests"][rid]["num_live"], vt_blocks=snap["requests"][rid]["blocks"],
                         live_helper=bs._live_tokens(sched, rid))
            rec["reqs"][rid] = r
        payload = getattr(out, "vtoken", None)
        if payload is not None:
            rec["payload"] = dict(evict=dict(payload.evict), scores=dict(payload.scores),
                                  fields=sorted(vars(payload)))
        if snap is not None:
            rec["evictions"] = snap["stats"]["evictions"]
            rec["faults"] = snap["stats"]["request_faults"]
        seen[driver.arm].append(rec)

    res = bs.run_cell(R, LIVE, arms=ARMS, steps=STEPS, warmup=WARMUP, chunk=CHUNK, seed=0, on_step=on_step)
    return res, seen, partial_prefill


def test_cell_result(cell):
    res, _, partial = cell
    assert res["prompt_len"] == 2 * LIVE and res["budget"] == LIVE
    for arm in ARMS:
        a = res["arms"][arm]
        assert a["steps"] == STEPS
        assert a["checks_ok"], a["check_failures"]
        assert a["prefill_steps"] >= cdiv(R * 2 * LIVE, CHUNK)  # chunked: several prefill steps
        assert a["total"]["median_ms"] > 0
        assert partial[arm] > 0  # some prefill chunks were partial
    for arm in VT_ARMS:
        a = res["arms"][arm]
        assert a["faults"] == 0 and a["mean_evicted_per_step"] == R
        # the default config apart from budget and slack: no other key set, prefill cut between chunks
        assert a["vtoken_config"] == {"policy": arm, "budget": LIVE, "slack": 0}
        assert a["prefill_eviction"] == "chunks"
        assert set(a) >= {"evict", "stock_schedule_part", "total", "schedule", "update"}
        assert "decide_on" not in a and "mean_moves_per_step" not in a
    assert set(res["arms"]["stock"]).isdisjoint({"evict", "vtoken_config", "mean_evicted_per_step"})


def test_every_request_scheduled_one_token(cell):
    _, seen, _ = cell
    for arm in ARMS:
        assert len(seen[arm]) == STEPS
        for rec in seen[arm]:
            assert sorted(rec["scheduled"]) == [f"req-{i}" for i in range(R)]
            assert set(rec["scheduled"].values()) == {1}
            assert sorted(rec["reqs"]) == sorted(rec["scheduled"])  # all running, none preempted


@pytest.mark.parametrize("arm", VT_ARMS)
def test_vtoken_keeps_the_budget(cell, arm):
    _, seen, _ = cell
    prev_evictions = None
    for rec in seen[arm]:
        assert rec["faults"] == 0
        for rid, r in rec["reqs"].items():
            # after the step: the budget kept by this step's eviction plus the token it appended
            assert r["num_live"] == r["live_helper"] == LIVE + 1, (rid, r)
            assert r["blocks"] == r["mgr_blocks"] == r["vt_blocks"] == cdiv(LIVE + 1, bs.BLOCK_SIZE) == 3, (rid, r)
            # vLLM's own count runs on: the logical context keeps growing
            assert r["computed"] == r["tokens"] - 1 > 2 * LIVE
        if prev_evictions is not None:
            assert rec["evictions"] - prev_evictions == R  # every request evicted in every step
        prev_evictions = rec["evictions"]


@pytest.mark.parametrize("arm", VT_ARMS)
def test_payload_carries_counts_only(cell, arm):
    from vtoken.policies.base import AttentionNeed

    _, seen, _ = cell
    for rec in seen[arm]:
        pl = rec["payload"]
        assert pl["evict"] == {f"req-{i}": 1 for i in range(R)}  # k = 1 for every request
        # the worker picks the victims and plans the moves: no slots or scores travel
        assert not {"src", "dst", "score_steps", "refill"} & set(pl["fields"]), pl["fields"]
        if arm == "h2o":  # the worker is asked for H2O's col_sum for every request
            assert pl["scores"] == {f"req-{i}": AttentionNeed.COL_SUM.value for i in range(R)}
        else:  # Random needs no statistics
            assert pl["scores"] == {}


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


@pytest.mark.parametrize("policy", bs.WORKER_POLICIES)
def test_worker_step(policy):
    why = bs.worker_available()
    if why:
        pytest.skip(why)
    w = bs.WorkerStep(policy, R, LIVE)
    assert w.live_counts() == [LIVE + 1] * R
    assert (w.col_sum is not None) == (policy == "h2o") and w.last_row is None
    assert (w.sinks, w.recent) == ((0, LIVE // 2) if policy == "h2o" else (0, 0))
    pos0 = [w.dec.logical_pos(i, w.table()[i]).tolist() for i in range(R)]
    assert pos0 == [list(range(LIVE + 1))] * R
    ev = w.step()
    assert ev.new_live.tolist() == [LIVE] * R and sorted(ev.evicted_rows.tolist()) == list(range(R))
    assert w.live_counts() == [LIVE + 1] * R  # after evict(1) + append(1): back to L + 1
    for i in range(R):
        pos = w.dec.logical_pos(i, w.table()[i]).tolist()
        victim = int(ev.evicted_pos[ev.evicted_rows == i])
        assert sorted(pos) == [p for p in range(LIVE + 2) if p != victim]  # the new token is position L + 1
        assert victim < LIVE + 1 - w.recent  # never in the recent window
    # each request's slots stay in its own blocks
    nb = cdiv(LIVE + 1, bs.BLOCK_SIZE)
    assert w.bt.tolist() == [list(range(i * nb, (i + 1) * nb)) for i in range(R)]


@pytest.mark.parametrize("policy", bs.WORKER_POLICIES)
def test_time_worker(policy):
    why = bs.worker_available()
    if why:
        pytest.skip(why)
    t = bs.time_worker(policy, R, LIVE, reps=3, threads=1)
    assert t["policy"] == policy and t["device"] == "cpu" and t["threads"] == 1
    assert t["num_requests"] == R and t["live"] == LIVE and t["num_live"] == LIVE + 1 and t["reps"] == 3
    assert 0 < t["min_ms"] <= t["median_ms"] <= t["max_ms"]


def test_worker_reps():
    assert bs.worker_reps(10, 256, 2048) == 10
    assert bs.worker_reps(10, 512, 8192) == 5 and bs.worker_reps(4, 512, 8192) == 3


def test_arm_names():
    assert bs.ARMS == ("stock", "h2o", "random")
    assert bs.arm_policy("stock") is None and bs.arm_policy("h2o") == "h2o"
    assert [bs.arm_label(a) for a in bs.ARMS] == ["stock", "vT h2o", "vT random"]
    assert bs.vtoken_config("random", 512) == {"policy": "random", "budget": 512, "slack": 0}


def test_scheduler_config_is_the_default_one():
    sched = bs.make_scheduler("h2o", num_requests=2, prompt_len=128, max_tokens=8, budget=64, chunk=96)
    from vtoken.config import VTokenConfig

    assert sched.vt_cfg == VTokenConfig(policy="h2o", budget=64, slack=0)
    assert sched.vt_cfg.resolved_prefill_eviction() == "chunks" and sched.vt_cfg.pacing == "fixed"
