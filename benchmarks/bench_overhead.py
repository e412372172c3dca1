"""Overhead of vToken: engine step time with vToken on vs stock vLLM, measured side by side.

Arms (offline, through ``drivers.harness.run_in_subprocess``; each run is a
fresh process, so every arm pays the same start-up and only the step loop is timed):

* ``stock``     -- no ``vtoken`` key (the plugin is installed but inert);
* ``noevict``   -- vToken on (H2O, scores accumulated every step), budget above every length:
  nothing is ever evicted, so this is the pure bookkeeping + scoring cost;
* ``evict``     -- vToken on, budget far below the sequence length and ``slack = 0``:
  every request evicts every decode step once full, so this adds policy + repack (moves) cost.

Workload: a batch of ``--batch`` requests that arrive together, ``--prompt-len`` token ids
(seeded pseudo-random ids; content does not matter for timing) and ``--output-len`` forced
output tokens (``ignore_eos``, greedy). Metric: mean step time = harness ``wall_s`` (the
step loop) / ``steps``; the loop is one prefill step followed by ``output_len - 1`` decode
steps, so it is decode-dominated. Arms are interleaved (A B C A B C ...) ``--reps`` times in
one run; the report is, per arm, the median over repetitions of the ratio to the ``stock``
run of the same repetition, with min/max as the spread (ratios, never absolute times, are
comparable on this shared machine).

With ``--policies P [P ...]`` the arms are ``stock`` and one evicting arm per policy instead
(``evict-<P>``; ``@worker`` only tags the arm ``-worker``, as in the committed results: every
arm decides on the worker; ``:slK`` sets the slack, 0 otherwise, and ``:seK`` ``score_every``):
every policy's evicting step against stock in one run (issue 26, "step cost").

Writes ``benchmarks/results/<name>.json`` and ``<name>.png``.

Usage::

    python benchmarks/bench_overhead.py --small      # SmolLM2 bf16, 2 reps (~5 min on 2 cores)
    python benchmarks/bench_overhead.py              # SmolLM2 bf16 + tiny fp32, 3 reps
    python benchmarks/bench_overhead.py --small --policies h2o h2o@worker tova@worker random@worker \
        knorm@worker keydiff@worker --name overhead_policies   # every policy's evicting step
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"


sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info, policy_spec  # noqa: E402


def make_spec(model_dir: Path, dtype: str, vocab: tuple[int, int], vt: dict | None, *, batch: int,
              prompt_len: int, output_len: int, block_size: int) -> dict:
    rng = random.Random(0)
    reqs = [dict(id=f"r{i}", prompt_token_ids=[rng.randrange(*vocab) for _ in range(prompt_len)],
                 max_tokens=output_len, ignore_eos=True) for i in range(batch)]
    blocks = batch * ((prompt_len + output_len) // block_size + 2) + 16
    engine = dict(model=str(model_dir), dtype=dtype, max_model_len=prompt_len + output_len + block_size,
                  block_size=block_size, enforce_eager=True, gpu_memory_utilization=0.1,
                  kv_cache_memory_bytes=256 << 20, num_gpu_blocks_override=blocks, skip_tokenizer_init=True,
                  max_num_seqs=max(batch, 8),
                  # (distinct prompts: nothing to hit)
                  enable_prefix_caching=False)
    return dict(engine=engine, vtoken=vt, requests=reqs, check=False)


def finalize_partial(partial: Path, out: Path) -> None:
    """Summarize an interrupted run's ``*.partial.json`` (ratios per complete repetition only)."""
    summary = json.loads(partial.read_text())
    summary["status"] = f"interrupted after {len(summary['runs'])} runs; ratios use complete repetitions only"
    for m in summary["config"]["models"]:
        runs = [r for r in summary["runs"] if r["model"] == m]
        if not runs:
            continue
        arms = list(summary["config"]["arms"])
        res = {arm: dict(step_ms=[r["step_ms"] for r in runs if r["arm"] == arm]) for arm in arms}
        for arm in res:
            res[arm]["step_ms_median"] = statistics.median(res[arm]["step_ms"]) if res[arm]["step_ms"] else None
        for arm in [x for x in arms if x != "stock"]:
            ratios = []
            for rep in sorted({r["rep"] for r in runs}):
                x = [r["step_ms"] for r in runs if r["rep"] == rep and r["arm"] == arm]
                s = [r["step_ms"] for r in runs if r["rep"] == rep and r["arm"] == "stock"]
                if x and s:
                    ratios.append(x[0] / s[0])
            if ratios:
                res[arm].update(ratio_to_stock=ratios, ratio_median=statistics.median(ratios),
                                ratio_min=min(ratios), ratio_max=max(ratios))
        summary["results"][m] = res
    out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary["results"], indent=1))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--finalize-partial":
        finalize_partial(Path(argv[1]), Path(argv[2]))
        return 0
    if argv and argv[0] == "--replot":  # redraw the plot of a result file (no engine runs)
        path = Path(argv[1])
        plot(json.loads(path.read_text()), path.with_suffix(".png"))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--models", nargs="+", choices=["smollm2", "tiny"], default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--policy", default="h2o")
    ap.add_argument("--evict-budget", type=int, default=64)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 2)))
    ap.add_argument("--policies", nargs="+", default=None, metavar="NAME[:seK][:slK][@worker]",
                    help="arms: stock and one evicting arm per policy spec (score_every K, slack K, @worker: "
                         "the arm tag only; slack 0 unless :slK)")
    ap.add_argument("--name", default=None)
    a = ap.parse_args(argv)
    models = a.models or (["smollm2"] if a.small else ["smollm2", "tiny"])
    reps = a.reps or (2 if a.small else 3)
    name = a.name or ("overhead_small" if a.small else "overhead")

    from tqdm import tqdm

    from vtoken.assets.paths import ensure_smollm2, ensure_tiny_model
    from drivers.harness import run_in_subprocess

    total_len = a.prompt_len + a.output_len
    arms = {
        "stock": None,
        "noevict": {"policy": a.policy, "budget": 4 * total_len},
        "evict": {"policy": a.policy, "budget": a.evict_budget, "slack": 0},
    }
    if a.policies:
        arms = {"stock": None}
        for spec in a.policies:
            pol, extra, _ = policy_spec(spec)
            arms[f"evict-{spec}"] = {"policy": pol, "budget": a.evict_budget, "slack": 0, **extra}
    mdefs = {}
    for m in models:
        if m == "smollm2":
            mdefs[m] = (ensure_smollm2(), "bfloat16", (100, 49000))
        else:
            mdefs[m] = (ensure_tiny_model(), "float32", (0, 256))

    t_start = time.time()
    summary = dict(benchmark="bench_overhead", date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                   command="python " + " ".join(["benchmarks/bench_overhead.py"] + argv), machine=machine_info(),
                   config=dict(models=models, reps=reps, batch=a.batch, prompt_len=a.prompt_len,
                               output_len=a.output_len, block_size=a.block_size,
                               policy=a.policy if not a.policies else "per arm",
                               arms=arms, threads=a.threads,
                               metric="harness wall_s / steps (1 prefill + output_len-1 decode steps)"),
                   runs=[], results={})
    env = {"OMP_NUM_THREADS": str(a.threads)}
    bar = tqdm(total=len(models) * reps * len(arms), desc="bench_overhead", unit="run")
    for m in models:
        mdir, dtype, vocab = mdefs[m]
        for rep in range(reps):
            order = list(arms) if rep % 2 == 0 else list(reversed(arms))  # A B C, C B A, ...
            for arm in order:
                spec = make_spec(mdir, dtype, vocab, arms[arm], batch=a.batch, prompt_len=a.prompt_len,
                                 output_len=a.output_len, block_size=a.block_size)
                t0 = time.time()
                out = run_in_subprocess(spec, env=env, timeout=900)
                vt = (out.get("vtoken") or {}).get("stats") or {}
                run = dict(model=m, rep=rep, arm=arm, wall_s=out["wall_s"], steps=out["steps"],
                           step_ms=1000.0 * out["wall_s"] / out["steps"], process_s=round(time.time() - t0, 1),
                           max_running=out["max_running"],
                           tokens_out=sum(len(v) for v in out["tokens"].values()),
                           vtoken_stats=vt, load_average_1m=os.getloadavg()[0])
                summary["runs"].append(run)
                (RESULTS / f"{name}.partial.json").write_text(json.dumps(summary, indent=1))
                bar.update(1)
                bar.write(f"{m} rep {rep} {arm:>8}: {run['step_ms']:.2f} ms/step ({out['steps']} steps)")
        res = {}
        for arm in arms:
            ms = [r["step_ms"] for r in summary["runs"] if r["model"] == m and r["arm"] == arm]
            res[arm] = dict(step_ms=ms, step_ms_median=statistics.median(ms))
        for arm in [x for x in arms if x != "stock"]:
            ratios = []
            for rep in range(reps):
                x = [r["step_ms"] for r in summary["runs"] if r["model"] == m and r["rep"] == rep and r["arm"] == arm][0]
                s = [r["step_ms"] for r in summary["runs"] if r["model"] == m and r["rep"] == rep and r["arm"] == "stock"][0]
                ratios.append(x / s)
            res[arm].update(ratio_to_stock=ratios, ratio_median=statistics.median(ratios),
                            ratio_min=min(ratios), ratio_max=max(ratios))
        summary["results"][m] = res
    bar.close()
    summary["total_wall_s"] = round(time.time() - t_start, 1)
    out_path = RESULTS / f"{name}.json"
    out_path.write_text(json.dumps(summary, indent=1))
    (RESULTS / f"{name}.partial.json").unlink(missing_ok=True)

    print(f"\n{'model':>8} | {'arm':>8} | median ms/step | ratio to stock (median [min, max])")
    for m, res in summary["results"].items():
        for arm, r in res.items():
            rr = (f"{r['ratio_median']:.3f} [{r['ratio_min']:.3f}, {r['ratio_max']:.3f}]" if "ratio_median" in r else "1")
            print(f"{m:>8} | {arm:>8} | {r['step_ms_median']:14.2f} | {rr}")
    print(f"wrote {out_path} ({summary['total_wall_s']} s)")

    plot(summary, RESULTS / f"{name}.png")
    return 0


