"""Cost of per-layer and per-head token sets (issue 23, ``docs/granularity.md``): side-cache memory
and the worker's decision time per step, per granularity, with the ratio to ``request``.

For SmolLM2-135M's geometry (30 layers, 3 KV heads of 64, bf16 KV: 23,040 bytes of KV per token
and the one model this project serves) and each granularity (``request`` 1 set, ``head_shared``
3, ``layer`` 30, ``head`` 90 sets per request):

* **memory**: side-cache bytes per KV slot (``vtoken.side_cache.SideCache.bytes_per_token``, what
  ``WorkerEviction`` logs at start-up) and its share of the KV cache, for H2O, TOVA and
  Scissorhands (their default ``window`` at budget 128);
* **time**: the worker's decision work of one steady decode step (``bench_scheduler.WorkerStep``:
  ``observe`` + ``evict`` of one token per request + ``append``, on a :class:`DeviceDecider`
  with that many sets; CPU, 1 torch thread), R requests x (budget + 1) live tokens, median of
  ``--reps`` steps after 2 warm-up steps. Arms are alternated per repetition round so that load
  drifts hit every arm alike; the load average is recorded. Not included: the KV move kernel,
  the scoring pass (per-head statistics cost the same attention pass; only their reduction
  differs), ``WorkerEviction``' bookkeeping.

Writes ``benchmarks/results/granularity_cost.json`` and a plot next to it.

Usage::

    python benchmarks/bench_granularity.py            # about 5 min on 2 cores
    python benchmarks/bench_granularity.py --quick    # seconds (tests)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine_info, write_json  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, KV_BYTES = 30, 3, 64, 2  # SmolLM2-135M, bf16 KV cache
GRANULARITIES = ("request", "head_shared", "layer", "head")
POLICIES = ("h2o", "tova", "scissorhands")
OUT = RESULTS / "granularity_cost.json"


def num_sets(granularity: str, layers: int = LAYERS, kv_heads: int = KV_HEADS) -> int:
    """Token sets per request (``docs/granularity.md``)."""
    return {"request": 1, "layer": layers, "head": layers * kv_heads, "head_shared": kv_heads}[granularity]


def kv_bytes_per_token(layers: int = LAYERS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM,
                       elem: int = KV_BYTES) -> int:
    """K and V bytes of one token over every layer."""
    return 2 * layers * kv_heads * head_dim * elem


def memory_rows(budget: int = 128) -> list[dict[str, Any]]:
    """Side-cache bytes per KV slot per (policy, granularity), and the share of the KV cache."""
    from vtoken.config import VTokenConfig
    from vtoken.side_cache import SideCache

    rows = []
    kv = kv_bytes_per_token()
    for pol in POLICIES:
        policy = VTokenConfig(policy=pol, budget=budget).make_policy()
        for g in GRANULARITIES:
            b = SideCache(1, policy.side_specs(), num_sets=num_sets(g)).bytes_per_token
            rows.append(dict(policy=pol, granularity=g, sets=num_sets(g), bytes_per_token=b,
                             kv_bytes_per_token=kv, percent_of_kv=100.0 * b / kv))
    return rows


def time_rows(requests: list[int], live: int, reps: int, policies=POLICIES) -> list[dict[str, Any]]:
    """Worker decision ms per step per (policy, granularity, requests), arms alternated."""
    import torch

    from bench_scheduler import WorkerStep

    torch.set_num_threads(1)
    out = []
    for R in requests:
        for pol in policies:
            arms = {g: WorkerStep(pol, R, live, num_sets=num_sets(g)) for g in GRANULARITIES}
            for w in arms.values():
                for _ in range(2):
                    w.step()
            ms: dict[str, list[float]] = {g: [] for g in GRANULARITIES}
            for _ in range(reps):
                for g, w in arms.items():
                    t0 = time.perf_counter_ns()
                    w.step()
                    ms[g].append((time.perf_counter_ns() - t0) / 1e6)
                    assert w.live_counts() == [live + 1] * R
            base = float(np.median(ms["request"]))
            for g in GRANULARITIES:
                med = float(np.median(ms[g]))
                out.append(dict(policy=pol, granularity=g, sets=num_sets(g), num_requests=R, live=live, reps=reps,
                                median_ms=med, min_ms=float(np.min(ms[g])), max_ms=float(np.max(ms[g])),
                                ratio_to_request=med / base))
            print(f"R={R:4d} {pol:13s} " + "  ".join(
                f"{g} {np.median(ms[g]):8.2f} ms ({np.median(ms[g]) / base:5.1f}x)" for g in GRANULARITIES), flush=True)
            del arms
    return out


def plot(doc: dict[str, Any], path: Path) -> Optional[Path]:
    """Worker decision ms per step vs token sets per request, one line per (policy, requests), log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rows = doc["time"]
    for pol in sorted({r["policy"] for r in rows}):
        for R in sorted({r["num_requests"] for r in rows}):
            rs = sorted((r for r in rows if r["policy"] == pol and r["num_requests"] == R), key=lambda r: r["sets"])
            ax.plot([r["sets"] for r in rs], [r["median_ms"] for r in rs], marker="o", label=f"{pol}, {R} requests")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks([1, 3, 30, 90], ["request\n1", "head_shared\n3", "layer\n30", "head\n90"])
    ax.set_xlabel("granularity, token sets per request (SmolLM2: 30 layers x 3 KV heads)")
    ax.set_ylabel("worker decisions, ms per decode step (CPU, 1 thread)")
    ax.set_title(f"observe + evict + append, {rows[0]['live'] + 1} live tokens per request")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print(f"wrote {png}")
    return png


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--live", type=int, default=128, help="budget: live tokens per request after each eviction")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="2 requests x 16 live, 2 reps, h2o only (tests)")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    if a.quick:
        a.requests, a.live, a.reps = [2], 16, 2
    load0 = list(os.getloadavg())
    t0 = time.perf_counter()
    doc = dict(meta=dict(command="python benchmarks/bench_granularity.py" + (" --quick" if a.quick else ""),
                         machine=machine_info(), model_geometry=dict(layers=LAYERS, kv_heads=KV_HEADS,
                                                                     head_dim=HEAD_DIM, kv_elem_bytes=KV_BYTES),
                         load_average_before=load0),
               memory=memory_rows(), time=time_rows(a.requests, a.live, a.reps,
                                                    policies=("h2o",) if a.quick else POLICIES))
    doc["meta"]["load_average_after"] = list(os.getloadavg())
    doc["meta"]["wall_s"] = time.perf_counter() - t0
    write_json(a.out, doc)
    if not a.quick:
        plot(doc, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
