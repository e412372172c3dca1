"""Cost of vToken under tensor parallelism: score all-reduce bytes per step, step time TP=2 vs TP=1.

Four arms, one engine each (offline harness, a fresh process per engine, V1 runner, sync
scheduling), tiny model (2 query heads, 1 KV head: the only local model whose head count
divides by 2; SmolLM2-135M has 9), fp32:

* ``tp1-stock``, ``tp2-stock``: no ``vtoken`` key;
* ``tp1-vtoken``, ``tp2-vtoken``: H2O, budget 64, slack 0: every request scores and evicts
  on every decode step once full, so every step pays the all-reduce.

TP=2 runs through vLLM's multiprocessing executor with ``VLLM_CPU_OMP_THREADS_BIND="0|1"``
and ``OMP_NUM_THREADS=1`` (one core per rank); TP=1 uses both cores. Metric: harness
``wall_s / steps``. Bytes all-reduced per step come from the worker test hook
(``VTOKEN_TEST_WORKER_DIR``: rank 0's log of every score all-reduce, float64 elements * 8,
and the wall time of the ``all_reduce`` call itself, which includes waiting for the slower rank).

The machine is shared with other agents (2 cores): timings are indicative only; the load
average is recorded before and after. Writes ``benchmarks/results/tp_cost.json``.

Usage::

    python benchmarks/bench_tp.py          # ~3 min on 2 cores
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine_info, run_metadata, write_json  # noqa: E402

BATCH, PROMPT, OUTPUT, BLOCK = 8, 128, 64, 32
VT = {"policy": "h2o", "budget": 64, "slack": 0}
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1"}


def spec(model: str, tp: int, vt) -> dict:
    rng = random.Random(0)
    reqs = [dict(id=f"r{i}", prompt_token_ids=[rng.randrange(1, 250) for _ in range(PROMPT)], max_tokens=OUTPUT)
            for i in range(BATCH)]
    engine = dict(model=model, dtype="float32", max_model_len=PROMPT + OUTPUT + BLOCK, block_size=BLOCK,
                  enforce_eager=True, gpu_memory_utilization=0.1, num_gpu_blocks_override=BATCH * 8 + 16,
                  skip_tokenizer_init=True, tensor_parallel_size=tp)
    return dict(engine=engine, vtoken=vt, requests=reqs, check=False)


def main() -> int:
    from vtoken.assets.paths import ensure_tiny_model
    from drivers.harness import run_in_subprocess

    model = str(ensure_tiny_model())
    load_before = list(os.getloadavg())
    runs = {}
    for tp in (1, 2):
        for arm, vt in (("stock", None), ("vtoken", VT)):
            name = f"tp{tp}-{arm}"
            with tempfile.TemporaryDirectory() as d:
                env = dict(TP2_ENV) if tp == 2 else {"OMP_NUM_THREADS": "2"}
                env["VTOKEN_TEST_WORKER_DIR"] = d
                out = run_in_subprocess(spec(model, tp, vt), env=env)
                log = Path(d) / "allreduce-rank0.jsonl"
                recs = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
            step_ms = 1000 * out["wall_s"] / out["steps"]
            runs[name] = dict(tp=tp, vtoken=vt is not None, steps=out["steps"], wall_s=out["wall_s"],
                              step_ms=step_ms, allreduce_calls=len(recs),
                              allreduce_bytes_per_call_mean=statistics.mean(r["bytes"] for r in recs) if recs else 0,
                              allreduce_bytes_per_call_max=max((r["bytes"] for r in recs), default=0),
                              allreduce_bytes_total=sum(r["bytes"] for r in recs),
                              allreduce_us_median=statistics.median(r["us"] for r in recs) if recs else 0,
                              allreduce_us_total=sum(r["us"] for r in recs),
                              evicted_tokens=(out.get("vtoken") or {}).get("stats", {}).get("evicted_tokens"))
            print(name, json.dumps(runs[name]))
    tokens_note = "vToken on: H2O budget 64 slack 0, every decode step scores all 8 requests"
    res = dict(
        benchmark="bench_tp", meta=run_metadata(model="tiny-llama (2 q heads, 1 kv head, 2 layers)", dtype="float32"),
        machine=machine_info(), load_average_before=load_before, load_average_after=list(os.getloadavg()),
        note="shared 2-core machine (other agents running): timings indicative only; one run per arm",
        config=dict(batch=BATCH, prompt_len=PROMPT, output_len=OUTPUT, block_size=BLOCK, vtoken=VT,
                    tp2_env=TP2_ENV, tp1_env={"OMP_NUM_THREADS": "2"}, workload=tokens_note,
                    metric="harness wall_s / steps (1 prefill + output_len-1 decode steps)"),
        runs=runs,
        ratios=dict(
            vtoken_over_stock_tp1=runs["tp1-vtoken"]["step_ms"] / runs["tp1-stock"]["step_ms"],
            vtoken_over_stock_tp2=runs["tp2-vtoken"]["step_ms"] / runs["tp2-stock"]["step_ms"],
            tp2_over_tp1_stock=runs["tp2-stock"]["step_ms"] / runs["tp1-stock"]["step_ms"],
            tp2_over_tp1_vtoken=runs["tp2-vtoken"]["step_ms"] / runs["tp1-vtoken"]["step_ms"],
        ),
    )
    write_json(RESULTS / "tp_cost.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
