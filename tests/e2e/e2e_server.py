"""End-to-end helpers: start an OpenAI server (``vllm.entrypoints.openai.api_server``) per module.

Every server runs on 127.0.0.1 on a free port, in its own process group, with the
CPU settings vToken's tests use (fp32, eager, block size 32, a fixed KV pool); the
fixture waits for ``/health`` (bounded) and always kills the whole group at teardown.
Every HTTP call has a timeout, every loop a bound.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import requests


BLOCK_SIZE = 32
NUM_BLOCKS = 96  # >= max_model_len / block_size + 1 (vLLM's start-up check) with room for 4 requests
MODEL_NAME = "tiny"
START_TIMEOUT_S = 600  # engine start is ~30 s idle, minutes when the 2 cores are shared
HTTP_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A running OpenAI server: its base URL, process and log file."""

    url: str
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    # ------------------------------------------------------------------ HTTP
    def post(self, path: str, body: dict, timeout: float = HTTP_TIMEOUT_S) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=timeout)

    def metrics_text(self) -> str:
        r = requests.get(self.url + "/metrics", timeout=30)
        r.raise_for_status()
        return r.text

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples as ``{name{labels}: value}`` and ``{name: sum over label sets}``."""
        out: dict[str, float] = {}
        for line in self.metrics_text().splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)", line)
            if not m:
                continue
            name, labels, val = m.group(1), m.group(2) or "", float(m.group(3))
            out[name + labels] = val
            out[name] = out.get(name, 0.0) + val
        return out

    def generate(self, kind: str, prompt: str, max_tokens: int, *, stream: bool = False,
                 xargs: Optional[dict] = None) -> tuple[list[int], list[int]]:
        """One greedy request; returns ``(prompt_token_ids, output_token_ids)``.

        ``kind`` is ``"completion"`` (/v1/completions) or ``"chat"`` (/v1/chat/completions,
        the prompt as one user message). EOS is ignored so every request yields ``max_tokens``.
        """
        body: dict[str, Any] = dict(model=MODEL_NAME, max_tokens=max_tokens, temperature=0.0,
                                    ignore_eos=True, return_token_ids=True, stream=stream)
        if xargs is not None:
            body["vllm_xargs"] = xargs
        if kind == "completion":
            path, body["prompt"] = "/v1/completions", prompt
        else:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        if not stream:
            r = self.post(path, body)
            assert r.status_code == 200, r.text
            js = r.json()
            ch = js["choices"][0]
            prompt_ids = js.get("prompt_token_ids") or ch.get("prompt_token_ids")
            return list(prompt_ids), list(ch["token_ids"])
        prompt_ids: Optional[list[int]] = None
        out: list[int] = []
        with requests.post(self.url + path, json=body, stream=True, timeout=HTTP_TIMEOUT_S) as r:
            assert r.status_code == 200, r.text
            for n, raw in enumerate(r.iter_lines(decode_unicode=True)):
                assert n < 100 * max_tokens + 100, "stream did not end"
                if not raw or not raw.startswith("data: "):
                    continue
                data = raw[len("data: "):]
                if data == "[DONE]":
                    break
                js = json.loads(data)
                if js.get("prompt_token_ids") is not None and prompt_ids is None:
                    prompt_ids = list(js["prompt_token_ids"])
                for ch in js.get("choices", []):
                    if ch.get("prompt_token_ids") is not None and prompt_ids is None:
                        prompt_ids = list(ch["prompt_token_ids"])
                    out.extend(ch.get("token_ids") or [])
        assert prompt_ids is not None, "no prompt_token_ids in the stream"
        return prompt_ids, out


def vllm_cli() -> Path:
    """The ``vllm`` console script of this interpreter's environment (vToken's ``vtoken.cli:vllm_main``)."""
    return Path(sys.executable).parent / "vllm"


def server_argv(model: str, port: int, additional_config: Optional[dict], *, cli: bool = False) -> list[str]:
    """The server's command line: ``python -m vllm.entrypoints.openai.api_server --model M ...``,
    or with ``cli`` the user's command ``<venv>/bin/vllm serve M ...``."""
    head = ([str(vllm_cli()), "serve", model] if cli
            else [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model])
    argv = head + [
        "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--gpu-memory-utilization", "0.2", "--num-gpu-blocks-override", str(NUM_BLOCKS),
        "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048",
        "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "8",
    ]
    if additional_config is not None:
        argv += ["--additional-config", json.dumps(additional_config)]
    return argv


@contextmanager
def run_server(model: str, log_path: Path, additional_config: Optional[dict] = None, *,
               cli: bool = False) -> Iterator[Server]:
    """Start the OpenAI server, wait for ``/health``; kill its process group on exit.

    ``cli``: start it as ``<venv>/bin/vllm serve`` (see :func:`server_argv`).
    """
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="2", VLLM_LOGGING_LEVEL="INFO")
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    logf = open(log_path, "wb")
    proc = subprocess.Popen(server_argv(model, port, additional_config, cli=cli), stdout=logf, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    srv = Server(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; log tail:\n{srv.log()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {START_TIMEOUT_S} s; log tail:\n{srv.log()[-4000:]}")
            try:
                if requests.get(srv.url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(1.0)
        yield srv
    finally:
        _kill_group(proc)
        logf.close()


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:  # stragglers (EngineCore) in the group
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expected_counters(res, bs: int = BLOCK_SIZE) -> dict[str, int]:
    """Counter increments one request must cause, replayed from an oracle result.

    Blocks: the prefill allocates ceil(P/B); before decode step i the scheduler evicts
    ``k_i`` tokens and keeps ceil(live/B) blocks (the rest are freed), then the step's
    token may need one more block.
    """
    held = _cdiv(res.prompt_len, bs)
    freed = 0
    for i in range(1, len(res.token_ids)):
        k = len(res.evicted_positions[i])
        if k:
            keep = _cdiv(res.num_live[i - 1] - k, bs)
            freed += held - keep
            held = keep
        held = max(held, _cdiv(res.num_live[i], bs))
    return dict(evicted_tokens=res.num_evicted, evictions=sum(1 for e in res.evicted_positions if len(e)),
                freed_blocks=freed)
