"""The `make bench` driver: run every benchmark in benchmarks/ and print a summary table.

``--small`` runs each benchmark's small version (the whole set is sized for < 20 minutes on
2 CPU cores); without it each benchmark runs at its default (full) size. A benchmark whose
script is missing is skipped with a message; a failing one is reported and the rest still run
(exit status 1 if any failed). Each benchmark runs in its own process, one at a time.

Usage::

    python benchmarks/bench_all.py --small            # what `make bench` runs
    python benchmarks/bench_all.py --small --only sla overhead
    python benchmarks/bench_all.py --list
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# name -> (script, small args, full args, result files written by the small version)
BENCHMARKS: dict[str, tuple[str, list[str], list[str], list[str]]] = {
    # Kernel micro-benchmarks: their small runs write *_small.json so they never
    # overwrite the committed full results.
    "move": ("bench_move.py", ["--iters", "5", "--moves", "1", "64", "--out", str(RESULTS / "bench_move_small.json")],
             [], ["bench_move_small.json"]),
    "retained_blocks": ("bench_retained_blocks.py", ["--small"], [], []),
    "concurrency": ("bench_concurrency.py", ["--small"], [], []),
    "quality": ("bench_quality.py", ["--small"], [], []),
    "overhead": ("bench_overhead.py", ["--small"], [], ["overhead_small.json", "overhead_small.png"]),
    # bench_sla.py --small alone takes ~25 min on 2 loaded cores (the eviction arms decode slowly
    # on CPU), so the driver runs a one-rate smoke of it into sla_bench_all.json; the committed
    # small results come from `bench_sla.py --small` run on its own.
    "sla": ("bench_sla.py", ["--small", "--rates", "1", "--num-prompts", "8", "--output-len", "64",
                             "--unloaded-prompts", "2", "--name", "sla_bench_all"], [],
            ["sla_bench_all.json", "sla_bench_all.png"]),
}


def _headline(name: str) -> str:
    """A one-line headline from a known result file (best effort)."""
    try:
        if name == "sla":
            d = json.loads((RESULTS / "sla_bench_all.json").read_text())
            r = d["headline"]["ratios"]
            arms = ", ".join(f"{k} {v['sla_rate']}" for k, v in d["headline"]["per_arm"].items())
            return f"SLA rate (req/s): {arms}; vToken/Naive " + ", ".join(
                f"{p} {x['vtoken_over_naive']}" for p, x in r.items())
        if name == "overhead":
            d = json.loads((RESULTS / "overhead_small.json").read_text())
            return "; ".join(f"{m}: noevict x{r['noevict']['ratio_median']:.3f}, evict x{r['evict']['ratio_median']:.3f}"
                             for m, r in d["results"].items())
    except Exception as e:  # noqa: BLE001
        return f"(no headline: {e.__class__.__name__})"
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="small versions (about 6 min in all on 2 quiet cores)")
    ap.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), default=None)
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args(argv)
    names = a.only or list(BENCHMARKS)
    if a.list:
        for n in names:
            s, sm, full, _ = BENCHMARKS[n]
            print(f"{n:>16}: {s} {' '.join(sm if a.small else full)}  ({'present' if (HERE / s).exists() else 'missing'})")
        return 0

    py = sys.executable
    rows = []
    t_all = time.time()
    for n in names:
        script, small_args, full_args, _ = BENCHMARKS[n]
        path = HERE / script
        if not path.exists():
            print(f"[bench_all] {n}: {script} not found, skipped", flush=True)
            rows.append((n, "skipped (missing)", 0.0, ""))
            continue
        cmd = [py, str(path)] + (small_args if a.small else full_args)
        print(f"[bench_all] {n}: {' '.join(cmd)}", flush=True)
        t0 = time.time()
        p = subprocess.run(cmd, cwd=str(HERE.parent), env=dict(os.environ))
        dt = time.time() - t0
        status = "ok" if p.returncode == 0 else f"FAILED (exit {p.returncode})"
        rows.append((n, status, dt, _headline(n) if p.returncode == 0 and a.small else ""))
    total = time.time() - t_all

    print("\n" + "=" * 100)
    print(f"{'benchmark':>16} | {'status':<18} | {'wall':>7} | headline")
    print("-" * 100)
    for n, st, dt, hl in rows:
        print(f"{n:>16} | {st:<18} | {dt:6.0f}s | {hl}")
    print("-" * 100)
    print(f"{'total':>16} | {'':<18} | {total:6.0f}s |")
    if a.only is None:  # a whole run: keep its wall times (the README quotes the total)
        out = RESULTS / f"bench_all{'_small' if a.small else ''}.json"
        out.write_text(json.dumps(dict(command="python benchmarks/bench_all.py" + (" --small" if a.small else ""),
                                       date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), total_wall_s=round(total, 1),
                                       load_average_1_5_15=list(os.getloadavg()),
                                       runs=[dict(name=n, status=st, wall_s=round(dt, 1)) for n, st, dt, _ in rows]),
                                  indent=1))
        print(f"wrote {out}")
    return 1 if any(r[1].startswith("FAILED") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
