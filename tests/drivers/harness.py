"""Offline harness: run requests through a real vLLM engine and report tokens and blocks.

The one engine runner of the integration tests, the reliability tests, the benchmarks and the
soak. It runs in its own process (``PYTHONPATH=tests python -m drivers.harness SPEC.json
OUT.json``) because a vLLM engine wants a fresh process, and because the plugin allow-list
(``VLLM_PLUGINS``) is read per process; the EngineCore runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the harness can read the block pool.

Spec (JSON)::

    {"engine": {LLM kwargs},            # model, dtype, block_size, num_gpu_blocks_override, ...
     "vtoken": {...} | null,            # additional_config["vtoken"]; null: no vtoken key
     "requests": [{"id": "r0", "prompt_token_ids": [...], "max_tokens": 64, "ignore_eos": true,
                   "extra_args": {...}, "abort_after_steps": 5, "arrive_at_step": 0,
                   "n": 1, "top_k": null, "temperature": 0.0}],   # n > 1: children in "children"
     "groups": [{"name": "g", "requests": [...]}],   # instead of "requests": batches run one
                                        # after another in the same engine, each from an idle engine
     "hooks": "path/to/file.py:Class",  # optional RunHooks subclass (instrumentation, faults)
     "check": true}                     # VTOKEN_CHECK: invariants after every step

Output (JSON), per group (with ``requests``: at the top level): ``tokens`` (request id ->
generated token ids), ``finish`` (id -> reason; ``"abort"`` for aborted ones),
``children`` (id -> every completion's token ids, in index order, for a request with ``n > 1``),
``free_blocks_start`` / ``free_blocks_end`` (the pool's free count at the group's ends),
``num_blocks``, ``steps``, ``wall_s``, ``max_running`` (most requests decoding together),
plus what the hooks add; with ``groups`` the output is ``{"groups": [{"name", ...}, ...]}``.
At the top level, when vToken is on: ``vtoken`` (scheduler stats and finished-request
lifetime figures). The hooks may add top-level keys too (:meth:`RunHooks.finish`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

__all__ = ["run_spec", "run_in_subprocess", "RunHooks", "GroupRun"]

MAX_STEPS = 20_000  # per group: a run that does not finish within this many steps is a bug


class GroupRun:
    """The state of one group while it runs, handed to :class:`RunHooks`.

    Attributes: ``engine`` (vLLM's ``LLMEngine``), ``sched`` (the EngineCore's scheduler),
    ``step`` (steps taken in this group so far), ``tokens``, ``finish`` (external request id ->
    token ids / finish reason), ``iid_of`` (external id -> vLLM's internal request id).
    """

    def __init__(self, engine, sched, name: Optional[str]):
        self.engine, self.sched, self.name = engine, sched, name
        self.step = 0
        self.tokens: dict[str, list[int]] = {}
        self.children: dict[str, list[list[int]]] = {}  # (filled at the end of the group)
        self.finish: dict[str, str] = {}
        self.iid_of: dict[str, str] = {}

    def abort(self, ext_id: str) -> None:
        """Abort a request now (between steps) and record its finish as ``"abort"``."""
        self.engine.abort_request([ext_id])
        self.finish[ext_id] = "abort"


class RunHooks:
    """Instrumentation points of :func:`run_spec` (all no-ops here); subclass to add faults or
    measurements. Named in the spec as ``"hooks": "path/to/file.py:Class"`` (loaded in the
    harness process), or passed to :func:`run_spec` directly."""

    def attach(self, engine, sched) -> None:
        """Once, after the engine is built."""

    def group_start(self, run: GroupRun) -> None:
        """At the start of each group (engine idle), before its first request is added."""

    def added(self, run: GroupRun, req: dict, iid: str) -> None:
        """Right after request ``req`` (its spec dict) was added as ``iid``, before the next step."""

    def before_step(self, run: GroupRun) -> None:
        """Right before each engine step; ``run.step`` is that step's index in the group."""

    def after_step(self, run: GroupRun) -> None:
        """After each engine step (``run.step`` already counts it), before ``abort_after_steps``
        aborts (a hook that aborts a request itself makes the harness skip it)."""

    def group_done(self, run: GroupRun) -> dict[str, Any]:
        """After a group ended (engine idle); extra keys for the group's output."""
        return {}

    def finish(self, out: dict[str, Any]) -> None:
        """At the end, with the whole output (add top-level keys in place)."""


def _load_hooks(ref: str) -> RunHooks:
    path, _, cls = ref.rpartition(":")
    mod_spec = importlib.util.spec_from_file_location(f"_vtoken_hooks_{Path(path).stem}", path)
    if not path or not cls or mod_spec is None or mod_spec.loader is None:
        raise ValueError(f"spec.hooks = {ref!r}: expected 'path/to/file.py:ClassName'")
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return getattr(mod, cls)()


def _run_group(engine, sched, pool, requests: list[dict], hooks: RunHooks, name: Optional[str] = None) -> dict:
    from vllm import SamplingParams

    run = GroupRun(engine, sched, name)
    free_start = pool.get_num_free_blocks()
    pending = sorted(requests, key=lambda r: r.get("arrive_at_step", 0))
    abort_at: dict[str, int] = {}
    n_of: dict[str, dict[int, list[int]]] = {}  # request id (n > 1) -> completion index -> token ids
    max_running = 0
    t0 = time.perf_counter()
    hooks.group_start(run)
    # A run that stops making progress (e.g. sampled tokens silently dropped) fails fast
    # instead of looping: every step computes at least one token, and no request computes more
    # than its prompt plus its output tokens (times 3: re-prefills after preemptions).
    max_steps = min(MAX_STEPS, 64 + 3 * sum(len(r["prompt_token_ids"]) + r.get("max_tokens", 64)
                                        + r.get("arrive_at_step", 0) + r.get("abort_after_steps", 0)
                                        for r in requests))
    while pending or engine.has_unfinished_requests():
        if run.step >= max_steps:
            raise RuntimeError(f"group {name!r} made no progress: not finished within {max_steps} steps; "
                               f"unfinished: {sorted(set(run.tokens) - set(run.finish))[:10]}")
        while pending and pending[0].get("arrive_at_step", 0) <= run.step:
            r = pending.pop(0)
            sp = SamplingParams(
                max_tokens=r.get("max_tokens", 64),
                n=r.get("n", 1),
                temperature=r.get("temperature", 0.0),
                **({"top_k": r["top_k"]} if r.get("top_k") is not None else {}),
                ignore_eos=r.get("ignore_eos", True),
                detokenize=False,
                extra_args=r.get("extra_args") or None,
            )
            iid = engine.add_request(r["id"], {"prompt_token_ids": r["prompt_token_ids"]}, sp)
            run.iid_of[r["id"]] = iid if isinstance(iid, str) else r["id"]
            run.tokens[r["id"]] = []
            if r.get("n", 1) > 1:
                n_of[r["id"]] = {}
            if "abort_after_steps" in r:
                abort_at[r["id"]] = run.step + r["abort_after_steps"]
            hooks.added(run, r, run.iid_of[r["id"]])
        if not engine.has_unfinished_requests():
            run.step += 1
            continue
        hooks.before_step(run)
        for o in engine.step():
            if run.finish.get(o.request_id) == "abort":
                continue
            run.tokens[o.request_id] = list(o.outputs[0].token_ids)
            if o.request_id in n_of:  # n > 1: each completion arrives under the parent's id, by index
                for c in o.outputs:
                    n_of[o.request_id][c.index] = list(c.token_ids)
            if o.finished:
                run.finish[o.request_id] = str(o.outputs[0].finish_reason)
        max_running = max(max_running, len(sched.running))
        run.step += 1
        hooks.after_step(run)
        for rid, at in list(abort_at.items()):
            if run.step >= at and rid not in run.finish:
                run.abort(rid)
                del abort_at[rid]
    wall = time.perf_counter() - t0
    run.children = {rid: [c[i] for i in sorted(c)] for rid, c in n_of.items()}
    # Let the aborted requests' frees reach the pool.
    for _ in range(3):
        if engine.has_unfinished_requests():
            engine.step()
    out: dict[str, Any] = dict(
        tokens=run.tokens,
        children=run.children,
        finish=run.finish,
        free_blocks_start=free_start,
        free_blocks_end=pool.get_num_free_blocks(),
        num_blocks=pool.num_gpu_blocks,
        steps=run.step,
        wall_s=wall,
        max_running=max_running,
    )
    out.update(hooks.group_done(run))
    return out


def run_spec(spec: dict[str, Any], hooks: Optional[RunHooks] = None) -> dict[str, Any]:
    """Run ``spec`` in this process (must be a fresh process; see module docstring).

    Args:
        spec: see the module docstring.
        hooks: instrumentation; default the spec's ``"hooks"`` entry, else none.
    Raises:
        RuntimeError: a group did not finish within ``MAX_STEPS`` steps.
        ValueError: a bad ``"hooks"`` reference.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ["VTOKEN_RECORD_FINISHED"] = "1"  # the finished requests' records (out["vtoken"]["finished"])
    if spec.get("check", True):
        os.environ["VTOKEN_CHECK"] = "1"
    if hooks is None:
        hooks = _load_hooks(spec["hooks"]) if spec.get("hooks") else RunHooks()
    from vllm import LLM

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
    hooks.attach(engine, sched)

    if "groups" in spec:
        out: dict[str, Any] = dict(groups=[dict(name=g["name"], **_run_group(engine, sched, pool, g["requests"], hooks,
                                                                            g["name"]))
                                           for g in spec["groups"]])
    else:
        out = _run_group(engine, sched, pool, spec["requests"], hooks)
    out["paths"] = _execution_path(llm, core)
    if hasattr(sched, "vt_stats"):
        out["vtoken"] = dict(stats=sched.vt_stats.as_dict(), finished=sched.vt_finished)
    hooks.finish(out)
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
    """Run ``spec`` in a fresh Python process (its own session) and return its output.

    Args:
        env: extra environment (e.g. ``{"VLLM_PLUGINS": ""}`` for stock vLLM without the plugin).

    Raises:
        RuntimeError: the run failed; the message holds the tail of its log.
        subprocess.TimeoutExpired: it ran longer than ``timeout`` seconds.
    """
    with tempfile.TemporaryDirectory() as d:
        sp, op = Path(d) / "spec.json", Path(d) / "out.json"
        sp.write_text(json.dumps(spec))
        e = dict(os.environ)
        e.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))
        e.pop("PROMETHEUS_MULTIPROC_DIR", None)  # in-process EngineCore: nothing to bridge
        if env:
            e.update(env)
        # this checkout's tests/drivers/ (and vtoken/) first, whatever the caller's directory
        here = Path(__file__).resolve().parents
        e["PYTHONPATH"] = os.pathsep.join([str(here[1]), str(here[2])] + [x for x in e.get("PYTHONPATH", "").split(os.pathsep) if x])
        p = subprocess.run([sys.executable, "-m", "drivers.harness", str(sp), str(op)],
                           env=e, capture_output=True, text=True, timeout=timeout, start_new_session=True)
        if p.returncode != 0 or not op.exists():
            tail = (p.stdout + p.stderr)[-6000:]
            raise RuntimeError(f"harness run failed (exit {p.returncode}):\n{tail}")
        return json.loads(op.read_text())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m drivers.harness SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    out = run_spec(spec)
    Path(argv[1]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
