"""Task accuracy under eviction: RULER's synthetic tasks through lm-evaluation-harness, offline.

Per arm one ``vllm serve`` (``drivers.launcher``: its own process group, always killed at the
end) on SmolLM2-135M-Instruct, prefix caching off in every arm: ``stock`` (no ``vtoken`` key),
then each policy at budgets of 12.5 %, 25 % and 50 % of the prompt (``budget_ratio``: the budget
is ``ceil(ratio * prompt tokens)`` of each request, so one server serves every context length).
Against each server, per (task, context length), one ``lm_eval run --model local-completions``
(a subprocess: this module never imports lm_eval) with the chat template applied, greedy, the
tokenizer and RULER's generated data from the local SmolLM2 directory; accuracy is scored here
from lm-eval's logged samples (:func:`score_sample`: the fraction of the reference strings found
in the answer, RULER's ``string_match_all``), and lm-eval's own figure is kept beside it.

KV cache kept, measured per cell from the server's ``/metrics`` (deltas over the cell): tokens a
request holds at its end, ``(prompt + generated - evicted) / requests`` (``vllm:request_prompt_tokens``,
``vllm:request_generation_tokens``, ``vtoken:evicted_tokens_total``), as a fraction of stock's in
the same cell; also the mean of ``vtoken:request_peak_blocks`` (with ``prefill_eviction after``
the peak is the whole prompt: the cut comes at the first decode step).

Offline: the six tasks of :data:`TASKS` generate their data locally (lm-eval's RULER code with
the SmolLM2 tokenizer). Left out (:data:`LEFT_OUT`): the tasks whose haystack or questions come
from the network.

Writes ``benchmarks/results/<name>.json`` (default ``tasks``; ``--small``: ``tasks_smoke``) and a
kvpress-style plot ``<name>.png`` (accuracy against KV kept, one line per policy, one panel per
task and length).

Usage::

    .venv/bin/python benchmarks/bench_tasks.py --small      # stock + H2O 25 %, niah_single_1 at 1k, 20 samples
    .venv/bin/python benchmarks/bench_tasks.py              # full: 6 tasks at 1k: stock, then every policy x 3
                                                            # budgets where stock reaches 60 %; 50 samples a cell
    .venv/bin/python benchmarks/bench_tasks.py --tasks ruler_vt --lengths 1024 --policies h2o tova --limit 10
    .venv/bin/python benchmarks/bench_tasks.py --policies --variant 'request:h2o,snapkv:{"granularity": "request"}'
                                                            # stock, then H2O and SnapKV with request token sets
"""

from __future__ import annotations

import argparse
import datetime as _dt
import glob
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tests/drivers/
sys.path.insert(0, str(HERE))

#: RULER's synthetic tasks that run offline (lm-eval task names)
TASKS = ["niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe"]
#: RULER tasks left out, and why (each needs the network)
LEFT_OUT = {
    "niah_single_2": "essay haystack: Paul Graham essays downloaded at data generation (+ nltk punkt_tab)",
    "niah_single_3": "essay haystack (downloaded)",
    "niah_multikey_1": "essay haystack (downloaded)",
    "niah_multivalue": "essay haystack (downloaded)",
    "niah_multiquery": "essay haystack (downloaded)",
    "ruler_qa_squad": "SQuAD questions and passages from the Hugging Face hub",
    "ruler_qa_hotpot": "HotpotQA questions and passages from the Hugging Face hub",
}
RATIOS = [0.125, 0.25, 0.5]
#: the full run's policies: every built-in one (``vtoken.policies.available_policies``, sorted)
POLICIES = ["expected_attention", "h2o", "keydiff", "knorm", "observed_attention", "random", "scissorhands",
            "snapkv", "streaming", "tova"]
#: the full run's context lengths: 1k only, so that stock on the six tasks and every policy at three
#: budgets fit ``make bench-tasks``'s 90 minutes on two cores (2k and 4k: ``--lengths``, ``--heatmap``)
LENGTHS = [1024]
SMALL = dict(tasks=["niah_single_1"], lengths=[1024], policies=["h2o"], ratios=[0.25], limit=20)
#: ``--heatmap``: the needle heatmap (accuracy by needle depth x context length) for the default
#: policy (H2O) and the best attention-based one at 25 % in a 1k run (TOVA)
HEATMAP = dict(tasks=["niah_single_1"], lengths=[1024, 2048, 4096], policies=["h2o", "tova"], ratios=[0.25],
               limit=40)
#: needle-depth bins of the heatmap (fractions of the prompt where the needle's value starts)
DEPTH_BINS = 5
FULL_LIMIT = 50


# ----------------------------------------------------------------------------- pure helpers (tested)
def arm_list(policies: Iterable[str], ratios: Iterable[float], granularity: Optional[str] = None,
             prefill_eviction: Optional[str] = "after",
             variants: Iterable[tuple[str, list[str], dict[str, Any]]] = ()) -> list[dict[str, Any]]:
    """``stock`` first, then every policy at every ratio, then every variant's policies at every
    ratio: ``{name, policy, budget_ratio, server, fields}`` (a variant's arms also ``variant``).

    ``server``: the ``vllm serve`` the arm runs against, one per engine-only setting (``stock``,
    ``vtoken-<prefill_eviction>``, or ``vtoken-<label>`` for a variant ``(label, policies, config)``,
    whose ``config`` keys go into its server's ``vtoken`` config: :func:`server_configs`); ``fields``:
    the per-request fields the lm-eval model ``vtoken-completions`` turns into each request's
    ``vllm_xargs`` (:func:`request_xargs`). Arms that differ only in per-request fields (policy,
    budget, token sets) share their server."""
    arms: list[dict[str, Any]] = [dict(name="stock", policy=None, budget_ratio=None, server="stock", fields={})]
    groups = [(None, list(policies), f"vtoken-{prefill_eviction or 'default'}")]
    groups += [(label, list(pols), f"vtoken-{label}") for label, pols, _ in variants]
    for label, pols, server in groups:
        for p in pols:
            for r in ratios:
                f: dict[str, Any] = {"policy": p, "budget_ratio": r}
                if granularity:
                    f["granularity"] = granularity
                arm = dict(name=f"{p}-{r * 100:g}pct" + (f"-{label}" if label else ""), policy=p, budget_ratio=r,
                           server=server, fields=f)
                if label:
                    arm["variant"] = label
                arms.append(arm)
    return arms


