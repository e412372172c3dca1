"""The acceptance measurement: median TPOT of vToken against stock vLLM, with vLLM's own load tool.

Two OpenAI servers in turn on the same model and options (``drivers.launcher``: each its own
process group, always killed at the end), ``stock`` (no ``vtoken`` key) and ``vtoken``
(``--vtoken``, default H2O at budget 64), alternated (stock, vtoken, then vtoken, stock, ...)
over ``--reps`` repetitions in one run (``--baseline DIR``: a third arm, ``vtoken_base``, the
same config on another tree's ``vtoken/``, e.g. the code before a change); against each, ``vllm bench serve`` (``<venv>/bin/vllm
bench serve``, a subprocess) with random prompts. Per run: median, mean and p90 TPOT and ITL,
median TTFT, the load average before and after. The result is the median over repetitions of
each arm's median TPOT, and their ratio (the criterion: vToken's median TPOT at most 1.5x
stock's in the same run).

Defaults (the issue's): the tiny test model (fp32), ``--dataset-name random --random-input-len
512 --random-output-len 128 --num-prompts 100 --request-rate 8 --ignore-eos``, block size 32,
``--kv-cache-memory-bytes`` 256 MiB, ``--enforce-eager``.

Writes ``benchmarks/results/<name>.json`` (default ``tpot_tiny``).

Usage::

    .venv/bin/python benchmarks/bench_tpot.py                 # 2 repetitions (~10 min on 2 shared cores)
    .venv/bin/python benchmarks/bench_tpot.py --threads 1 2 --baseline /tmp/vtoken_base   # + the code before
    .venv/bin/python benchmarks/bench_tpot.py --reps 3 --vtoken '{"policy": "h2o", "budget": 64}'
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from common import RESULTS, machine_info, pythonpath_first  # noqa: E402
from drivers.launcher import free_port, start_server, vllm_cli  # noqa: E402


def server_args(a: argparse.Namespace) -> list[str]:
    # (as bench_sla.py's servers: no prefix caching. vLLM's random prompts are arithmetic runs of
    # token ids, so on the tiny model's 512-token vocabulary they share whole blocks, and a hit is
    # protected from H2O's eviction: with it on, a request keeps ~200 live tokens instead of 65)
    return ["--dtype", a.dtype, "--block-size", str(a.block_size), "--max-model-len", str(a.max_model_len),
            "--kv-cache-memory-bytes", str(a.kv_bytes), "--enforce-eager", "--disable-uvicorn-access-log",
            "--served-model-name", "tiny"] + ([] if a.prefix_caching else ["--no-enable-prefix-caching"])


def bench_argv(a: argparse.Namespace, port: int, model: str, result_dir: str, filename: str) -> list[str]:
    return [str(vllm_cli()), "bench", "serve", "--backend", "vllm", "--host", "127.0.0.1", "--port", str(port),
            "--model", "tiny", "--tokenizer", model, "--dataset-name", "random",
            "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
            "--num-prompts", str(a.num_prompts), "--request-rate", str(a.rate), "--seed", str(a.seed),
            "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", result_dir, "--result-filename", filename, "--disable-tqdm"]


def run_arm(a: argparse.Namespace, arm: str, vt: dict | None, model: str, rep: int, logdir: Path,
            tree: str | None = None, threads: int = 2, extra_env: dict | None = None) -> dict[str, Any]:
    port = free_port()
    log = logdir / f"server_{arm}_t{threads}_{rep}.log"
    env = dict(OMP_NUM_THREADS=str(threads), **(extra_env or {}))
    if tree:  # another tree's vtoken first (the server and its EngineCore inherit it)
        env["PYTHONPATH"] = pythonpath_first(tree, os.environ.get("PYTHONPATH"))
    srv = start_server(model, log, server_args(a), None if vt is None else {"vtoken": vt}, port=port,
                       env=env, cwd=Path(tree) if tree else ROOT)
    try:
        srv.wait_healthy(900)
        with tempfile.TemporaryDirectory() as d:
            argv = bench_argv(a, port, model, d, "r.json")
            load_before = list(os.getloadavg())
            t0 = time.time()
            p = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd=ROOT)
            if p.returncode != 0:
                raise RuntimeError(f"vllm bench serve failed ({p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
            res = json.loads((Path(d) / "r.json").read_text())
        keys = ("median_tpot_ms", "mean_tpot_ms", "p90_tpot_ms", "p99_tpot_ms", "median_itl_ms", "mean_itl_ms",
                "median_ttft_ms", "mean_ttft_ms", "completed", "total_output_tokens", "request_throughput",
                "output_throughput", "duration")
        out = dict(rep=rep, arm=arm, threads=threads, vtoken=vt, tree=tree or str(ROOT), startup_s=srv.startup_s, bench_s=round(time.time() - t0, 1),
                   load_before=load_before, load_after=list(os.getloadavg()),
                   command=" ".join(shlex.quote(x) for x in argv[:-6]), **{k: res.get(k) for k in keys})
        if vt is not None:
            m = srv.metrics()
            out["vtoken_metrics"] = {k: v for k, v in m.items() if k.startswith("vtoken:") and "{" not in k}
        return out
    finally:
        srv.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the tiny test model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--vtoken", default='{"policy": "h2o", "budget": 64}')
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-bytes", type=int, default=256 << 20)
    ap.add_argument("--threads", type=int, nargs="+", default=[2],
                    help="OMP_NUM_THREADS of the servers; several: each setting in turn, all arms alternated in each")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="also an arm vtoken_base: the vToken config on another tree's vtoken/ (e.g. the code "
                         "before a change: git archive COMMIT | tar -x -C DIR)")
    ap.add_argument("--prefix-caching", action="store_true", help="leave vLLM's prefix caching on (off by default)")
    ap.add_argument("--name", default="tpot_tiny")
    a = ap.parse_args(argv)
    if a.model is None:
        from vtoken.assets.paths import ensure_tiny_model

        a.model = str(ensure_tiny_model())
    arms = {"stock": None, "vtoken": json.loads(a.vtoken)}
    trees = {}
    if a.baseline:
        arms["vtoken_base"] = json.loads(a.vtoken)
        trees["vtoken_base"] = str(Path(a.baseline).resolve())
    logdir = Path(tempfile.mkdtemp(prefix="bench_tpot_"))
    doc: dict[str, Any] = dict(
        bench="bench_tpot", command="python " + " ".join(["benchmarks/bench_tpot.py"] + argv),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), machine=machine_info(),
        loadavg_before=list(os.getloadavg()),
        server=dict(args=server_args(a), threads=a.threads, model=a.model), arms=arms, baseline=trees or None,
        load=dict(tool="vllm bench serve", dataset="random", input_len=a.input_len, output_len=a.output_len,
                  num_prompts=a.num_prompts, request_rate=a.rate, seed=a.seed),
        runs=[])
    t_start = time.time()
    for threads in a.threads:
        for rep in range(a.reps):
            order = list(arms) if rep % 2 == 0 else list(reversed(arms))
            for arm in order:
                r = run_arm(a, arm, arms[arm], a.model, rep, logdir, trees.get(arm), threads)
                doc["runs"].append(r)
                print(f"threads {threads} rep {rep} {arm:>6}: median TPOT {r['median_tpot_ms']:.2f} ms, mean "
                      f"{r['mean_tpot_ms']:.2f}, p90 {r['p90_tpot_ms']:.2f}; median ITL {r['median_itl_ms']:.2f}; "
                      f"median TTFT {r['median_ttft_ms']:.1f} ms; {r['completed']} done; load "
                      f"{r['load_before'][0]:.2f}", flush=True)
                (RESULTS / f"{a.name}.partial.json").write_text(json.dumps(doc, indent=1))
    doc["results"] = {}
    for threads in a.threads:
        runs = [r for r in doc["runs"] if r["threads"] == threads]
        med = {arm: statistics.median(r["median_tpot_ms"] for r in runs if r["arm"] == arm) for arm in arms}
        per_rep = [next(r for r in runs if r["rep"] == k and r["arm"] == "vtoken")["median_tpot_ms"]
                   / next(r for r in runs if r["rep"] == k and r["arm"] == "stock")["median_tpot_ms"]
                   for k in range(a.reps)]
        res = dict(median_tpot_ms=med, ratio=med["vtoken"] / med["stock"], ratio_per_rep=per_rep,
                   criterion="vtoken median TPOT <= 1.5 x stock's, same run",
                   meets_criterion=med["vtoken"] / med["stock"] <= 1.5)
        if a.baseline:
            res["base_ratio"] = med["vtoken_base"] / med["stock"]
            res["base_ratio_per_rep"] = [
                next(r for r in runs if r["rep"] == k and r["arm"] == "vtoken_base")["median_tpot_ms"]
                / next(r for r in runs if r["rep"] == k and r["arm"] == "stock")["median_tpot_ms"] for k in range(a.reps)]
        doc["results"][f"threads_{threads}"] = res
    doc["loadavg_after"] = list(os.getloadavg())
    doc["total_wall_s"] = round(time.time() - t_start, 1)
    out = RESULTS / f"{a.name}.json"
    out.write_text(json.dumps(doc, indent=1))
    (RESULTS / f"{a.name}.partial.json").unlink(missing_ok=True)
    for key, res in doc["results"].items():
        med = res["median_tpot_ms"]
        print(f"{key}: median TPOT stock {med['stock']:.2f} ms, vtoken {med['vtoken']:.2f} ms: ratio {res['ratio']:.2f} "
              f"(per repetition {[round(x, 2) for x in res['ratio_per_rep']]})"
              + (f"; vtoken_base {med['vtoken_base']:.2f} ms: ratio {res['base_ratio']:.2f}" if a.baseline else ""))
    print(f"wrote {out} ({doc['total_wall_s']} s; load {doc['loadavg_before']} -> {doc['loadavg_after']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
