"""Retained KV blocks per request: vToken vs Naive-Evict vs no eviction (and the ideal ceil(live/B)).

Method. Long ShareGPT conversations (re-joined pieces, chat template applied) are truncated
to ``prompt_len`` tokens and each generates ``gen`` tokens (greedy, ignore_eos). One engine per
(model, block size); every (policy, budget) variant of every conversation is one request of
the same batch (per-request overrides ``vtoken_policy`` / ``vtoken_budget``), and the pool is
large enough that nothing is preempted. Per finished request the scheduler reports, averaged
over the request's scheduled steps (prefill included) and at peak:

* ``avg_blocks`` / ``peak_blocks``: blocks vToken actually held (read from vLLM's block table);
* ``naive_*``: what Naive-Evict holds for the *same* eviction decisions (a block is freed only
  when every token ever placed in it is dead) -- so one vToken run gives both arms exactly;
* ``full_*``: no eviction, ``ceil(logical/B)``;
* ideal (from the scheduler trace): ``ceil(kept/B)`` with ``kept`` the live tokens kept between
  steps; vToken holds the ideal plus, at most, the block that the step's new token needs.

The ``decode_*`` figures repeat the average/peak over decode steps only (after the prompt, which
is prefilled whole with no eviction, so the lifetime peak of every arm is the prompt's blocks).

One extra run repeats one configuration (the identical batch) with ``mode: "naive"``: the engine then really holds the
Naive-Evict blocks; its ``avg_blocks`` must equal the vToken run's ``naive_avg_blocks`` and its
tokens must equal the vToken run's tokens (same decisions; Naive-Evict here attends densely over
the same live tokens, the conservative choice).

Block size: vLLM's CPU attention backend needs block sizes that are multiples of 32, so 16
(the GPU default) cannot be run here; 32 and 64 are measured.

Usage::

    python benchmarks/bench_retained_blocks.py --small   # tiny model, 3 engines: 917 s on 2 heavily shared cores
    python benchmarks/bench_retained_blocks.py --full    # + SmolLM2 B=32/64: 974 s (OMP_NUM_THREADS=1, loaded)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    parse_size_args,
    ALL_POLICIES,
    cdiv,
    engine_kwargs,
    load_long_conversations,
    mean,
    run_engine,
    run_metadata,
    smollm2,
    tiny,
    write_json,
)

SEED = 0


def plan(size: str) -> dict:
    """Engine runs. ``naive_check``: index of the run repeated with ``mode: "naive"`` (identical batch,
    so the scheduler makes the same steps and the per-step averages are comparable exactly)."""
    if size == "small":
        return dict(
            runs=[
                dict(model="tiny", dtype="float32", block_size=32, policies=ALL_POLICIES, budgets=[128, 256, 512],
                     n_conv=1, prompt_len=1024, gen=64),
                dict(model="tiny", dtype="float32", block_size=64, policies=ALL_POLICIES, budgets=[128, 256, 512],
                     n_conv=1, prompt_len=1024, gen=64),
            ],
            naive_check=0,
        )
    return dict(
        runs=[
            dict(model="smollm2", dtype="bfloat16", block_size=32, policies=ALL_POLICIES, budgets=[128, 256, 512],
                 n_conv=1, prompt_len=1024, gen=64),
            dict(model="smollm2", dtype="bfloat16", block_size=64, policies=ALL_POLICIES, budgets=[128, 256, 512],
                 n_conv=1, prompt_len=1024, gen=64),
            dict(model="tiny", dtype="float32", block_size=32, policies=ALL_POLICIES, budgets=[128, 256, 512],
                 n_conv=2, prompt_len=1024, gen=128),
        ],
        naive_check=2,
    )


_MODELS = {"smollm2": smollm2, "tiny": tiny}
_CONV_CACHE: dict = {}


def conversations(model_name: str, model_dir: str, n: int, prompt_len: int) -> list[dict]:
    key = (model_name, n, prompt_len)
    if key not in _CONV_CACHE:
        # tiny model: its own byte-level tokenizer (vocab 512); SmolLM2: its tokenizer.
        convs = load_long_conversations(n, prompt_len, seed=SEED,
                                        tokenizer_dir=model_dir if model_name == "tiny" else None)
        _CONV_CACHE[key] = [dict(id=c["id"], ids=c["ids"][:prompt_len]) for c in convs]
    return _CONV_CACHE[key]


def build_spec(run: dict, mode: str = "vtoken") -> tuple[dict, dict]:
    model_dir = _MODELS[run["model"]]()
    convs = conversations(run["model"], model_dir, run["n_conv"], run["prompt_len"])
    reqs, meta = [], {}
    for ci, c in enumerate(convs):
        for pol in run["policies"]:
            for b in run["budgets"]:
                rid = f"c{ci}.{pol}.{b}"
                reqs.append(dict(id=rid, prompt_token_ids=c["ids"], max_tokens=run["gen"], ignore_eos=True,
                                 extra_args=dict(vtoken_policy=pol, vtoken_budget=b)))
                meta[rid] = dict(conv=ci, conv_id=c["id"], policy=pol, budget=b)
    B = run["block_size"]
    total = run["prompt_len"] + run["gen"]
    num_blocks = len(reqs) * (cdiv(total, B) + 1) + 16  # room for every request unevicted: no preemption
    spec = dict(engine=engine_kwargs(model_dir, dtype=run["dtype"], block_size=B, max_model_len=total + B,
                                     num_blocks=num_blocks),
                vtoken=dict(policy="h2o", budget=256, mode=mode), requests=reqs, check=False)
    return spec, meta


def _base_id(internal: str, known) -> str:
    if internal in known:
        return internal
    base = internal.rsplit("-", 1)[0]
    return base if base in known else internal


def analyse(run: dict, out: dict, meta: dict) -> list[dict]:
    B = run["block_size"]
    fin = {_base_id(f["req_id"], meta): f for f in out["vtoken"]["finished"]}
    internal = {f["req_id"]: _base_id(f["req_id"], meta) for f in out["vtoken"]["finished"]}
    per: dict[str, dict[str, list]] = {}
    for rec in out.get("trace", []):
        for iid, (live, logical, held, naive_ret, _exp) in rec["reqs"].items():
            rid = internal.get(iid, _base_id(iid, meta))
            f = fin.get(rid)
            if f is None:
                continue
            P = f["prompt_len"]
            decode = logical > P
            kept = live - 1 if decode else live
            d = per.setdefault(rid, dict(ideal=[], held=[], naive=[], full=[], decode=[]))
            d["ideal"].append(cdiv(max(kept, 0), B))
            d["held"].append(held)
            d["naive"].append(max(naive_ret, cdiv(live, B)))
            d["full"].append(cdiv(logical, B))
            d["decode"].append(decode)
    rows = []
    for rid, m in meta.items():
        f = fin.get(rid)
        if f is None:
            raise RuntimeError(f"request {rid} did not finish")
        t = per.get(rid)
        row = dict(id=rid, **m, prompt_len=f["prompt_len"], steps=f["steps"], evicted=f["evicted"],
                   num_live=f["num_live"], num_logical=f["num_logical"],
                   vtoken_avg=f["avg_blocks"], vtoken_peak=f["peak_blocks"],
                   naive_avg=f["naive_avg_blocks"], naive_peak=f["naive_peak_blocks"],
                   full_avg=f["full_avg_blocks"], full_peak=f["full_peak_blocks"],
                   tokens=out["tokens"].get(rid))
        if t:
            row["ideal_avg"] = mean(t["ideal"])
            row["ideal_peak"] = max(t["ideal"])
            dec = [i for i, x in enumerate(t["decode"]) if x]
            for k in ("ideal", "held", "naive", "full"):
                name = "vtoken" if k == "held" else k
                vals = [t[k][i] for i in dec]
                row[f"decode_{name}_avg"] = mean(vals)
                row[f"decode_{name}_peak"] = max(vals) if vals else None
            # cross-check: the trace's held/naive averages equal the scheduler's lifetime figures
            row["trace_matches"] = (abs(mean(t["held"]) - f["avg_blocks"]) < 1e-9
                                    and abs(mean(t["naive"]) - f["naive_avg_blocks"]) < 1e-9)
        rows.append(row)
    return rows


def summarise(rows: list[dict], run: dict) -> list[dict]:
    out = []
    for pol in run["policies"]:
        for b in run["budgets"]:
            rs = [r for r in rows if r["policy"] == pol and r["budget"] == b]
            s = dict(model=run["model"], block_size=run["block_size"], policy=pol, budget=b, n=len(rs))
            for k in ("vtoken_avg", "naive_avg", "full_avg", "ideal_avg", "vtoken_peak", "naive_peak", "full_peak",
                      "ideal_peak", "decode_vtoken_avg", "decode_naive_avg", "decode_full_avg", "decode_ideal_avg",
                      "decode_vtoken_peak", "decode_naive_peak"):
                s[k] = mean(r.get(k, float("nan")) for r in rs)
            s["reduction_avg"] = 1 - s["vtoken_avg"] / s["naive_avg"]
            s["reduction_peak"] = 1 - s["vtoken_peak"] / s["naive_peak"]
            s["reduction_decode_avg"] = 1 - s["decode_vtoken_avg"] / s["decode_naive_avg"]
            s["reduction_decode_peak"] = 1 - s["decode_vtoken_peak"] / s["decode_naive_peak"]
            s["reduction_vs_full_avg"] = 1 - s["vtoken_avg"] / s["full_avg"]
            out.append(s)
    return out


def plot(summary: list[dict], path: Path, title: str) -> None:
    """Bars per policy and budget: blocks held with no eviction, Naive-Evict, vToken and the ideal;
    the green label above each budget is vToken's reduction vs Naive-Evict (time averages)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    pols = list(dict.fromkeys(s["policy"] for s in summary))
    buds = sorted(set(s["budget"] for s in summary))
    fig, axes = plt.subplots(1, len(pols), figsize=(3.6 * len(pols), 4.6), sharey=True, squeeze=False)
    arms = [("full_avg", "no eviction", "#999999"), ("naive_avg", "Naive-Evict", "#d95f02"),
            ("vtoken_avg", "vToken (held)", "#1b9e77"), ("ideal_avg", "ideal ceil(live/B)", "#7570b3")]
    w = 0.2
    ymax = max(s["full_avg"] for s in summary)
    for ax, pol in zip(axes[0], pols):
        x = np.arange(len(buds))
        for j, (k, lab, col) in enumerate(arms):
            ys = [next((s[k] for s in summary if s["policy"] == pol and s["budget"] == b), np.nan) for b in buds]
            ax.bar(x + (j - 1.5) * w, ys, w, label=lab, color=col)
        for xi, b in zip(x, buds):
            s = next((s for s in summary if s["policy"] == pol and s["budget"] == b), None)
            if s:  # above the budget's group of bars, clear of every bar
                ax.text(xi, 1.03 * ymax, f"-{100 * s['reduction_avg']:.0f}%",
                        ha="center", va="bottom", fontsize=11, color="#1b9e77", fontweight="bold")
        ax.set_xticks(x, [str(b) for b in buds])
        ax.set_title(pol, fontsize=12)
        ax.set_xlabel("budget (tokens)", fontsize=11)
        ax.tick_params(labelsize=10)
        ax.set_ylim(0, 1.16 * ymax)
    axes[0][0].set_ylabel("blocks held per request (time average)", fontsize=11)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(arms), fontsize=11, frameon=False)
    fig.suptitle(f"{title}\ngreen label above each budget: vToken's reduction of blocks held vs Naive-Evict "
                 "(time averages)", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def _plot_all(result: dict, out_path: Path) -> None:
    """One plot per (model, block size) vToken run of ``result``, named after ``out_path``."""
    for run in result["runs"]:
        if run["mode"] != "vtoken":
            continue
        c = run["config"]
        png = out_path.with_name(f"{out_path.stem}_{c['model']}_B{c['block_size']}.png")
        plot(run["summary"], png, f"{c['model']} ({c['dtype']}), block size {c['block_size']}, prompt {c['prompt_len']}, "
             f"gen {c['gen']}, {c['n_conv']} ShareGPT conv.")


def main(argv=None) -> int:
    args, out_path = parse_size_args(argv, __doc__.splitlines()[0], "retained_blocks")
    if args.replot:
        _plot_all(json.loads(args.replot.read_text()), args.replot)
        return 0
    from tqdm import tqdm

    p = plan(args.size)
    t_start = time.perf_counter()
    result = dict(meta=run_metadata(benchmark="retained_blocks", size=args.size, seeds=dict(data_shuffle=SEED,
                                    engine=0, random_policy=0), models=dict(smollm2="SmolLM2-135M-Instruct (bf16)",
                                    tiny="tiny random 2-layer Llama (fp32, byte tokenizer)"), plan=p),
                  runs=[], summary=[])
    jobs = [("vtoken", r) for r in p["runs"]] + [("naive", p["runs"][p["naive_check"]])]
    bar = tqdm(jobs, desc="engines", unit="engine")
    for mode, run in bar:
        bar.set_postfix_str(f"{run['model']} B={run['block_size']} {mode}")
        spec, meta = build_spec(run, mode)
        t0 = time.perf_counter()
        out = run_engine(spec, trace=True)
        rows = analyse(run, out, meta)
        rec = dict(mode=mode, config=run, engine_wall_s=time.perf_counter() - t0, loop_wall_s=out["wall_s"],
                   steps=out["steps"], max_running=out["max_running"], preemptions=out["preemptions"],
                   vtoken_stats=out["vtoken"]["stats"], requests=rows)
        if mode == "vtoken":
            rec["summary"] = summarise(rows, run)
            result["summary"].extend(rec["summary"])
        result["runs"].append(rec)
    # naive-mode check against the matching vToken run's accounting
    nrun = result["runs"][-1]
    cfg = nrun["config"]
    # The vToken arm for the check: a vToken run with the same model and block size and conversation.
    match = result["runs"][p["naive_check"]]
    vt = {r["id"]: r for r in match["requests"]}
    checks = []
    for r in nrun["requests"]:
        v = vt.get(r["id"])
        if v is None:
            continue
        checks.append(dict(id=r["id"], naive_mode_avg_blocks=r["vtoken_avg"], vtoken_run_naive_avg_blocks=v["naive_avg"],
                           naive_mode_peak_blocks=r["vtoken_peak"], vtoken_run_naive_peak_blocks=v["naive_peak"],
                           avg_equal=abs(r["vtoken_avg"] - v["naive_avg"]) < 1e-9,
                           peak_equal=r["vtoken_peak"] == v["naive_peak"], steps=(r["steps"], v["steps"]),
                           tokens_equal=r["tokens"] == v["tokens"]))
    result["naive_mode_check"] = dict(config=cfg, requests=checks,
                                      all_equal=bool(checks) and all(c["avg_equal"] and c["peak_equal"] for c in checks),
                                      all_tokens_equal=bool(checks) and all(c["tokens_equal"] for c in checks))
    for run in result["runs"]:
        for r in run["requests"]:
            r.pop("tokens", None)
    result["meta"]["total_wall_s"] = time.perf_counter() - t_start
    write_json(out_path, result)
    _plot_all(result, out_path)  # one plot per (model, block size)
    # headline table
    print(f"{'model':8} {'B':>3} {'policy':13} {'budget':>6} {'naive':>7} {'vtoken':>7} {'ideal':>7} {'full':>7} {'red.':>6} {'dec.red':>7}")
    for s in result["summary"]:
        print(f"{s['model']:8} {s['block_size']:>3} {s['policy']:13} {s['budget']:>6} {s['naive_avg']:7.2f} "
              f"{s['vtoken_avg']:7.2f} {s['ideal_avg']:7.2f} {s['full_avg']:7.2f} {100 * s['reduction_avg']:5.1f}% "
              f"{100 * s['reduction_decode_avg']:6.1f}%")
    print("naive-mode check:", result["naive_mode_check"]["all_equal"], "tokens equal:",
          result["naive_mode_check"]["all_tokens_equal"], f"total {result['meta']['total_wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