def plot(summary: dict, path: Path) -> None:
    """Step time / stock per vToken arm: each repetition a dot, its median a bar, the min-max a
    vertical line (no box: a handful of repetitions is not a distribution)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = summary["config"]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * (len(c["arms"]) - 1) * len(summary["results"])), 4.2))
    labels, data = [], []
    for m, res in summary["results"].items():
        for arm in [x for x in c["arms"] if x != "stock"]:
            cfg = c["arms"][arm]
            labels.append(f"{m}, {arm}\n(budget {cfg['budget']})")
            data.append(res[arm]["ratio_to_stock"])
    for i, d in enumerate(data):
        med = sorted(d)[len(d) // 2] if len(d) % 2 else sum(sorted(d)[len(d) // 2 - 1:len(d) // 2 + 1]) / 2
        ax.vlines(i, min(d), max(d), color="k", lw=1.5)
        ax.hlines(med, i - 0.15, i + 0.15, color="#1b9e77", lw=3)
        ax.scatter([i] * len(d), d, s=30, color="k", zorder=3)
        ax.text(i + 0.2, med, f"{med:.2f}x", va="center", fontsize=11)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(labels)), labels, fontsize=10)
    ax.set_xlim(-0.6, len(labels) - 0.4)
    ax.set_ylabel("decode step time / stock vLLM", fontsize=11)
    ax.set_title(f"vToken overhead ({c['reps']} repetitions, arms alternated; dot: one repetition, bar: median)\n"
                 f"batch {c['batch']}, prompt {c['prompt_len']}, out {c['output_len']}, {c['policy']}, "
                 f"block {c['block_size']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
