"""``decide_on: worker``'s vectorized count path against the per-request scheduler path.

The scheduler's count-only path (``sched/counts.py``: one numpy row per request,
``_vt_evict_fixed_counts`` and ``_vt_after_scheduled_counts`` over all rows at once) must reach the
same integers as ``decide_on: scheduler``, which picks the victims itself, one request at a time,
through a token table: how many tokens each request evicts and when (``evict_log``), its live and
logical counts, the blocks it holds, its lifetime block figures, the pool's free blocks, the tail
blocks handed back (``payload.truncate``), and the engine-wide counters. Which tokens go differs
(the worker picks them); how many must not.

Both schedulers are vLLM's real ``Scheduler`` with vToken, driven model-free by fake runner outputs
(``benchmarks/bench_scheduler.py``'s ``make_scheduler``) through a mixed workload: staggered
arrivals, prompts below and above their budgets, per-request budgets, policies and opt-outs
(``vllm_xargs``), small prefill chunks that interleave with decodes, slack, aborts and finishes,
so the rows are neither consecutive nor all decoding. Seconds, no model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_scheduler as bs  # noqa: E402

from vtoken.integrations.vllm.sched.counts import COLUMN_FIELDS  # noqa: E402

# (Naive-Evict's figures come from the worker's dead-block reports under decide_on: worker, and no
# worker runs here: tests/integration/test_worker_decisions.py checks them against the oracle)
FIGURES = tuple(f for f in COLUMN_FIELDS if f not in ("clean_len", "min_dst_slot", "score_need", "naive_block_steps",
                                                      "naive_peak_blocks"))
STAT_KEYS = ("evicted_tokens", "freed_blocks", "evictions", "request_faults")


def _workload(seed: int, n: int = 24) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        xargs = {}
        if rng.random() < 0.5:
            xargs["vtoken_budget"] = int(rng.choice([16, 40, 64, 100]))
        if rng.random() < 0.4:
            xargs["vtoken_policy"] = str(rng.choice(["random", "streaming", "h2o", "tova"]))
        if rng.random() < 0.15:
            xargs["vtoken_enable"] = False
        out.append(dict(rid=f"r{i}", prompt=rng.integers(0, 256, size=int(rng.integers(8, 260))).tolist(),
                        max_tokens=int(rng.integers(1, 90)), arrive=int(rng.integers(0, 50)), xargs=xargs,
                        abort=int(rng.integers(5, 120)) if rng.random() < 0.2 else None))
    return out


class _Run:
    """One scheduler (``arm``) through the workload, recording per step what the test compares."""

    def __init__(self, arm: str, work: list[dict], *, budget: int, slack: int, chunk: int, seed: int):
        self.sched = bs.make_scheduler(arm, num_requests=len(work), prompt_len=300, max_tokens=100, budget=budget,
                                       chunk=chunk, slack=slack)
        self.worker = arm.endswith(bs.WORKER_SUFFIX)
        self.work = work
        self.rng = np.random.default_rng(seed)

    def _add(self, w: dict) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=w["max_tokens"], ignore_eos=True, extra_args=w["xargs"] or None)
        self.sched.add_request(Request(w["rid"], list(w["prompt"]), sp, None))

    def _fake_output(self, out):
        from vllm.v1.outputs import ModelRunnerOutput

        from vtoken.policies.base import AttentionNeed

        sched = self.sched
        ids = list(out.num_scheduled_tokens)
        sampled = [[bs.SAMPLED_TOKEN] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
                   else [] for r in ids]
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled)
        payload = getattr(out, "vtoken", None)
        if payload is not None and payload.score_steps:  # decide_on: scheduler only
            scores = {}
            for rid in payload.score_steps:
                need = payload.scores.get(rid, 0)
                n = bs._live_tokens(sched, rid)
                scores[rid] = (self.rng.random(n) if need & AttentionNeed.COL_SUM.value else None,
                               self.rng.random(n) if need & AttentionNeed.LAST_ROW.value else None)
            mro.vtoken_scores = scores
        return mro

    def step(self, t: int) -> dict:
        from vllm.v1.request import RequestStatus

        sched = self.sched
        for w in self.work:
            if w["arrive"] == t:
                self._add(w)
            if w["abort"] == t and w["rid"] in sched.requests:
                sched.finish_requests(w["rid"], RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        payload = getattr(out, "vtoken", None)
        rec = dict(scheduled=dict(out.num_scheduled_tokens),
                   truncate=dict(payload.truncate) if payload is not None else {},
                   free=sched.kv_cache_manager.block_pool.get_num_free_blocks(), reqs={})
        for rid, st in sched._vt_states.items():
            rec["reqs"][rid] = dict(live=int(st.table.num_live), logical=int(st.table.num_logical),
                                    held=len(sched._vt_mgr.req_to_blocks.get(rid, ())),
                                    log=[tuple(map(int, e)) for e in st.evict_log],
                                    **{f: getattr(st, f) for f in FIGURES})
        if self.worker and payload is not None:
            # the payload's k is the count the scheduler path took this step
            rec["k"] = dict(payload.evict)
        sched.update_from_output(out, self._fake_output(out))
        s = sched.vt_stats.as_dict()
        rec["stats"] = {k: s[k] for k in STAT_KEYS}
        return rec


@pytest.mark.parametrize("seed, budget, slack, chunk", [(0, 48, 0, 64), (1, 32, 3, 40), (2, 64, 0, 100),
                                                        (3, 24, 5, 33)])
def test_worker_counts_equal_the_scheduler_path(seed, budget, slack, chunk):
    work = _workload(seed)
    a = _Run("random", work, budget=budget, slack=slack, chunk=chunk, seed=seed)
    b = _Run("random" + bs.WORKER_SUFFIX, work, budget=budget, slack=slack, chunk=chunk, seed=seed)
    evicting_steps = 0
    for t in range(400):
        ra, rb = a.step(t), b.step(t)
        ks = rb.pop("k", {})
        for rid, k in ks.items():  # each k the worker is sent: this step's logged count, or less (capped)
            step, asked = ra["reqs"][rid]["log"][-1]
            assert step == ra["reqs"][rid]["decode_steps"] and 0 < k <= asked, (t, rid, k, asked)
        for key in ("scheduled", "truncate", "free", "stats"):
            assert rb[key] == ra[key], (t, key)
        assert rb["reqs"].keys() == ra["reqs"].keys(), t
        for rid in ra["reqs"]:
            assert rb["reqs"][rid] == ra["reqs"][rid], (t, rid)
        evicting_steps += bool(ks)
        if t > max(w["arrive"] for w in work) and not a.sched.requests and not b.sched.requests:
            break
    else:
        pytest.fail("the workload did not finish in 400 steps")
    # not vacuous: requests evicted in many steps, several at once, and handed blocks back
    assert evicting_steps >= 20, evicting_steps
    assert ra["stats"]["evictions"] >= 100 and ra["stats"]["freed_blocks"] >= 10, ra["stats"]