def parse_variant(spec: str) -> tuple[str, list[str], dict[str, Any]]:
    """``--variant LABEL:POLICY[,POLICY...]:JSON`` -> ``(label, policies, config)``.

    Raises:
        ValueError: not three ``:``-separated parts, a label that is not ``[a-z0-9_]+``, no policy,
            or JSON that is not an object.
    """
    parts = spec.split(":", 2)
    if len(parts) != 3:
        raise ValueError(f"--variant {spec!r}: expected LABEL:POLICY[,POLICY...]:JSON")
    label, pols, cfg = parts
    if not re.fullmatch(r"[a-z0-9_]+", label):
        raise ValueError(f"--variant {spec!r}: label {label!r}; allowed: lower-case letters, digits, _")
    policies = [p for p in pols.split(",") if p]
    if not policies:
        raise ValueError(f"--variant {spec!r}: no policy")
    config = json.loads(cfg)
    if not isinstance(config, dict):
        raise ValueError(f"--variant {spec!r}: the config must be a JSON object")
    return label, policies, config


def server_configs(arms: Iterable[dict[str, Any]], prefill_eviction: Optional[str] = "after",
                   variants: Iterable[tuple[str, list[str], dict[str, Any]]] = ()
                   ) -> dict[str, Optional[dict[str, Any]]]:
    """The ``--additional-config`` of each server the arms need (None: stock, no ``vtoken`` key).

    A vToken server carries only the engine-only settings (``prefill_eviction``, and a variant's
    config over it) and a policy for requests without overrides (the first arm's); every arm's
    policy and budget come per request."""
    extra = {f"vtoken-{label}": cfg for label, _, cfg in variants}
    out: dict[str, Optional[dict[str, Any]]] = {}
    for a in arms:
        if a["server"] in out:
            continue
        if a["server"] == "stock":
            out["stock"] = None
        else:
            vt: dict[str, Any] = {"policy": a["policy"]}
            if prefill_eviction:
                vt["prefill_eviction"] = prefill_eviction
            vt.update(extra.get(a["server"], {}))
            out[a["server"]] = {"vtoken": vt}
    return out


#: a cell's ``slack`` where it is the policy's default for each request's own budget
SLACK_PER_REQUEST = "the policy's default for each request's budget"


def effective_settings(server_config: Optional[dict[str, Any]], policy: Optional[str]) -> dict[str, Any]:
    """What vToken applies to a request of ``policy`` on a server started with ``server_config``
    (``RequestOverrides.apply`` on the engine config): granularity, prefill_eviction, slack; {} for stock."""
    if not server_config or not policy:
        return {}
    from vtoken.config import RequestOverrides, parse_config

    cfg = RequestOverrides(vtoken_policy=policy).apply(parse_config(server_config["vtoken"]))
    plan = cfg.plan()
    # a default slack that depends on the budget (Scissorhands: half of it) differs per request
    from vtoken.policies import get_policy_class

    fixed = cfg.slack is not None or get_policy_class(policy).default_slack(1) == \
        get_policy_class(policy).default_slack(1 << 20)
    return dict(granularity=plan.granularity, prefill_eviction=plan.prefill_eviction,
                slack=plan.slack if fixed else SLACK_PER_REQUEST)


def settle(cell: dict[str, Any], cfgs: dict[str, Optional[dict[str, Any]]]) -> None:
    """Record on a cell what vToken applied to its requests (:func:`effective_settings` on its
    server's config): ``granularity``, ``prefill_eviction``, ``slack`` (None for stock)."""
    eff = effective_settings(cfgs[cell["server"]], cell["policy"])
    cell.update(granularity=eff.get("granularity"), prefill_eviction=eff.get("prefill_eviction"),
                slack=eff.get("slack"))


def request_xargs(prompt_ids: Any, policy: Optional[str] = None, budget_ratio: Optional[float] = None,
                  budget: Optional[int] = None, granularity: Optional[str] = None,
                  enable: Optional[bool] = None) -> dict[str, Any]:
    """The ``vllm_xargs`` of one request: ``vtoken_policy``, ``vtoken_budget`` (``budget``, or
    ``budget_ratio`` of this request's prompt tokens: :func:`budget_tokens`, what the engine's
    ``budget_ratio`` gives), ``vtoken_granularity``, ``vtoken_enable``; empty without fields.
    ``prompt_ids``: the request's prompt token ids (needed only with ``budget_ratio``)."""
    x: dict[str, Any] = {}
    if enable is not None:
        x["vtoken_enable"] = bool(enable)
    if policy:
        x["vtoken_policy"] = str(policy)
    if budget_ratio is not None:
        if budget is not None:
            raise ValueError("give budget or budget_ratio, not both")
        if not isinstance(prompt_ids, list) or not all(isinstance(t, int) for t in prompt_ids):
            raise ValueError("budget_ratio needs the prompt as token ids (lm-eval tokenized_requests=True)")
        x["vtoken_budget"] = budget_tokens(float(budget_ratio), len(prompt_ids))
    elif budget is not None:
        x["vtoken_budget"] = int(budget)
    if granularity:
        x["vtoken_granularity"] = str(granularity)
    return x


def budget_tokens(ratio: float, prompt_tokens: int) -> int:
    """The budget vToken applies to a prompt under ``budget_ratio``: ``ceil(ratio * prompt tokens)``, >= 1
    (``vtoken.config.effective_budget`` also raises it to the policy's sinks + recent tokens)."""
    return max(1, math.ceil(ratio * prompt_tokens))


def _clean(pred: str) -> str:
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


def score_sample(pred: str, refs: list[str]) -> float:
    """Fraction of the reference strings found (case-insensitive) in the answer, control
    characters turned into newlines first: RULER's ``string_match_all`` for one sample."""
    if not refs:
        raise ValueError("a sample without references")
    p = _clean(pred).lower()
    return sum(r.lower() in p for r in refs) / len(refs)


def samples_from_jsonl(lines: Iterable[str]) -> list[tuple[str, list[str]]]:
    """``(answer, references)`` of each sample of lm-eval's ``--log_samples`` file
    (``filtered_resps`` or ``resps``, and ``doc["outputs"]``)."""
    out = []
    for line in lines:
        if not line.strip():
            continue
        s = json.loads(line)
        resp = s.get("filtered_resps") or s.get("resps")
        while isinstance(resp, list):
            resp = resp[0] if resp else ""
        refs = s["doc"]["outputs"]
        out.append((str(resp), [refs] if isinstance(refs, str) else list(refs)))
    return out


