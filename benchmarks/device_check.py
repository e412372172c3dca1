"""One prepared GPU check (``make device-check``): at most ~8 minutes on one NVIDIA GPU.

With CUDA it runs, in order, each part guarded and time-boxed (a part that fails or runs out of
time is recorded as such and the next one still runs), writing the JSON after every part:

1. the GPU tests: ``tests/core/test_kernels.py``, ``tests/core/test_score_kernel.py`` and
   ``tests/gpu/test_gpu_runner_cpu.py`` with ``-k cuda`` (the compiled Triton move and scoring
   kernels, the CUDA worker step's staged one-launch moves and its scorer, against PyTorch on
   real CUDA tensors, caches laid out by vLLM's own ``create_kv_cache_views``);
2. a move-bandwidth benchmark: ``move_tokens_paged_triton`` over every layer of a
   Llama-3-8B-shaped and a SmolLM2-shaped cache (``LBNHC`` and ``LBHNC``) against a plain
   device-to-device copy of the same number of bytes;
3. a scorer timing: one layer of the two-phase scorer on a decode batch and a prefill chunk,
   with its achieved K-read bandwidth, next to the PyTorch reference; and the worker's
   per-step decider work (observe, evict, append) at 256 / 512 requests x 2,048 / 8,192 tokens;
4. the oracle matrix on the CUDA worker (FlashAttention, vLLM's default runner and scheduling):
   5 policies x 3 budgets x 2 prompt lengths on the tiny model (built locally, no network), once
   with ``cudagraph_mode=NONE`` (eager, same compilation) and once with vLLM's default CUDA graphs
   (``FULL_AND_PIECEWISE``), both in vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``: no
   FlashAttention KV splits, so a graph replay computes what the eager step does; plain mode if
   vLLM refuses it); the tokens must be equal in both, no scored step may have replayed a
   FULL graph (``route``), and each run is compared with the dense oracle (float32, reported:
   the engine runs bf16, FlashAttention has no fp32);
5. step time: stock vLLM (plugin not loaded), vToken on without eviction (a budget above every
   length), vToken on evicting, with default CUDA graphs (SmolLM2-135M when its assets are on the
   machine, else the tiny model);
6. when time is left: the oracle matrix on the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``) with
   default CUDA graphs, tokens equal to Model Runner V2's.

and writes ``benchmarks/results/device_check.json``. Without CUDA it prints one line saying so
and runs the interpreter subset of the same tests (``TRITON_INTERPRET=1`` on CPU tensors); it
writes no JSON then.

Usage::

    python benchmarks/device_check.py [--out benchmarks/results/device_check.json]
                                      [--skip-tests] [--skip-bench] [--skip-engine] [--budget-s 450]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, machine_info, write_json  # noqa: E402

import torch  # noqa: E402

TEST_FILES = ["tests/core/test_kernels.py", "tests/core/test_score_kernel.py", "tests/gpu/test_gpu_runner_cpu.py"]
HOOKS = str(ROOT / "benchmarks" / "device_hooks.py") + ":RouteStatsHooks"


# ------------------------------------------------------------------ tests
def run_pytest(select: str, env: dict[str, str], timeout_s: int) -> dict[str, Any]:
    """Run the kernel test files with ``-k select``; counts and failed ids from JUnit XML."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider",
               *TEST_FILES, "-k", select, f"--junitxml={xml}"]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=timeout_s)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-4000:]
        except subprocess.TimeoutExpired as exc:
            rc, tail = -1, f"timed out after {timeout_s} s: {str(exc.stdout)[-2000:]}"
        res: dict[str, Any] = dict(command=" ".join(cmd[1:]), returncode=rc,
                                   seconds=round(time.perf_counter() - t0, 1))
        if xml.exists():
            root = ET.parse(xml).getroot()
            suite = root if root.tag == "testsuite" else root.find("testsuite")
            for k in ("tests", "failures", "errors", "skipped"):
                res[k] = int(suite.get(k, 0))
            res["passed"] = res["tests"] - res["failures"] - res["errors"] - res["skipped"]
            res["failed_ids"] = [
                f"{tc.get('classname')}::{tc.get('name')}"
                for tc in suite.iter("testcase")
                if tc.find("failure") is not None or tc.find("error") is not None
            ]
        if rc != 0:
            res["output_tail"] = tail
        return res


