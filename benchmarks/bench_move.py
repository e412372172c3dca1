"""Time KV-cache token moves: PyTorch reference vs the Triton kernel.

Cache: SmolLM2-sized by default (30 layers, 3 KV heads, head_dim 64, bf16), laid out per
layer as ``[2, num_blocks, block_size, H, hd]`` and passed as 60 K/V slot views. Moves:
M = 1, 64, 1024 random disjoint src/dst slot pairs.

On a CUDA machine both the reference (on the GPU) and Triton (one launch) are timed with CUDA
events; without CUDA only the reference on CPU is timed. Prints a table and writes
``benchmarks/results/bench_move.json`` (date, machine, command, results).

Usage::

    python benchmarks/bench_move.py [--num-blocks 1024] [--block-size 16] [--moves 1 64 1024]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vtoken.kernels import move_tokens_reference, triton_available  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "u8": torch.uint8}


def make_views(layers, num_blocks, block_size, heads, head_dim, dtype, device):
    views, caches = [], []
    n = num_blocks * block_size
    for _ in range(layers):
        kv = torch.empty(2, num_blocks, block_size, heads, head_dim, dtype=dtype, device=device)
        if dtype.is_floating_point:
            kv.normal_()
        else:
            kv.random_(0, 256)
        caches.append(kv)
        views += [kv[0].view(n, heads * head_dim), kv[1].view(n, heads * head_dim)]
    return caches, views


def time_fn(fn, device, warmup, iters):
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)  # us
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples), min(samples)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--moves", type=int, nargs="+", default=[1, 64, 1024])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "bench_move.json")
    )
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    use_triton = cuda and triton_available()
    dtype = DTYPES[args.dtype]
    num_slots = args.num_blocks * args.block_size
    if 2 * max(args.moves) > num_slots:
        ap.error(f"need 2*M <= num_slots ({num_slots}) for disjoint src/dst")

    torch.manual_seed(args.seed)
    _caches, views = make_views(
        args.layers, args.num_blocks, args.block_size, args.kv_heads, args.head_dim, dtype, device
    )
    row_bytes = args.kv_heads * args.head_dim * views[0].element_size()
    cache_bytes = 2 * args.layers * num_slots * row_bytes

    if use_triton:
        from vtoken.kernels.move import move_tokens_triton

    results = []
    for m in args.moves:
        perm = torch.randperm(num_slots)
        src = perm[:m].to(device)
        dst = perm[m : 2 * m].to(device)
        moved_bytes = m * len(views) * row_bytes
        impls = [("reference", lambda: move_tokens_reference(views, src, dst))]
        if use_triton:
            impls.append(("triton", lambda: move_tokens_triton(views, src, dst, debug=False)))
        for name, fn in impls:
            med, best = time_fn(fn, device, args.warmup, args.iters)
            results.append(
                {
                    "impl": name,
                    "device": device.type,
                    "moves": m,
                    "views": len(views),
                    "bytes_moved": moved_bytes,
                    "median_us": round(med, 2),
                    "min_us": round(best, 2),
                    # read + write
                    "effective_GBps": round(2 * moved_bytes / (med * 1e-6) / 1e9, 3),
                }
            )

    gpu = torch.cuda.get_device_name(device) if cuda else None
    record = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "host": platform.node(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "gpu": gpu,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": _triton_version(),
        },
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "config": {
            "layers": args.layers,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "dtype": args.dtype,
            "num_blocks": args.num_blocks,
            "block_size": args.block_size,
            "row_bytes": row_bytes,
            "cache_bytes": cache_bytes,
            "warmup": args.warmup,
            "iters": args.iters,
        },
        "note": None if use_triton else "no CUDA device: Triton not timed; reference on CPU",
        "results": results,
    }

    print(
        f"# {args.layers} layers x K/V, {args.kv_heads} heads x {args.head_dim} {args.dtype}, "
        f"{num_slots} slots ({cache_bytes / 2**20:.0f} MiB), device={device.type}"
        + (f" ({gpu})" if gpu else "")
    )
    if not use_triton:
        print("# no CUDA device: Triton not timed; reference on CPU")
    print(f"{'impl':<10} {'M':>6} {'median us':>12} {'min us':>12} {'GB/s':>9}")
    for r in results:
        print(
            f"{r['impl']:<10} {r['moves']:>6} {r['median_us']:>12.1f} {r['min_us']:>12.1f} "
            f"{r['effective_GBps']:>9.2f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"# wrote {out}")


def _triton_version():
    try:
        import triton

        return triton.__version__
    except Exception:
        return None


if __name__ == "__main__":
    main()
