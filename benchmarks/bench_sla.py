"""SLA-constrained throughput: stock vLLM vs Naive-Evict vs vToken on the OpenAI server.

Method (DESIGN.md section 7, reference/peers.md D1):

* One OpenAI server per arm, started one at a time on 127.0.0.1 with a fixed, small KV pool
  (``--num-gpu-blocks-override``) so the system is memory-bound. Arms: stock vLLM (no
  ``vtoken`` key), Naive-Evict (``{"vtoken": {"mode": "naive", "policy": P, "budget": B}}``)
  and vToken (``{"vtoken": {"policy": P, "budget": B}}``) for each policy P.
* Load comes from vLLM's own ``vllm bench serve`` (``vllm.benchmarks.serve``: the exact code
  behind the CLI, called in this process with the same argv so vllm is imported once;
  ``python benchmarks/bench_sla.py --vllm-cli bench serve ...`` runs vToken's ``vllm`` console
  script, ``vtoken.cli.vllm_main``). ShareGPT prompts, fixed output length with
  ``--ignore-eos`` (ShareGPT outputs are short; a fixed long output makes the budget bind and
  keeps the work identical across arms), Poisson arrivals, ``--seed 0``, a sweep of rates.
* SLOs come from the unloaded latency measured in the same run on the stock arm
  (``--max-concurrency 1``, a few prompts), per prompt token as in DistServe's goodput:
  ``SLO_ttft(request) = k_ttft x (a + b x prompt tokens)`` with ``a, b`` a least-squares fit
  of the unloaded TTFTs (``a`` clipped at 0), and ``SLO_tpot = k_tpot x P50 TPOT``. vLLM's
  ``--goodput`` gets the TPOT bound (it takes one TTFT bound for all requests); the per-prompt
  TTFT bound is applied to the saved per-request data.
* Attainment at a rate = good requests / completed requests. SLA throughput of an arm = the highest swept rate such that it and
  every lower swept rate reach >= 90 % attainment (DistServe's 90 % target).
* Preemptions: ``vllm:num_preemptions_total`` from ``/metrics`` before and after each rate;
  ``vllm:kv_cache_usage_perc`` / ``num_requests_running`` / ``num_requests_waiting`` polled
  every 0.5 s during each rate (mean and peak).

Per-request TTFT/ITL are saved (``--save-detailed``), so attainment can be recomputed for
other SLO scales without rerunning (``k_grid`` in the summary).

Writes ``benchmarks/results/<name>/`` (one vLLM result JSON per arm and rate, server logs
tails) plus ``benchmarks/results/<name>.json`` (summary) and ``<name>.png``.

Usage::

    python benchmarks/bench_sla.py --small                       # h2o; stock / naive / vtoken
    python benchmarks/bench_sla.py --policies h2o random scissorhands --rates 0.25 0.5 1 2 3
    python benchmarks/bench_sla.py --policies h2o@worker tova@worker snapkv@worker keydiff@worker \
        knorm@worker --budget 128 --num-prompts 40 --rates 0.25 0.375 0.5 0.75 1 1.25 1.5 \
        --search bisect --name sla_at_quality        # issue 26: the -worker arms, SLA at a quality
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import signal
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tests/drivers/
RESULTS = ROOT / "benchmarks" / "results"
PY = sys.executable

from drivers.launcher import server_argv, start_server  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from common import policy_spec  # noqa: E402


def _vllm_cli_main(argv: list[str]) -> int:
    """Run vLLM's CLI as vToken's ``vllm`` console script does (``vtoken.cli.vllm_main``)."""
    from vtoken.cli import vllm_main

    sys.argv = ["vllm"] + argv
    try:
        vllm_main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


# ----------------------------------------------------------------------------------------
# machine / versions


sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info  # noqa: E402


# ----------------------------------------------------------------------------------------
# server


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback only)
        return r.read().decode()


def scrape(port: int) -> dict[str, float]:
    """Sum of each vllm:* sample over labels (one engine, one model)."""
    out: dict[str, float] = {}
    for line in _get(f"http://127.0.0.1:{port}/metrics").splitlines():
        if not line.startswith("vllm:") and not line.startswith("vtoken"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$", line)
        if m:
            try:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
            except ValueError:
                pass
    return out


class Poller(threading.Thread):
    """Polls /metrics gauges during one load run."""

    KEYS = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")

    def __init__(self, port: int, period: float = 0.5):
        super().__init__(daemon=True)
        self.port, self.period = port, period
        self.samples: dict[str, list[float]] = {k: [] for k in self.KEYS}
        self._halt = threading.Event()

    def run(self):
        while not self._halt.is_set():
            try:
                s = scrape(self.port)
                for k in self.KEYS:
                    if k in s:
                        self.samples[k].append(s[k])
            except Exception:
                pass
            self._halt.wait(self.period)

    def stop(self) -> dict:
        self._halt.set()
        self.join(timeout=5)
        res = {}
        for k, v in self.samples.items():
            name = k.split(":", 1)[1]
            res[name + "_mean"] = statistics.fmean(v) if v else None
            res[name + "_max"] = max(v) if v else None
        return res


class Server:
    """One OpenAI server per arm (``drivers.launcher``: its own process group,
    always killed on exit); a context manager that waits for ``/health`` on entry."""

    def __init__(self, model_dir: Path, vt: dict | None, *, pool_blocks: int, port: int, log: Path,
                 max_model_len: int, block_size: int, threads: int, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None):
        self.args = ["--dtype", "bfloat16", "--block-size", str(block_size),
                     "--max-model-len", str(max_model_len), "--gpu-memory-utilization", "0.1",
                     "--num-gpu-blocks-override", str(pool_blocks), "--no-enable-prefix-caching",
                     # CPU: an explicit KV size skips the RSS-based sizing (which fails at 0.1 on this
                     # 13 GiB node) and, with --enforce-eager, the minutes-long compile warm-up.
                     "--kv-cache-memory-bytes", str(256 << 20), "--enforce-eager",
                     "--disable-uvicorn-access-log"]
        if max_num_seqs is not None:
            self.args += ["--max-num-seqs", str(max_num_seqs)]
        if max_num_batched_tokens is not None:
            self.args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        self.model_dir, self.vt, self.port, self.log, self.threads = model_dir, vt, port, log, threads
        self.cmd = server_argv(str(model_dir), port, self.args, None if vt is None else {"vtoken": vt},
                               served_model_name="smollm2")
        self.srv = None

    def __enter__(self):
        self.srv = start_server(str(self.model_dir), self.log, self.args, None if self.vt is None else {"vtoken": self.vt},
                                served_model_name="smollm2", port=self.port,
                                env=dict(OMP_NUM_THREADS=str(self.threads)), cwd=ROOT)
        try:
            self.srv.wait_healthy(600)
        except BaseException:
            self.srv.close()
            raise
        self.startup_s = self.srv.startup_s
        return self

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except Exception:
            return ""

    def __exit__(self, *exc):
        if self.srv is not None:
            self.srv.close()
        return False


# ----------------------------------------------------------------------------------------
# load (vllm bench serve, in process)


def bench_argv(*, port: int, model_dir: Path, dataset: Path, num_prompts: int, rate: float, out_len: int,
               result_dir: Path, filename: str, goodput: dict | None,
               max_concurrency: int | None = None) -> list[str]:
    """``vllm bench serve`` argv on a ShareGPT-format ``dataset`` (ShareGPT's own, or
    :func:`long_prompts`')."""
    data = ["--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--sharegpt-output-len", str(out_len)]
    a = ["bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
         "--host", "127.0.0.1", "--port", str(port), *data,
         "--model", "smollm2", "--tokenizer", str(model_dir),
         "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--seed", "0",
         "--ignore-eos", "--temperature", "0",
         "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
         "--save-result", "--save-detailed", "--result-dir", str(result_dir),
         "--result-filename", filename, "--disable-tqdm"]
    if goodput is not None:
        # vLLM's --goodput takes one TTFT bound for all requests; the TTFT SLO here grows with the
        # prompt (ttft_slo), so vLLM checks the TPOT SLO and the per-prompt TTFT SLO is applied
        # to the saved per-request data (attainment()).
        a += ["--goodput", f"tpot:{goodput['tpot_ms']:.1f}"]
    if max_concurrency is not None:
        a += ["--max-concurrency", str(max_concurrency)]
    return a


def long_prompts(n: int, prompt_len: int, k: int = 32) -> Path:
    """A ShareGPT-format JSON of ``n`` prompts of at most ``prompt_len`` tokens: the first
    ``prompt_len`` tokens of the conversations ``make bench-quality`` scores (``bench_quality.py``:
    ``load_long_conversations(n, prompt_len + K, seed=1)``, chat template applied, K = 32), decoded
    to text, so the SLA arms serve the prompts whose ΔNLL the quality table reports. A prompt is cut
    a token at a time until the text re-tokenizes to at most ``prompt_len`` tokens (vLLM's ShareGPT
    loader drops prompts over 1,024 tokens; the result files hold the exact ``input_lens``). Each
    conversation's second turn is a placeholder (``--sharegpt-output-len`` fixes the output).
    Written under vToken's data cache, next to the long ShareGPT file.

    Raises:
        SystemExit: ``prompt_len`` over 1,024 (vLLM's ShareGPT loader's prompt limit).
    """
    if prompt_len > 1024:
        raise SystemExit(f"--prompt-len {prompt_len}: at most 1024 (vLLM's ShareGPT loader drops longer prompts)")
    from transformers import AutoTokenizer

    from vtoken.assets.paths import ensure_sharegpt_long, smollm2_dir

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import load_long_conversations

    out = ensure_sharegpt_long().parent / f"sla_prompts_n{n}_len{prompt_len}.json"
    if out.exists():
        return out
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    rows = []
    for c in load_long_conversations(n, prompt_len + k, seed=1):
        ids = c["ids"][:prompt_len]
        while len(tok(text := tok.decode(ids))["input_ids"]) > prompt_len:
            ids = ids[:-1]
        rows.append({"id": c["id"], "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "-"}]})
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows))
    tmp.replace(out)
    return out


def run_bench(argv: list[str]) -> dict:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser()
    add_cli_args(p)
    args = p.parse_args(argv[2:])  # drop "bench serve"
    main(args)
    return json.loads((Path(args.result_dir) / args.result_filename).read_text())


def per_request(res: dict) -> list[tuple[float, float, int]]:
    """(ttft_ms, tpot_ms, prompt_tokens) of each completed request, from --save-detailed fields."""
    out = []
    ttfts, itls, olens = res.get("ttfts", []), res.get("itls", []), res.get("output_lens", [])
    ilens = res.get("input_lens", [0] * len(ttfts))
    errs = res.get("errors") or [""] * len(ttfts)
    for i, t in enumerate(ttfts):
        if errs[i] or not olens or olens[i] == 0:
            continue
        il = itls[i] if i < len(itls) else []
        tpot = (sum(il) / (olens[i] - 1)) if olens[i] > 1 else 0.0
        out.append((t * 1000.0, tpot * 1000.0, int(ilens[i])))
    return out


def fit_ttft(reqs: list[tuple[float, float, int]]) -> tuple[float, float]:
    """Least-squares ``TTFT = a + b x prompt_tokens`` (ms, ms/token) over unloaded requests; with
    fewer than two distinct prompt lengths, ``(median TTFT, 0)``. A negative fit is clipped."""
    xs = [q[2] for q in reqs]
    ys = [q[0] for q in reqs]
    if len(set(xs)) < 2:
        return statistics.median(ys), 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    b = max(b, 0.0)
    a = max(my - b * mx, 0.0)
    return a, b


def ttft_slo_ms(slo: dict, prompt_tokens: int, k_ttft: float | None = None) -> float:
    """The TTFT SLO of one request: ``k_ttft x (a + b x prompt_tokens)``, the unloaded stock TTFT
    of a prompt of that length times the SLO scale (DistServe-style, per request)."""
    k = slo["k_ttft"] if k_ttft is None else k_ttft
    return k * (slo["ttft_a_ms"] + slo["ttft_b_ms_per_token"] * prompt_tokens)


def attainment(reqs: list[tuple[float, float, int]], slo: dict, k_ttft: float | None = None,
               k_tpot: float | None = None) -> float | None:
    """Fraction of completed requests meeting both SLOs (per-prompt TTFT, mean TPOT)."""
    if not reqs:
        return None
    tpot = slo["tpot_ms"] if k_tpot is None else k_tpot * slo["unloaded_p50_tpot_ms"]
    return sum(1 for t, p, n in reqs if t <= ttft_slo_ms(slo, n, k_ttft) and p <= tpot) / len(reqs)


def sla_rate(rates: list[float], att: list[float | None], thr: float) -> float | None:
    """The highest measured rate reaching ``thr`` attainment below the lowest measured rate that
    does not (``None`` when the lowest measured rate misses). ``rates`` are the measured rates,
    in any order; under ``--search sweep`` every grid rate is measured, so this is "the highest
    rate such that it and every lower rate pass"."""
    best = None
    for r, a in sorted(zip(rates, att)):
        if a is None or a < thr:
            break
        best = r
    return best


def bisect_rates(rates: list[float], passes: Callable[[float], bool]) -> list[float]:
    """``--search bisect``: binary search for the knee on the sorted grid ``rates``, assuming
    attainment falls as the rate rises. ``passes(rate) -> bool`` runs one load; returns the
    rates measured, in order. At most ``ceil(log2(len(rates) + 1))`` loads; afterwards the
    knee's two neighbouring grid rates are both measured (the highest passing and the lowest
    missing), except at the ends of the grid (every rate passes, or the lowest misses)."""
    grid = sorted(rates)
    lo, hi, done = -1, len(grid), []
    while hi - lo > 1:
        mid = (lo + hi) // 2
        done.append(grid[mid])
        if passes(grid[mid]):
            lo = mid
        else:
            hi = mid
    return done


def build_arms(policies: list[str], budget: int, pacings: list[str], seqs: list[int | None]) -> list[tuple[str, dict | None, int | None]]:
    """(name, vtoken config or None, --max-num-seqs) per arm. A policy spec is ``NAME``, then any
    of ``:seK`` (``score_every = K``) and ``:slK`` (``slack = K``), then optionally ``@worker``
    (the arm tag ``-worker`` only, as in the committed results; every arm decides on the worker,
    :func:`common.policy_spec`): ``h2o``, ``h2o:se4``, ``snapkv:sl128:se1000@worker``.
    Per spec: Naive-Evict, then vToken per pacing."""
    arms: list[tuple[str, dict | None]] = [("stock", None)]
    for spec in policies:
        name, extra, tag = policy_spec(spec)  # ("@" in an arm name marks --max-num-seqs)
        arms.append((f"naive-{tag}", {"mode": "naive", "policy": name, "budget": budget, **extra}))
        for pc in pacings:
            arms.append((f"vtoken-{tag}" + ("" if pc == "fixed" else f"-{pc}"),
                         {"policy": name, "budget": budget, "pacing": pc, **extra}))
    out = []
    for n in seqs:
        for name, vt in arms:
            out.append((name + ("" if n is None or len(seqs) == 1 else f"@seqs{n}"), vt, n))
    return out


# ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--vllm-cli":
        return _vllm_cli_main(argv[1:])
    if argv and argv[0] == "--combine":
        return combine(argv[1:])
    if argv and argv[0] == "--replace-arms":
        return replace_arms(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="h2o only, 3 rates, 12 prompts (~10 min on 2 cores)")
    ap.add_argument("--policies", nargs="+", default=None,
                    help="policy specs: NAME[:seK][:slK][@worker] (score_every K, slack K, @worker: arm tag), "
                         "e.g. random h2o h2o:se4 snapkv:sl128:se1000@worker")
    ap.add_argument("--pacings", nargs="+", default=None, choices=["fixed", "pressure"],
                    help="vToken arms per policy (default: fixed pressure; --small: fixed)")
    ap.add_argument("--max-num-seqs", type=int, nargs="+", default=None,
                    help="vLLM's --max-num-seqs, the operator's concurrency lever; every arm runs once per value "
                         "(default: vLLM's own default)")
    ap.add_argument("--budget", type=int, default=None, help="vtoken budget (tokens)")
    ap.add_argument("--pool-blocks", type=int, default=65,
                    help="--num-gpu-blocks-override; 65 = 64 usable (2048 tokens, one max-model-len request) + the null block")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--rates", type=float, nargs="+", default=None)
    ap.add_argument("--prompt-len", type=int, default=None,
                    help="serve the quality benchmark's conversations cut to this many tokens (e.g. 1024, as "
                         "make bench-quality scores them) instead of ShareGPT's own prompts")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="vLLM's --max-num-batched-tokens for every arm (the prefill chunk)")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--unloaded-prompts", type=int, default=None,
                    help="prompts run one at a time on the stock arm to fit TTFT(prompt tokens) and the TPOT (default 3 small / 8)")
    ap.add_argument("--k-ttft", type=float, default=5.0, help="TTFT SLO = k x unloaded stock TTFT of the same prompt length")
    ap.add_argument("--k-tpot", type=float, default=2.0, help="TPOT SLO = k x unloaded stock P50 TPOT")
    ap.add_argument("--attain", type=float, default=0.9)
    ap.add_argument("--port", type=int, default=18931)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 2)))
    ap.add_argument("--name", default=None, help="result name (default sla_small / sla)")
    ap.add_argument("--reverse", action="store_true",
                    help="run the arms in reverse order: with a first run in forward order this gives an "
                         "A B C / C B A design against drifting machine load")
    ap.add_argument("--slo-from", default=None,
                    help="take the SLOs (and unloaded reference) from an earlier summary JSON instead of this run's stock arm")
    ap.add_argument("--arms", nargs="+", default=None, help="run only these arms (e.g. vtoken-h2o); use with --slo-from")
    ap.add_argument("--search", choices=["sweep", "bisect"], default="sweep",
                    help="sweep: every rate of --rates on every arm; bisect: a binary search per arm for its "
                         "knee on the --rates grid (at most ceil(log2(n + 1)) loads; assumes attainment falls "
                         "as the rate rises; unmeasured rates show as '-')")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)

    policies = a.policies or (["h2o"] if a.small else ["random", "h2o", "h2o:se4"])
    pacings = a.pacings or (["fixed"] if a.small else ["fixed", "pressure"])
    seqs: list[int | None] = a.max_num_seqs or [None]
    rates = a.rates or ([0.5, 1.0, 2.0] if a.small else [0.5, 1.0, 2.0, 3.0])
    num_prompts = a.num_prompts or (12 if a.small else 24)
    out_len = a.output_len or 128
    budget = a.budget or 64
    unloaded_prompts = a.unloaded_prompts or (3 if a.small else 8)
    name = a.name or ("sla_small" if a.small else "sla")
    rdir = RESULTS / name
    rdir.mkdir(parents=True, exist_ok=True)

    from tqdm import tqdm

    from vtoken.assets.paths import ensure_sharegpt, ensure_smollm2

    model_dir = ensure_smollm2()
    dataset = ensure_sharegpt()
    if a.prompt_len is not None:
        if a.prompt_len + out_len > a.max_model_len:
            raise SystemExit(f"--prompt-len {a.prompt_len} + --output-len {out_len} > --max-model-len {a.max_model_len}")
        dataset = long_prompts(max(num_prompts, unloaded_prompts), a.prompt_len)

    arms = build_arms(policies, budget, pacings, seqs)
    if a.arms:
        arms = [x for x in arms if x[0] in a.arms]
    if a.reverse:
        arms = arms[::-1]
    # SIGTERM (e.g. from `timeout`) must still run Server.__exit__ and kill the server's group.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.time()
    summary: dict = dict(
        benchmark="bench_sla", date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        command="python " + " ".join(["benchmarks/bench_sla.py"] + argv), machine=machine_info(),
        load_average_at_start=os.getloadavg(),
        config=dict(policies=policies, pacings=pacings, max_num_seqs=seqs, budget=budget, pool_blocks=a.pool_blocks,
                    block_size=a.block_size, pool_tokens=a.pool_blocks * a.block_size, max_model_len=a.max_model_len,
                    rates=rates, num_prompts=num_prompts, output_len=out_len, unloaded_prompts=unloaded_prompts,
                    prompt_len=a.prompt_len, max_num_batched_tokens=a.max_num_batched_tokens,
                    k_ttft=a.k_ttft, k_tpot=a.k_tpot, attainment_threshold=a.attain, threads=a.threads,
                    search=a.search,
                    dataset=str(dataset), model=str(model_dir)),
        load_tool="vllm.benchmarks.serve (vllm bench serve), in process; argv recorded per run",
        arms={}, commands=[])
    slo: dict | None = None
    if a.slo_from:
        slo = dict(json.loads(Path(a.slo_from).read_text())["slo"], from_file=str(a.slo_from))
        summary["slo"] = slo

    bar = tqdm(total=len(arms) * (len(rates) + 1), desc="bench_sla", unit="run")
    for arm, vt, nseq in arms:
        rec: dict = dict(vtoken=vt, max_num_seqs=nseq, runs=[])
        srv = Server(model_dir, vt, pool_blocks=a.pool_blocks, port=a.port, log=rdir / f"{arm}.server.log",
                     max_model_len=a.max_model_len, block_size=a.block_size, threads=a.threads, max_num_seqs=nseq,
                     max_num_batched_tokens=a.max_num_batched_tokens)
        rec["server_cmd"] = " ".join(srv.cmd[:1] + [repr(c) if " " in c else c for c in srv.cmd[1:]])
        summary["commands"].append(f"OMP_NUM_THREADS={a.threads} " + rec["server_cmd"])
        try:
            with srv:
                rec["server_startup_s"] = round(srv.startup_s, 1)
                # Unloaded latency: one request at a time (max concurrency 1), same workload shape.
                ua = bench_argv(port=a.port, model_dir=model_dir, dataset=dataset, num_prompts=unloaded_prompts,
                                rate=float("inf"), out_len=out_len, result_dir=rdir, filename=f"{arm}_unloaded.json",
                                goodput=None, max_concurrency=1)
                t0 = time.time()
                ures = run_bench(ua)
                ureqs = per_request(ures)
                fa, fb = fit_ttft(ureqs)
                rec["unloaded"] = dict(argv="vllm " + " ".join(ua), wall_s=round(time.time() - t0, 1),
                                       p50_ttft_ms=ures["median_ttft_ms"], p50_tpot_ms=ures["median_tpot_ms"],
                                       mean_ttft_ms=ures["mean_ttft_ms"], mean_tpot_ms=ures["mean_tpot_ms"],
                                       ttft_fit_a_ms=round(fa, 2), ttft_fit_b_ms_per_token=round(fb, 4),
                                       per_request_ttft_tpot_ms_prompt=[[round(x, 2), round(y, 2), n] for x, y, n in ureqs])
                summary["commands"].append(rec["unloaded"]["argv"])
                bar.update(1)
                if slo is None:  # the stock arm runs first: its unloaded latency fixes the SLOs
                    slo = dict(ttft_a_ms=round(fa, 2), ttft_b_ms_per_token=round(fb, 4), k_ttft=a.k_ttft,
                               tpot_ms=round(a.k_tpot * ures["median_tpot_ms"], 1), k_tpot=a.k_tpot, from_arm=arm,
                               unloaded_p50_ttft_ms=ures["median_ttft_ms"], unloaded_p50_tpot_ms=ures["median_tpot_ms"],
                               rule="a request is good when TTFT <= k_ttft x (a + b x its prompt tokens) and its mean "
                                    "TPOT <= tpot_ms; a, b: least-squares fit of the stock arm's unloaded TTFT")
                    summary["slo"] = slo

                def run_rate(r: float) -> bool:
                    """One load at ``r`` req/s, recorded in ``rec["runs"]``; True when its attainment
                    reaches ``--attain``."""
                    ra = bench_argv(port=a.port, model_dir=model_dir, dataset=dataset, num_prompts=num_prompts,
                                    rate=r, out_len=out_len, result_dir=rdir, filename=f"{arm}_rate{r:g}.json",
                                    goodput=slo)
                    m0 = scrape(a.port)
                    poll = Poller(a.port)
                    poll.start()
                    t0 = time.time()
                    res = run_bench(ra)
                    wall = time.time() - t0
                    gauges = poll.stop()
                    m1 = scrape(a.port)
                    reqs = per_request(res)
                    att = attainment(reqs, slo)
                    good = sum(1 for t, p, n in reqs if t <= ttft_slo_ms(slo, n) and p <= slo["tpot_ms"])
                    vt_delta = {k: round(m1[k] - m0.get(k, 0.0), 4) for k in m1
                                if k.startswith("vtoken") and k.endswith("_total")}
                    run = dict(rate=r, argv="vllm " + " ".join(ra), wall_s=round(wall, 1),
                               completed=res["completed"], failed=res.get("failed", 0),
                               duration_s=res["duration"], request_throughput=res["request_throughput"],
                               request_goodput=good / res["duration"] if res["duration"] else 0.0,
                               vllm_request_goodput_tpot_only=res["request_goodput"],
                               output_throughput=res["output_throughput"], attainment=att,
                               p50_ttft_ms=res["median_ttft_ms"], p99_ttft_ms=res["p99_ttft_ms"],
                               p50_tpot_ms=res["median_tpot_ms"], p99_tpot_ms=res["p99_tpot_ms"],
                               p99_itl_ms=res["p99_itl_ms"], p99_e2el_ms=res["p99_e2el_ms"],
                               preemptions=m1.get("vllm:num_preemptions_total", 0) - m0.get("vllm:num_preemptions_total", 0),
                               vtoken_counters=vt_delta,
                               per_request_ttft_tpot_ms_prompt=[[round(x, 2), round(y, 2), n] for x, y, n in reqs],
                               load_average_1m=os.getloadavg()[0], **gauges)
                    rec["runs"].append(run)
                    summary["commands"].append(run["argv"])
                    bar.update(1)
                    bar.write(f"{arm:>24} rate {r:g}: attain {att:.2f} goodput {run['request_goodput']:.3f} "
                              f"p99 ttft {res['p99_ttft_ms']:.0f} tpot {res['p99_tpot_ms']:.0f} ms "
                              f"preempt {run['preemptions']:.0f} kv max {gauges.get('kv_cache_usage_perc_max')} "
                              f"load {run['load_average_1m']:.1f}")
                    return att is not None and att >= a.attain

                if a.search == "bisect":
                    bisect_rates(rates, run_rate)
                    bar.update(len(rates) - len(rec["runs"]))
                else:
                    for r in rates:
                        run_rate(r)
                rec["runs"].sort(key=lambda x: x["rate"])
                rec["server_log_vtoken_lines"] = [l for l in srv.tail(4000).splitlines() if "vtoken" in l.lower()][-5:]
        except Exception as e:  # one arm that fails (its server, a load) does not lose the others
            rec["error"] = repr(e)
            bar.write(f"{arm}: FAILED {e!r}; see {rdir / (arm + '.server.log')}")
        rec["sla_rate"] = sla_rate([x["rate"] for x in rec["runs"]], [x["attainment"] for x in rec["runs"]], a.attain)
        summary["arms"][arm] = rec
        (RESULTS / f"{name}.partial.json").write_text(json.dumps(summary, indent=1))
    bar.close()
    (RESULTS / f"{name}.partial.json").unlink(missing_ok=True)
    finish(summary, rates, a.attain)
    summary["total_wall_s"] = round(time.time() - t_start, 1)
    summary["load_average_at_end"] = os.getloadavg()
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(summary, indent=1))
    report(summary, rates)
    print(f"wrote {out} ({summary['total_wall_s']} s)")
    if not a.no_plot:
        plot(summary, RESULTS / f"{name}.png")
    return 0