def sample_depths(lines: Iterable[str]) -> list[Optional[float]]:
    """Where each sample's needle sits: the offset of its first reference string in the prompt
    (``doc["input"]``) as a fraction of the prompt's length, in ``[0, 1)``; None when absent (a task
    whose answer is not copied from the context)."""
    out: list[Optional[float]] = []
    for line in lines:
        if not line.strip():
            continue
        doc = json.loads(line)["doc"]
        text, refs = str(doc.get("input", "")), doc["outputs"]
        ref = refs if isinstance(refs, str) else (refs[0] if refs else "")
        i = text.find(str(ref)) if ref else -1
        out.append(i / len(text) if i >= 0 and text else None)
    return out


def by_depth(samples: list[tuple[str, list[str]]], depths: list[Optional[float]], bins: int = DEPTH_BINS
             ) -> list[dict[str, Any]]:
    """Accuracy per needle-depth bin: ``bins`` equal bins of ``[0, 1)``, each ``{lo, hi, n, correct,
    accuracy}`` (accuracy None for an empty bin); samples without a depth are left out."""
    cells = [dict(lo=i / bins, hi=(i + 1) / bins, n=0, correct=0, score=0.0) for i in range(bins)]
    for (pred, refs), d in zip(samples, depths):
        if d is None:
            continue
        c = cells[min(int(d * bins), bins - 1)]
        sc = score_sample(pred, refs)
        c["n"] += 1
        c["score"] += sc
        c["correct"] += sc == 1.0
    for c in cells:
        c["accuracy"] = c.pop("score") / c["n"] if c["n"] else None
    return cells


def accuracy(samples: list[tuple[str, list[str]]]) -> dict[str, Any]:
    """``{accuracy, n, correct}``: mean :func:`score_sample` (``correct``: samples scoring 1)."""
    scores = [score_sample(p, r) for p, r in samples]
    return dict(accuracy=sum(scores) / len(scores) if scores else math.nan, n=len(scores),
                correct=sum(s == 1.0 for s in scores))


def dense_gate(stock_cells: Iterable[dict[str, Any]], floor: float) -> tuple[set[tuple[str, int]], list[dict[str, Any]]]:
    """The (task, length) pairs on which dense (stock) accuracy reaches ``floor`` (fraction), and
    the dropped ones (``task``, ``length``, ``accuracy``, ``n``): eviction arms run only where the
    model solves the task with its full cache (issue rule: drop a length where dense is below 60 %).
    ``floor`` 0 keeps every pair."""
    keep, dropped = set(), []
    for c in stock_cells:
        key = (c["task"], int(c["length"]))
        if c["accuracy"] >= floor:
            keep.add(key)
        else:
            dropped.append(dict(task=c["task"], length=int(c["length"]), accuracy=c["accuracy"], n=c.get("n")))
    return keep, sorted(dropped, key=lambda d: (d["task"], d["length"]))


def metric_delta(before: dict[str, float], after: dict[str, float], names: Iterable[str]) -> dict[str, float]:
    """``after - before`` for each name (0 when absent from both)."""
    return {n: after.get(n, 0.0) - before.get(n, 0.0) for n in names}


KV_METRICS = ("vllm:request_prompt_tokens_sum", "vllm:request_prompt_tokens_count",
              "vllm:request_generation_tokens_sum", "vtoken:evicted_tokens_total",
              "vtoken:request_peak_blocks_sum", "vtoken:request_peak_blocks_count")


def kv_kept(delta: dict[str, float], block_size: int) -> dict[str, Any]:
    """KV kept per request over a cell, from :data:`KV_METRICS` deltas: mean prompt tokens, mean
    tokens held at the end (prompt + generated - evicted), those in blocks (``/ block_size``), and
    the mean of ``vtoken:request_peak_blocks`` (None without vToken)."""
    n = delta["vllm:request_prompt_tokens_count"]
    if n <= 0:
        return dict(requests=0, mean_prompt_tokens=None, mean_kept_tokens=None, mean_kept_blocks=None,
                    mean_peak_blocks=None)
    kept = (delta["vllm:request_prompt_tokens_sum"] + delta["vllm:request_generation_tokens_sum"]
            - delta["vtoken:evicted_tokens_total"]) / n
    pc = delta["vtoken:request_peak_blocks_count"]
    return dict(requests=int(n), mean_prompt_tokens=delta["vllm:request_prompt_tokens_sum"] / n,
                mean_kept_tokens=kept, mean_kept_blocks=kept / block_size,
                mean_peak_blocks=delta["vtoken:request_peak_blocks_sum"] / pc if pc > 0 else None)


def add_kv_fractions(cells: list[dict[str, Any]]) -> None:
    """Sets each cell's ``kv_kept_fraction``: its mean kept tokens over stock's for the same
    (task, length); stock's is 1.0, None where stock's cell is missing."""
    stock = {(c["task"], c["length"]): c["kv"]["mean_kept_tokens"] for c in cells if c["arm"] == "stock"}
    for c in cells:
        s, k = stock.get((c["task"], c["length"])), c["kv"]["mean_kept_tokens"]
        c["kv_kept_fraction"] = k / s if s and k is not None else None


def lm_eval_argv(python: str, task: str, length: int, port: int, tokenizer: str, limit: int, out_dir: str,
                 max_length: int, concurrency: int, seed: int = 0, fields: Optional[dict[str, Any]] = None,
                 xargs_log: Optional[str] = None) -> list[str]:
    """The ``lm_eval run`` command of one cell against the server on ``port``: lm-eval's command line
    with the ``vtoken-completions`` model (:mod:`lm_eval_vtoken`, ``local-completions`` plus each
    request's ``vllm_xargs`` from ``fields``; without fields it sends what ``local-completions`` does)."""
    model_args = [
        "model=smollm2", f"base_url=http://127.0.0.1:{port}/v1/completions", f"tokenizer={tokenizer}",
        "tokenizer_backend=huggingface", "tokenized_requests=True", f"num_concurrent={concurrency}",
        f"max_length={max_length}", "max_retries=1", "timeout=1200"]
    model_args += [f"vtoken_{k}={v}" for k, v in (fields or {}).items()]
    if xargs_log:
        model_args.append(f"xargs_log={xargs_log}")
    return [python, str(HERE / "lm_eval_vtoken.py"), "run", "--model", "vtoken-completions",
            "--model_args", ",".join(model_args),
            "--tasks", task, "--metadata", json.dumps({"max_seq_lengths": [length]}), "--apply_chat_template",
            "--limit", str(limit), "--log_samples", "--output_path", out_dir, "--seed", str(seed)]


