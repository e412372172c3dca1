"""Maximum feasible concurrency under a fixed KV pool: stock vLLM vs Naive-Evict vs vToken.

Method. The pool is fixed with ``num_gpu_blocks_override`` to the blocks of ``pool_requests``
full-length requests (plus vLLM's null block); ``max_num_seqs`` is raised above any N tried.
N requests of identical shape (``prompt_len`` distinct real ShareGPT tokens each, ``gen``
tokens, greedy, ignore_eos) are submitted at step 0. N is *feasible* when all N requests are
running (decoding) together at some step (harness ``max_running == N``) and vLLM preempted
nothing (``Scheduler._preempt_request`` is counted in the engine process, which covers stock
vLLM too; for vToken/naive runs ``vtoken.stats.preemption_resets`` must also be 0). At its
first preemption a probe's requests are aborted. The largest feasible N is found by exponential
bracketing and bisection between verified-feasible and verified-infeasible N (the search's
ceiling is an upper bound: N requests decoding together hold at least N * ceil((budget+1)/B)
blocks). One engine per mode (stock, naive, vtoken) is reused for all its probes (policy and
budget are per-request overrides); after each probe the pool must be whole again.

Arms: stock vLLM (no plugin, ``VLLM_PLUGINS=""``), and per policy (h2o, random, scissorhands)
Naive-Evict (``mode: naive``: the engine holds exactly the blocks Naive-Evict would; it attends
densely over the live tokens, the conservative choice) and vToken (``mode: vtoken``).

Model: the tiny 2-layer Llama (fp32). SmolLM2 is too slow here for tens of requests x hundreds
of steps with per-step attention scoring on 2 shared CPU cores; block accounting does not
depend on model size, only the policies' choices (attention patterns) do.

Usage::

    python benchmarks/bench_concurrency.py --small   # 423 s (OMP_NUM_THREADS=1, loaded 2-core machine)
    python benchmarks/bench_concurrency.py --full    # see benchmarks/README.md
    python benchmarks/bench_concurrency.py --chunks  # vToken with prefill_eviction: chunks (chunk 64; SnapKV
                                                     # too, which has no Naive-Evict arm), beside the committed
                                                     # --full result's stock / Naive-Evict / vToken arms
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RESULTS,
    parse_size_args,
    PAPER_POLICIES,
    cdiv,
    engine_kwargs,
    load_long_conversations,
    run_metadata,
    smollm2,
    tiny,
    write_json,
)

SEED = 0


def plan(size: str) -> dict:
    if size == "small":
        return dict(model="tiny", dtype="float32", block_size=32, prompt_len=512, gen=128, pool_requests=4,
                    budgets=[128], policies=PAPER_POLICIES)
    full = dict(model="tiny", dtype="float32", block_size=32, prompt_len=512, gen=256, pool_requests=8,
                budgets=[128, 256], policies=PAPER_POLICIES)
    if size == "chunks":  # the full plan plus vToken with prefill_eviction: chunks (issue 25), chunk 64
        return dict(full, chunk=64, chunk_policies=list(PAPER_POLICIES) + ["snapkv"])
    return full


def prompts(model_dir: str, model: str, n: int, prompt_len: int) -> list[list[int]]:
    """``n`` distinct prompts of exactly ``prompt_len`` tokens: consecutive slices of long conversations."""
    convs = load_long_conversations(max(1, n // 4 + 1), prompt_len * 4, seed=SEED,
                                    tokenizer_dir=model_dir if model == "tiny" else None)
    out = []
    for c in convs:
        ids = c["ids"]
        for s in range(0, len(ids) - prompt_len + 1, prompt_len):
            out.append(ids[s:s + prompt_len])
    if len(out) < n:
        raise RuntimeError(f"only {len(out)} prompts of {prompt_len} tokens; need {n}")
    return out[:n]


def _search(probe, start: int, upper: int) -> tuple[int, int, dict]:
    """Largest feasible N in [0, upper): exponential bracketing up from ``start``, then bisection.

    ``upper`` must be infeasible (not probed); feasibility is assumed monotone in N.
    """
    known: dict[int, bool] = {}

    def test(n: int) -> bool:
        if n not in known:
            known[n] = probe(n)
        return known[n]

    lo, hi = 0, upper
    n = max(1, min(start, upper - 1))
    if test(n):
        lo, step = n, 1
        while lo + step < hi:
            if test(lo + step):
                lo += step
                step *= 2
            else:
                hi = lo + step
                break
    else:
        hi = n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if test(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi, known


def child(spec_path: str, out_path: str) -> int:
    """One engine (stock, naive or vtoken), reused for every probe of every arm of that mode.

    A probe submits N requests at once and steps until they finish. It is feasible iff vLLM
    never preempted (``Scheduler._preempt_request`` is counted; vToken/naive also count
    ``preemption_resets``) and all N were running together at some step. At the first
    preemption the probe's requests are aborted. After each probe the pool must be whole again.
    """
    import json
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched import scheduler as sched_mod

    spec = json.loads(Path(spec_path).read_text())
    count = [0]
    orig = sched_mod.Scheduler._preempt_request

    def _counting(self, *a, **kw):
        count[0] += 1
        return orig(self, *a, **kw)

    sched_mod.Scheduler._preempt_request = _counting
    kw = dict(spec["engine"])
    if spec.get("vtoken") is not None:
        kw["additional_config"] = {"vtoken": spec["vtoken"]}
    llm = LLM(**kw)
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    free0 = pool.get_num_free_blocks()
    prompts, gen = spec["prompts"], spec["gen"]
    probes: list[dict] = []
    seq = [0]

    def probe(n: int, extra: dict | None, arm: str) -> bool:
        seq[0] += 1
        t0 = time.perf_counter()
        c0 = count[0]
        r0 = sched.vt_stats.preemption_resets if hasattr(sched, "vt_stats") else 0
        ids = [f"p{seq[0]}-r{i}" for i in range(n)]
        for i, rid in enumerate(ids):
            sp = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True, detokenize=False,
                                extra_args=extra or None)
            engine.add_request(rid, {"prompt_token_ids": prompts[i]}, sp)
        max_running = steps = 0
        aborted = False
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            max_running = max(max_running, len(sched.running))
            if count[0] > c0 and not aborted:
                engine.abort_request(ids)
                aborted = True
        for _ in range(3):
            engine.step() if engine.has_unfinished_requests() else None
        resets = (sched.vt_stats.preemption_resets if hasattr(sched, "vt_stats") else 0) - r0
        free = pool.get_num_free_blocks()
        if free != free0:
            raise RuntimeError(f"pool not whole after probe {arm} N={n}: {free} free, {free0} at start")
        ok = count[0] == c0 and resets == 0 and max_running == n
        probes.append(dict(arm=arm, n=n, feasible=ok, preemptions=count[0] - c0, preemption_resets=resets,
                           aborted=aborted, max_running=max_running, steps=steps, wall_s=time.perf_counter() - t0))
        print(f"PROBE {arm} N={n} feasible={ok} max_running={max_running} preemptions={count[0] - c0}", flush=True)
        return ok

    results = []
    for arm in spec["arms"]:
        extra = None if arm.get("policy") is None else dict(vtoken_policy=arm["policy"], vtoken_budget=arm["budget"])
        lo, hi, known = _search(lambda n: probe(n, extra, arm["name"]), arm["start"], arm["upper"])
        results.append(dict(arm=arm["name"], mode=spec["mode"], policy=arm.get("policy"), budget=arm.get("budget"),
                            max_feasible_n=lo, first_infeasible_n=hi, upper_bound=arm["upper"],
                            probes=sorted(known.items())))
    Path(out_path).write_text(json.dumps(dict(results=results, probes=probes, pool_free_blocks=free0,
                                              num_blocks=pool.num_gpu_blocks)))
    return 0


def run_mode(p: dict, mode: str, arms: list[dict], prompts_: list[list[int]], model_dir: str, num_blocks: int,
             max_n: int) -> dict:
    import json
    import os
    import subprocess
    import tempfile

    chunks = mode == "vtoken_chunks"  # prefill_eviction: chunks, chunk p["chunk"]
    vt = None if mode == "stock" else dict(mode="vtoken" if chunks else mode, policy="h2o", budget=min(p["budgets"]))
    if chunks:
        vt.update(prefill_eviction="chunks")
    elif vt is not None:  # the committed vtoken / naive arms: whole prompts, one token set per request
        vt.update(prefill_eviction="after", granularity="request")
    spec = dict(engine=engine_kwargs(model_dir, dtype=p["dtype"], block_size=p["block_size"],
                                     max_model_len=p["prompt_len"] + p["gen"] + p["block_size"], num_blocks=num_blocks,
                                     # (vLLM: max_num_seqs <= max_num_batched_tokens, the chunk here)
                                     max_num_seqs=max_n if chunks else max(max_n, 256),
                                     max_num_batched_tokens=p["chunk"] if chunks else max(8192, p["prompt_len"] + p["gen"])),
                vtoken=vt, mode=mode, arms=arms, prompts=prompts_, gen=p["gen"])
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    if mode == "stock":
        env["VLLM_PLUGINS"] = ""
    with tempfile.TemporaryDirectory() as d:
        sp, op = Path(d) / "spec.json", Path(d) / "out.json"
        sp.write_text(json.dumps(spec))
        pr = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(sp), str(op)], env=env,
                            capture_output=True, text=True)
        if pr.returncode != 0 or not op.exists():
            raise RuntimeError(f"{mode} engine failed (exit {pr.returncode}):\n{(pr.stdout + pr.stderr)[-6000:]}")
        return json.loads(op.read_text())


def main(argv=None) -> int:
    args, out_path = parse_size_args(argv, __doc__.splitlines()[0], "concurrency", extra_sizes=("chunks",))
    from tqdm import tqdm

    p = plan(args.size)
    t_start = time.perf_counter()
    model_dir = (tiny if p["model"] == "tiny" else smollm2)()
    B = p["block_size"]
    full_blocks = cdiv(p["prompt_len"] + p["gen"], B)
    num_blocks = p["pool_requests"] * full_blocks + 1  # + vLLM's null block
    # Upper bound per arm (infeasible for sure): all N decoding at once hold >= N * ceil((budget+1)/B) blocks.
    ub = {b: (num_blocks - 1) // cdiv(b + 1, B) + 1 for b in p["budgets"]}
    max_n = max(ub.values())
    prompts_ = prompts(model_dir, p["model"], max_n, p["prompt_len"])
    stock_upper = (num_blocks - 1) // full_blocks + 2
    modes = [("stock", [dict(name="stock", start=p["pool_requests"], upper=stock_upper)])]
    for mode in ("naive", "vtoken"):
        modes.append((mode, [dict(name=f"{mode}/{pol}/{b}", policy=pol, budget=b, upper=ub[b],
                                  start=p["pool_requests"] if mode == "naive" else 2 * p["pool_requests"])
                             for b in p["budgets"] for pol in p["policies"]]))
    if p.get("chunk"):
        modes.append(("vtoken_chunks", [dict(name=f"vtoken_chunks/{pol}/{b}", policy=pol, budget=b, upper=ub[b],
                                             start=2 * p["pool_requests"])
                                        for b in p["budgets"] for pol in p["chunk_policies"]]))
    results, probes = [], []
    reused = None
    if args.size == "chunks":  # the other modes' plan is --full's: take its committed results, run only chunks
        reused = RESULTS / "concurrency_full.json"
        full = json.loads(reused.read_text())
        if full["meta"]["plan"] != plan("full"):
            raise ValueError(f"{reused}: its plan {full['meta']['plan']} is not --full's {plan('full')}; rerun --full")
        results, probes = list(full["results"]), list(full["probes"])
        modes = [m for m in modes if m[0] == "vtoken_chunks"]
    for mode, arms in tqdm(modes, desc="engines", unit="engine"):
        if mode in ("vtoken", "vtoken_chunks"):  # start at vToken's (twice Naive-Evict's) answer: fewer probes
            for a in arms:
                prev = next((x for x in results if x["arm"] == f"vtoken/{a['policy']}/{a['budget']}"), None)
                nv = next((x for x in results if x["arm"] == f"naive/{a['policy']}/{a['budget']}"), None)
                if mode == "vtoken_chunks" and prev is not None:
                    a["start"] = max(1, prev["max_feasible_n"])
                elif nv is not None:
                    a["start"] = max(1, 2 * nv["max_feasible_n"])
        r = run_mode(p, mode, arms, prompts_, model_dir, num_blocks, max_n)
        results.extend(r["results"])
        probes.extend(r["probes"])
    stock = results[0]["max_feasible_n"]
    for r in results:
        r["vs_stock"] = r["max_feasible_n"] / stock if stock else None
        if r["mode"] in ("vtoken", "vtoken_chunks"):  # (SnapKV has no Naive-Evict arm)
            nv = next((x for x in results if x["arm"] == f"naive/{r['policy']}/{r['budget']}"), None)
            r["vs_naive"] = r["max_feasible_n"] / nv["max_feasible_n"] if nv and nv["max_feasible_n"] else None
    res = dict(meta=run_metadata(benchmark="concurrency", size=args.size, seeds=dict(data_shuffle=SEED, engine=0,
                                 random_policy=0), model=f"{p['model']} ({p['dtype']})", plan=p,
                                 pool_blocks=num_blocks, full_request_blocks=full_blocks,
                                 reused_results_from=None if reused is None else str(reused.relative_to(RESULTS.parents[1])),
                                 total_wall_s=time.perf_counter() - t_start),
               results=results, probes=probes)
    write_json(out_path, res)
    plot(res, out_path.with_suffix(".png"))
    print(f"pool {num_blocks} blocks (B={B}), request {p['prompt_len']}+{p['gen']} tokens = {full_blocks} blocks")
    for r in results:
        extra = f"  x{r['vs_naive']:.2f} vs naive" if r.get("vs_naive") else ""
        print(f"{r['arm']:24} max N = {r['max_feasible_n']:4d} (N={r['first_infeasible_n']} fails)  "
              f"x{r['vs_stock']:.2f} vs stock{extra}")
    print(f"total {res['meta']['total_wall_s']:.0f} s")
    return 0


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rs = res["results"]
    stock = rs[0]["max_feasible_n"]
    groups = [(r["policy"], r["budget"]) for r in rs if r["mode"] == "naive"]
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(groups), 3.4))
    x = np.arange(len(groups))
    nv = [next(r["max_feasible_n"] for r in rs if r["arm"] == f"naive/{p}/{b}") for p, b in groups]
    vt = [next(r["max_feasible_n"] for r in rs if r["arm"] == f"vtoken/{p}/{b}") for p, b in groups]
    ch = [next((r["max_feasible_n"] for r in rs if r["arm"] == f"vtoken_chunks/{p}/{b}"), None) for p, b in groups]
    w = 0.27 if any(c is not None for c in ch) else 0.4
    ax.bar(x - w / 2 - (w / 2 if w < 0.4 else 0), nv, w, label="Naive-Evict", color="#d95f02")
    ax.bar(x + (0 if w < 0.4 else w / 2), vt, w, label="vToken", color="#1b9e77")
    for xi, a, b in zip(x, nv, vt):
        ax.text(xi + (0 if w < 0.4 else w / 2), b, f"x{b / a:.2f}" if a else "", ha="center", va="bottom", fontsize=8)
    if w < 0.4:
        ax.bar(x + w, [c or 0 for c in ch], w, label="vToken, prefill_eviction chunks", color="#7570b3")
        for xi, a, c in zip(x, nv, ch):
            if c:
                ax.text(xi + w, c, f"x{c / a:.2f}" if a else "", ha="center", va="bottom", fontsize=8)
    ax.axhline(stock, color="#666666", ls="--", label=f"stock vLLM ({stock})")
    ax.set_xticks(x, [f"{p}\nbudget {b}" for p, b in groups], fontsize=8)
    ax.set_ylabel("max requests decoding together\n(no preemption)")
    m = res["meta"]
    ax.set_title(f"{m['model']}, pool {m['pool_blocks']} blocks, B={m['plan']['block_size']}, "
                 f"{m['plan']['prompt_len']}+{m['plan']['gen']} tok", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2], sys.argv[3]))
    sys.exit(main())
