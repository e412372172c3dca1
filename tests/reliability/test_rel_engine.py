"""Faults and isolation inside a real engine, against solo runs in another engine run.

Two engine runs (``_engine_runner.py``, ``VTOKEN_CHECK=1``: block ownership and per-request
block counts are asserted after every step) with the same engine config, a 40-block pool
(39 usable) and H2O, budget 40, slack 0 as the engine default:

* the **batch run**: three groups one after another: ``mix`` (isolation: eviction on with
  several policies and budgets, eviction off, one budget above the length), ``faults``
  (aborts while waiting, mid chunked prefill, right after an eviction, inside the step
  whose schedule() evicted and planned token moves, mid-decode) and ``storm`` (more
  eviction-off demand than the pool holds: preemptions);
* the **solo run**: every surviving request alone (one group each).

After every group the pool's free count is back at its start (39) and the scheduler tracks
no request. Every surviving request's tokens equal its solo run's, preempted ones included:
a preempted eviction-on request resumes with the live K/V and policy state the worker saved
(docs/integration.md, "Preemption"). The engine keeps ``prefill_eviction: after`` here: with
``chunks`` a prompt is cut wherever vLLM's load-dependent chunk boundaries fall, so a batch and a
solo run may cut a long prompt at different points (a known limit of the default, named in
docs/configuration.md).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from _engine_runner import run_in_subprocess
from execution_paths import EXPECTED, path_env

pytestmark = pytest.mark.engine

VT = {"policy": "h2o", "budget": 40, "slack": 0, "prefill_eviction": "after"}
OFF = {"vtoken_enable": False}


def _prompt(i: int, n: int) -> list[int]:
    return [((i + 3) * 37 + j * (11 + i % 5)) % 250 + 1 for j in range(n)]


def _engine(model: str) -> dict:
    return dict(model=model, dtype="float32", max_model_len=512, block_size=32, enforce_eager=True,
                gpu_memory_utilization=0.1, num_gpu_blocks_override=40, skip_tokenizer_init=True,
                max_num_batched_tokens=256, max_num_seqs=16)


def _r(rid, i, plen, max_tokens, extra=None, **kw):
    return dict(id=rid, prompt_token_ids=_prompt(i, plen), max_tokens=max_tokens, extra_args=extra, **kw)


MIX = [
    _r("iso-off-a", 1, 70, 32, OFF),
    _r("iso-off-b", 2, 150, 32, OFF),
    _r("iso-h2o-40", 3, 90, 32),
    _r("iso-tova-29", 4, 100, 32, {"vtoken_policy": "tova", "vtoken_budget": 29}),
    _r("iso-scissorhands-64", 5, 120, 32, {"vtoken_policy": "scissorhands", "vtoken_budget": 64}),
    _r("iso-streaming-45", 6, 60, 32, {"vtoken_policy": "streaming", "vtoken_budget": 45}),
    _r("iso-random-33", 7, 80, 32, {"vtoken_policy": "random", "vtoken_budget": 33}),
    _r("iso-h2o-512", 8, 50, 32, {"vtoken_budget": 512}),  # max_model_len: never evicts (more is refused)
]
FAULTS = [
    # step 0: three short prompts prefill together (190 tokens <= 256 per step)
    _r("a-evict", 10, 80, 40, abort="after_eviction"),
    _r("a-repack", 11, 70, 40, {"vtoken_policy": "tova"}, abort="in_repack"),
    _r("f-off", 12, 40, 64, OFF),
    # step 2: a 400-token prompt, chunked; aborted after its first chunk
    _r("a-prefill", 13, 400, 40, arrive_at_step=2, abort="prefill"),
    # step 4: survivors with eviction, an eviction-off request aborted mid-decode
    _r("f-h2o", 14, 70, 48, arrive_at_step=4),
    _r("f-tova", 15, 55, 48, {"vtoken_policy": "tova", "vtoken_budget": 33}, arrive_at_step=4),
    _r("a-decode-off", 16, 60, 48, OFF, arrive_at_step=4, abort_after_steps=10),
    # step 5: aborted while still waiting
    _r("a-wait", 17, 50, 40, arrive_at_step=5, abort="waiting"),
]
# 6 x ceil(220/32) = 42 blocks of eviction-off demand > 39: preemption storm
STORM = [_r(f"s-off-{i}", 20 + i, 120, 100, OFF) for i in range(6)]
STORM += [_r(f"s-on-{i}", 30 + i, 120, 100, {"vtoken_policy": ["h2o", "tova", "streaming"][i]}) for i in range(3)]
#: requests allowed to differ from their solo run: none. (Scissorhands' ``< 1/t`` test flipped here
#: while the batched decode scorer computed in float32, which rounds with the batch's padded width;
#: it computes in float64 now, ``StepScores._fold_singles``.)
BATCH_DEPENDENT: set = set()
ABORTED = {"a-evict", "a-repack", "a-prefill", "a-decode-off", "a-wait"}
GROUPS = {"mix": MIX, "faults": FAULTS, "storm": STORM}


def _run(spec: dict, name: str, path_name: str = "v1-sync") -> dict:
    """One engine run on an execution path; ``VTOKEN_REL_CACHE=<dir>`` (development only) reuses a
    stored result of the same spec."""
    cache = os.environ.get("VTOKEN_REL_CACHE")
    if not cache:
        return run_in_subprocess(spec, env=path_env(path_name))
    key = hashlib.sha256(json.dumps([spec, path_name], sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache) / f"{name}-{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    out = run_in_subprocess(spec, env=path_env(path_name))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


@pytest.fixture(scope="module")
def batch_run(tiny_path):
    spec = dict(engine=_engine(tiny_path), vtoken=VT, groups=[dict(name=k, requests=v) for k, v in GROUPS.items()])
    return {g["name"]: g for g in _run(spec, "batch")["groups"]}


@pytest.fixture(scope="module")
def solo_run(tiny_path):
    solo = [dict(r, arrive_at_step=0) for reqs in GROUPS.values() for r in reqs if r["id"] not in ABORTED]
    for r in solo:
        r.pop("abort", None)
        r.pop("abort_after_steps", None)
    spec = dict(engine=_engine(tiny_path), vtoken=VT, groups=[dict(name=r["id"], requests=[r]) for r in solo])
    out = {}
    for g in _run(spec, "solo")["groups"]:
        assert g["preemptions"][g["name"]] == 0
        assert g["stats_delta"]["request_faults"] == 0, g["name"]  # a fault would turn eviction off
        assert g["free_blocks_end"] == g["free_blocks_start"] == g["num_blocks"] - 1
        out[g["name"]] = g["tokens"][g["name"]]
    return out


@pytest.mark.parametrize("group", list(GROUPS))
def test_pool_back_to_start_and_nothing_tracked(batch_run, group):
    g = batch_run[group]
    assert g["free_blocks_start"] == g["num_blocks"] - 1 == 39
    assert g["free_blocks_end"] == g["free_blocks_start"]
    assert g["vt_states_left"] == g["vt_plans_left"] == g["requests_left"] == 0
    # no injected abort is a fault; a fault here (e.g. a hook out of step with the scheduler)
    # would quietly turn eviction off and make the solo comparison vacuous
    assert g["stats_delta"]["request_faults"] == 0


def test_isolation_mixed_batch_equals_solo(batch_run, solo_run):
    g = batch_run["mix"]
    assert g["max_running"] == len(MIX) and sum(g["preemptions"].values()) == 0
    for r in MIX:
        assert g["finish"][r["id"]] == "length"
        assert len(solo_run[r["id"]]) == r["max_tokens"]
        if r["id"] in BATCH_DEPENDENT:
            continue
        assert g["tokens"][r["id"]] == solo_run[r["id"]], r["id"]
    ev = g["evictions"]
    # eviction happened exactly for the requests whose length exceeds their budget
    assert not ev["iso-off-a"] and not ev["iso-off-b"] and not ev["iso-h2o-512"]
    for rid in ("iso-h2o-40", "iso-tova-29", "iso-scissorhands-64", "iso-streaming-45", "iso-random-33"):
        assert ev[rid], rid
    assert g["stats_delta"]["moved_tokens"] > 0 and g["stats_delta"]["freed_blocks"] > 0


def test_faults_aborts_at_every_phase(batch_run):
    g = batch_run["faults"]
    ph, ev = g["phase_at_abort"], g["evictions"]
    for rid in ABORTED:
        assert g["finish"][rid] == "abort", rid
    assert sum(g["preemptions"].values()) == 0
    # waiting: never scheduled, no block
    assert ph["a-wait"]["status"] == "WAITING" and ph["a-wait"]["blocks"] == 0
    assert g["tokens"]["a-wait"] == [] and not ev["a-wait"]
    # mid chunked prefill: part of the 400-token prompt computed, nothing sampled
    p = ph["a-prefill"]
    assert p["step"] == 3 and 0 < p["num_computed_tokens"] < p["num_prompt_tokens"] == 400
    assert p["num_output_tokens"] == 0 and p["blocks"] > 0
    # eviction on known steps: prefilled in step 0, first evicted in step 1's schedule()
    # (live 80 > budget 40 + slack 0); f-h2o prefilled in step 4, evicted in step 5
    # (the prefill's 80 tokens are live; the sampled token joins after the eviction)
    assert ev["a-evict"][0][:2] == [1, 80 - 40]
    assert ev["f-h2o"][0][:2] == [5, 70 - 40]
    # right after that eviction, between steps
    assert ph["a-evict"]["step"] == 1 and ph["a-evict"]["live"] == 41 and ph["a-evict"]["blocks"] == 2
    # inside the repack step: schedule() evicted a-repack and planned moves; aborted before the worker ran
    r = ph["a-repack"]
    assert r["step"] == 1 and r["moves_this_step"] > 0 and r["payload_moves"] >= r["moves_this_step"]
    assert r["truncated"] == 2  # ceil(41/32): its third block went back to the pool in that schedule()
    assert len(g["tokens"]["a-repack"]) <= 1
    # mid-decode, eviction off
    assert ph["a-decode-off"]["status"] == "RUNNING" and ph["a-decode-off"]["num_output_tokens"] > 0


def test_faults_survivors_equal_solo(batch_run, solo_run):
    g = batch_run["faults"]
    for rid in ("f-off", "f-h2o", "f-tova"):
        assert g["finish"][rid] == "length"
        assert g["tokens"][rid] == solo_run[rid], rid


def test_preemption_storm(batch_run, solo_run):
    g = batch_run["storm"]
    pre = g["preemptions"]
    assert sum(pre.values()) > 0, "no preemption: the storm did not overload the pool"
    # both kinds were preempted: eviction-off ones (recomputed, must still equal solo) and eviction-on ones
    assert any(pre[r["id"]] for r in STORM if r["id"].startswith("s-off")), pre
    assert any(pre[r["id"]] for r in STORM if r["id"].startswith("s-on")), pre
    assert g["stats_delta"]["preemption_resets"] == sum(v for k, v in pre.items() if k.startswith("s-on"))
    for r in STORM:
        rid = r["id"]
        assert g["finish"][rid] == "length" and len(g["tokens"][rid]) == r["max_tokens"], rid
        # eviction off (recomputed) and eviction on (its K/V saved and restored): exact
        assert g["tokens"][rid] == solo_run[rid], f"{rid} (preempted {pre[rid]}x)"


# ---------------------------------------------------------------------- vLLM's default path
@pytest.fixture(scope="module")
def async_runs(tiny_path):
    """The same groups and solo runs on Model Runner V2 with async scheduling (vLLM's GPU default)."""
    spec = dict(engine=_engine(tiny_path), vtoken=VT, groups=[dict(name=k, requests=v) for k, v in GROUPS.items()])
    out = _run(spec, "batch", "mrv2-async")
    assert out["paths"] == EXPECTED["mrv2-async"]
    batch = {g["name"]: g for g in out["groups"]}
    solo = [dict(r, arrive_at_step=0) for reqs in GROUPS.values() for r in reqs if r["id"] not in ABORTED]
    for r in solo:
        r.pop("abort", None)
        r.pop("abort_after_steps", None)
    sout = _run(dict(engine=_engine(tiny_path), vtoken=VT, groups=[dict(name=r["id"], requests=[r]) for r in solo]),
                "solo", "mrv2-async")
    solo_tokens = {}
    for g in sout["groups"]:
        assert g["preemptions"][g["name"]] == 0
        assert g["stats_delta"]["request_faults"] == 0, g["name"]  # a fault would turn eviction off
        assert g["free_blocks_end"] == g["free_blocks_start"] == g["num_blocks"] - 1
        solo_tokens[g["name"]] = g["tokens"][g["name"]]
    return batch, solo_tokens


def test_mrv2_async_aborts_storm_and_isolation(async_runs):
    """On MRV2 + async scheduling: every group returns the pool to its start and tracks nothing;
    aborts at every phase (waiting, mid chunked prefill, right after an eviction, inside the step
    whose schedule() planned moves, mid-decode) lose nothing; the survivors, the mixed batch and
    the storm's never-preempted and eviction-off requests equal their solo runs on the same path;
    the storm preempts both kinds; every storm request equals its solo run."""
    batch, solo = async_runs
    for name, g in batch.items():
        assert g["free_blocks_end"] == g["free_blocks_start"] == g["num_blocks"] - 1, name
        assert g["vt_states_left"] == 0 and g["vt_plans_left"] == 0, name
        assert g["stats_delta"]["request_faults"] == 0, name
    f = batch["faults"]
    for rid in ABORTED:
        assert f["finish"][rid] == "abort", rid
    assert f["phase_at_abort"]["a-wait"]["status"] == "WAITING" and f["tokens"]["a-wait"] == []
    p = f["phase_at_abort"]["a-prefill"]
    assert 0 < p["num_computed_tokens"] < p["num_prompt_tokens"] == 400 and p["num_output_tokens"] == 0
    assert f["phase_at_abort"]["a-repack"]["moves_this_step"] > 0
    for rid in ("f-off", "f-h2o", "f-tova"):
        assert f["finish"][rid] == "length" and f["tokens"][rid] == solo[rid], rid
    for r in MIX:
        if r["id"] not in BATCH_DEPENDENT:
            assert batch["mix"]["tokens"][r["id"]] == solo[r["id"]], r["id"]
    g = batch["storm"]
    pre = g["preemptions"]
    assert any(pre[r["id"]] for r in STORM if r["id"].startswith("s-off")), pre
    assert any(pre[r["id"]] for r in STORM if r["id"].startswith("s-on")), pre
    for r in STORM:
        rid = r["id"]
        assert g["finish"][rid] == "length" and len(g["tokens"][rid]) == r["max_tokens"], rid
        assert g["tokens"][rid] == solo[rid], f"{rid} (preempted {pre[rid]}x)"
