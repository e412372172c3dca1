"""Harness hooks for ``test_engine_preempt.py`` (loaded in the harness process): measure, from
vLLM's KV manager, the blocks a preempted request holds right after the step that resumed it.

Output key ``resumes``: per resume, ``{"req", "step", "blocks", "num_tokens", "scheduled"}`` (engine
step of the group, blocks held in the full-attention manager, the request's logical token count,
the tokens vLLM scheduled for it in the resume step: ``SchedulerOutput.num_scheduled_tokens``);
``preempted_steps``: request id -> engine steps at which vLLM preempted it; ``finished_at``:
request id -> the engine step after which it had finished.
"""

from __future__ import annotations

from drivers.harness import RunHooks


class PreemptProbe(RunHooks):
    def attach(self, engine, sched) -> None:
        self.sched = sched
        self.pending: set[str] = set()
        self.resumes: list[dict] = []
        self.preempted: dict[str, list[int]] = {}
        self.step = 0
        self.finished_at: dict[str, int] = {}
        orig = sched._preempt_request

        def _preempt_request(request, *a, **k):
            self.pending.add(request.request_id)
            self.preempted.setdefault(request.request_id, []).append(self.step)
            return orig(request, *a, **k)

        sched._preempt_request = _preempt_request
        self.scheduled: dict[str, int] = {}
        orig_schedule = sched.schedule

        def schedule(*a, **k):
            out = orig_schedule(*a, **k)
            self.scheduled = dict(out.num_scheduled_tokens)
            return out

        sched.schedule = schedule

    def before_step(self, run) -> None:
        self.step = run.step

    def after_step(self, run) -> None:
        for ext in run.finish:
            self.finished_at.setdefault(ext, run.step)
        mgr = self.sched.kv_cache_manager.coordinator.single_type_managers[0]
        running = {r.request_id: r for r in self.sched.running}
        for rid in list(self.pending):
            req = running.get(rid)
            blocks = len(mgr.req_to_blocks.get(rid, ()))
            if req is not None and blocks:
                self.resumes.append(dict(req=rid, step=run.step, blocks=blocks, num_tokens=req.num_tokens,
                                         scheduled=self.scheduled.get(rid, 0)))
                self.pending.discard(rid)

    def group_done(self, run) -> dict:
        ext = {iid: ext for ext, iid in run.iid_of.items()}
        return dict(resumes=[dict(r, req=ext.get(r["req"], r["req"])) for r in self.resumes],
                    preempted_steps={ext.get(k, k): v for k, v in self.preempted.items()},
                    finished_at=dict(self.finished_at))