def xargs_summary(lines: Iterable[str]) -> dict[str, Any]:
    """From the ``xargs_log`` of a cell: ``requests``, ``mean_prompt_tokens``, ``mean_budget_tokens``
    (None without budgets) and the distinct ``vtoken_policy`` values sent."""
    rows = [json.loads(x) for x in lines if x.strip()]
    budgets = [r["vllm_xargs"]["vtoken_budget"] for r in rows if "vtoken_budget" in r["vllm_xargs"]]
    prompts = [r["prompt_tokens"] for r in rows if r.get("prompt_tokens") is not None]
    return dict(requests=len(rows), mean_prompt_tokens=sum(prompts) / len(prompts) if prompts else None,
                mean_budget_tokens=sum(budgets) / len(budgets) if budgets else None,
                policies=sorted({r["vllm_xargs"]["vtoken_policy"] for r in rows if "vtoken_policy" in r["vllm_xargs"]}))


def shared_kv(sent: dict[str, Any], block_size: int, slack: int = 0) -> dict[str, Any]:
    """A cell's KV kept when other cells shared its server (so the server's ``/metrics`` deltas are
    not its own), from what it sent (:func:`xargs_summary`): the mean ``vtoken_budget`` plus the
    pacing ``slack`` (tokens a request holds over its budget before it evicts again: an upper
    bound, reached when it generates that many; at most the prompt), or without a budget (stock)
    the mean prompt, which a request holds whole (its few generated tokens not counted). The
    server's measured total over all its cells is checked in ``servers[].kv_check``."""
    budget = sent["mean_budget_tokens"] is not None
    kept = min(sent["mean_budget_tokens"] + slack, sent["mean_prompt_tokens"]) if budget else sent["mean_prompt_tokens"]
    return dict(requests=sent["requests"], mean_prompt_tokens=sent["mean_prompt_tokens"], mean_kept_tokens=kept,
                mean_kept_blocks=None if kept is None else kept / block_size, mean_peak_blocks=None,
                source=("budget sent (vllm_xargs.vtoken_budget)" + (f" + slack {slack}" if slack else "")
                        if budget else "prompt tokens sent (no budget)")
                + "; the server's /metrics total is checked in servers[].kv_check")


def cell_slack(cell: dict[str, Any]) -> int:
    """The pacing slack of a cell's requests in tokens: its recorded ``slack``, or where that is the
    policy's per-request default (:data:`SLACK_PER_REQUEST`) the default at the cell's mean budget."""
    slack = cell.get("slack")
    if slack == SLACK_PER_REQUEST:
        from vtoken.policies import get_policy_class

        return int(get_policy_class(cell["policy"]).default_slack(round(cell["xargs_sent"]["mean_budget_tokens"])))
    return int(slack or 0)


def rederive(doc: dict[str, Any], block_size: int) -> dict[str, Any]:
    """Recomputes a result's derived fields from its recorded ones: the KV kept of cells that shared
    their server (:func:`shared_kv` of their ``xargs_sent``) and every ``kv_kept_fraction``."""
    for c in doc["cells"]:
        if not c.get("alone_on_server", True):
            c["kv"] = shared_kv(c["xargs_sent"], block_size, cell_slack(c) if c.get("policy") else 0)
    add_kv_fractions(doc["cells"])
    return doc


def same_answers(new: list[tuple[str, list[str]]], old: list[tuple[str, list[str]]]) -> dict[str, int]:
    """Answer-by-answer comparison of two runs of the same documents (lm-eval's ``--limit`` takes the
    first documents, so the shorter run's are the longer run's first): ``compared`` (the shorter
    length), ``equal`` (same answer), ``same_refs`` (same references: the documents match)."""
    n = min(len(new), len(old))
    return dict(compared=n, equal=sum(new[i][0] == old[i][0] for i in range(n)),
                same_refs=sum(new[i][1] == old[i][1] for i in range(n)))


def lm_eval_reported(results: dict[str, Any], task: str, length: int) -> Optional[float]:
    """lm-eval's own figure for the cell (its results JSON ``results[task]["<length>,none"]``)."""
    r = results.get("results", {}).get(task, {})
    v = r.get(f"{length},none")
    return None if v is None or v == -1 else float(v)


def vtoken_line(log: str) -> dict[str, str]:
    """The resolved settings of the server's ``vToken on: ...`` log line (granularity, prefill_eviction, slack)."""
    m = re.search(r"vToken on: (.*)", log)
    if not m:
        return {}
    line = m.group(1)
    out = {}
    for key in ("policy", "slack", "block_size", "granularity", "prefill_eviction", "mode"):
        mm = re.search(rf"\b{key}=(\S+(?: \(the [^)]*\))?)", line)
        if mm:
            out[key] = mm.group(1)
    return out


# ----------------------------------------------------------------------------- running
def server_args(a: argparse.Namespace) -> list[str]:
    return ["--dtype", a.dtype, "--block-size", str(a.block_size), "--max-model-len", str(a.max_model_len),
            "--kv-cache-memory-bytes", str(a.kv_bytes), "--enforce-eager", "--disable-uvicorn-access-log",
            "--served-model-name", "smollm2", "--no-enable-prefix-caching"]


def offline_env() -> dict[str, str]:
    return dict(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                HF_ALLOW_CODE_EVAL="0", TOKENIZERS_PARALLELISM="false")