def finish(summary: dict, rates: list[float], thr: float) -> None:
    """Headline (SLA rate per arm; vToken / Naive-Evict per policy spec) and the SLO-scale grid."""
    head = {}
    for arm, rec in summary["arms"].items():
        head[arm] = dict(sla_rate=rec["sla_rate"], preemptions=sum(x["preemptions"] for x in rec["runs"]),
                         peak_goodput=max((x["request_goodput"] for x in rec["runs"]), default=None))
    ratios = {}
    for arm in head:
        if not arm.startswith("vtoken-"):
            continue
        rest = arm[len("vtoken-"):]
        suffix = rest[rest.index("@"):] if "@" in rest else ""
        tag = rest[: len(rest) - len(suffix)].removesuffix("-pressure")
        naive, stock = head.get(f"naive-{tag}{suffix}", {}), head.get(f"stock{suffix}", {})
        v, n, s0 = head[arm]["sla_rate"], naive.get("sla_rate"), stock.get("sla_rate")
        ratios[arm] = dict(vs=f"naive-{tag}{suffix}", vtoken_over_naive=(v / n) if v and n else None,
                           vtoken_over_stock=(v / s0) if v and s0 else None,
                           peak_goodput_over_naive=(head[arm]["peak_goodput"] / naive["peak_goodput"])
                           if naive.get("peak_goodput") else None)
    summary["headline"] = dict(per_arm=head, ratios=ratios)
    summary["k_grid_sla_rate"] = k_grid(summary, rates, thr)


