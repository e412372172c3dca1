"""End-to-end helpers: the OpenAI server of the tests, started per module with the one launcher.

The launcher is :mod:`drivers.launcher` (also used by ``benchmarks/soak.py``
and ``benchmarks/bench_sla.py``): 127.0.0.1, a free port, its own process group killed at
teardown, a bounded wait for ``/health``. This module adds the tests' server shape (fp32,
eager, block size 32, a fixed KV pool) and greedy request helpers.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import requests

from drivers import launcher
from drivers.launcher import vllm_cli  # noqa: F401  (re-exported for the tests)

BLOCK_SIZE = 32
NUM_BLOCKS = 96  # >= max_model_len / block_size + 1 (vLLM's start-up check) with room for 4 requests
MODEL_NAME = "tiny"
START_TIMEOUT_S = 600  # engine start is ~30 s idle, minutes when the 2 cores are shared
HTTP_TIMEOUT_S = 180
#: the tests' server shape (vLLM options after --model/--host/--port)
SERVER_ARGS = [
    "--gpu-memory-utilization", "0.2", "--num-gpu-blocks-override", str(NUM_BLOCKS),
    "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048",
    "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "8",
    # Prefix caching is vLLM's default and vToken keeps it (issue 12). These servers compare
    # tokens and eviction counts with the dense oracle, which needs each request's protected
    # prefix (its cache hit); chat requests share the chat template's first tokens, so a hit
    # would shift it. They run without it; prefix caching with vToken is covered by
    # tests/integration/test_prefix_caching.py, tests/e2e/test_prefix_multiturn.py, the soak and the README demo
    # (tests/e2e/test_vllm_serve.py::test_readme_demo_frees_blocks: make serve's command, with
    # vLLM's default on).
    "--no-enable-prefix-caching",
]


class Server(launcher.OpenAIServer):
    """A running OpenAI server (``url``, ``proc``, ``log_path``) with the tests' request helpers."""

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


@contextmanager
def run_server(model: str, log_path: Path, additional_config: Optional[dict] = None, *,
               cli: bool = False) -> Iterator[Server]:
    """Start the tests' server (``--served-model-name tiny``, :data:`SERVER_ARGS`), wait for
    ``/health``; kill its process group on exit. ``cli``: start it as ``<venv>/bin/vllm serve``."""
    with launcher.run_server(model, log_path, SERVER_ARGS, additional_config, served_model_name=MODEL_NAME, cli=cli,
                             env=dict(OMP_NUM_THREADS="2", VLLM_LOGGING_LEVEL="INFO"),
                             start_timeout_s=START_TIMEOUT_S, server_cls=Server) as srv:
        yield srv


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expected_counters(res, bs: int = BLOCK_SIZE) -> dict[str, int]:
    """Counter increments one request must cause, replayed from an oracle result.

    Blocks: the prefill allocates ceil(P/B); before decode step i the scheduler evicts
    ``k_i`` tokens and keeps ceil((live + 1)/B) blocks, room for the step's token (the rest
    are freed); a step's token may need one more block.
    """
    held = _cdiv(res.prompt_len, bs)
    freed = 0
    for i in range(1, len(res.token_ids)):
        k = len(res.evicted_positions[i])
        if k:
            keep = _cdiv(res.num_live[i - 1] - k + 1, bs)
            freed += held - keep
            held = keep
        held = max(held, _cdiv(res.num_live[i], bs))
    return dict(evicted_tokens=res.num_evicted, evictions=sum(1 for e in res.evicted_positions if len(e)),
                freed_blocks=freed)
