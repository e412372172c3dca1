"""Harness hooks that inject faults confined to one request (loaded in the harness process).

* requests with budget 41: their policy's ``select_victims`` raises ``ValueError`` (a policy bug);
* requests whose id starts with ``short``: the attention statistics the worker returns for them
  are one slot short (a score-length mismatch).

The vToken log records (logger ``vllm.vtoken``) of the run are returned as ``out["vtoken_log"]``.
"""

from __future__ import annotations

import copy
import logging

from drivers.harness import RunHooks

FAULTY_BUDGET = 41


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(f"{record.levelname} {record.getMessage()}")


class FaultInjection(RunHooks):
    def attach(self, engine, sched) -> None:
        self.capture = _Capture()
        logging.getLogger("vllm.vtoken").addHandler(self.capture)
        orig_policy = sched._vt_policy

        def _vt_policy(cfg, budget):
            pol = orig_policy(cfg, budget)
            if budget == FAULTY_BUDGET:
                pol = copy.copy(pol)

                def select_victims(*a, **k):
                    raise ValueError("injected policy fault")

                pol.select_victims = select_victims
            return pol

        sched._vt_policy = _vt_policy
        orig_update = sched.update_from_output

        def update_from_output(scheduler_output, model_runner_output):
            scores = getattr(model_runner_output, "vtoken_scores", None)
            if scores:
                cut = {}
                for rid, (col, last) in scores.items():
                    if rid.startswith("short"):
                        col = None if col is None else col[:-1]
                        last = None if last is None else last[:-1]
                    cut[rid] = (col, last)
                model_runner_output.vtoken_scores = cut
            return orig_update(scheduler_output, model_runner_output)

        sched.update_from_output = update_from_output

    def finish(self, out) -> None:
        out["vtoken_log"] = self.capture.records
