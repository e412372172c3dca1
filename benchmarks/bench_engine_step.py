"""Where vToken's decode-step time goes in a real engine: stock vLLM vs vToken, side by side.

Each arm runs its own in-process engine (``drivers.harness.run_in_subprocess``: a fresh process,
UniProc executor, so the worker runs in the timed process), arms alternated (A B, B A, ...)
over ``--reps`` repetitions in one run; the load average is recorded per run. Workload: ``--batch``
requests arrive together, ``--prompt-len`` seeded random token ids each, ``--output-len`` forced
output tokens (greedy, ``ignore_eos``); a pool with room for everything (no preemption). Only
decode-only steps (every scheduled request computes one token, at least ``--batch`` / 2 of them)
are counted, so the figures are per decode step at about that batch.

Per step the hooks (:class:`StepHooks`, in the engine's process) time, with ``perf_counter``
wrappers (a few microseconds per call):

* ``step``      -- ``LLMEngine.step()``;
* ``schedule``  -- ``Scheduler.schedule()`` (vLLM's scheduling plus vToken's counts);
* ``update``    -- ``Scheduler.update_from_output()``;
* ``executor``  -- the executor's ``execute_model`` + ``sample_tokens`` (the worker), of which
  vToken's parts: ``begin`` (``WorkerEviction.begin``: select, plan, side-cache moves, append),
  ``kv_moves`` (``WorkerStep._apply_set_moves``: K/V moves in every layer),
  ``begin_step`` (``WorkerStep.begin_step``, containing the two before),
  ``start_scoring``, ``scoring_layers`` (``StepScores.accumulate``, in the attention wrapper,
  every layer), ``scoring_result`` (``StepScores.result`` or ``.batched``: the deferred
  one-query rows and the packing), ``fold`` (``WorkerEviction.fold``), ``naive`` (``WorkerEviction.take_naive_freed``),
  ``physical`` (``_vt_physical_inputs``: physical ``seq_lens`` and slot mapping);
* ``forward``   -- ``executor`` minus every vToken part above (the model and sampling, stock's work);
* ``other``     -- ``step`` minus ``executor``, ``schedule`` and ``update`` (output processing).

``--baseline DIR`` adds an arm ``vtoken_base``: the vToken arm's config on the vToken code of
another tree (e.g. ``git archive COMMIT | tar -x -C DIR``: the code before a change), its
package first on ``PYTHONPATH``, in the same alternation.

``--profile`` adds one more run of each arm per repetition under ``cProfile`` (the steps after the
first decode step): the functions ranked by own time and by cumulative time, and the vToken
functions by cumulative time (``VT_PROF_DUMP=PATH``: also the raw stats, ``PATH.<pid>``, for ``pstats``).

Writes ``benchmarks/results/<name>.json``.

Usage::

    .venv/bin/python benchmarks/bench_engine_step.py                       # tiny fp32, batch 48, 2 reps
    .venv/bin/python benchmarks/bench_engine_step.py --batch 32 --reps 3 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# (no ``common`` import here: the hooks load in the engine's process before vLLM, and ``common``
# puts this checkout first on sys.path, which would shadow a ``--baseline`` tree's vtoken)
if str(HERE.parent) not in sys.path:
    sys.path.append(str(HERE.parent))  # (last: a baseline tree on PYTHONPATH comes first)
sys.path.append(str(HERE.parent / "tests"))  # tests/drivers/
from drivers.harness import RunHooks  # noqa: E402

#: vToken's timed parts (nested: begin and kv_moves are inside begin_step)
VT_PARTS = ("begin_step", "begin", "kv_moves", "start_scoring", "physical", "scoring_layers", "scoring_result",
            "fold", "naive")
#: the parts that sum to the executor's vToken time (no double counting)
VT_DISJOINT = ("begin_step", "start_scoring", "physical", "scoring_layers", "scoring_result", "fold", "naive")
PARTS = ("step", "schedule", "update", "executor", "other", "forward", *VT_PARTS)


class StepHooks(RunHooks):
    """Times the parts of every engine step (module docstring); in the harness process."""

    profile = False

    def attach(self, engine, sched) -> None:
        from vtoken.integrations.vllm.worker import eviction, scoring, step
        from vtoken.integrations.vllm.worker import runner_v1

        self.steps: list[dict[str, float]] = []
        self.cur: dict[str, float] = {}
        self.prof = cProfile.Profile() if self.profile or os.environ.get("VT_BENCH_PROFILE") else None
        self.profiling = False
        self.seen_decode = False

        def timed(fn, key):
            def w(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.cur[key] = self.cur.get(key, 0.0) + time.perf_counter() - t0
            w.__wrapped__ = fn
            return w

        for cls, name, key in ((scoring.StepScores, "accumulate", "scoring_layers"),
                               (scoring.StepScores, "result", "scoring_result"),
                               (scoring.StepScores, "batched", "scoring_result"),
                               (step.WorkerStep, "begin_step", "begin_step"),
                               (step.WorkerStep, "_apply_set_moves", "kv_moves"),
                               (step.WorkerStep, "start_scoring", "start_scoring"),
                               (eviction.WorkerEviction, "begin", "begin"),
                               (eviction.WorkerEviction, "fold", "fold"),
                               (eviction.WorkerEviction, "take_naive_freed", "naive"),
                               (runner_v1.VTokenV1Adapter, "_vt_physical_inputs", "physical")):
            if hasattr(cls, name):  # (a baseline tree may lack one)
                setattr(cls, name, timed(getattr(cls, name), key))
        core = engine.engine_core.engine_core
        ex = core.model_executor
        for name in ("execute_model", "sample_tokens"):
            if hasattr(ex, name):
                setattr(ex, name, timed(getattr(ex, name), "executor"))
        orig_schedule = sched.schedule

        def schedule(*a, **k):
            t0 = time.perf_counter()
            out = orig_schedule(*a, **k)
            self.cur["schedule"] = self.cur.get("schedule", 0.0) + time.perf_counter() - t0
            n = out.num_scheduled_tokens
            self.cur["decode_only"] = float(bool(n) and all(v == 1 for v in n.values()))
            self.cur["batch"] = float(len(n))
            return out

        sched.schedule = schedule
        sched.update_from_output = timed(sched.update_from_output, "update")

    def before_step(self, run) -> None:
        self.cur.clear()
        if self.prof is not None and self.seen_decode:
            self.prof.enable()
            self.profiling = True
        self.t0 = time.perf_counter()

    def after_step(self, run) -> None:
        t = time.perf_counter() - self.t0
        if self.profiling:
            self.prof.disable()
            self.profiling = False
        c = dict(self.cur)
        c["step"] = t
        self.steps.append(c)
        if c.get("decode_only"):
            self.seen_decode = True

    def finish(self, out: dict[str, Any]) -> None:
        import vtoken

        out["steps_timed"] = self.steps
        out["vtoken_package"] = str(Path(vtoken.__file__).parent)
        if self.prof is not None:
            out["profile"] = profile_summary(self.prof)
            if os.environ.get("VT_PROF_DUMP"):
                self.prof.dump_stats(os.environ["VT_PROF_DUMP"] + f".{os.getpid()}")


class ProfileHooks(StepHooks):
    profile = True


class OpCountHooks(StepHooks):
    """Counts the torch ops dispatched in each decode-only step (``--count-ops``), by origin: the
    innermost ``vtoken/`` or ``vllm/`` frame of the caller's stack decides (``vtoken/FILE:FUNC``,
    else ``vllm``, else ``other``), so stock's work that vToken's adapters call stays stock's.
    A ``TorchDispatchMode`` sees every op below autograd (CPU kernels and views alike)."""

    def attach(self, engine, sched) -> None:
        from collections import Counter

        from torch.utils._python_dispatch import TorchDispatchMode

        super().attach(engine, sched)
        hooks = self

        class _Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if hooks.counting:
                    f = sys._getframe(1)
                    site = "other"
                    while f is not None:
                        fn = f.f_code.co_filename
                        if "/vtoken/" in fn:
                            site = "vtoken/" + fn.rsplit("/vtoken/", 1)[1] + ":" + f.f_code.co_name
                            break
                        if "/vllm/" in fn:
                            site = "vllm"
                            break
                        f = f.f_back
                    hooks.step_ops[site] += 1
                return func(*args, **(kwargs or {}))

        self.counting = False
        self.step_ops: Counter = Counter()
        self.decode_ops: list[tuple[float, Counter]] = []  # (batch, ops) of each decode-only step
        self._mode = _Count()
        self._mode.__enter__()

    def before_step(self, run) -> None:
        super().before_step(run)
        self.step_ops.clear()
        self.counting = True

    def after_step(self, run) -> None:
        self.counting = False
        super().after_step(run)
        c = self.steps[-1]
        if c.get("decode_only"):
            self.decode_ops.append((c.get("batch", 0), self.step_ops.copy()))

    def finish(self, out: dict[str, Any]) -> None:
        from collections import Counter

        super().finish(out)
        # the steps :func:`split` times: decode-only, at least half the largest batch
        top = max((b for b, _ in self.decode_ops), default=0)
        rows = [c for b, c in self.decode_ops if b >= top / 2]
        total: Counter = Counter()
        for c in rows:
            total.update(c)
        n = max(len(rows), 1)
        out["op_counts"] = dict(steps=len(rows), per_step={k: round(v / n, 2) for k, v in total.most_common()})


def profile_summary(prof: cProfile.Profile, top: int = 40) -> dict[str, Any]:
    """Own-time ranking (every function) and cumulative times of vToken's functions."""
    st = pstats.Stats(prof)
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _callers) in st.stats.items():
        rows.append(dict(func=f"{_short(file)}:{line}:{func}", calls=nc, tottime_s=round(tt, 4), cumtime_s=round(ct, 4)))
    own = sorted(rows, key=lambda r: -r["tottime_s"])[:top]
    vt = sorted((r for r in rows if r["func"].startswith("vtoken/")), key=lambda r: -r["cumtime_s"])[:top]
    cum = sorted(rows, key=lambda r: -r["cumtime_s"])[:2 * top]
    total = sum(r["tottime_s"] for r in rows)
    return dict(total_s=round(total, 3), by_own_time=own, vtoken_by_cumulative=vt, by_cumulative=cum)


