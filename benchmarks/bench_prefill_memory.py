"""Peak memory of prefill scoring (issue 15 item 7): one long prompt on SmolLM2, H2O vs stock.

H2O needs column sums over the whole prompt, so the prefill step scores every query row
against every key in every layer. Before tiling, that built ``[heads, q, n]`` float32 logits
per layer (plus a masked copy and the softmax): 9 heads x 4k x 4k x 4 B = 604 MB per temporary
at 4k tokens, 2.4 GB at 8k. ``prefill_stats`` now tiles over query rows (``TILE_ELEMS`` logits
per tile, 16 MiB).

Arms (each one engine in a fresh process; peak RSS of that process, which holds the in-process
EngineCore and the uniproc worker; ``ru_maxrss`` of the waited-for child):

* ``stock``: no ``vtoken`` key;
* ``h2o-tiled``: vToken on, H2O, budget 1024 (the current code);
* ``h2o-untiled``: the same with ``scoring.TILE_ELEMS`` raised so one tile holds the whole
  prompt (what the code did before; only at prompt lengths where it fits in memory).

One request, ``--prompt-len`` tokens prefilled in one step (``max_num_batched_tokens`` = the
prompt length, the worst case), 8 output tokens, bf16. The machine is shared: RSS is exact
per process, times are indicative. Writes ``benchmarks/results/prefill_memory.json``.

Usage::

    python benchmarks/bench_prefill_memory.py --prompt-len 4096 --arms stock h2o-tiled h2o-untiled
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine_info, run_metadata, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, subprocess, sys
spec, out, untiled = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
code = ("import sys, vtoken.integrations.vllm.worker.scoring as s\n"
        + ("s.TILE_ELEMS = 1 << 62\n" if untiled else "")
        + "from drivers.harness import main\nsys.exit(main(sys.argv[1:]))\n")
p = subprocess.run([sys.executable, "-c", code, spec, out])
print(json.dumps(dict(rc=p.returncode, maxrss_kb=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[4096])
    ap.add_argument("--arms", nargs="+", default=["stock", "h2o-tiled", "h2o-untiled"])
    ap.add_argument("--out", type=Path, default=RESULTS / "prefill_memory.json")
    a = ap.parse_args(argv)
    from vtoken.assets.paths import ensure_smollm2

    model = str(ensure_smollm2())
    res = dict(benchmark="bench_prefill_memory", meta=run_metadata(model="SmolLM2-135M-Instruct", dtype="bfloat16"),
               machine=machine_info(), note="shared 2-core machine: RSS exact per process, times indicative",
               runs=[])
    prev = json.loads(a.out.read_text())["runs"] if a.out.exists() else []
    for plen in a.prompt_len:
        for arm in a.arms:
            rng = random.Random(0)
            spec = dict(engine=dict(model=model, dtype="bfloat16", max_model_len=plen + 64, block_size=32,
                                    enforce_eager=True, gpu_memory_utilization=0.1, kv_cache_memory_bytes=512 << 20,
                                    max_num_batched_tokens=plen + 64, skip_tokenizer_init=True),
                        vtoken=None if arm == "stock" else {"policy": "h2o", "budget": 1024},
                        requests=[dict(id="long", prompt_token_ids=[rng.randrange(100, 49000) for _ in range(plen)],
                                       max_tokens=8)],
                        check=False)
            with tempfile.TemporaryDirectory() as d:
                sp, op = Path(d) / "spec.json", Path(d) / "out.json"
                sp.write_text(json.dumps(spec))
                env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
                t0 = time.time()
                p = subprocess.run([sys.executable, "-c", CHILD, str(sp), str(op), "1" if arm == "h2o-untiled" else "0"],
                                   env=env, capture_output=True, text=True)
                wall = time.time() - t0
                info = json.loads(p.stdout.strip().splitlines()[-1]) if p.stdout.strip() else dict(rc=p.returncode)
                out = json.loads(op.read_text()) if op.exists() else None
            run = dict(prompt_len=plen, arm=arm, rc=info.get("rc"), peak_rss_mib=info.get("maxrss_kb", 0) / 1024,
                       process_wall_s=wall, step_loop_s=out and out["wall_s"],
                       evicted_tokens=out and (out.get("vtoken") or {}).get("stats", {}).get("evicted_tokens"),
                       tokens=out and out["tokens"]["long"], load_average=list(os.getloadavg()))
            if info.get("rc") != 0:
                run["log_tail"] = (p.stdout + p.stderr)[-1500:]
            print(json.dumps({k: v for k, v in run.items() if k != "tokens"}), flush=True)
            prev = [r for r in prev if not (r["prompt_len"] == plen and r["arm"] == arm)] + [run]
            res["runs"] = prev
            write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