# ------------------------------------------------------------------ timing helpers
def cuda_time_ms(fn: Callable[[], None], warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of ``fn`` measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b))
    return statistics.median(samples)


def paged_caches(layout_name: str, layers: int, num_blocks: int, bs: int, hkv: int, hd: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    sys.path.insert(0, str(ROOT / "tests" / "core"))
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm_kv_views import vllm_kv_views

    return vllm_kv_views(KVCacheLayout[layout_name], num_layers=layers, num_blocks=num_blocks,
                         block_size=bs, num_kv_heads=hkv, head_size=hd, dtype=dtype,
                         device="cuda")


# ------------------------------------------------------------------ move bandwidth
MOVE_CASES = [
    # name, layers, num_blocks, block_size, kv heads, head size
    ("llama3_8b", 32, 2048, 16, 8, 128),
    ("smollm2_135m", 30, 1024, 32, 3, 64),
]


def bench_moves() -> list[dict[str, Any]]:
    from vtoken.kernels import move_tokens_paged_reference, move_tokens_paged_triton

    out = []
    gen = torch.Generator().manual_seed(0)
    for name, layers, nb, bs, hkv, hd in MOVE_CASES:
        for layout in ("LBNHC", "LBHNC"):
            raw, caches = paged_caches(layout, layers, nb, bs, hkv, hd, torch.bfloat16)
            raw.random_(-128, 127)
            slots = nb * bs
            for m in (256, 4096):
                perm = torch.randperm(slots, generator=gen)
                src, dst = perm[:m].cuda(), perm[m : 2 * m].cuda()
                token_bytes = hkv * 2 * hd * 2  # one layer, one token, all heads, K and V
                moved = m * layers * token_bytes  # bytes read (= bytes written)
                t_kernel = cuda_time_ms(lambda: move_tokens_paged_triton(caches, src, dst,
                                                                         debug=False))
                a = torch.empty(moved, dtype=torch.uint8, device="cuda")
                b = torch.empty_like(a)
                t_copy = cuda_time_ms(lambda: b.copy_(a))
                row = dict(case=name, layout=layout, layers=layers, num_blocks=nb,
                           block_size=bs, kv_heads=hkv, head_size=hd, dtype="bf16", moves=m,
                           bytes_moved=moved, triton_ms=round(t_kernel, 4),
                           triton_GBps=round(2 * moved / t_kernel / 1e6, 1),
                           d2d_copy_ms=round(t_copy, 4),
                           d2d_copy_GBps=round(2 * moved / t_copy / 1e6, 1))
                row["triton_vs_copy"] = round(row["triton_GBps"] / row["d2d_copy_GBps"], 3)
                if m == 256 and layout == "LBNHC":
                    t_ref = cuda_time_ms(
                        lambda: move_tokens_paged_reference(caches, src, dst, check_overlap=False),
                        warmup=1, iters=5)
                    row["torch_reference_ms"] = round(t_ref, 4)
                out.append(row)
                print(f"move {name:13s} {layout} M={m:5d}: triton {t_kernel:.3f} ms "
                      f"({row['triton_GBps']} GB/s), d2d copy {t_copy:.3f} ms "
                      f"({row['d2d_copy_GBps']} GB/s)")
                del a, b
            del raw, caches
            torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------ scorer timing
SCORE_CASES = [
    # name, heads (q, kv), head size, block size, rows as (n, ql)
    ("llama3_8b_decode_b64_n2048", 32, 8, 128, 16, [(2048, 1)] * 64),
    ("llama3_8b_prefill_chunk512_n2048", 32, 8, 128, 16, [(2048, 512)]),
    ("smollm2_decode_b64_n512", 9, 3, 64, 32, [(512, 1)] * 64),
]


def bench_scorer() -> list[dict[str, Any]]:
    from vtoken.kernels.score import (ScoreRow, plan_scores, score_attention_reference,
                                      score_attention_triton)

    out = []
    gen = torch.Generator().manual_seed(1)
    for name, hq, hkv, hd, bs, rows in SCORE_CASES:
        nblk = [math.ceil(n / bs) for n, _ in rows]
        nb = sum(nblk) + 1
        raw, (kv,) = paged_caches("LBNHC", 1, nb, bs, hkv, hd, torch.bfloat16)
        kv.normal_()
        perm = torch.randperm(nb, generator=gen)
        bt = torch.zeros(len(rows), max(nblk), dtype=torch.int32)
        at = 0
        for i, k in enumerate(nblk):
            bt[i, :k] = perm[at : at + k].to(torch.int32)
            at += k
        bt = bt.cuda()
        t_total = sum(q for _, q in rows)
        q = torch.randn(t_total, hq, hd, device="cuda", dtype=torch.bfloat16)
        specs, qs = [], 0
        for i, (n, ql) in enumerate(rows):
            specs.append(ScoreRow(i, n, qs, ql, True, True))
            qs += ql
        plan = plan_scores(specs)
        o = plan.new_out("cuda")
        lse = torch.empty(plan.lse_rows, hq, dtype=torch.float32, device="cuda")
        lg = torch.empty(max(1, plan.logits_per_head * hq), dtype=torch.float32, device="cuda")
        scale = 1 / math.sqrt(hd)
        t_tri = cuda_time_ms(lambda: score_attention_triton(q, kv, bt, plan, o, scale=scale,
                                                            lse=lse, logits=lg))
        t_ref = cuda_time_ms(lambda: score_attention_reference(q, kv, bt, plan, o, scale=scale),
                             warmup=1, iters=3)
        sum_n = sum(n for n, _ in rows)
        k_bytes = sum_n * hkv * hd * 2
        # Estimated bytes of the scorer (triton_score.py's docstring, "Cost"): decode rows read K once and write +
        # read fp32 logits; chunks read K in both phases (phase A once per q tile, ~L2).
        est = sum(n * (hkv * hd * 2 + 8 * hq + 8) if ql == 1 else 2 * n * hkv * hd * 2
                  for n, ql in rows)
        row = dict(case=name, q_heads=hq, kv_heads=hkv, head_size=hd, block_size=bs,
                   rows=len(rows), sum_n=sum_n, max_ql=max(q for _, q in rows),
                   triton_ms_per_layer=round(t_tri, 4), torch_reference_ms=round(t_ref, 4),
                   estimated_bytes=est, achieved_GBps=round(est / t_tri / 1e6, 1),
                   attention_kv_bytes=2 * k_bytes,
                   estimated_bytes_vs_attention=round(est / (2 * k_bytes), 3))
        out.append(row)
        print(f"score {name}: triton {t_tri:.3f} ms/layer ({row['achieved_GBps']} GB/s of the "
              f"estimated bytes), torch reference {t_ref:.3f} ms")
        del raw, kv
        torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------ engine parts
POLICIES = ["h2o", "tova", "scissorhands", "random", "streaming"]
BUDGETS = [29, 45, 64]
NEW_TOKENS = 64
BASE_VTOKEN = {"policy": "h2o", "budget": 45}


def bench_worker_decider() -> list[dict[str, Any]]:
    """The worker's per-step eviction work on the GPU: one ``DeviceDecider`` step (observe for
    H2O, evict ``k = 1`` per request, append one token) for 256 and 512 requests x 2,048 and 8,192
    live tokens (``benchmarks/bench_scheduler.py``'s ``time_worker``, CUDA-synchronised)."""
    from bench_scheduler import time_worker

    rows = []
    for policy in ("h2o", "random"):
        for r in (256, 512):
            for live in (2048, 8192):
                rows.append(time_worker(policy, r, live, device="cuda", reps=10))
                print(f"worker decider {policy} {r} x {live}: {rows[-1]['median_ms']:.3f} ms")
    # per-layer and per-head token sets (issue 23, docs/granularity.md): SmolLM2's 30 layers x 3 KV
    # heads, H2O, 256 requests x 2,048 live; the ratio to one set per request
    base = None
    for sets, name in ((1, "request"), (3, "head_shared"), (30, "layer"), (90, "head")):
        row = dict(time_worker("h2o", 256, 2048, device="cuda", reps=10, num_sets=sets), granularity=name)
        base = base or row["median_ms"]
        row["ratio_to_request"] = row["median_ms"] / base
        rows.append(row)
        print(f"worker decider h2o 256 x 2048, {name} ({sets} sets): {row['median_ms']:.3f} ms "
              f"({row['ratio_to_request']:.1f}x request)")
    return rows


def _prompt(i: int, n: int, vocab: int = 250) -> list[int]:
    return [((i + 3) * 37 + j * (11 + i % 5)) % vocab + 1 for j in range(n)]


def oracle_requests() -> list[dict[str, Any]]:
    """policy x budget x {prompt shorter, longer than the budget}: one mixed batch (as tests/integration)."""
    import itertools

    reqs = []
    for k, (pol, budget, plen) in enumerate(itertools.product(POLICIES, BUDGETS, [20, 100])):
        reqs.append(dict(id=f"{pol}-{budget}-{plen}", prompt_token_ids=_prompt(k, plen), max_tokens=NEW_TOKENS,
                         extra_args={"vtoken_policy": pol, "vtoken_budget": budget}))
    return reqs


#: ``--dry-run-cpu``: run the engine parts' plumbing on CPU engines (float32, block 32, small sizes)
DRY_RUN_CPU = False


def engine_kw(model: str, *, eager: bool, max_model_len: int = 1024) -> dict[str, Any]:
    """LLM kwargs of the device check's engines (bf16: FlashAttention runs fp16/bf16 only)."""
    if DRY_RUN_CPU:
        return dict(model=model, dtype="float32", max_model_len=max_model_len, block_size=32, enforce_eager=True,
                    gpu_memory_utilization=0.1, num_gpu_blocks_override=1024, max_num_seqs=64,
                    skip_tokenizer_init=True, seed=0)
    e: dict[str, Any] = dict(model=model, dtype="bfloat16", max_model_len=max_model_len, block_size=16,
                             gpu_memory_utilization=0.3, num_gpu_blocks_override=4096, max_num_seqs=64,
                             skip_tokenizer_init=True, seed=0)
    if eager:  # no CUDA graphs, same torch.compile: the numerics the graphs replay
        e["compilation_config"] = {"cudagraph_mode": "NONE"}
    return e


class Deadline:
    """The check's time box: ``left()`` seconds remain; parts ask before starting."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def _engine(spec: dict[str, Any], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    from drivers.harness import run_in_subprocess

    t0 = time.perf_counter()
    try:
        out = run_in_subprocess(spec, env=env, timeout=max(10.0, timeout))
    except subprocess.TimeoutExpired:
        return dict(status="timed out", seconds=round(time.perf_counter() - t0, 1), timeout_s=round(timeout))
    except Exception as exc:  # noqa: BLE001 - recorded, the check goes on
        return dict(status="failed", error=f"{type(exc).__name__}: {str(exc)[-3000:]}",
                    seconds=round(time.perf_counter() - t0, 1))
    out["status"] = "ran"
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def run_oracle_matrix(deadline: Deadline, part_s: float) -> dict[str, Any]:
    """Part 4 (module docstring): tokens eager == tokens with CUDA graphs, FULL never on scored steps."""
    from vtoken.assets.paths import ensure_tiny_model

    end = time.monotonic() + min(part_s, deadline.left())
    model = str(ensure_tiny_model())
    reqs = oracle_requests()
    # vLLM's batch-invariant mode: FlashAttention without KV splits and batch-invariant kernels in both
    # runs, so eager and graph replays compute the same numbers and any token difference is vToken's
    env = None if DRY_RUN_CPU else {"VLLM_BATCH_INVARIANT": "1"}
    res: dict[str, Any] = dict(model="tiny-llama (2 layers, 2 q heads, 1 kv head, head 64)", requests=len(reqs),
                               new_tokens=NEW_TOKENS, vtoken=BASE_VTOKEN, env=env, runs={})
    for name, eager in (("eager", True), ("cuda_graphs", False)):
        left = end - time.monotonic() - 20  # keep time for the oracle comparison
        if left < 45:
            res["runs"][name] = dict(status="skipped: out of time")
            continue
        spec = dict(engine=engine_kw(model, eager=eager), vtoken=BASE_VTOKEN, requests=reqs, hooks=HOOKS, check=True)
        out = _engine(spec, timeout=left, env=env)
        if out.get("status") == "failed" and env and name == "eager":  # batch-invariant mode refused: plain mode
            res["batch_invariant_error"] = out.get("error")
            env = res["env"] = None
            out = _engine(spec, timeout=end - time.monotonic() - 20 - 45)
        res["runs"][name] = {k: out.get(k) for k in ("status", "seconds", "error", "timeout_s", "paths", "route",
                                                      "runner", "moves_launched", "steps", "wall_s")}
        if out.get("status") == "ran":
            res["runs"][name]["stats"] = out.get("vtoken", {}).get("stats")
            res["runs"][name]["tokens"] = out["tokens"]
        print(f"oracle matrix, {name}: {out.get('status')} in {out.get('seconds')} s; route {out.get('route')}")
    runs = res["runs"]
    ran = [n for n in ("eager", "cuda_graphs") if runs.get(n, {}).get("status") == "ran"]
    if len(ran) == 2:
        a, b = runs["eager"]["tokens"], runs["cuda_graphs"]["tokens"]
        diff = [r["id"] for r in reqs if a.get(r["id"]) != b.get(r["id"])]
        res["tokens_equal"] = not diff
        res["differing_requests"] = diff
    route = runs.get("cuda_graphs", {}).get("route") or {}
    res["full_graph_on_scored_steps"] = (route.get("modes") or {}).get("FULL", 0) if route else None
    # the dense oracle (float32 on the GPU); async scheduling decides as sync
    if ran and end - time.monotonic() > 10:
        try:
            from vtoken.config import parse_config, parse_request_overrides
            from reference.oracle import load_oracle_model, oracle_generate

            m = load_oracle_model(model, dtype=torch.float32, device="cpu" if DRY_RUN_CPU else "cuda")
            base = parse_config(BASE_VTOKEN)
            agree = {n: 0 for n in ran}
            done = 0
            for r in reqs:
                if end - time.monotonic() < 3:
                    break
                cfg = parse_request_overrides(r["extra_args"]).apply(base)
                ref = list(oracle_generate(m, r["prompt_token_ids"], NEW_TOKENS, cfg).token_ids)
                done += 1
                for n in ran:
                    agree[n] += int(runs[n]["tokens"].get(r["id"]) == ref)
            res["oracle"] = dict(compared=done, equal_to_oracle=agree,
                                 note="engine bf16 vs oracle float32: agreement is reported, not required")
        except Exception as exc:  # noqa: BLE001
            res["oracle"] = dict(error=f"{type(exc).__name__}: {exc}")
    for n in ran:
        _TOKENS[n] = runs[n].pop("tokens", None)
    _TOKENS["env"] = res["env"]
    runner = (runs.get("cuda_graphs", {}).get("paths") or {}).get("runner") or ""
    res["runner_is_vtoken_gpu"] = runner.startswith("vtoken.integrations.vllm.worker.gpu_runner.")
    res["ok"] = (bool(res.get("tokens_equal")) and res["full_graph_on_scored_steps"] == 0
                 and route.get("scored", 0) > 0 and res["runner_is_vtoken_gpu"])
    return res


#: tokens of the oracle-matrix runs (run name -> request id -> tokens), for the V1 comparison
_TOKENS: dict[str, Any] = {}


def run_oracle_matrix_v1(deadline: Deadline, part_s: float) -> dict[str, Any]:
    """Part 6 (when time is left): the same matrix on the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``),
    default CUDA graphs; tokens must equal Model Runner V2's eager run (same scheduling, same lag)."""
    from vtoken.assets.paths import ensure_tiny_model

    left = min(part_s, deadline.left()) - 5
    if left < 45:
        return dict(status="skipped: out of time", ok=True)
    reqs = oracle_requests()
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    if _TOKENS.get("env"):
        env.update(_TOKENS["env"])  # the matrix's batch-invariant mode, when it ran in it
    out = _engine(dict(engine=engine_kw(str(ensure_tiny_model()), eager=False), vtoken=BASE_VTOKEN, requests=reqs,
                       hooks=HOOKS, check=True), timeout=left, env=env)
    res = {k: out.get(k) for k in ("status", "seconds", "error", "timeout_s", "paths", "route", "runner",
                                   "moves_launched")}
    ref = _TOKENS.get("eager")
    if out.get("status") == "ran" and ref:
        diff = [r["id"] for r in reqs if out["tokens"].get(r["id"]) != ref.get(r["id"])]
        res["tokens_equal_to_mrv2_eager"] = not diff
        res["differing_requests"] = diff
    route = res.get("route") or {}
    res["ok"] = (out.get("status") == "ran" and bool(res.get("tokens_equal_to_mrv2_eager"))
                 and (route.get("modes") or {}).get("FULL", 0) == 0 and (DRY_RUN_CPU or route.get("scored", 0) > 0))
    print(f"oracle matrix, V1 runner + CUDA graphs: {out.get('status')} in {out.get('seconds')} s; route {route}")
    return res


