"""One prepared GPU check (``make device-check``): at most ~8 minutes on one NVIDIA GPU.

With CUDA it runs, in order:

1. the GPU kernel tests: ``tests/core/test_kernels.py`` and ``tests/core/test_score_kernel.py``
   with ``-k cuda`` (the compiled Triton move and scoring kernels against PyTorch on real
   CUDA tensors, caches laid out by vLLM's own ``create_kv_cache_views``);
2. a move-bandwidth benchmark: ``move_tokens_paged_triton`` over every layer of a
   Llama-3-8B-shaped and a SmolLM2-shaped cache (``LBNHC`` and ``LBHNC``) against a plain
   device-to-device copy of the same number of bytes;
3. a scorer timing: one layer of the two-phase scorer on a decode batch and a prefill chunk,
   with its achieved K-read bandwidth, next to the PyTorch reference;

and writes ``benchmarks/results/device_check.json``. The engine parts of the check (the
oracle matrix under eager mode and CUDA graphs, and the step-time benchmark vToken off /
on-without-eviction / on-evicting) need the CUDA worker, which is **not yet built**: the JSON
carries them as explicit ``"status": "not yet built"`` placeholders, nothing is faked.

Without CUDA it prints one line saying so and runs the interpreter subset of the same tests
(``TRITON_INTERPRET=1`` on CPU tensors); it writes no JSON then.

Usage::

    python benchmarks/device_check.py [--out benchmarks/results/device_check.json]
                                      [--skip-tests] [--skip-bench]
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

TEST_FILES = ["tests/core/test_kernels.py", "tests/core/test_score_kernel.py"]
NOT_BUILT = "not yet built"


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
        # Estimated bytes of the scorer (gpu-path.md 5.3): decode rows read K once and write +
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


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "device_check.json")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    args = ap.parse_args(argv)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])

    if not torch.cuda.is_available():
        print("device-check: no CUDA device on this machine; running the Triton interpreter "
              "subset on CPU instead (no JSON written)")
        res = run_pytest("not cuda", env, timeout_s=900)
        print(f"interpreter subset: {res.get('passed')} passed, {res.get('failures')} failed, "
              f"{res.get('errors')} errors, {res.get('skipped')} skipped in {res['seconds']} s")
        if res["returncode"] != 0:
            print(res.get("output_tail", ""))
        return 0 if res["returncode"] == 0 else 1

    env.pop("TRITON_INTERPRET", None)
    t0 = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    import triton

    result: dict[str, Any] = dict(
        command=" ".join([Path(sys.executable).name] + sys.argv),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        machine=machine_info(),
        gpu=dict(name=props.name, capability=f"{props.major}.{props.minor}",
                 memory_GiB=round(props.total_memory / 2**30, 1),
                 cuda=torch.version.cuda, triton=triton.__version__),
    )
    ok = True
    if not args.skip_tests:
        result["kernel_tests"] = run_pytest("cuda", env, timeout_s=360)
        ok = result["kernel_tests"]["returncode"] == 0
        kt = result["kernel_tests"]
        print(f"GPU kernel tests: {kt.get('passed')} passed, {kt.get('failures')} failed, "
              f"{kt.get('errors')} errors, {kt.get('skipped')} skipped in {kt['seconds']} s")
    if not args.skip_bench:
        try:
            result["move_bandwidth"] = bench_moves()
            result["scorer"] = bench_scorer()
        except Exception as exc:  # noqa: BLE001 - record and keep the test result
            result["bench_error"] = f"{type(exc).__name__}: {exc}"
            ok = False
            print(f"benchmark failed: {result['bench_error']}")
    result["oracle_matrix"] = dict(
        status=NOT_BUILT,
        what="greedy tokens of vToken vs the dense oracle, every policy, small model, eager "
             "and default CUDA graphs (FULL_AND_PIECEWISE), tokens equal in both",
        needs="the CUDA worker (issue 14, item 1)")
    result["step_time"] = dict(
        status=NOT_BUILT,
        what="decode step time: vToken off / on without eviction / on evicting",
        needs="the CUDA worker (issue 14, item 1)")
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["ok"] = ok
    write_json(args.out, result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
