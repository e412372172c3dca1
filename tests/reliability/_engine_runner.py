"""Run groups of requests through one real vLLM engine (vToken on) and report tokens and blocks.

``python _engine_runner.py SPEC.json OUT.json``. Like ``vtoken.integrations.vllm.harness``
(in-process EngineCore, ``VTOKEN_CHECK=1``: the scheduler checks block ownership and
accounting after every step and a violation fails the run), plus what the fault tests need:

* ``groups``: batches run one after another in the same engine; each group starts and ends
  with an idle engine, and reports the pool's free count at both ends.
* per-request faults: ``abort`` = ``"waiting"`` (right after it is added, before any step),
  ``"prefill"`` (after the first step, mid chunked prefill), ``"after_eviction"`` (between
  steps, right after the step whose schedule() first evicted it), ``"in_repack"`` (inside
  the step whose schedule() evicted it and planned token moves: after schedule(), before the
  worker runs the step), or ``abort_after_steps`` (group-relative).
* per request: the steps on which its evictions happened (and their moves), how often it
  was preempted, and the phase it was in when it was aborted.

Spec::

    {"engine": {LLM kwargs}, "vtoken": {...}, "check": true,
     "groups": [{"name": "g", "requests": [{"id", "prompt_token_ids", "max_tokens",
                                            "extra_args", "arrive_at_step", "abort", ...}]}]}
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def run(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if spec.get("check", True):
        os.environ["VTOKEN_CHECK"] = "1"
    from vllm import LLM, SamplingParams

    kw = dict(spec["engine"])
    kw.setdefault("seed", 0)
    kw.setdefault("enable_prefix_caching", False)
    kw["additional_config"] = {"vtoken": spec["vtoken"]}
    llm = LLM(**kw)
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool

    # ---- instrumentation (instance attributes shadow the class methods)
    cur = {"step": 0}
    evict_log: dict[str, list[list[int]]] = {}  # internal id -> [[step, evicted, moves], ...]
    preempt: dict[str, int] = {}
    in_step_abort: dict[str, str] = {}  # internal id -> external id, abort inside the repack step
    phase_at_abort: dict[str, dict] = {}
    orig_evict = sched._vt_evict

    def _vt_evict(rid, st, k, payload, srcs, dsts):
        e0, m0 = st.evicted, st.moved
        orig_evict(rid, st, k, payload, srcs, dsts)
        evict_log.setdefault(rid, []).append([cur["step"], st.evicted - e0, st.moved - m0])

    sched._vt_evict = _vt_evict
    orig_preempt = sched._preempt_request

    def _preempt_request(request, *a, **k):
        preempt[request.request_id] = preempt.get(request.request_id, 0) + 1
        return orig_preempt(request, *a, **k)

    sched._preempt_request = _preempt_request
    orig_schedule = sched.schedule
    ext_of: dict[str, str] = {}

    def _phase(iid: str) -> dict:
        req = sched.requests.get(iid)
        if req is None:
            return dict(status="gone")
        st = sched._vt_states.get(iid)
        return dict(status=str(req.status.name), num_computed_tokens=req.num_computed_tokens,
                    num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=len(req.output_token_ids),
                    blocks=len(sched._vt_mgr.req_to_blocks.get(iid, ())),
                    live=None if st is None else st.table.num_live,
                    logical=None if st is None else st.table.num_logical)

    def schedule(*a, **k):
        out = orig_schedule(*a, **k)
        for iid in list(in_step_abort):
            log = evict_log.get(iid) or []
            if log and log[-1][0] == cur["step"] and log[-1][2] > 0:
                payload = getattr(out, "vtoken", None)
                ph = _phase(iid)
                ph.update(step=cur["step"], moves_this_step=log[-1][2],
                          payload_moves=0 if payload is None else int(payload.num_moves),
                          truncated=None if payload is None else payload.truncate.get(iid))
                phase_at_abort[ext_of[iid]] = ph
                engine.abort_request([in_step_abort.pop(iid)])
        return out

    sched.schedule = schedule

    groups_out = []
    for g in spec["groups"]:
        free_start = pool.get_num_free_blocks()
        stats0 = dict(sched.vt_stats.as_dict())
        pending = sorted(g["requests"], key=lambda r: r.get("arrive_at_step", 0))
        tokens: dict[str, list[int]] = {}
        finish: dict[str, str] = {}
        iid_of: dict[str, str] = {}
        abort_at: dict[str, int] = {}
        after_evict: set[str] = set()
        step = 0
        max_running = 0
        t0 = time.perf_counter()
        cur["step"] = 0
        while pending or engine.has_unfinished_requests():
            assert step < 20000, "group did not finish"
            while pending and pending[0].get("arrive_at_step", 0) <= step:
                r = pending.pop(0)
                sp = SamplingParams(max_tokens=r.get("max_tokens", 64), temperature=0.0, ignore_eos=True,
                                    detokenize=False, extra_args=r.get("extra_args") or None)
                iid = engine.add_request(r["id"], {"prompt_token_ids": r["prompt_token_ids"]}, sp)
                iid_of[r["id"]] = iid
                ext_of[iid] = r["id"]
                tokens[r["id"]] = []
                ab = r.get("abort")
                if ab == "waiting":
                    phase_at_abort[r["id"]] = dict(_phase(iid), step=step)
                    engine.abort_request([r["id"]])
                    finish[r["id"]] = "abort"
                elif ab == "prefill":
                    abort_at[r["id"]] = step + 1
                elif ab == "after_eviction":
                    after_evict.add(r["id"])
                elif ab == "in_repack":
                    in_step_abort[iid] = r["id"]
                if "abort_after_steps" in r:
                    abort_at[r["id"]] = step + r["abort_after_steps"]
            if not engine.has_unfinished_requests():
                step += 1
                continue
            cur["step"] = step
            for o in engine.step():
                rid = o.request_id
                if rid in finish and finish[rid] == "abort":
                    continue
                tokens[rid] = list(o.outputs[0].token_ids)
                if o.finished:
                    finish[rid] = str(o.outputs[0].finish_reason)
            for ext, ph in phase_at_abort.items():  # aborted inside the step
                if ph.get("step") == step and ext not in finish:
                    finish[ext] = "abort"
            max_running = max(max_running, len(sched.running))
            step += 1
            for rid in list(after_evict):
                iid = iid_of[rid]
                if evict_log.get(iid) and rid not in finish:
                    phase_at_abort[rid] = dict(_phase(iid), step=step - 1,
                                               evicted_on=evict_log[iid][-1][0])
                    engine.abort_request([rid])
                    finish[rid] = "abort"
                    after_evict.discard(rid)
            for rid, at in list(abort_at.items()):
                if step >= at and rid not in finish:
                    phase_at_abort[rid] = dict(_phase(iid_of[rid]), step=step)
                    engine.abort_request([rid])
                    finish[rid] = "abort"
                    del abort_at[rid]
        for _ in range(3):  # let the aborted requests' frees reach the pool
            if engine.has_unfinished_requests():
                engine.step()
        sched.vt_check_invariants()
        stats1 = sched.vt_stats.as_dict()
        groups_out.append(dict(
            name=g["name"], tokens=tokens, finish=finish, free_blocks_start=free_start,
            free_blocks_end=pool.get_num_free_blocks(), num_blocks=pool.num_gpu_blocks, steps=step,
            wall_s=time.perf_counter() - t0, max_running=max_running,
            evictions={ext: evict_log.get(iid, []) for ext, iid in iid_of.items()},
            preemptions={ext: preempt.get(iid, 0) for ext, iid in iid_of.items()},
            phase_at_abort={k: v for k, v in phase_at_abort.items() if k in iid_of},
            stats_delta={k: stats1[k] - stats0[k] for k in stats1 if isinstance(stats1[k], (int, float))},
            vt_states_left=len(sched._vt_states), vt_req_cfg_left=len(sched._vt_req_cfg),
            requests_left=len(sched.requests),
        ))
    return dict(groups=groups_out)


def run_in_subprocess(spec: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    import subprocess
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        sp, op = Path(d) / "spec.json", Path(d) / "out.json"
        sp.write_text(json.dumps(spec))
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "2")
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        p = subprocess.run([sys.executable, __file__, str(sp), str(op)], env=env, capture_output=True, text=True,
                           timeout=timeout, start_new_session=True)
        if p.returncode != 0 or not op.exists():
            raise RuntimeError(f"engine run failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-6000:]}")
        return json.loads(op.read_text())


if __name__ == "__main__":
    s = json.loads(open(sys.argv[1]).read())
    res = run(s)
    open(sys.argv[2], "w").write(json.dumps(res))