def run_step_time(deadline: Deadline, part_s: float) -> dict[str, Any]:
    """Part 5 (module docstring): decode step time, vToken off / on without eviction / on evicting."""
    from vtoken.assets.paths import ensure_tiny_model, smollm2_dir

    end = time.monotonic() + min(part_s, deadline.left())
    sm = smollm2_dir()
    if (sm / "model.safetensors").exists() and not DRY_RUN_CPU:
        model, name, vocab = str(sm), "smollm2-135m-instruct", 20000
    else:
        model, name, vocab = str(ensure_tiny_model()), "tiny-llama", 250
    n_req, plen, new, budget = (32, 384, 256, 128) if not DRY_RUN_CPU else (4, 96, 24, 48)

    def reqs(tag: str, extra: dict | None = None, n: int = n_req, new_tokens: int = new) -> list[dict]:
        out = []
        for i in range(n):
            r = dict(id=f"{tag}{i}", prompt_token_ids=_prompt(i, plen, vocab), max_tokens=new_tokens, ignore_eos=True)
            if extra:
                r["extra_args"] = dict(extra)
            out.append(r)
        return out

    warm = dict(name="warmup", requests=reqs("w", n=8, new_tokens=32))
    res: dict[str, Any] = dict(model=name, requests=n_req, prompt_tokens=plen, new_tokens=new, budget=budget,
                               cuda_graphs="vLLM default (FULL_AND_PIECEWISE)")
    runs: dict[str, Any] = {}
    specs = [
        ("stock", dict(engine=engine_kw(model, eager=False, max_model_len=2048), vtoken=None,
                       groups=[warm, dict(name="off", requests=reqs("off"))], check=False), {"VLLM_PLUGINS": ""}),
        ("vtoken", dict(engine=engine_kw(model, eager=False, max_model_len=2048),
                        vtoken={"policy": "h2o", "budget": budget},
                        groups=[warm, dict(name="on_no_evict", requests=reqs("ne", {"vtoken_budget": 2048})),
                                dict(name="on_evicting", requests=reqs("ev"))], hooks=HOOKS, check=False), None),
    ]
    for key, spec, env in specs:
        left = end - time.monotonic()
        if left < 40:
            runs[key] = dict(status="skipped: out of time")
            continue
        out = _engine(spec, timeout=left, env=env)
        runs[key] = {k: out.get(k) for k in ("status", "seconds", "error", "timeout_s", "paths", "route", "runner")}
        for g in out.get("groups", []):
            if g["name"] == "warmup":
                continue
            toks = sum(len(t) for t in g["tokens"].values())
            res[g["name"]] = dict(steps=g["steps"], wall_s=round(g["wall_s"], 3),
                                  ms_per_step=round(1000 * g["wall_s"] / max(1, g["steps"]), 3),
                                  output_tokens_per_s=round(toks / max(g["wall_s"], 1e-9), 1))
        print(f"step time, {key}: {out.get('status')} in {out.get('seconds')} s")
    res["runs"] = runs
    for g in ("off", "on_no_evict", "on_evicting"):
        if g in res:
            print(f"  {g}: {res[g]['ms_per_step']} ms/step, {res[g]['output_tokens_per_s']} tok/s")
    res["ok"] = all(g in res for g in ("off", "on_no_evict", "on_evicting"))
    return res