def _short(file: str) -> str:
    for mark in ("/vtoken/", "/vllm/", "/torch/", "/benchmarks/", "/drivers/"):
        i = file.rfind(mark)
        if i >= 0:
            return file[i + 1:]
    return file


def make_spec(model_dir: str, dtype: str, vocab: tuple[int, int], vt: dict | None, *, batch: int, prompt_len: int,
              output_len: int, block_size: int, hooks: str, arrive_every: int = 0, num_requests: int = 0,
              executor: Optional[str] = None, prefix_caching: bool = False) -> dict:
    rng = random.Random(0)
    n = num_requests or batch
    reqs = [dict(id=f"r{i}", prompt_token_ids=[rng.randrange(*vocab) for _ in range(prompt_len)],
                 max_tokens=output_len, ignore_eos=True, arrive_at_step=i * arrive_every) for i in range(n)]
    blocks = n * ((prompt_len + output_len) // block_size + 2) + 16  # room for everything: no preemption
    engine = dict(model=model_dir, dtype=dtype, max_model_len=prompt_len + output_len + block_size,
                  block_size=block_size, enforce_eager=True, gpu_memory_utilization=0.1,
                  kv_cache_memory_bytes=256 << 20, num_gpu_blocks_override=blocks, skip_tokenizer_init=True,
                  max_num_seqs=max(n, 8), max_num_batched_tokens=max(2048, prompt_len))
    engine["enable_prefix_caching"] = prefix_caching  # (vLLM's default on; the harness's off)
    if executor:  # e.g. "mp": the worker in its own process, as the OpenAI server runs it (parts then unseen)
        engine["distributed_executor_backend"] = executor
    return dict(engine=engine, vtoken=vt, requests=reqs, check=False, hooks=f"{Path(__file__).resolve()}:{hooks}")


def run_in_tree(spec: dict, root: str, env: dict, timeout: float) -> dict:
    """``drivers.harness.run_in_subprocess`` with another tree's ``vtoken`` (and ``drivers``) first."""
    with tempfile.TemporaryDirectory() as d:
        sp, op = Path(d) / "spec.json", Path(d) / "out.json"
        sp.write_text(json.dumps(spec))
        e = dict(os.environ)
        e.pop("PROMETHEUS_MULTIPROC_DIR", None)
        e.update(env)
        from common import pythonpath_first

        e["PYTHONPATH"] = pythonpath_first(root, e.get("PYTHONPATH"))
        p = subprocess.run([sys.executable, "-m", "drivers.harness", str(sp), str(op)], env=e, capture_output=True,
                           text=True, timeout=timeout, start_new_session=True, cwd=root)
        if p.returncode != 0 or not op.exists():
            raise RuntimeError(f"harness run failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-6000:]}")
        return json.loads(op.read_text())


def split(steps: list[dict], min_batch: int, window: Optional[tuple[int, int]] = None) -> dict[str, Any]:
    """Per-part medians and means over the decode-only steps of at least ``min_batch`` requests,
    or (``window``) over every step ``window[0] <= i < window[1]`` (prefills included)."""
    if window is not None:
        rows = steps[window[0]:window[1]]
    else:
        rows = [s for s in steps if s.get("decode_only") and s.get("batch", 0) >= min_batch]
    n = len(rows)
    if not n:
        return dict(decode_steps=0)
    med = {}
    for p in PARTS:
        if p == "forward":
            vals = [s.get("executor", 0.0) - sum(s.get(q, 0.0) for q in VT_DISJOINT) for s in rows]
        elif p == "other":
            vals = [s["step"] - s.get("executor", 0.0) - s.get("schedule", 0.0) - s.get("update", 0.0) for s in rows]
        else:
            vals = [s.get(p, 0.0) for s in rows]
        med[p] = dict(median_ms=1000 * statistics.median(vals), mean_ms=1000 * statistics.fmean(vals))
    return dict(decode_steps=n, batch_mean=statistics.fmean(s["batch"] for s in rows), parts=med)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vtoken", default='{"policy": "h2o", "budget": 64}', help="the vToken arm's config (JSON)")
    ap.add_argument("--profile", action="store_true", help="one more cProfile'd run of each arm per repetition")
    ap.add_argument("--count-ops", action="store_true",
                    help="one more run of each arm per repetition counting the torch ops of each decode step by origin")
    ap.add_argument("--arrive-every", type=int, default=0, metavar="K",
                    help="a stream instead of one batch: request i arrives at step i*K (--requests of them), and "
                         "every step from the output length's step to the last arrival counts (prefills included)")
    ap.add_argument("--requests", type=int, default=0, help="requests in the stream (default --batch)")
    ap.add_argument("--prefix-caching", action="store_true", help="vLLM's prefix caching on (its default; off here "
                                                                    "unless given, as in the harness)")
    ap.add_argument("--executor", default=None, help="vLLM's distributed_executor_backend (mp: the worker in its own "
                                                     "process, as the OpenAI server runs it; the worker's parts unseen)")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="another tree whose vtoken/ runs the vToken config as arm vtoken_base")
    ap.add_argument("--name", default="engine_step")
    a = ap.parse_args(argv)

    sys.path.insert(0, str(HERE))
    from common import machine_info
    from vtoken.assets.paths import ensure_smollm2, ensure_tiny_model
    from drivers.harness import run_in_subprocess

    if a.model == "tiny":
        mdir, dtype, vocab = str(ensure_tiny_model()), "float32", (0, 256)
    else:
        mdir, dtype, vocab = str(ensure_smollm2()), "bfloat16", (100, 49000)
    arms = {"stock": None, "vtoken": json.loads(a.vtoken)}
    if a.baseline:
        arms["vtoken_base"] = json.loads(a.vtoken)
    tree = {"vtoken_base": str(Path(a.baseline).resolve())} if a.baseline else {}

    def run_arm(spec: dict, arm: str) -> dict:
        if arm in tree:
            return run_in_tree(spec, tree[arm], env, 1800)
        return run_in_subprocess(spec, env=env, timeout=1800)

    env = {"OMP_NUM_THREADS": str(a.threads)}
    doc: dict[str, Any] = dict(bench="bench_engine_step", command="python " + " ".join(["benchmarks/bench_engine_step.py"] + argv),
                               machine=machine_info(), loadavg_before=list(os.getloadavg()),
                               config=dict(model=a.model, batch=a.batch, prompt_len=a.prompt_len,
                                           arrive_every=a.arrive_every, requests=a.requests, executor=a.executor,
                                           prefix_caching=a.prefix_caching,
                                           output_len=a.output_len, block_size=a.block_size, reps=a.reps,
                                           threads=a.threads, arms=arms, baseline=a.baseline,
                                           metric="per decode-only step (batch >= half of --batch), median over "
                                                  "the run's steps; parts nested as in the module docstring"),
                               runs=[], profiles=[], op_counts=[])
    t_start = time.time()
    for rep in range(a.reps):
        order = list(arms) if rep % 2 == 0 else list(reversed(arms))
        for arm in order:
            spec = make_spec(mdir, dtype, vocab, arms[arm], batch=a.batch, prompt_len=a.prompt_len,
                             output_len=a.output_len, block_size=a.block_size, hooks="StepHooks",
                             arrive_every=a.arrive_every, num_requests=a.requests, executor=a.executor, prefix_caching=a.prefix_caching)
            la = os.getloadavg()[0]
            out = run_arm(spec, arm)
            window = (a.output_len, a.arrive_every * ((a.requests or a.batch) - 1)) if a.arrive_every else None
            s = split(out["steps_timed"], a.batch // 2, window)
            run = dict(rep=rep, arm=arm, load_average_1m=la, vtoken_package=out.get("vtoken_package"), **s)
            doc["runs"].append(run)
            p = s.get("parts", {})
            print(f"rep {rep} {arm:>7}: {s['decode_steps']} steps, step {p.get('step', {}).get('median_ms', 0):.2f} ms "
                  f"(mean {p.get('step', {}).get('mean_ms', 0):.2f}) "
                  f"(load {la:.2f}); " + ", ".join(f"{k} {v['median_ms']:.2f}" for k, v in p.items() if v['median_ms'] > 0.005),
                  flush=True)
        for arm in (order if a.profile else ()):
            spec = make_spec(mdir, dtype, vocab, arms[arm], batch=a.batch, prompt_len=a.prompt_len,
                             output_len=a.output_len, block_size=a.block_size, hooks="ProfileHooks",
                             arrive_every=a.arrive_every, num_requests=a.requests, executor=a.executor, prefix_caching=a.prefix_caching)
            out = run_arm(spec, arm)
            doc["profiles"].append(dict(rep=rep, arm=arm, load_average_1m=os.getloadavg()[0], **out["profile"]))
            prof = out["profile"]
            print(f"profile rep {rep} {arm}: total {prof['total_s']} s; top own time:")
            for r in prof["by_own_time"][:15]:
                print(f"  {r['tottime_s']:8.3f} s {r['calls']:>8} {r['func']}")
            print("  vtoken cumulative:")
            for r in prof["vtoken_by_cumulative"][:25]:
                print(f"  {r['cumtime_s']:8.3f} s {r['calls']:>8} {r['func']}")
        for arm in (order if a.count_ops else ()):
            spec = make_spec(mdir, dtype, vocab, arms[arm], batch=a.batch, prompt_len=a.prompt_len,
                             output_len=a.output_len, block_size=a.block_size, hooks="OpCountHooks",
                             arrive_every=a.arrive_every, num_requests=a.requests, executor=a.executor,
                             prefix_caching=a.prefix_caching)
            oc = run_arm(spec, arm)["op_counts"]
            ops = oc["per_step"]
            vt = {k: v for k, v in ops.items() if k.startswith("vtoken/")}
            row = dict(rep=rep, arm=arm, steps=oc["steps"], total=round(sum(ops.values()), 1),
                       vtoken=round(sum(vt.values()), 1), vllm=ops.get("vllm", 0), other=ops.get("other", 0),
                       vtoken_sites=vt)
            doc["op_counts"].append(row)
            print(f"ops rep {rep} {arm}: {row['total']} torch ops per decode step ({oc['steps']} steps): vllm "
                  f"{row['vllm']}, vtoken {row['vtoken']}, other {row['other']}", flush=True)
            for k, v in list(vt.items())[:12]:
                print(f"  {v:7.1f} {k}")
    res = {}
    for arm in arms:
        rs = [r for r in doc["runs"] if r["arm"] == arm and r.get("decode_steps")]
        res[arm] = {p: statistics.median(r["parts"][p]["median_ms"] for r in rs) for p in PARTS}
    def ratios_of(arm: str) -> list[float]:
        return [v["parts"]["step"]["median_ms"] / s["parts"]["step"]["median_ms"]
                for rep in range(a.reps)
                for v in doc["runs"] if v["rep"] == rep and v["arm"] == arm
                for s in doc["runs"] if s["rep"] == rep and s["arm"] == "stock"]

    def mean_ratios_of(arm: str) -> list[float]:
        return [v["parts"]["step"]["mean_ms"] / s["parts"]["step"]["mean_ms"]
                for rep in range(a.reps)
                for v in doc["runs"] if v["rep"] == rep and v["arm"] == arm
                for s in doc["runs"] if s["rep"] == rep and s["arm"] == "stock"]

    ratios = ratios_of("vtoken")
    doc["results"] = dict(median_ms=res, step_ratio_per_rep=ratios,
                          step_ratio_median=statistics.median(ratios) if ratios else None,
                          mean_step_ms={arm: statistics.median(r["parts"]["step"]["mean_ms"] for r in doc["runs"]
                                                              if r["arm"] == arm and r.get("decode_steps")) for arm in arms},
                          mean_step_ratio_per_rep=mean_ratios_of("vtoken"))
    if a.baseline:
        rb = ratios_of("vtoken_base")
        doc["results"].update(base_step_ratio_per_rep=rb, base_step_ratio_median=statistics.median(rb) if rb else None,
                              base_mean_step_ratio_per_rep=mean_ratios_of("vtoken_base"))
    doc["loadavg_after"] = list(os.getloadavg())
    doc["total_wall_s"] = round(time.time() - t_start, 1)
    path = RESULTS / f"{a.name}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"\n{'part':>15} | " + " | ".join(f"{arm:>9}" for arm in arms) + "   (median ms per decode step)")
    for p in PARTS:
        print(f"{p:>15} | " + " | ".join(f"{res[arm][p]:9.3f}" for arm in arms))
    print(f"vtoken / stock step: {ratios} (median {doc['results']['step_ratio_median']}); mean step "
          f"{doc['results']['mean_step_ms']}, ratios {doc['results']['mean_step_ratio_per_rep']}")
    if a.baseline:
        print(f"vtoken_base / stock step: {doc['results']['base_step_ratio_per_rep']} "
              f"(median {doc['results']['base_step_ratio_median']})")
    print(f"wrote {path} ({doc['total_wall_s']} s; load {doc['loadavg_before']} -> {doc['loadavg_after']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