class _ServerUse:
    """Which cells ran alone on a server (their ``/metrics`` deltas are theirs alone)."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.active: dict[str, int] = {}
        self.started: dict[str, int] = {}

    def enter(self, server: str) -> tuple[bool, int]:
        with self.lock:
            alone = self.active.get(server, 0) == 0
            self.active[server] = self.active.get(server, 0) + 1
            self.started[server] = self.started.get(server, 0) + 1
            return alone, self.started[server]

    def leave(self, server: str, alone: bool, epoch: int) -> bool:
        with self.lock:
            self.active[server] -= 1
            return alone and self.started[server] == epoch


def run_cell(a: argparse.Namespace, srv, arm: dict[str, Any], task: str, length: int, model: str,
             workdir: Path, use: Optional[_ServerUse] = None) -> dict[str, Any]:
    out_dir = workdir / f"{arm['name']}_{task}_{length}"
    xlog = workdir / f"{arm['name']}_{task}_{length}.xargs.jsonl"
    argv = lm_eval_argv(sys.executable, task, length, srv.port, model, a.limit, str(out_dir), a.max_model_len,
                        a.concurrency, a.seed, fields=arm["fields"], xargs_log=str(xlog))
    use = use or _ServerUse()
    alone, epoch = use.enter(arm["server"])
    before = srv.metrics()
    load_before = list(os.getloadavg())
    t0 = time.time()
    env = dict(os.environ, **offline_env())
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=a.cell_timeout, cwd=str(workdir), env=env)
        wall = round(time.time() - t0, 1)
        load_after = list(os.getloadavg())
        time.sleep(1.0)  # the last request's histogram observation reaches /metrics
        after = srv.metrics()
    finally:
        alone = use.leave(arm["server"], alone, epoch)
    (out_dir.parent / f"{out_dir.name}.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"lm_eval failed ({p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
    kv = (dict(kv_kept(metric_delta(before, after, KV_METRICS), a.block_size), source="/metrics delta of the cell")
          if alone else None)
    return cell_from_files(a, arm, task, length, workdir, kv, wall, load_before, load_after,
                           " ".join(shlex.quote(x) for x in argv))


def cell_from_files(a: argparse.Namespace, arm: dict[str, Any], task: str, length: int, workdir: Path,
                    kv: Optional[dict[str, Any]], wall: float, load_before: list, load_after: list,
                    command: str) -> dict[str, Any]:
    """A cell's record from what its lm-eval run left in ``workdir`` (samples, results, the
    requests' ``vllm_xargs`` log); ``kv`` None: the cell shared its server (:func:`shared_kv`)."""
    out_dir = workdir / f"{arm['name']}_{task}_{length}"
    xlog = workdir / f"{arm['name']}_{task}_{length}.xargs.jsonl"
    sfiles = sorted(glob.glob(str(out_dir / "**" / f"samples_{task}_*.jsonl"), recursive=True))
    rfiles = sorted(glob.glob(str(out_dir / "**" / "results_*.json"), recursive=True))
    if not sfiles:
        raise RuntimeError(f"no samples file under {out_dir}")
    lines = Path(sfiles[-1]).read_text().splitlines()
    samples = samples_from_jsonl(lines)
    acc = accuracy(samples)
    depths = sample_depths(lines)
    reported = lm_eval_reported(json.loads(Path(rfiles[-1]).read_text()), task, length) if rfiles else None
    sent = xargs_summary(xlog.read_text().splitlines() if xlog.exists() else [])
    alone = kv is not None
    if not alone:  # other cells shared the server meanwhile: what each request was sent to keep
        kv = shared_kv(sent, a.block_size)
    cell = dict(arm=arm["name"], policy=arm["policy"], budget_ratio=arm["budget_ratio"], server=arm["server"],
                variant=arm.get("variant"),
                budget_tokens=sent["mean_budget_tokens"], task=task, length=length, **acc,
                lm_eval_accuracy=reported, kv=kv, xargs_sent=sent, alone_on_server=alone,
                examples=[dict(answer=s[0][:200], refs=s[1]) for s in samples[:2]],
                wall_s=wall, load_before=load_before, load_after=load_after, command=command)
    if any(d is not None for d in depths):
        cell["by_depth"] = by_depth(samples, depths)
    cell["_samples"] = samples
    return cell


#: a cell's progress line as :func:`main` prints it (``--salvage`` reads wall time and load back)
_CELL_LINE = re.compile(r"^\[\d+/\d+\]\s+(\S+) (\S+) (\d+): accuracy .*, ([\d.]+) s, load ([\d.]+)-([\d.]+)$")


def salvage_lines(log: Iterable[str]) -> dict[tuple[str, str, int], tuple[float, float, float]]:
    """``(arm, task, length) -> (wall s, load before, load after)`` from a run's printed cell lines."""
    out = {}
    for line in log:
        m = _CELL_LINE.match(line.strip())
        if m:
            out[(m[1], m[2], int(m[3]))] = (float(m[4]), float(m[5]), float(m[6]))
    return out


