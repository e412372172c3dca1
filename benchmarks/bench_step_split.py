"""Where a decode step's time goes: forward, scoring, token moves, vToken planning, vLLM scheduling.

The SLA sweep (``bench_sla.py``) shows H2O missing its TPOT SLO in every arm on this CPU. This
benchmark measures why, by splitting each engine step of the SLA set-up's arms into parts,
timed inside one in-process engine (``drivers.harness``, UniProc executor, so
the worker runs in the timed process):

* ``schedule``   -- ``Scheduler.schedule()`` without vToken's planning (vLLM's own scheduling);
* ``plan``       -- vToken's planning inside ``schedule()``: victim selection, the repack plan,
  folding scores into the policy (``vt_stats.repack_seconds``);
* ``update``     -- ``Scheduler.update_from_output()`` (vToken's bookkeeping of the step included);
* ``moves``      -- applying the step's token moves to every layer's KV cache in the worker
  (``WorkerStep.begin_step``);
* ``scoring``    -- the worker's attention-statistics pass: CPU attention returns no
  probabilities, so ``StepScores.accumulate`` recomputes ``softmax(q K^T)`` per layer (and
  ``StepScores.result``);
* ``forward``    -- the model executor's ``execute_model`` + ``sample_tokens`` minus moves and
  scoring (the model's forward pass and sampling, as in stock vLLM);
* ``other``      -- the rest of ``LLMEngine.step()`` (output processing).

Only decode-only steps (every scheduled request computes one token) are summed, so the numbers
are per decode step at the workload's batch size. Arms run one after another in fresh
processes, alternated (A B C ..., then reversed) over ``--reps`` repetitions in one run; the
load average is recorded per run. Absolute times are this machine's; compare arms by ratio.

Arms (the SLA sweep's, fixed budget 64 unless said): ``stock`` (no vToken), ``naive-h2o``,
``vtoken-h2o``, ``vtoken-h2o-se4`` (``score_every`` 4), ``vtoken-h2o-pressure`` (pressure pacing
with a pool that has room: no eviction, every kept token scored), ``vtoken-random`` (no scoring).

Writes ``benchmarks/results/<name>.json`` and ``<name>.png`` (stacked bars, one per arm).

Usage::

    python benchmarks/bench_step_split.py                 # SmolLM2 bf16, batch 8, prompt 512 + 128, 2 reps
    python benchmarks/bench_step_split.py --replot benchmarks/results/step_split.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, machine_info, write_json  # noqa: E402

from drivers.harness import RunHooks  # noqa: E402

PARTS = ("forward", "scoring", "moves", "plan", "schedule", "update", "other")

ARMS: dict[str, Any] = {
    "stock": None,
    "naive-h2o": {"mode": "naive", "policy": "h2o", "budget": 64},
    "vtoken-h2o": {"policy": "h2o", "budget": 64},
    "vtoken-h2o-se4": {"policy": "h2o", "budget": 64, "score_every": 4},
    "vtoken-h2o-pressure": {"policy": "h2o", "budget": 64, "pacing": "pressure"},
    "vtoken-random": {"policy": "random", "budget": 64},
}


class SplitHooks(RunHooks):
    """Times the parts of every engine step (see the module docstring); in the harness process."""

    def attach(self, engine, sched) -> None:
        from vtoken.integrations.vllm.worker import scoring, step

        self.steps: list[dict[str, float]] = []
        self.cur: dict[str, float] = {}

        def timed(fn, key):
            def w(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.cur[key] = self.cur.get(key, 0.0) + time.perf_counter() - t0
            return w

        for cls, name, key in ((scoring.StepScores, "accumulate", "scoring"), (scoring.StepScores, "result", "scoring"),
                               (step.WorkerStep, "begin_step", "moves")):
            setattr(cls, name, timed(getattr(cls, name), key))
        core = engine.engine_core.engine_core
        ex = core.model_executor
        for name in ("execute_model", "sample_tokens"):
            if hasattr(ex, name):
                setattr(ex, name, timed(getattr(ex, name), "executor"))
        self.sched = sched
        orig_schedule = sched.schedule

        def schedule(*a, **k):
            r0 = self._repack_s()
            t0 = time.perf_counter()
            out = orig_schedule(*a, **k)
            self.cur["schedule_total"] = self.cur.get("schedule_total", 0.0) + time.perf_counter() - t0
            self.cur["plan"] = self.cur.get("plan", 0.0) + self._repack_s() - r0
            n = out.num_scheduled_tokens
            self.cur["decode_only"] = float(bool(n) and all(v == 1 for v in n.values()))
            self.cur["batch"] = float(len(n))
            return out

        sched.schedule = schedule
        sched.update_from_output = timed(sched.update_from_output, "update")

    def _repack_s(self) -> float:
        st = getattr(self.sched, "vt_stats", None)
        return 0.0 if st is None else float(st.repack_seconds)

    def before_step(self, run) -> None:
        self.cur.clear()
        self.t0 = time.perf_counter()

    def after_step(self, run) -> None:
        c = dict(self.cur)
        c["step"] = time.perf_counter() - self.t0
        self.steps.append(c)

    def finish(self, out: dict[str, Any]) -> None:
        rows = [s for s in self.steps if s.get("decode_only")]
        tot = {p: 0.0 for p in PARTS}
        for s in rows:
            g = lambda k: s.get(k, 0.0)  # noqa: E731
            tot["scoring"] += g("scoring")
            tot["moves"] += g("moves")
            tot["forward"] += g("executor") - g("scoring") - g("moves")
            tot["plan"] += g("plan")
            tot["schedule"] += g("schedule_total") - g("plan")
            tot["update"] += g("update")
            tot["other"] += g("step") - g("executor") - g("schedule_total") - g("update")
        n = max(len(rows), 1)
        out["split_ms"] = {p: 1000.0 * v / n for p, v in tot.items()}
        out["split_ms"]["step"] = 1000.0 * sum(s["step"] for s in rows) / n
        out["decode_steps"] = len(rows)
        out["decode_batch_mean"] = sum(s["batch"] for s in rows) / n


def make_spec(model_dir: str, vt: dict | None, *, batch: int, prompt_len: int, output_len: int,
              block_size: int) -> dict:
    rng = random.Random(0)
    reqs = [dict(id=f"r{i}", prompt_token_ids=[rng.randrange(100, 49000) for _ in range(prompt_len)],
                 max_tokens=output_len, ignore_eos=True) for i in range(batch)]
    blocks = batch * ((prompt_len + output_len) // block_size + 2) + 16  # room for everything: no preemption
    engine = dict(model=model_dir, dtype="bfloat16", max_model_len=prompt_len + output_len + block_size,
                  block_size=block_size, enforce_eager=True, gpu_memory_utilization=0.1,
                  kv_cache_memory_bytes=256 << 20, num_gpu_blocks_override=blocks, skip_tokenizer_init=True,
                  max_num_seqs=max(batch, 8), max_num_batched_tokens=max(2048, prompt_len))
    return dict(engine=engine, vtoken=vt, requests=reqs, check=False, hooks=f"{Path(__file__).resolve()}:SplitHooks")


def summarize(runs: list[dict]) -> dict[str, dict]:
    res: dict[str, dict] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        rs = [r for r in runs if r["arm"] == arm]
        med = {p: statistics.median(r["split_ms"][p] for r in rs) for p in (*PARTS, "step")}
        res[arm] = dict(median_ms=med, reps=len(rs))
    stock = res.get("stock")
    if stock:
        for arm, r in res.items():
            r["step_over_stock"] = r["median_ms"]["step"] / stock["median_ms"]["step"]
            r["extra_ms_over_stock"] = {p: r["median_ms"][p] - stock["median_ms"][p] for p in PARTS}
    return res


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = summary["results"]
    arms = list(res)
    colors = dict(forward="#4c72b0", scoring="#dd8452", moves="#55a868", plan="#c44e52", schedule="#8172b3",
                  update="#937860", other="#bbbbbb")
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    bottom = [0.0] * len(arms)
    for p in PARTS:
        vals = [res[a]["median_ms"][p] for a in arms]
        ax.bar(range(len(arms)), vals, bottom=bottom, color=colors[p], label=p, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, a in enumerate(arms):
        ax.text(i, bottom[i] + 0.3, f"{res[a]['median_ms']['step']:.1f} ms", ha="center", fontsize=9)
    ax.set_xticks(range(len(arms)), arms, rotation=15, fontsize=9)
    ax.set_ylabel("ms per decode step (median over repetitions)")
    c = summary["config"]
    ax.set_title(f"Decode step split, SmolLM2 bf16, batch {c['batch']}, prompt {c['prompt_len']} + {c['output_len']} "
                 f"out, budget 64\n{c['reps']} repetitions, arms alternated; 2 CPU cores", fontsize=10)
    ax.legend(fontsize=8, ncol=4, loc="upper left")
    ax.set_ylim(0, max(bottom) * 1.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    ap.add_argument("--name", default="step_split")
    ap.add_argument("--replot", type=Path, default=None, metavar="JSON", help="only redraw the plot of a result file")
    a = ap.parse_args(argv)
    if a.replot:
        plot(json.loads(a.replot.read_text()), a.replot.with_suffix(".png"))
        return 0

    from tqdm import tqdm

    from vtoken.assets.paths import ensure_smollm2
    from drivers.harness import run_in_subprocess

    model = str(ensure_smollm2())
    t_start = time.time()
    summary: dict[str, Any] = dict(
        benchmark="bench_step_split", command="python " + " ".join(["benchmarks/bench_step_split.py"] + argv),
        machine=machine_info(),
        config=dict(model="smollm2-135m-instruct", dtype="bfloat16", batch=a.batch, prompt_len=a.prompt_len,
                    output_len=a.output_len, block_size=a.block_size, reps=a.reps,
                    arms={k: ARMS[k] for k in a.arms}, parts=list(PARTS),
                    metric="mean ms per decode-only engine step, per part; median over repetitions"),
        runs=[])
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 2))}
    bar = tqdm(total=a.reps * len(a.arms), desc="bench_step_split", unit="run")
    for rep in range(a.reps):
        for arm in (a.arms if rep % 2 == 0 else list(reversed(a.arms))):
            spec = make_spec(model, ARMS[arm], batch=a.batch, prompt_len=a.prompt_len, output_len=a.output_len,
                             block_size=a.block_size)
            out = run_in_subprocess(spec, env=env, timeout=900)
            stats = (out.get("vtoken") or {}).get("stats") or {}
            run = dict(arm=arm, rep=rep, split_ms=out["split_ms"], decode_steps=out["decode_steps"],
                       decode_batch_mean=out["decode_batch_mean"], steps=out["steps"],
                       evicted_tokens=stats.get("evicted_tokens", 0), moved_tokens=stats.get("moved_tokens", 0),
                       paths=out.get("paths"), load_average_1m=os.getloadavg()[0])
            summary["runs"].append(run)
            bar.update(1)
            s = run["split_ms"]
            bar.write(f"rep {rep} {arm:>20}: {s['step']:.2f} ms/step = " + ", ".join(f"{p} {s[p]:.2f}" for p in PARTS))
    bar.close()
    summary["results"] = summarize(summary["runs"])
    summary["total_wall_s"] = round(time.time() - t_start, 1)
    summary["machine"]["load_average_1_5_15_end"] = list(os.getloadavg())
    out_path = RESULTS / f"{a.name}.json"
    write_json(out_path, summary)
    plot(summary, out_path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
