"""Start and stop vLLM's OpenAI server in a subprocess: the one launcher of the tests, soak and benchmarks.

The server runs on 127.0.0.1, on a free port unless one is given, in its own process group
(``start_new_session``), with its stdout and stderr in a log file. :meth:`OpenAIServer.close`
(and leaving :func:`run_server`) sends SIGTERM to the whole group, waits up to 30 s, then
SIGKILLs what is left (the EngineCore and workers are in the group). Waiting for ``/health``
is bounded; every HTTP call has a timeout. ``PROMETHEUS_MULTIPROC_DIR`` is removed from the
server's environment so each server gets its own (vToken's metrics bridge makes one).

The command is ``python -m vllm.entrypoints.openai.api_server --model M ...`` or, with
``cli=True``, the user's command ``<venv>/bin/vllm serve M ...`` (vToken's console script).
This module starts processes only; it does not import vllm.
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
from pathlib import Path
from typing import Iterator, Optional, Sequence

import requests

__all__ = ["OpenAIServer", "free_port", "parse_metrics", "run_server", "server_argv", "start_server", "vllm_cli"]

START_TIMEOUT_S = 600  # ~30 s on an idle machine, minutes when the 2 cores are shared


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_cli() -> Path:
    """The ``vllm`` console script of this interpreter's environment (vToken's ``vtoken.cli:vllm_main``)."""
    return Path(sys.executable).parent / "vllm"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as ``{name{labels}: value}`` plus ``{name: sum over its label sets}``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        name, labels, val = m.group(1), m.group(2) or "", float(m.group(3))
        if labels:
            out[name + labels] = val
        out[name] = out.get(name, 0.0) + val
    return out


def server_argv(model: str, port: int, args: Sequence[str] = (), additional_config: Optional[dict] = None, *,
                served_model_name: Optional[str] = None, cli: bool = False) -> list[str]:
    """The server's command line: the module entry point, or ``<venv>/bin/vllm serve`` with ``cli``.

    ``args`` are further vLLM options; ``additional_config`` goes to ``--additional-config`` as JSON.
    """
    head = ([str(vllm_cli()), "serve", model] if cli
            else [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model])
    argv = head + (["--served-model-name", served_model_name] if served_model_name else [])
    argv += ["--host", "127.0.0.1", "--port", str(port), *args]
    if additional_config is not None:
        argv += ["--additional-config", json.dumps(additional_config)]
    return argv


class OpenAIServer:
    """A started OpenAI server process: ``url``, ``port``, ``proc``, ``argv``, ``log_path``.

    Create it with :func:`start_server` or :func:`run_server`.
    """

    def __init__(self, argv: list[str], port: int, log_path: Path, env: dict[str, str], cwd: Optional[Path] = None):
        self.argv, self.port, self.log_path = argv, port, Path(log_path)
        self.url = f"http://127.0.0.1:{port}"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._logf = open(self.log_path, "wb")
        self.t_start = time.monotonic()
        self.startup_s: Optional[float] = None
        self.proc = subprocess.Popen(argv, stdout=self._logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True, cwd=None if cwd is None else str(cwd))

    # ------------------------------------------------------------------ process
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> "OpenAIServer":
        """Poll ``/health`` until 200; sets ``startup_s``.

        Raises:
            RuntimeError: the process exited, or no 200 within ``timeout_s`` (with the log tail).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log tail:\n{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {timeout_s:.0f} s; log tail:\n{self.log()[-4000:]}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    self.startup_s = time.monotonic() - self.t_start
                    return self
            except requests.RequestException:
                pass
            time.sleep(1.0)

    def healthy(self) -> bool:
        """The process runs and ``/health`` answers 200 (10 s timeout)."""
        if self.proc.poll() is not None:
            return False
        try:
            return requests.get(self.url + "/health", timeout=10).status_code == 200
        except requests.RequestException:
            return False

    def close(self) -> None:
        """SIGTERM the process group, wait up to 30 s, SIGKILL what is left; idempotent."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:  # stragglers (EngineCore, workers) in the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if not self._logf.closed:
            self._logf.close()

    # ------------------------------------------------------------------ HTTP
    def post(self, path: str, body: dict, timeout: float = 180) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=timeout)

    def metrics_text(self) -> str:
        r = requests.get(self.url + "/metrics", timeout=30)
        r.raise_for_status()
        return r.text

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples (see :func:`parse_metrics`)."""
        return parse_metrics(self.metrics_text())


def start_server(model: str, log_path: Path, args: Sequence[str] = (), additional_config: Optional[dict] = None, *,
                 served_model_name: Optional[str] = None, port: Optional[int] = None, cli: bool = False,
                 env: Optional[dict[str, str]] = None, cwd: Optional[Path] = None,
                 server_cls: type = OpenAIServer) -> OpenAIServer:
    """Start the server (does not wait for it; call ``wait_healthy()``, and always ``close()``).

    Args:
        model: model directory. args: further vLLM options. additional_config: the
            ``--additional-config`` value (``{"vtoken": {...}}``), None for none.
        port: default a free port. cli: start ``<venv>/bin/vllm serve`` instead of the module.
        env: extra environment variables (on top of this process's; ``OMP_NUM_THREADS``
            defaults to 2). server_cls: an :class:`OpenAIServer` subclass to return.
    """
    port = port or free_port()
    e = dict(os.environ)
    e.setdefault("OMP_NUM_THREADS", "2")
    e.pop("PROMETHEUS_MULTIPROC_DIR", None)
    e.update(env or {})
    argv = server_argv(model, port, args, additional_config, served_model_name=served_model_name, cli=cli)
    return server_cls(argv, port, log_path, e, cwd)


@contextmanager
def run_server(model: str, log_path: Path, args: Sequence[str] = (), additional_config: Optional[dict] = None, *,
               start_timeout_s: float = START_TIMEOUT_S, **kwargs) -> Iterator[OpenAIServer]:
    """:func:`start_server`, wait for ``/health``, yield the server; always close it on exit."""
    srv = start_server(model, log_path, args, additional_config, **kwargs)
    try:
        srv.wait_healthy(start_timeout_s)
        yield srv
    finally:
        srv.close()