def report(summary: dict, rates: list[float]) -> None:
    s = summary["slo"]
    print(f"\nSLO: TTFT <= {s['k_ttft']:g} x ({s['ttft_a_ms']:.0f} ms + {s['ttft_b_ms_per_token']:.3f} ms/prompt token), "
          f"TPOT <= {s['tpot_ms']:.1f} ms; attainment >= {summary['config']['attainment_threshold']:.0%}")
    print(f"{'arm':>24} | " + " | ".join(f"r={r:g}" for r in rates) + " | SLA rate | preempt")
    for arm, rec in summary["arms"].items():
        by = {x["rate"]: x["attainment"] for x in rec["runs"]}
        cells = " | ".join("-" if r not in by else "n/a" if by[r] is None else f"{by[r]:.2f}" for r in rates)
        print(f"{arm:>24} | {cells} | {rec['sla_rate']} | {summary['headline']['per_arm'][arm]['preemptions']:.0f}")
    for arm, r in summary["headline"]["ratios"].items():
        print(f"{arm}: SLA rate / {r['vs']} = {r['vtoken_over_naive']}; peak goodput / {r['vs']} = {r['peak_goodput_over_naive']}")


def k_grid(summary: dict, rates: list[float], thr: float) -> dict:
    """SLA rate per arm for a grid of SLO scales (k x the unloaded stock latency)."""
    grid = {}
    slo = summary["slo"]
    for kt in (2, 5, 10, 20):
        for kp in (1.5, 2, 3, 5):
            row = {}
            for arm, rec in summary["arms"].items():
                att = [attainment([tuple(q) for q in x["per_request_ttft_tpot_ms_prompt"]], slo, kt, kp)
                       for x in rec["runs"]]
                row[arm] = sla_rate([x["rate"] for x in rec["runs"]], att, thr)
            grid[f"k_ttft={kt},k_tpot={kp}"] = row
    return grid


