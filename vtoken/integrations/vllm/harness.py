"""Offline harness: run a batch of requests through a real vLLM engine and report tokens and blocks.

Used by the integration tests, the benchmarks and the soak. It runs in its own process
(``python -m vtoken.integrations.vllm.harness SPEC.json OUT.json``) because a vLLM
engine wants a fresh process, and because the plugin allow-list (``VLLM_PLUGINS``) is
read per process; the EngineCore runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
so the harness can read the block pool.

Spec (JSON)::

    {"engine": {LLM kwargs},            # model, dtype, block_size, num_gpu_blocks_override, ...
     "vtoken": {...} | null,            # additional_config["vtoken"]; null: no vtoken key
     "requests": [{"id": "r0", "prompt_token_ids": [...], "max_tokens": 64,
                   "extra_args": {...}, "abort_after_steps": 5, "arrive_at_step": 0}],
     "check": true}                     # VTOKEN_CHECK: invariants after every step

Output (JSON): ``tokens`` (request id -> generated token ids), ``finish`` (id -> reason),
``free_blocks_start`` / ``free_blocks_end``, ``num_blocks``, ``steps``, ``vtoken``
(scheduler stats and finished-request lifetime figures, when vToken is on),
``max_running`` (most requests decoding together).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["run_spec", "run_in_subprocess"]


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``spec`` in this process (must be a fresh process; see module docstring)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if spec.get("check", True):
        os.environ["VTOKEN_CHECK"] = "1"
    from vllm import LLM, SamplingParams

    kw = dict(spec["engine"])
    kw.setdefault("seed", 0)
    kw.setdefault("enable_prefix_caching", False)
    if spec.get("vtoken") is not None:
        kw["additional_config"] = {"vtoken": spec["vtoken"]}
    llm = LLM(**kw)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # InprocClient -> EngineCore
    sched = core.scheduler
    pool = sched.kv_cache_manager.block_pool
    free_start = pool.get_num_free_blocks()

    pending = sorted(spec["requests"], key=lambda r: r.get("arrive_at_step", 0))
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    abort_at: dict[str, int] = {}
    step = 0
    max_running = 0
    t0 = time.perf_counter()
    # A run that stops making progress (e.g. sampled tokens silently dropped) fails fast
    # instead of looping: no request needs more steps than its prompt plus its output tokens.
    max_steps = spec.get("max_steps") or 64 + sum(
        len(r["prompt_token_ids"]) + r.get("max_tokens", 64) + r.get("arrive_at_step", 0) for r in spec["requests"])
    while pending or engine.has_unfinished_requests():
        if step > max_steps:
            raise RuntimeError(f"harness: no progress after {step} engine steps (bound {max_steps}); "
                               f"unfinished: {sorted(set(tokens) - set(finish))[:10]}")
        while pending and pending[0].get("arrive_at_step", 0) <= step:
            r = pending.pop(0)
            sp = SamplingParams(
                max_tokens=r.get("max_tokens", 64),
                temperature=0.0,
                ignore_eos=r.get("ignore_eos", True),
                detokenize=False,
                extra_args=r.get("extra_args") or None,
            )
            engine.add_request(r["id"], {"prompt_token_ids": r["prompt_token_ids"]}, sp)
            tokens[r["id"]] = []
            if "abort_after_steps" in r:
                abort_at[r["id"]] = step + r["abort_after_steps"]
        if not engine.has_unfinished_requests():
            step += 1
            continue
        for o in engine.step():
            tokens[o.request_id] = list(o.outputs[0].token_ids)
            if o.finished:
                finish[o.request_id] = str(o.outputs[0].finish_reason)
        max_running = max(max_running, len(sched.running))
        step += 1
        for rid, at in list(abort_at.items()):
            if step >= at and rid not in finish:
                engine.abort_request([rid])
                finish[rid] = "abort"
                del abort_at[rid]
    wall = time.perf_counter() - t0
    # Let the aborted requests' frees reach the pool.
    for _ in range(3):
        if engine.has_unfinished_requests():
            engine.step()
    out: dict[str, Any] = dict(
        tokens=tokens,
        finish=finish,
        free_blocks_start=free_start,
        free_blocks_end=pool.get_num_free_blocks(),
        num_blocks=pool.num_gpu_blocks,
        steps=step,
        wall_s=wall,
        max_running=max_running,
        paths=_execution_path(llm, core),
    )
    if hasattr(sched, "vt_stats"):
        out["vtoken"] = dict(stats=sched.vt_stats.as_dict(), finished=sched.vt_finished)
    return out


def _execution_path(llm, core) -> dict[str, Any]:
    """Which scheduler, model runner and scheduling mode the engine actually runs."""
    vc = llm.llm_engine.vllm_config
    runner = None
    try:
        runner = type(core.model_executor.driver_worker.worker.model_runner)
    except AttributeError:  # multiprocess executor: the runner lives in another process
        pass
    return dict(
        scheduler=f"{type(core.scheduler).__module__}.{type(core.scheduler).__qualname__}",
        runner=None if runner is None else f"{runner.__module__}.{runner.__qualname__}",
        use_v2_model_runner=bool(vc.use_v2_model_runner),
        async_scheduling=bool(vc.scheduler_config.async_scheduling),
        batch_queue=core.batch_queue_size,
    )


def run_in_subprocess(spec: dict[str, Any], *, env: dict[str, str] | None = None, timeout: float = 900) -> dict[str, Any]:
    """Run ``spec`` in a fresh Python process and return its output.

    Args:
        env: extra environment (e.g. ``{"VLLM_PLUGINS": ""}`` for stock vLLM without the plugin).

    Raises:
        RuntimeError: the run failed; the message holds the tail of its log.
    """
    with tempfile.TemporaryDirectory() as d:
        sp, op = Path(d) / "spec.json", Path(d) / "out.json"
        sp.write_text(json.dumps(spec))
        e = dict(os.environ)
        e.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))
        if env:
            e.update(env)
        p = subprocess.run([sys.executable, "-m", "vtoken.integrations.vllm.harness", str(sp), str(op)],
                           env=e, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0 or not op.exists():
            tail = (p.stdout + p.stderr)[-6000:]
            raise RuntimeError(f"harness run failed (exit {p.returncode}):\n{tail}")
        return json.loads(op.read_text())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m vtoken.integrations.vllm.harness SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    out = run_spec(spec)
    Path(argv[1]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