def probe_overrides(srv, arm: dict[str, Any], prompt_tokens: int = 800, max_tokens: int = 4,
                    server_config: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One request of the arm alone on its server (token-id prompt, greedy, ``ignore_eos``), with the
    ``/metrics`` delta around it: the server-side proof that the per-request budget took effect
    (``kept`` = prompt + generated - evicted must be the ``vtoken_budget`` sent plus at most 2: with
    slack 0 the live tokens are cut to the budget at each decode step, the step's token is added to
    them, and the last sampled token, counted as generated, never enters the cache). A policy with
    pacing slack (Scissorhands: half its budget) evicts only past ``budget + slack``, so up to
    ``slack`` more are allowed: the slack of the request's plan on a server of ``server_config``."""
    ids = [100 + (7 * i) % 20000 for i in range(prompt_tokens)]
    xargs = request_xargs(ids, **arm["fields"])
    names = KV_METRICS + ("vtoken:evictions_total", "vtoken:request_faults_total")
    before = srv.metrics()
    r = srv.post("/v1/completions", dict(model="smollm2", prompt=ids, max_tokens=max_tokens, temperature=0,
                                         ignore_eos=True, vllm_xargs=xargs), timeout=600)
    r.raise_for_status()
    time.sleep(1.0)
    d = metric_delta(before, srv.metrics(), names)
    kept = (d["vllm:request_prompt_tokens_sum"] + d["vllm:request_generation_tokens_sum"]
            - d["vtoken:evicted_tokens_total"])
    b = xargs.get("vtoken_budget")
    slack = 0
    if server_config and b is not None:
        from vtoken.config import RequestOverrides, parse_config

        over = RequestOverrides(vtoken_policy=xargs.get("vtoken_policy"), vtoken_budget=b)
        slack = over.apply(parse_config(server_config["vtoken"])).plan(prompt_tokens).slack
    return dict(arm=arm["name"], vllm_xargs=xargs, prompt_tokens=prompt_tokens,
                generated=d["vllm:request_generation_tokens_sum"], evicted=d["vtoken:evicted_tokens_total"],
                evictions=d["vtoken:evictions_total"], faults=d["vtoken:request_faults_total"], kept=kept,
                slack=slack, ok=b is not None and b <= kept <= b + 2 + slack and d["vtoken:request_faults_total"] == 0)


def server_kv_check(before: dict[str, float], after: dict[str, float], cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The server's measured tokens held at the end of its requests, summed over a phase,
    ``prompt + generated - evicted`` (``/metrics``), against the sum of the budgets its cells sent."""
    d = metric_delta(before, after, KV_METRICS)
    measured = (d["vllm:request_prompt_tokens_sum"] + d["vllm:request_generation_tokens_sum"]
                - d["vtoken:evicted_tokens_total"])
    sent = sum(c["xargs_sent"]["mean_budget_tokens"] * c["xargs_sent"]["requests"] for c in cells
               if c["xargs_sent"]["mean_budget_tokens"] is not None)
    return dict(requests=int(d["vllm:request_prompt_tokens_count"]),
                requests_sent=sum(c["xargs_sent"]["requests"] for c in cells),
                measured_kept_tokens_sum=measured, budget_tokens_sum=sent,
                measured_over_budget=measured / sent if sent else None)


def plot(doc: dict[str, Any], path: Path) -> None:
    """kvpress style: accuracy against KV kept (fraction of stock's tokens), one line per policy,
    one panel per (task, length); stock is the point at 1.0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = doc["cells"]
    panels = sorted({(c["task"], c["length"]) for c in cells}, key=lambda t: (TASKS.index(t[0]) if t[0] in TASKS
                                                                              else 99, t[1]))
    ncol = min(3, len(panels))
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.4 * nrow), squeeze=False)
    for ax, (task, length) in zip(axes.flat, panels):
        here = [c for c in cells if c["task"] == task and c["length"] == length]
        stock = [c for c in here if c["arm"] == "stock"]
        lines = sorted({(c["policy"], c.get("variant") or "") for c in here if c["policy"]})
        for pol, var in lines:
            pts = sorted((c["kv_kept_fraction"], c["accuracy"]) for c in here if c["policy"] == pol
                         and (c.get("variant") or "") == var and c["kv_kept_fraction"] is not None)
            pts += [(1.0, s["accuracy"]) for s in stock]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{pol} ({var})" if var else pol)
        for s in stock:
            ax.scatter([1.0], [s["accuracy"]], color="k", zorder=5, label="stock (full cache)")
        ax.set_title(f"{task}, {length} tokens", fontsize=9)
        ax.set_xlabel("KV kept (fraction of stock's tokens)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    n = max((c["n"] for c in cells), default=0)
    fig.suptitle(f"RULER synthetic tasks, SmolLM2-135M-Instruct\nvToken prefill_eviction "
                 f"{doc['settings']['prefill_eviction']}, prefix caching off, n <= {n} per cell", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def heatmap_grid(doc: dict[str, Any], arm: str, task: str) -> tuple[list[int], list[list[Optional[float]]]]:
    """``(lengths, grid)``: ``grid[bin][j]`` = the arm's accuracy at depth bin ``bin`` (shallow first)
    and length ``lengths[j]`` (None: no sample there)."""
    cells = sorted((c for c in doc["cells"] if c["arm"] == arm and c["task"] == task and "by_depth" in c),
                   key=lambda c: c["length"])
    lengths = [c["length"] for c in cells]
    bins = len(cells[0]["by_depth"]) if cells else 0
    return lengths, [[c["by_depth"][b]["accuracy"] for c in cells] for b in range(bins)]


def has_heatmap(doc: dict[str, Any]) -> bool:
    """A heatmap (:func:`plot_heatmap`) is drawn for a run with needle depths at more than one
    context length (``--heatmap``); a one-length run's depths stay in its cells."""
    return len({int(c["length"]) for c in doc["cells"] if "by_depth" in c}) > 1


def plot_heatmap(doc: dict[str, Any], path: Path) -> None:
    """One panel per arm: accuracy by needle depth (rows) and context length (columns), numbers printed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task = next(c["task"] for c in doc["cells"] if "by_depth" in c)
    arms = [x["name"] for x in doc["arms"]]
    fig, axes = plt.subplots(1, len(arms), figsize=(3.2 * len(arms), 3.4), squeeze=False)
    for ax, arm in zip(axes[0], arms):
        lengths, grid = heatmap_grid(doc, arm, task)
        vals = [[float("nan") if v is None else v for v in row] for row in grid]
        im = ax.imshow(vals, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for b, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, b, "-" if v is None else f"{v:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" for n in lengths])
        ax.set_yticks(range(len(grid)), [f"{100 * b // len(grid)}-{100 * (b + 1) // len(grid)} %" for b in range(len(grid))]
                      if ax is axes[0][0] else [])
        ax.set_title(arm, fontsize=9)
        ax.set_xlabel("context length")
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    fig.suptitle(f"{task}: accuracy by needle depth, SmolLM2-135M, budget 25 % of the prompt", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_result(doc: dict[str, Any], name: str, block_size: int) -> Path:
    """The end of a run, a ``--salvage`` and a ``--rederive``: the derived KV figures recomputed
    (:func:`rederive`), ``results/<name>.json`` written, its plot drawn, and the needle heatmap
    where the run has one (:func:`has_heatmap`). Returns the JSON's path."""
    from common import RESULTS

    rederive(doc, block_size)
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(doc, indent=1))
    plot(doc, out.with_suffix(".png"))
    if has_heatmap(doc):
        plot_heatmap(doc, RESULTS / f"{name}_heatmap.png")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help=f"smoke: {SMALL}")
    ap.add_argument("--heatmap", action="store_true", help=f"the needle heatmap: {HEATMAP}")
    ap.add_argument("--tasks", nargs="+", default=None, choices=TASKS)
    ap.add_argument("--lengths", nargs="+", type=int, default=None)
    ap.add_argument("--policies", nargs="*", default=None,
                    help="vToken policies (default: every built-in one; none: stock alone, dense accuracy only)")
    ap.add_argument("--ratios", nargs="+", type=float, default=None, help="budgets as fractions of the prompt")
    ap.add_argument("--limit", type=int, default=None, help=f"samples per cell (default {FULL_LIMIT}; --small 20)")
    ap.add_argument("--granularity", default=None, help="vToken token sets (default: each policy's own)")
    ap.add_argument("--prefill-eviction", default="after", choices=["after", "chunks"])
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:POLICIES:JSON",
                    help="more arms on a server of their own: POLICIES (comma-separated) at every ratio, the server's "
                         "vtoken config updated with JSON, e.g. 'request:h2o,snapkv:{\"granularity\": \"request\"}' "
                         "(arms named POLICY-RATIOpct-LABEL); repeatable")
    ap.add_argument("--dense-floor", type=float, default=0.6,
                    help="run the stock cells first and the eviction arms only on the (task, length) pairs where "
                         "stock's accuracy reaches this fraction (0: every pair)")
    ap.add_argument("--concurrency", type=int, default=4, help="lm-eval's num_concurrent")
    ap.add_argument("--model", default=None, help="model directory (default: the local SmolLM2)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the longest length + 512")
    ap.add_argument("--kv-bytes", type=int, default=512 << 20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cell-timeout", type=int, default=3600)
    ap.add_argument("--parallel", type=int, default=4,
                    help="cells (lm-eval runs) at once across the servers (0: all of them; each is a process of "
                         "about 1 GB beside the servers')")
    ap.add_argument("--compare-with", nargs="*", default=None,
                    help="work directories of earlier runs (one server per arm): answers compared sample by sample")
    ap.add_argument("--name", default=None, help="result name (default tasks; --small: tasks_smoke)")
    ap.add_argument("--salvage", nargs=2, default=None, metavar=("WORKDIR", "LOG"),
                    help="no run: rebuild the result of a run given these same options that died before writing it "
                         "(a server killed): every cell from what its lm-eval run left in WORKDIR, its wall time and "
                         "load from the run's printed LOG; the file says so")
    ap.add_argument("--why", default=None, metavar="TEXT",
                    help="with --salvage: why the run ended early (recorded as salvaged.why)")
    ap.add_argument("--rederive", default=None, metavar="NAME",
                    help="no run: recompute results/NAME.json's derived fields (KV kept of shared-server cells, "
                         "fractions) from its recorded ones, and redraw NAME.png")
    a = ap.parse_args(argv)
    if a.rederive:
        from common import RESULTS

        doc = json.loads((RESULTS / f"{a.rederive}.json").read_text())
        args = doc["server"]["args"]
        out = write_result(doc, a.rederive, int(args[args.index("--block-size") + 1]))
        print(f"rederived {out} and {out.with_suffix('.png')}")
        return 0
    preset = SMALL if a.small else HEATMAP if a.heatmap else dict(tasks=TASKS, lengths=LENGTHS, policies=POLICIES, ratios=RATIOS,
                                         limit=FULL_LIMIT)
    for k, v in preset.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.name = a.name or ("tasks_smoke" if a.small else "tasks_needle" if a.heatmap else "tasks")
    a.max_model_len = a.max_model_len or max(a.lengths) + 512
    if a.model is None:
        from vtoken.assets.paths import smollm2_dir

        a.model = str(smollm2_dir())
    from common import RESULTS, machine_info
    from drivers.launcher import start_server

    try:
        variants = [parse_variant(v) for v in a.variant]
    except ValueError as e:
        ap.error(str(e))
    arms = arm_list(a.policies, a.ratios, a.granularity, a.prefill_eviction, variants)
    workdir = Path(tempfile.mkdtemp(prefix="bench_tasks_"))
    doc: dict[str, Any] = dict(
        bench="bench_tasks", small=a.small, command="python " + shlex.join(["benchmarks/bench_tasks.py"] + argv),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), machine=machine_info(),
        loadavg_before=list(os.getloadavg()),
        settings=dict(model=a.model, prefix_caching=False, tasks=a.tasks, lengths=a.lengths, limit=a.limit,
                      policies=a.policies, budget_ratios=a.ratios, granularity=a.granularity or "policy default",
                      prefill_eviction=a.prefill_eviction,
                      variants={label: dict(policies=p, config=c) for label, p, c in variants}, concurrency=a.concurrency, seed=a.seed,
                      dense_floor=a.dense_floor,
                      chat_template=True, greedy=True, parallel=a.parallel or "all cells",
                      lm_eval_model="vtoken-completions (local-completions + vllm_xargs per request)",
                      scorer="fraction of reference strings in the answer (RULER string_match_all)"),
        server=dict(args=server_args(a)), left_out=LEFT_OUT, arms=[], cells=[])
    cfgs = server_configs(arms, a.prefill_eviction, variants)
    doc["servers"] = {}
    if a.salvage:
        return salvage(a, doc, arms, cfgs, Path(a.salvage[0]), Path(a.salvage[1]))
    cells_todo = [(arm, task, length) for arm in arms for task in a.tasks for length in a.lengths]
    total = len(cells_todo)
    t_start = time.time()
    servers: dict[str, Any] = {}
    use = _ServerUse()
    import threading
    from concurrent.futures import ThreadPoolExecutor, as_completed

    done_lock = threading.Lock()
    try:
        # every server starts at once; each is used by every arm that needs only per-request fields
        for name, cfg in cfgs.items():
            servers[name] = start_server(a.model, workdir / f"server_{name}.log", server_args(a), cfg, cli=True,
                                         env=dict(OMP_NUM_THREADS="2"), cwd=ROOT)
        for name, srv in servers.items():
            srv.wait_healthy(1200)
            doc["servers"][name] = dict(additional_config=cfgs[name], startup_s=round(srv.startup_s or 0, 1),
                                        started_with=sorted(cfgs), resolved=vtoken_line(srv.log()),
                                        command=" ".join(shlex.quote(x) for x in srv.argv),
                                        arms=[x["name"] for x in arms if x["server"] == name])
            print(f"server {name} healthy in {srv.startup_s:.0f} s", flush=True)
        t_ready = time.time()
        doc["servers_ready_s"] = round(t_ready - t_start, 1)
        probes = [probe_overrides(servers[x["server"]], x, server_config=cfgs[x["server"]]) for x in arms
                  if x["server"] != "stock"]
        doc["probes"] = probes
        for pr in probes:
            print(f"probe {pr['arm']}: sent {pr['vllm_xargs']}, kept {pr['kept']} (evicted {pr['evicted']}, faults "
                  f"{pr['faults']}): {'ok' if pr['ok'] else 'NOT THE BUDGET SENT'}", flush=True)
        if not all(pr["ok"] for pr in probes):
            raise RuntimeError("a per-request override did not take effect on the server (see the probes)")
        phase_before = {n: srv.metrics() for n, srv in servers.items()}
        t_cells = time.time()
        k = 0

        def one(item):
            arm, task, length = item
            return run_cell(a, servers[arm["server"]], arm, task, length, a.model, workdir, use)

        def run_all(items: list) -> None:
            nonlocal k
            with ThreadPoolExecutor(max_workers=a.parallel or max(len(items), 1)) as ex:
                futs = [ex.submit(one, it) for it in items]
                for f in as_completed(futs):
                    c = f.result()
                    settle(c, cfgs)
                    with done_lock:
                        k += 1
                        doc["cells"].append(c)
                    kv = c["kv"]
                    print(f"[{k}/{total}] {c['arm']:>14} {c['task']} {c['length']}: accuracy {c['accuracy']:.3f} "
                          f"({c['correct']}/{c['n']}; lm-eval {c['lm_eval_accuracy']}), kept tokens "
                          f"{kv['mean_kept_tokens']}, {c['wall_s']} s, load {c['load_before'][0]:.2f}-"
                          f"{c['load_after'][0]:.2f}", flush=True)

        dense = [it for it in cells_todo if it[0]["server"] == "stock"]
        if a.dense_floor > 0 and dense:
            # dense first: the eviction arms run only where the full cache solves the task
            run_all(dense)
            keep, dropped = dense_gate([c for c in doc["cells"] if c["arm"] == "stock"], a.dense_floor)
            doc["dense_gate"] = dict(floor=a.dense_floor, kept=sorted([t, n] for t, n in keep), dropped=dropped)
            for d in dropped:
                print(f"dropped {d['task']} at {d['length']}: dense accuracy {d['accuracy']:.3f} < "
                      f"{a.dense_floor}", flush=True)
            rest = [it for it in cells_todo if it[0]["server"] != "stock" and (it[1], it[2]) in keep]
            total = len(dense) + len(rest)
            run_all(rest)
        else:
            run_all(cells_todo)
        doc["cells_wall_s"] = round(time.time() - t_cells, 1)
        for n, srv in servers.items():
            mine = [c for c in doc["cells"] if c["server"] == n]
            doc["servers"][n]["kv_check"] = server_kv_check(phase_before[n], srv.metrics(), mine)
    finally:
        for srv in servers.values():
            srv.close()
    order = {x["name"]: i for i, x in enumerate(arms)}
    doc["cells"].sort(key=lambda c: (order[c["arm"]], c["task"], c["length"]))
    doc["arms"] = [dict(x, server_config=cfgs[x["server"]]) for x in arms]
    for ref in a.compare_with or []:
        for c in doc["cells"]:
            old = sorted(glob.glob(str(Path(ref) / f"{c['arm']}_{c['task']}_{c['length']}" / "**"
                                       / f"samples_{c['task']}_*.jsonl"), recursive=True))
            if old:
                cmp = same_answers(c["_samples"], samples_from_jsonl(Path(old[-1]).read_text().splitlines()))
                c.setdefault("same_as_one_server_per_arm", []).append(dict(cmp, reference=old[-1]))
    for c in doc["cells"]:
        c.pop("_samples", None)
    doc["loadavg_after"] = list(os.getloadavg())
    doc["total_wall_s"] = round(time.time() - t_start, 1)
    out = write_result(doc, a.name, a.block_size)
    (RESULTS / f"{a.name}.partial.json").unlink(missing_ok=True)
    for c in doc["cells"]:
        print(f"{c['arm']:>14} {c['task']} {c['length']}: accuracy {c['accuracy']:.3f} (n {c['n']}), KV kept "
              f"{c['kv_kept_fraction'] if c['kv_kept_fraction'] is None else round(c['kv_kept_fraction'], 3)}")
    print(f"wrote {out} and {out.with_suffix('.png')} ({doc['total_wall_s']} s; logs in {workdir})")
    return 0