def combine(argv: list[str]) -> int:
    """``--combine NAME A.json B.json ...``: pool the per-request data of runs with the same SLOs,
    arms and rates (e.g. a forward and a reversed run) into ``results/NAME.json`` / ``.png``."""
    name, files = argv[0], argv[1:]
    runs = [json.loads(Path(f).read_text()) for f in files]
    base = runs[0]
    slo = base["slo"]
    thr = base["config"]["attainment_threshold"]
    rates = base["config"]["rates"]
    if any(r["config"].get("search", "sweep") != "sweep" for r in runs):
        raise SystemExit("--combine: only --search sweep runs can be pooled (a bisect run measures other rates per arm)")
    for r in runs[1:]:
        if (r["slo"]["ttft_a_ms"], r["slo"]["ttft_b_ms_per_token"], r["slo"]["tpot_ms"]) != (
                slo["ttft_a_ms"], slo["ttft_b_ms_per_token"], slo["tpot_ms"]) or r["config"]["rates"] != rates:
            raise SystemExit(f"--combine: {r['command']!r} has other SLOs or rates; runs must share them (use --slo-from)")
    out = dict(benchmark="bench_sla (combined)", date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               command="python benchmarks/bench_sla.py --combine " + " ".join(argv), sources=files,
               machine=machine_info(), config=base["config"], slo=slo, arms={})
    arm_names: list[str] = []
    for r in runs:
        arm_names += [a for a in r["arms"] if a not in arm_names]
    for arm in arm_names:
        src = [r for r in runs if arm in r["arms"]]
        rec = dict(runs=[], sources=[f for f, r in zip(files, runs) if arm in r["arms"]])
        for i, rate in enumerate(rates):
            xs = [r["arms"][arm]["runs"][i] for r in src]
            reqs = [tuple(q) for x in xs for q in x["per_request_ttft_tpot_ms_prompt"]]
            rec["runs"].append(dict(rate=rate, attainment=attainment(reqs, slo),
                                    attainment_per_source=[x["attainment"] for x in xs],
                                    per_request_ttft_tpot_ms_prompt=[list(q) for q in reqs],
                                    request_goodput=statistics.fmean(x["request_goodput"] for x in xs),
                                    request_throughput=statistics.fmean(x["request_throughput"] for x in xs),
                                    preemptions=sum(x["preemptions"] for x in xs), completed=len(reqs),
                                    load_average_1m=[x["load_average_1m"] for x in xs]))
        rec["sla_rate"] = sla_rate(rates, [x["attainment"] for x in rec["runs"]], thr)
        rec["server_cmd"] = src[0]["arms"][arm]["server_cmd"]
        out["arms"][arm] = rec
    finish(out, rates, thr)
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1))
    report(out, rates)
    plot(out, RESULTS / f"{name}.png")
    return 0


