"""Fault injection for the reliability tests, as hooks of the one engine runner.

The runner is ``drivers.harness`` (in-process EngineCore, ``VTOKEN_CHECK=1``:
the scheduler checks block ownership and accounting after every step and a violation fails
the run; ``groups`` run one after another in the same engine, each from an idle engine, with
the pool's free count at both ends). :class:`FaultHooks` adds what the fault tests need:

* per-request faults: ``abort`` = ``"waiting"`` (right after it is added, before any step),
  ``"prefill"`` (after the first step, mid chunked prefill), ``"after_eviction"`` (between
  steps, right after the step whose schedule() first evicted it), ``"in_repack"`` (inside
  the step whose schedule() evicted it and planned token moves: after schedule(), before the
  worker runs the step), or ``abort_after_steps`` (group-relative).
* per request: the steps on which its evictions happened (and their moves), how often it
  was preempted, and the phase it was in when it was aborted.

* per group: the scheduler's stats delta, ``vt_check_invariants()`` at the end, and what is
  left in the scheduler's maps.

Spec (the harness's, with ``abort`` per request)::

    {"engine": {LLM kwargs}, "vtoken": {...}, "check": true,
     "groups": [{"name": "g", "requests": [{"id", "prompt_token_ids", "max_tokens",
                                            "extra_args", "arrive_at_step", "abort", ...}]}]}
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from drivers import harness


class FaultHooks(harness.RunHooks):
    """Aborts at chosen phases, and per-request eviction / preemption logs (scheduler internals)."""

    def __init__(self) -> None:
        self.cur = {"step": 0}
        #: internal id -> [[step, evicted, evicted], ...] (the count the step's payload asks the worker to evict)
        self.evict_log: dict[str, list[list[int]]] = {}
        self.preempt: dict[str, int] = {}
        self.in_step_abort: dict[str, str] = {}  # internal id -> external id, abort inside the repack step
        self.phase_at_abort: dict[str, dict] = {}
        self.ext_of: dict[str, str] = {}

    # ---- instrumentation (instance attributes shadow the class methods)
    def attach(self, engine, sched) -> None:
        self.engine, self.sched = engine, sched
        orig_preempt = sched._preempt_request

        def _preempt_request(request, *a, **k):
            self.preempt[request.request_id] = self.preempt.get(request.request_id, 0) + 1
            return orig_preempt(request, *a, **k)

        sched._preempt_request = _preempt_request
        orig_schedule = sched.schedule

        def schedule(*a, **k):
            out = orig_schedule(*a, **k)
            payload = getattr(out, "vtoken", None)
            # the scheduler counts each eviction (the worker picks the victims and plans the moves)
            for rid, n in (payload.evict if payload is not None else {}).items():
                self.evict_log.setdefault(rid, []).append([self.cur["step"], n, n])
            for iid in list(self.in_step_abort):
                log = self.evict_log.get(iid) or []
                if log and log[-1][0] == self.cur["step"] and log[-1][2] > 0:
                    payload = getattr(out, "vtoken", None)
                    ph = self._phase(iid)
                    ph.update(step=self.cur["step"], moves_this_step=log[-1][2],
                              payload_moves=0 if payload is None else int(payload.evict.get(iid, 0)),
                              truncated=None if payload is None else payload.truncate.get(iid))
                    self.phase_at_abort[self.ext_of[iid]] = ph
                    engine.abort_request([self.in_step_abort.pop(iid)])
            return out

        sched.schedule = schedule

    def _phase(self, iid: str) -> dict:
        sched = self.sched
        req = sched.requests.get(iid)
        if req is None:
            return dict(status="gone")
        st = sched._vt_states.get(iid)
        return dict(status=str(req.status.name), num_computed_tokens=req.num_computed_tokens,
                    num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=len(req.output_token_ids),
                    blocks=len(sched._vt_mgr.req_to_blocks.get(iid, ())),
                    live=None if st is None else st.table.num_live,
                    logical=None if st is None else st.table.num_logical)

    # ---- per group
    def group_start(self, run) -> None:
        self.stats0 = dict(self.sched.vt_stats.as_dict())
        self.abort_at: dict[str, int] = {}
        self.after_evict: set[str] = set()
        self.cur["step"] = 0

    def added(self, run, req, iid) -> None:
        self.ext_of[iid] = req["id"]
        ab = req.get("abort")
        if ab == "waiting":
            self.phase_at_abort[req["id"]] = dict(self._phase(iid), step=run.step)
            run.abort(req["id"])
        elif ab == "prefill":
            self.abort_at[req["id"]] = run.step + 1
        elif ab == "after_eviction":
            self.after_evict.add(req["id"])
        elif ab == "in_repack":
            self.in_step_abort[iid] = req["id"]
        if "abort_after_steps" in req:  # here too, so that the phase at the abort is recorded
            self.abort_at[req["id"]] = run.step + req["abort_after_steps"]

    def before_step(self, run) -> None:
        self.cur["step"] = run.step

    def after_step(self, run) -> None:
        step = run.step  # the step just taken is step - 1
        for ext, ph in self.phase_at_abort.items():  # aborted inside the step
            if ph.get("step") == step - 1 and ext not in run.finish:
                run.finish[ext] = "abort"
        for rid in list(self.after_evict):
            iid = run.iid_of[rid]
            if self.evict_log.get(iid) and rid not in run.finish:
                self.phase_at_abort[rid] = dict(self._phase(iid), step=step - 1,
                                                evicted_on=self.evict_log[iid][-1][0])
                run.abort(rid)
                self.after_evict.discard(rid)
        for rid, at in list(self.abort_at.items()):
            if step >= at and rid not in run.finish:
                self.phase_at_abort[rid] = dict(self._phase(run.iid_of[rid]), step=step)
                run.abort(rid)
                del self.abort_at[rid]

    def group_done(self, run) -> dict[str, Any]:
        sched = self.sched
        sched.vt_check_invariants()
        stats1 = sched.vt_stats.as_dict()
        ids = run.iid_of
        return dict(
            evictions={ext: self.evict_log.get(iid, []) for ext, iid in ids.items()},
            preemptions={ext: self.preempt.get(iid, 0) for ext, iid in ids.items()},
            phase_at_abort={k: v for k, v in self.phase_at_abort.items() if k in ids},
            stats_delta={k: stats1[k] - self.stats0[k] for k in stats1 if isinstance(stats1[k], (int, float))},
            vt_states_left=len(sched._vt_states), vt_plans_left=len(sched._vt_plans),
            requests_left=len(sched.requests),
        )


def run_in_subprocess(spec: dict[str, Any], timeout: float = 600, env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Run ``spec`` through the harness in a fresh process with :class:`FaultHooks`
    (``env``: extra environment, e.g. ``execution_paths.path_env(...)``)."""
    e = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    e.update(env or {})
    return harness.run_in_subprocess(dict(spec, hooks=f"{Path(__file__).resolve()}:FaultHooks"), env=e,
                                     timeout=timeout)
