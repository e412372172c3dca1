"""Harness hooks that inject faults confined to one request into the worker (loaded in the harness
process, where the engine runs in-process, so the worker's classes are patched here).

* requests whose id starts with ``boom``: the worker's eviction (``DeviceDecider.evict``) raises
  ``ValueError("injected policy fault")`` whenever they are in the batch (a policy bug): the
  batch is retried one request at a time and only ``boom`` fails;
* requests whose id starts with ``nan``: the attention statistics the worker folds for them are
  NaN (a numerical fault in the forward's statistics).

The vToken log records (logger ``vllm.vtoken``) of the run are returned as ``out["vtoken_log"]``.
"""

from __future__ import annotations

import logging

import numpy as np

from drivers.harness import RunHooks


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(f"{record.levelname} {record.getMessage()}")


class FaultInjection(RunHooks):
    def attach(self, engine, sched) -> None:
        from vtoken.integrations.vllm.worker.eviction import WorkerEviction

        self.capture = _Capture()
        logging.getLogger("vllm.vtoken").addHandler(self.capture)
        from vtoken.side_cache import DeviceDecider

        live: list = []  # the engine's WorkerEviction (in-process worker)
        orig_begin = WorkerEviction.begin

        def begin(self, *a, **k):
            if not live:
                live.append(self)
            return orig_begin(self, *a, **k)

        orig_evict = DeviceDecider.evict

        def evict(self, rows, *a, **k):  # a policy bug that shows whenever "boom" is in the batch
            for rid, got in (live[0].where.items() if live else ()):
                if rid.startswith("boom") and got[0].dec is self and int(got[1]) in rows.tolist():
                    raise ValueError("injected policy fault")
            return orig_evict(self, rows, *a, **k)

        WorkerEviction.begin = begin
        DeviceDecider.evict = evict
        orig_fold = WorkerEviction.fold

        def nan_map(m):
            return {rid: tuple(None if a is None else (np.full_like(a, np.nan) if rid.startswith("nan") else a)
                               for a in v) for rid, v in m.items()}

        def fold(self, scores):
            if isinstance(scores, dict):
                scores = nan_map(scores)
            elif scores is not None:  # the batched form (StepScores.batched): padded rows, and the rest as a map
                for i, rid in enumerate(scores.rids):
                    if rid is not None and rid.startswith("nan"):
                        for t in (scores.acc, scores.per_head):
                            if t is not None:
                                t[i] = float("nan")
                scores.rest = nan_map(scores.rest)
            return orig_fold(self, scores)

        WorkerEviction.fold = fold

    def finish(self, out) -> None:
        out["vtoken_log"] = self.capture.records