def replace_arms(argv: list[str]) -> int:
    """``--replace-arms BASE.json RERUN.json``: put the arms of a rerun (made with ``--slo-from BASE.json
    --arms ...``) in place of those of BASE, in BASE's file. The replaced arms stay under
    ``superseded_arms`` (with the rerun's command); headline, SLO-scale grid and plot are recomputed.

    Raises:
        SystemExit: the rerun has other SLOs or another rate grid than BASE, or an arm BASE lacks.
    """
    if len(argv) != 2:
        raise SystemExit("--replace-arms BASE.json RERUN.json")
    base_path, rerun_path = Path(argv[0]), Path(argv[1])
    base, rerun = json.loads(base_path.read_text()), json.loads(rerun_path.read_text())
    key = ("ttft_a_ms", "ttft_b_ms_per_token", "tpot_ms", "k_ttft", "k_tpot")
    if [base["slo"][k] for k in key] != [rerun["slo"][k] for k in key] or base["config"]["rates"] != rerun["config"]["rates"]:
        raise SystemExit(f"--replace-arms: {rerun_path} has other SLOs or rates than {base_path} "
                         "(run it with --slo-from BASE and the same --rates)")
    missing = [a for a in rerun["arms"] if a not in base["arms"]]
    if missing:
        raise SystemExit(f"--replace-arms: arms {missing} of {rerun_path} are not in {base_path} (it has {list(base['arms'])})")
    sup = base.setdefault("superseded_arms", {})
    src = dict(file=str(rerun_path), command=rerun["command"], date=rerun["date"])
    for arm, rec in rerun["arms"].items():
        sup[arm] = dict(base["arms"][arm], replaced_by=src)
        base["arms"][arm] = dict(rec, rerun=dict(src, load_average_at_start=rerun["load_average_at_start"],
                                                 total_wall_s=rerun["total_wall_s"]))
    finish(base, base["config"]["rates"], base["config"]["attainment_threshold"])
    base_path.write_text(json.dumps(base, indent=1))
    report(base, base["config"]["rates"])
    plot(base, base_path.with_suffix(".png"))
    print(f"wrote {base_path}: arms {list(rerun['arms'])} from {rerun_path}")
    return 0


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    # one colour per policy spec; the line style says the arm: Naive-Evict dashed, vToken fixed
    # solid, vToken pressure dash-dotted, stock black dotted
    tags: dict[str, str] = {}
    for arm, rec in summary["arms"].items():
        tag = arm.split("-", 1)[1].removesuffix("-pressure") if "-" in arm else arm
        color = "black" if arm.startswith("stock") else tags.setdefault(tag, f"C{len(tags) % 10}")
        style = ("-." if arm.endswith("-pressure") else "-") if arm.startswith("vtoken") else (
            "--" if arm.startswith("naive") else ":")
        rs = [x["rate"] for x in rec["runs"]]
        kw = dict(color=color, marker="o", ms=4, label=arm)
        ax1.plot(rs, [x["request_goodput"] for x in rec["runs"]], style, **kw)
        ax2.plot(rs, [x["attainment"] for x in rec["runs"]], style, **kw)
        ax3.plot(rs, [x["request_throughput"] for x in rec["runs"]], style, **kw)
    rs = summary["config"]["rates"]
    ax1.plot(rs, rs, color="grey", lw=0.5, label="offered rate")
    ax1.set_xlabel("request rate (req/s)")
    ax1.set_ylabel("goodput (good req/s)")
    ax2.axhline(summary["config"]["attainment_threshold"], color="grey", lw=0.8)
    ax2.set_xlabel("request rate (req/s)")
    ax2.set_ylabel("SLO attainment")
    ax2.set_ylim(-0.02, 1.02)
    ax3.set_xlabel("request rate (req/s)")
    ax3.set_ylabel("completed req/s (no SLO)")
    c, s = summary["config"], summary["slo"]
    fig.suptitle(f"SmolLM2-135M bf16, CPU x{summary['machine']['cpu_count']}, pool {c['pool_blocks']}x{c['block_size']} tok, "
                 f"budget {c['budget']}, out {c['output_len']}; SLO TTFT {s['k_ttft']:g} x ({s['ttft_a_ms']:.0f} ms + "
                 f"{s['ttft_b_ms_per_token']:.2f} ms/prompt token), TPOT {s['tpot_ms']:.0f} ms", fontsize=9)
    ax3.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
