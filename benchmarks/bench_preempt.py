"""What a preempted evicting request recomputes when it resumes, counted by vLLM itself.

A 10-block pool (block size 32) on the tiny GQA model (2 layers, 4 query / 2 KV heads, fp32),
one engine per granularity (``request``, ``layer``, ``head``, ``head_shared``; H2O budget 40,
slack 0; offline harness, V1 runner, sync scheduling): ``off`` (eviction off, 150-token prompt,
100 new tokens) grows from 5 to 8 blocks while three evicting requests (70-100-token prompts,
60-120 new tokens), admitted after it and cut to 2 blocks each, share the rest: when ``off``
needs a block the pool is empty and vLLM preempts the last admitted evicting request, after it
has evicted. Per resume the harness hook
below records, from vLLM's own objects:

* ``scheduled``: the tokens vLLM scheduled for the request in the step that resumed it
  (``SchedulerOutput.num_scheduled_tokens``): what it recomputes, plus the tokens it computes anew;
* ``live``: the request's live tokens when it was preempted (vToken's count; every token set
  keeps as many), ``logical``: its logical tokens;
* ``blocks``: the blocks it holds right after that step (``req_to_blocks``).

vToken keeps a preempted request's state: the worker saves its live K/V blocks and every set's
policy state and restores them at the resume, so the resume schedules only the one token that
has no KV yet (the last sampled) whatever the granularity: per-head sets, which keep different
tokens per KV head, need no union of their live sets. A re-prefill would schedule ``live + 1``
(recomputing the live tokens) and stock vLLM ``logical + 1``.

Writes ``benchmarks/results/preempt_recompute.json`` (every resume, per granularity, and the
totals). Usage::

    python benchmarks/bench_preempt.py          # ~2 min on 2 cores
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, run_metadata, write_json  # noqa: E402

from drivers.harness import RunHooks  # noqa: E402

GRANULARITIES = ("request", "layer", "head", "head_shared")
VT = {"policy": "h2o", "budget": 40, "slack": 0}
REQUESTS = [("off", 150, 100, 0, False), ("v", 100, 60, 1, True), ("w", 70, 120, 2, True), ("x", 80, 90, 3, True)]


class ResumeProbe(RunHooks):
    """Per resume: the tokens vLLM scheduled, the live / logical tokens at the preemption, the
    blocks held after the resume step (output keys ``resumes``, ``preemptions``)."""

    def attach(self, engine, sched) -> None:
        self.sched, self.pending, self.resumes, self.scheduled, self.preemptions = sched, {}, [], {}, 0
        orig_preempt, orig_schedule = sched._preempt_request, sched.schedule

        def _preempt_request(request, *a, **k):
            st = sched._vt_states.get(request.request_id)
            self.pending[request.request_id] = (None if st is None else st.table.num_live,
                                                None if st is None else st.table.num_logical)
            self.preemptions += 1
            return orig_preempt(request, *a, **k)

        def schedule(*a, **k):
            out = orig_schedule(*a, **k)
            self.scheduled = dict(out.num_scheduled_tokens)
            return out

        sched._preempt_request, sched.schedule = _preempt_request, schedule

    def after_step(self, run) -> None:
        mgr = self.sched.kv_cache_manager.coordinator.single_type_managers[0]
        for rid in list(self.pending):
            if rid in self.scheduled:
                live, logical = self.pending.pop(rid)
                self.resumes.append(dict(req=rid, scheduled=self.scheduled[rid], live=live, logical=logical,
                                         blocks=len(mgr.req_to_blocks.get(rid, ()))))

    def group_done(self, run) -> dict:
        return dict(resumes=self.resumes, preemptions=self.preemptions)


def _prompt(i: int, n: int) -> list[int]:
    return [((i + 3) * 37 + j * (11 + i % 5)) % 250 + 1 for j in range(n)]


def main() -> int:
    from vtoken.assets.paths import ensure_tiny_gqa_model
    from drivers.harness import run_in_subprocess

    model = str(ensure_tiny_gqa_model())
    load_before = list(os.getloadavg())
    out: dict = {}
    for gran in GRANULARITIES:
        reqs = [dict(id=rid, prompt_token_ids=_prompt(5 + i, n), max_tokens=new, arrive_at_step=at,
                     extra_args=None if on else {"vtoken_enable": False})
                for i, (rid, n, new, at, on) in enumerate(REQUESTS)]
        engine = dict(model=model, dtype="float32", max_model_len=320, block_size=32, enforce_eager=True,
                      gpu_memory_utilization=0.1, num_gpu_blocks_override=11, skip_tokenizer_init=True)
        res = run_in_subprocess(dict(engine=engine, vtoken=dict(VT, granularity=gran), requests=reqs,
                                     hooks=f"{Path(__file__).resolve()}:ResumeProbe"))
        rs = res["resumes"]
        out[gran] = dict(preemptions=res["preemptions"], resumes=rs,
                         scheduled_total=sum(r["scheduled"] for r in rs),
                         live_total=sum(r["live"] for r in rs), logical_total=sum(r["logical"] for r in rs),
                         request_faults=res["vtoken"]["stats"]["request_faults"])
        print(f"{gran:12} preemptions {res['preemptions']:2}  resumes {len(rs):2}  scheduled at resume "
              f"{out[gran]['scheduled_total']:4}  (live {out[gran]['live_total']}, logical "
              f"{out[gran]['logical_total']})")
    meta = run_metadata(model="tiny-llama-gqa", vtoken=VT, requests=REQUESTS, pool_blocks=10, block_size=32,
                        command="python benchmarks/bench_preempt.py", load_before=load_before,
                        load_after=list(os.getloadavg()))
    write_json(RESULTS / "preempt_recompute.json", dict(meta=meta, granularity=out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
