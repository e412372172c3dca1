"""Longest prompt served in a fixed KV pool (issue 25): stock vLLM, Naive-Evict, vToken ``after`` and
vToken ``chunks``.

Method: SmolLM2-135M (bf16, its 8,192 positions), a pool of ``--blocks`` blocks of 32 tokens
(``--num-gpu-blocks-override``; one block is vLLM's null block), chunked prefill with
``--chunk`` tokens per step, H2O at ``--budget`` (slack 0). For each arm and each prompt length of
the grid (ascending: half the pool, the pool less two blocks, twice and four times the pool, capped
by the model's positions), a fresh engine (``tests/drivers/harness.py``) with ``max_model_len`` = prompt
+ ``--new`` tokens gets one request of that length; the length is served when the request ends
with all its ``--new`` tokens. The arm stops at its first failure and records the reason (vLLM's
start-up capacity check, or the request never fitting). Naive-Evict runs under ``decide_on:
scheduler`` (as when this result was made; the worker path runs ``mode: naive`` too now); ``after``
and ``chunks`` under ``decide_on: worker``.

Writes ``benchmarks/results/longest_prompt.json``. Usage::

    python benchmarks/bench_longest_prompt.py
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from tqdm import tqdm  # noqa: E402

from common import run_metadata, write_json  # noqa: E402
from drivers.harness import run_in_subprocess  # noqa: E402


def _prompt(n: int) -> list[int]:
    return [(j * 7919 + 13) % 48000 + 100 for j in range(n)]


def arms(budget: int) -> list[tuple[str, object]]:
    h2o = {"policy": "h2o", "budget": budget, "slack": 0}
    return [("stock", None), ("naive", dict(h2o, mode="naive", prefill_eviction="after")),
            ("vtoken_after", dict(h2o, prefill_eviction="after")),
            ("vtoken_chunks", dict(h2o, prefill_eviction="chunks"))]


def try_length(vt, length: int, args) -> dict:
    from vtoken.assets.paths import smollm2_dir

    engine = dict(model=str(smollm2_dir()), dtype="bfloat16", max_model_len=length + args.new, block_size=32,
                  enforce_eager=True, gpu_memory_utilization=0.1, num_gpu_blocks_override=args.blocks,
                  skip_tokenizer_init=True, enable_prefix_caching=False, max_num_batched_tokens=args.chunk,
                  max_num_seqs=4, enable_chunked_prefill=True)
    req = dict(id="p", prompt_token_ids=_prompt(length), max_tokens=args.new)
    try:
        out = run_in_subprocess(dict(engine=engine, vtoken=vt, requests=[req], check=False), timeout=1200)
    except RuntimeError as e:  # the engine did not start, or the run failed
        msg = str(e)
        reason = ("start-up: the pool cannot hold max_model_len" if "max seq len" in msg
                  else msg.strip().splitlines()[-1][:300])
        return dict(length=length, served=False, reason=reason)
    got = len(out["tokens"].get("p", []))
    res = dict(length=length, served=got == args.new, wall_s=out.get("wall_s"), steps=out.get("steps"))
    fin = (out.get("vtoken") or {}).get("finished") or []
    if fin:
        res.update(peak_blocks=fin[0]["peak_blocks"], evicted=fin[0]["evicted"])
    if got != args.new:
        res["reason"] = f"{got} of {args.new} tokens ({out['finish'].get('p')})"
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "longest_prompt.json"))
    args = ap.parse_args(argv)
    pool = (args.blocks - 1) * 32
    grid = sorted({pool // 2, pool - 64, min(2 * pool, 8192 - args.new), min(4 * pool, 8192 - args.new) - 64})
    results = []
    for name, vt in tqdm(arms(args.budget), desc="arms", unit="arm"):
        runs = []
        for length in grid:
            r = try_length(vt, length, args)
            runs.append(r)
            print(name, r, flush=True)
            if not r["served"]:
                break
        served = [r["length"] for r in runs if r["served"]]
        results.append(dict(arm=name, vtoken=vt, runs=runs, longest_served=max(served, default=0)))
    write_json(Path(args.out), dict(meta=run_metadata(), args=vars(args), pool_tokens=pool, grid=grid,
                                    arms=results, load_average_1m=os.getloadavg()[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