# ------------------------------------------------------------------ main
PART_S = dict(kernel_tests=90, bench=40, oracle_matrix=200, step_time=120, oracle_matrix_v1=90)


def main(argv: list[str] | None = None) -> int:
    # this check is how a GPU gets validated: its engines opt in to the unvalidated CUDA path
    # (vToken refuses CUDA by name without it; README "GPU support")
    os.environ.setdefault("VTOKEN_UNVALIDATED_PLATFORM", "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "device_check.json")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--budget-s", type=float, default=450.0, help="time box of the whole check (seconds)")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="tests only: run the engine parts' plumbing on CPU engines (no GPU numbers)")
    args = ap.parse_args(argv)
    global DRY_RUN_CPU
    DRY_RUN_CPU = args.dry_run_cpu
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])

    if not torch.cuda.is_available() and not DRY_RUN_CPU:
        print("device-check: no CUDA device on this machine; running the Triton interpreter "
              "subset on CPU instead (no JSON written)")
        res = run_pytest("not cuda", env, timeout_s=900)
        print(f"interpreter subset: {res.get('passed')} passed, {res.get('failures')} failed, "
              f"{res.get('errors')} errors, {res.get('skipped')} skipped in {res['seconds']} s")
        if res["returncode"] != 0:
            print(res.get("output_tail", ""))
        return 0 if res["returncode"] == 0 else 1

    env.pop("TRITON_INTERPRET", None)
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]  # the harness's engine processes import this checkout
    deadline = Deadline(args.budget_s)
    t0 = time.perf_counter()
    result: dict[str, Any] = dict(command=" ".join([Path(sys.executable).name] + sys.argv),
                                  date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                                  complete=False)
    if DRY_RUN_CPU:
        result["dry_run_cpu"] = "engine plumbing on CPU engines; no GPU numbers"
        args.skip_tests = args.skip_bench = True
    try:
        props = torch.cuda.get_device_properties(0)
        result["gpu"] = dict(name=props.name, capability=f"{props.major}.{props.minor}",
                             memory_GiB=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
        import triton

        result["gpu"]["triton"] = triton.__version__
        result["machine"] = machine_info()
    except Exception as exc:  # noqa: BLE001
        result["setup_error"] = f"{type(exc).__name__}: {exc}"
    oks: dict[str, bool] = {}

    def part(name: str, fn: Callable[[], Any], ok_of: Callable[[Any], bool]) -> None:
        if deadline.left() < 20:
            result[name] = dict(status="skipped: out of time")
            oks[name] = False
        else:
            t = time.perf_counter()
            try:
                result[name] = fn()
                oks[name] = ok_of(result[name])
            except Exception as exc:  # noqa: BLE001 - record, go on
                import traceback

                result[name] = dict(status="failed", error=f"{type(exc).__name__}: {exc}",
                                    traceback=traceback.format_exc()[-3000:])
                oks[name] = False
                print(f"{name} failed: {result[name]['error']}")
            print(f"[{name}: {round(time.perf_counter() - t, 1)} s, {deadline.left():.0f} s left]")
        result["seconds"] = round(time.perf_counter() - t0, 1)
        result["ok_parts"] = dict(oks)
        write_json(args.out, result)  # partial results survive a later crash or kill

    if not args.skip_tests:
        def tests():
            kt = run_pytest("cuda", env, timeout_s=int(min(PART_S["kernel_tests"], deadline.left() - 10)))
            print(f"GPU tests: {kt.get('passed')} passed, {kt.get('failures')} failed, "
                  f"{kt.get('errors')} errors, {kt.get('skipped')} skipped in {kt['seconds']} s")
            return kt

        part("kernel_tests", tests, lambda kt: kt["returncode"] == 0)
    if not args.skip_bench:
        part("move_bandwidth", bench_moves, lambda r: bool(r))
        part("scorer", bench_scorer, lambda r: bool(r))
        part("worker_decider", bench_worker_decider, lambda r: bool(r))
    if not args.skip_engine:
        part("oracle_matrix", lambda: run_oracle_matrix(deadline, PART_S["oracle_matrix"]), lambda r: r["ok"])
        part("step_time", lambda: run_step_time(deadline, PART_S["step_time"]), lambda r: r["ok"])
        if deadline.left() >= 50:  # optional: only when the box has room left
            part("oracle_matrix_v1", lambda: run_oracle_matrix_v1(deadline, PART_S["oracle_matrix_v1"]),
                 lambda r: r["ok"])
    result["complete"] = True
    result["ok"] = bool(oks) and all(oks.values())
    result["seconds"] = round(time.perf_counter() - t0, 1)
    write_json(args.out, result)
    print(f"device-check: {'ok' if result['ok'] else 'NOT ok'} ({result['ok_parts']}) in {result['seconds']} s "
          f"-> {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