def salvage(a: argparse.Namespace, doc: dict[str, Any], arms: list[dict[str, Any]],
            cfgs: dict[str, Optional[dict[str, Any]]], workdir: Path, log: Path) -> int:
    """``--salvage``: the result of a run that died before writing it, from its work directory and
    printed log (cells whose lm-eval run left no samples are left out, and listed)."""
    got = salvage_lines(log.read_text().splitlines())
    missing = []
    doc.pop("loadavg_before", None)
    doc["date"] = None
    for arm in arms:
        for task in a.tasks:
            for length in a.lengths:
                if not (workdir / f"{arm['name']}_{task}_{length}").exists():
                    missing.append(f"{arm['name']} {task} {length}")
                    continue
                wall, lb, la = got.get((arm["name"], task, length), (None, None, None))
                c = cell_from_files(a, arm, task, length, workdir, None, wall, [lb], [la],
                                    "lm_eval run (the port of a server of the dead run): see its work directory")
                c.pop("_samples")
                settle(c, cfgs)
                doc["cells"].append(c)
    doc["arms"] = [dict(x, server_config=cfgs[x["server"]]) for x in arms]
    walls = [c["wall_s"] for c in doc["cells"] if c["wall_s"] is not None]
    argv = sys.argv[1:]
    i = argv.index("--salvage")
    run = argv[:i] + argv[i + 3:]
    if "--why" in run:  # (not an option of the run)
        w = run.index("--why")
        run = run[:w] + run[w + 2:]
    doc["command"] = "python " + shlex.join(["benchmarks/bench_tasks.py"] + run)  # the run's
    doc["salvaged"] = dict(
        why=a.why or "the run ended before writing its result",
        command="python " + shlex.join(["benchmarks/bench_tasks.py"] + sys.argv[1:]), workdir=str(workdir),
        log=str(log), cells_without_a_printed_line=[c["arm"] for c in doc["cells"] if c["wall_s"] is None],
        cells_missing=missing, no_server_kv_check=True)
    doc["total_wall_s"] = None
    doc["cells_wall_s_sum"] = round(sum(walls), 1)
    out = write_result(doc, a.name, a.block_size)
    print(f"salvaged {len(doc['cells'])} cells into {out} (missing: {missing or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
