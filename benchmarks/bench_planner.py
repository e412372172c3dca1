"""Planning cost per request-step of the token table, the repack planner and Naive-Evict.

Run:  .venv/bin/python benchmarks/bench_planner.py [--steps 3000] [--contexts 4096 32768 262144]

For each context length n (live tokens held at steady state) and each scenario:

* ``steady``: every step evicts 1 random live token, then appends 1 (decode at budget);
* ``batch64``: every step evicts 64 random live tokens at once, then appends 64;

it times, per step, in microseconds (median / mean / p99, wall clock, one thread):

* ``plan_repack``: the pure planner on the evicted slots;
* ``evict_slots``: ``TokenTable.evict_slots`` (validate + plan + update both maps);
* ``naive_evict``: ``NaiveEvictCounter.evict_positions`` (baseline accounting);
* ``full_scan``: for contrast only, a planner that scans a live mask of the whole
  context (O(n)); it is what "cost grows with the context" looks like. Timed in a
  separate loop so its scratch arrays do not flush the table from the caches.

The victims are drawn before the timer starts. Prints a table and writes
``benchmarks/results/bench_planner.json`` (date, machine, command, numbers).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vtoken.repack import NaiveEvictCounter, plan_repack  # noqa: E402
from vtoken.token_table import TokenTable  # noqa: E402

BLOCK_SIZE = 16
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_planner.json")


def full_scan_plan(evicted_slots: np.ndarray, num_live: int) -> tuple[np.ndarray, np.ndarray]:
    """O(num_live) reference planner (contrast only): scan a live mask of the whole context."""
    live = np.ones(num_live, dtype=bool)
    live[evicted_slots] = False
    new_n = num_live - evicted_slots.size
    dst = np.flatnonzero(~live[:new_n])
    src = np.flatnonzero(live[new_n:]) + new_n
    return src, dst


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _stats(ns: list[int]) -> dict:
    us = np.asarray(ns, dtype=np.float64) / 1e3
    return {
        "median_us": float(np.median(us)),
        "mean_us": float(us.mean()),
        "p99_us": float(np.percentile(us, 99)),
    }


def run_case(num_live: int, k: int, steps: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    table = TokenTable(BLOCK_SIZE)
    naive = NaiveEvictCounter(BLOCK_SIZE)
    table.append(num_live)
    naive.append(num_live)
    timings: dict[str, list[int]] = {"plan_repack": [], "evict_slots": [], "naive_evict": [], "full_scan": []}
    warmup = min(200, steps // 5)
    moves = 0
    clock = time.perf_counter_ns
    gc.disable()
    try:
        for step in range(warmup + steps):
            slots = rng.choice(num_live, size=k, replace=False) if k > 1 else rng.integers(0, num_live, size=1)
            slots = slots.astype(np.int64)
            positions = table.logical_pos[slots].copy()

            t0 = clock()
            plan_repack(slots, num_live, BLOCK_SIZE)
            t1 = clock()
            plan = table.evict_slots(slots)
            t2 = clock()
            naive.evict_positions(positions)
            t3 = clock()

            table.append(k)
            naive.append(k)
            if step >= warmup:
                timings["plan_repack"].append(t1 - t0)
                timings["evict_slots"].append(t2 - t1)
                timings["naive_evict"].append(t3 - t2)
                moves += plan.num_moves
        # The contrast planner runs in its own loop: its O(n) scratch arrays would
        # otherwise evict the table from the caches between the timed calls above.
        for step in range(warmup + steps):
            slots = rng.choice(num_live, size=k, replace=False) if k > 1 else rng.integers(0, num_live, size=1)
            t0 = clock()
            full_scan_plan(slots, num_live)
            t1 = clock()
            if step >= warmup:
                timings["full_scan"].append(t1 - t0)
    finally:
        gc.enable()
    table.check_invariants()
    assert table.num_live == num_live
    return {
        "num_live": num_live,
        "evict_per_step": k,
        "steps": steps,
        "block_size": BLOCK_SIZE,
        "mean_moves_per_step": moves / steps,
        "naive_retained_blocks_end": naive.num_retained_blocks,
        "vtoken_blocks_end": table.num_blocks(),
        **{name: _stats(ns) for name, ns in timings.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3000, help="timed steps per case")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 262144])
    ap.add_argument("--batch", type=int, default=64, help="tokens evicted at once in the batch case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)

    results = []
    for scenario, k in (("steady", 1), (f"batch{args.batch}", args.batch)):
        for n in args.contexts:
            r = run_case(n, k, args.steps, args.seed)
            r["scenario"] = scenario
            results.append(r)

    cols = ["plan_repack", "evict_slots", "naive_evict", "full_scan"]
    print(f"block_size={BLOCK_SIZE}, {args.steps} steps per case; median (p99) microseconds per request-step")
    header = f"{'scenario':<10}{'num_live':>10}{'moves':>7}" + "".join(f"{c:>18}" for c in cols)
    print(header)
    print("-" * len(header))
    for r in results:
        cells = "".join(f"{r[c]['median_us']:>9.1f} ({r[c]['p99_us']:>5.1f})" for c in cols)
        print(f"{r['scenario']:<10}{r['num_live']:>10}{r['mean_moves_per_step']:>7.1f}{cells}")

    growth = {}
    for scenario in {r["scenario"] for r in results}:
        rows = sorted((r for r in results if r["scenario"] == scenario), key=lambda r: r["num_live"])
        lo, hi = rows[0], rows[-1]
        growth[scenario] = {
            "from_num_live": lo["num_live"],
            "to_num_live": hi["num_live"],
            **{c: hi[c]["median_us"] / lo[c]["median_us"] for c in cols},
        }
    print("\nmedian cost ratio, largest / smallest context (1.0 = flat):")
    for scenario, g in sorted(growth.items()):
        ratios = ", ".join(f"{c} {g[c]:.2f}x" for c in cols)
        print(f"  {scenario} ({g['to_num_live']} vs {g['from_num_live']}): {ratios}")

    doc = {
        "benchmark": "bench_planner",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "processor": _cpu_model(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "cpu_count": os.cpu_count(),
        },
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "units": "microseconds per request-step (one eviction call), wall clock",
        "results": results,
        "growth_largest_over_smallest": growth,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
