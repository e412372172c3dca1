"""Prefix caching with vToken on the OpenAI server: multi-turn ShareGPT chats (issues 12, 24).

Method:

* One OpenAI server per arm (SmolLM2-135M, bf16, 127.0.0.1, ``--enable-prefix-caching``
  explicit, a fixed pool of ``--num-gpu-blocks-override`` blocks of 32 tokens), started one at
  a time. Arms: ``stock`` (no ``vtoken`` key); ``vtoken`` (H2O: it needs the prompt's
  statistics, so a request keeps its cache hit, docs/integration.md, "Prefix caching");
  ``vtoken_tova``: a policy that needs no prompt statistics, so a first eviction copies the cached
  blocks it writes; ``vtoken_skip`` (H2O, ``prefix_hits: skip``: a request whose hit H2O would
  keep computes its prompt instead, so its tokens never depend on the cache);
  ``vtoken_keydiff`` (KeyDiff: a request copies its hit into private
  blocks when it starts); ``vtoken_protect_prompt`` (H2O, ``protect_cached_prefix: true``), all
  at ``--budget``.
* Workload: ``--conversations`` ShareGPT conversations with at least ``--turns`` user turns,
  each user turn cut to ``--turn-chars`` characters, all starting with the same system prompt
  (a shared prefix across conversations). The conversations run concurrently (one thread
  each); each turn is a ``/v1/chat/completions`` request whose messages are the whole history
  (previous user turns and the server's own replies), ``max_tokens`` fixed with
  ``ignore_eos`` and greedy sampling, so every arm does the same number of steps.
* Prefix-cache hit rate: the deltas of ``vllm:prefix_cache_hits_total`` /
  ``vllm:prefix_cache_queries_total`` over the run (vLLM's own counters; 0 when no request looked
  the cache up, ``vtoken:prefix_reads_skipped_total``). Retained blocks:
  ``vllm:kv_cache_usage_perc`` x (pool - 1) polled every 0.2 s (blocks held by running
  requests; cached free blocks count as free), mean and peak; for the vToken arms also
  ``vtoken:retained_blocks`` (sum over requests' block lists; a shared block counts per
  sharer). Copy cost: ``vtoken:unshared_blocks_total`` (cached blocks copied into private ones
  at a first eviction) and the bytes they are (every layer's K and V of a block, from the model
  config), and ``vtoken:unshare_deferred_total``; and each arm's wall time (one sample: an
  indication).

Writes ``benchmarks/results/prefix_cache_sharegpt.json``.

Usage::

    python benchmarks/bench_prefix_cache.py                 # 4 conversations x 4 turns
    python benchmarks/bench_prefix_cache.py --conversations 8 --turns 6
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from tqdm import tqdm  # noqa: E402

from bench_sla import scrape  # noqa: E402
from common import run_metadata, write_json  # noqa: E402

SYSTEM = ("You are a helpful, precise assistant for a software company. Answer in plain English, keep "
          "answers short, cite the user's own words when you disagree, never invent facts, and say so "
          "when you do not know. Use lists for steps, code blocks for code, and no more than three "
          "paragraphs. Be polite, be direct, and do not repeat the question back to the user.")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (loopback only)
        return json.loads(r.read())


def conversations(n: int, turns: int, turn_chars: int) -> list[list[str]]:
    """``n`` ShareGPT conversations' first ``turns`` user turns (each cut to ``turn_chars``)."""
    from vtoken.assets.paths import ensure_sharegpt, sharegpt_path

    ensure_sharegpt()
    out = []
    for conv in json.load(open(sharegpt_path())):
        users = [t["value"][:turn_chars] for t in conv.get("conversations", [])
                 if t.get("from") in ("human", "user") and t.get("value", "").strip()]
        if len(users) >= turns:
            out.append(users[:turns])
            if len(out) == n:
                break
    return out


def _block_bytes(block_size: int = 32, dtype_bytes: int = 2) -> int:
    """Bytes of one KV block of the served model (bf16): every layer's K and V."""
    from vtoken.assets.paths import smollm2_dir

    c = json.loads((Path(smollm2_dir()) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * block_size * dtype_bytes


def copy_cost(num_blocks: int, copies: int = 4, reps: int = 30) -> dict:
    """Time of the K/V part of ``WorkerStep.copy_blocks`` on this CPU for the served model:
    ``copies`` blocks copied in every layer through the probed CPU layout (``move_tokens``, as the
    worker does), median of ``reps`` (ms). The worker's side caches add a few
    bytes per slot and are left out."""
    import statistics

    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vtoken.assets.paths import smollm2_dir
    from vtoken.integrations.vllm.worker.kv_layout import cpu_kv_layout

    c = json.loads((Path(smollm2_dir()) / "config.json").read_text())
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    heads, layers, bs = c["num_key_value_heads"], c["num_hidden_layers"], 32
    isa = _get_attn_isa(torch.bfloat16, bs, hd)
    lay = cpu_kv_layout(torch.bfloat16, isa, bs, hd, heads)
    caches = [torch.randn(num_blocks, heads, bs, 2 * hd).to(torch.bfloat16) for _ in range(layers)]
    offs = torch.arange(bs)
    src = (torch.arange(copies)[:, None] * bs + offs).reshape(-1)
    dst = ((torch.arange(copies) + copies)[:, None] * bs + offs).reshape(-1)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for kv in caches:
            lay.move_tokens(kv, src, dst)
        times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(times)
    return dict(copies=copies, layers=layers, isa=isa, ms_median=ms, ms_per_block=ms / copies,
                bytes_per_block=_block_bytes(bs))


def run_arm(name: str, vt, args, convs) -> dict:
    from vtoken.assets.paths import smollm2_dir

    port = _port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(smollm2_dir()),
            "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
            "--num-gpu-blocks-override", str(args.blocks), "--block-size", "32", "--max-model-len", "4096",
            "--enforce-eager", "--enable-prefix-caching", "--max-num-seqs", "16", "--gpu-memory-utilization", "0.1"]
    if vt is not None:
        argv += ["--additional-config", json.dumps({"vtoken": vt})]
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 2))
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    log = open(ROOT / "benchmarks" / "results" / f".prefix_cache_{name}.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name}: server exited with {proc.returncode}")
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:  # noqa: S310
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() - t0 > 600:
                raise RuntimeError(f"{name}: server not healthy after 600 s")
            time.sleep(1.0)
        m0 = scrape(port)
        samples: dict[str, list[float]] = {"blocks": [], "vtoken_retained": []}
        halt = threading.Event()

        def poll():
            while not halt.is_set():
                try:
                    s = scrape(port)
                    samples["blocks"].append(s.get("vllm:kv_cache_usage_perc", 0.0) * (args.blocks - 1))
                    if "vtoken:retained_blocks" in s:
                        samples["vtoken_retained"].append(s["vtoken:retained_blocks"])
                except Exception:  # noqa: BLE001
                    pass
                halt.wait(0.2)

        def chat(turns: list[str], out: list):
            msgs = [{"role": "system", "content": SYSTEM}]
            for u in turns:
                msgs.append({"role": "user", "content": u})
                r = _post(port, {"model": "smollm2", "messages": msgs, "max_tokens": args.max_tokens,
                                 "temperature": 0, "ignore_eos": True})
                msgs.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
                out.append(r["usage"]["prompt_tokens"])

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        t1 = time.monotonic()
        prompt_tokens: list[int] = []
        threads = [threading.Thread(target=chat, args=(c, prompt_tokens)) for c in convs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t1
        halt.set()
        poller.join(timeout=5)
        m1 = scrape(port)
        d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
        hits, queries = d.get("vllm:prefix_cache_hits_total", 0.0), d.get("vllm:prefix_cache_queries_total", 0.0)
        res = dict(arm=name, vtoken=vt, requests=len(prompt_tokens), prompt_tokens=sum(prompt_tokens),
                   prefix_cache_hits=hits, prefix_cache_queries=queries,
                   # (no lookup at all, prefix_hits skip: nothing hit)
                   prefix_cache_hit_rate=hits / queries if queries else 0.0, wall_s=wall,
                   blocks_mean=sum(samples["blocks"]) / max(len(samples["blocks"]), 1),
                   blocks_peak=max(samples["blocks"], default=0.0),
                   evicted_tokens=d.get("vtoken:evicted_tokens_total"), freed_blocks=d.get("vtoken:freed_blocks_total"),
                   unshared_blocks=d.get("vtoken:unshared_blocks_total"),
                   unshared_bytes=None if vt is None else d.get("vtoken:unshared_blocks_total", 0.0) * _block_bytes(),
                   unshare_deferred=d.get("vtoken:unshare_deferred_total"),
                   prefix_reads_skipped=d.get("vtoken:prefix_reads_skipped_total"))
        if samples["vtoken_retained"]:
            res["vtoken_retained_blocks_mean"] = sum(samples["vtoken_retained"]) / len(samples["vtoken_retained"])
            res["vtoken_retained_blocks_peak"] = max(samples["vtoken_retained"])
        print(json.dumps(res))
        return res
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-chars", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prefix_cache_sharegpt.json"))
    args = ap.parse_args(argv)
    convs = conversations(args.conversations, args.turns, args.turn_chars)
    vt = {"policy": "h2o", "budget": args.budget}
    arms = [("stock", None), ("vtoken", vt), ("vtoken_tova", dict(vt, policy="tova")),
            ("vtoken_skip", dict(vt, prefix_hits="skip")),
            ("vtoken_keydiff", dict(vt, policy="keydiff")),
            ("vtoken_protect_prompt", dict(vt, protect_cached_prefix=True))]
    results = []
    for name, cfg in tqdm(arms, desc="arms", unit="server"):
        results.append(run_arm(name, cfg, args, convs))
    cost = copy_cost(args.blocks)
    for r in results:  # the copies' time over the run, from the measured time per block
        if r["unshared_blocks"] is not None:
            r["copy_ms_est"] = r["unshared_blocks"] * cost["ms_per_block"]
    write_json(Path(args.out), dict(meta=run_metadata(), args=vars(args), system_prompt_chars=len(SYSTEM),
                                    arms=results, copy_cost=cost, load_average_1m=os.getloadavg()[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
