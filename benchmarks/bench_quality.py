"""Quality under eviction, per policy and budget, against the full (no-eviction) cache. SmolLM2.

Two measurements on long ShareGPT conversations (chat template applied), each cut at
``prompt_len`` tokens:

A. Teacher-forced, dense oracle (``reference.oracle.oracle_generate``, HF transformers, fp32,
   eager attention). The oracle runs the same step order and eviction as the engine (the engine
   is verified token-exact against it). The model is wrapped so that every decode step is fed
   the conversation's *real* next token instead of the oracle's own greedy sample (teacher
   forcing); the oracle's per-step logits then score the real continuation. Per policy/budget:
   mean NLL (and perplexity) of the next ``K`` real tokens, the NLL increase over the full
   cache, top-1 accuracy on the real tokens, and next-token agreement = fraction of positions
   whose argmax equals the full cache's argmax at the same position.

B. Greedy generation inside vLLM (SmolLM2 bf16). For every conversation prefix the same batch
   holds one full-cache request (``vtoken_enable: false``: the plugin is inert for it, stock
   behaviour) and one request per policy/budget; each generates ``K`` tokens greedily. Reported:
   the fraction of positions before the first divergence from the full-cache tokens
   (``prefix_agreement``) and the fraction of positions with equal tokens overall
   (``positional_agreement``; after a divergence the texts differ, so this is a loose figure).

Usage::

    python benchmarks/bench_quality.py --small   # 419 s (OMP_NUM_THREADS=1, loaded 2-core machine)
    python benchmarks/bench_quality.py --full    # not run yet; est. 30-60 min
    python benchmarks/bench_quality.py --scale   # = make bench-quality: 40 conversations, oracle only,
                                                 # policy x budget x pacing (fixed / pressure)
    python benchmarks/bench_quality.py --granularity  # = make bench-quality-granularity: the same 40
                                                 # conversations, H2O / TOVA / Scissorhands x budget x pacing
                                                 # x token sets (request / layer / head, docs/granularity.md)
    python benchmarks/bench_quality.py --prefill      # = make bench-quality-prefill: the same 40 conversations,
                                                 # H2O / TOVA / SnapKV x budget, the prompt cut after the whole
                                                 # prompt or between 256-token prefill chunks (issue 25)
    python benchmarks/bench_quality.py --keyonly      # the same 40 conversations, K-norm / KeyDiff / Expected
                                                 # Attention x budget at their head token sets (issue 26)
    python benchmarks/bench_quality.py --compress     # = make bench-quality-compress: the same 40 conversations,
                                                 # SnapKV at budget 512 cutting the prompt only (slack 128,
                                                 # score_every 1000: the generated tokens are kept)
    python benchmarks/bench_quality.py --granularity --from-partial benchmarks/results/quality_granularity.partial.json
                                                 # an interrupted run's finished conversations as the result
    python benchmarks/bench_quality.py --granularity --resume benchmarks/results/quality_granularity.partial.json
                                                 # go on with an interrupted run (total_wall_s: this part only)
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    parse_size_args,
    ALL_POLICIES,
    PAPER_POLICIES,
    cdiv,
    engine_kwargs,
    load_long_conversations,
    mean,
    run_engine,
    run_metadata,
    smollm2,
    write_json,
)

SEED = 0


def plan(size: str) -> dict:
    if size == "small":
        return dict(oracle=dict(n_conv=1, prompt_len=512, K=32, policies=PAPER_POLICIES, budgets=[128, 256]),
                    engine=dict(n_conv=1, prompt_len=768, K=32, policies=PAPER_POLICIES, budgets=[128, 256]))
    if size == "scale":
        # Issue 13 item 4: >= 40 long conversations, every policy x budget x pacing; oracle only
        # (teacher-forced; the engine part B is covered by --small/--full). Pressure pacing is
        # replayed from the pool model below (POOL).
        return dict(oracle=dict(n_conv=40, prompt_len=1024, K=32, policies=ALL_POLICIES, budgets=[128, 512],
                                pacings=["fixed", "pressure"], pool=POOL))
    if size == "granularity":
        # Issue 23 item 8: the granularity axis (Random and StreamingLLM keep the same set at every
        # granularity: their scores do not depend on attention, so they are left out)
        return dict(oracle=dict(n_conv=40, prompt_len=1024, K=32, policies=["h2o", "tova", "scissorhands"],
                                budgets=[128, 512], pacings=["fixed", "pressure"], pool=POOL,
                                granularities=["request", "layer", "head"]))
    if size == "keyonly":
        # Issue 26: the key-only policies at their default (head) token sets, the same 40
        # conversations (H2O at head sets: the --granularity result)
        return dict(oracle=dict(n_conv=40, prompt_len=1024, K=32, policies=["knorm", "keydiff", "expected_attention"],
                                budgets=[128, 512], granularities=["head"], keyonly=True))
    if size == "prefill":
        # Issue 25: the quality cost of evicting between prefill chunks against evicting after the
        # whole prompt, same budget, both at each policy's default token sets (fixed pacing only)
        return dict(oracle=dict(n_conv=40, prompt_len=1024, K=32, policies=["h2o", "tova", "snapkv"],
                                budgets=[128, 512], prefill=["after", "chunks"], prefill_chunk=256))
    if size == "compress":
        # Issue 26: SnapKV as its paper runs it, the prompt compressed (between prefill chunks, to
        # the budget) and every generated token kept: slack 128 (the SLA run's output length) is
        # never reached by a decode step, score_every 1000 asks no decode step for statistics
        return dict(oracle=dict(n_conv=40, prompt_len=1024, K=32, policies=["snapkv"], budgets=[512],
                                prefill=["chunks"], prefill_chunk=256, slack=128, score_every=1000))
    return dict(oracle=dict(n_conv=3, prompt_len=1024, K=64, policies=ALL_POLICIES, budgets=[128, 256, 512]),
                engine=dict(n_conv=3, prompt_len=1536, K=64, policies=ALL_POLICIES, budgets=[128, 256, 512]))


#: the pool the conversations share under pressure pacing (--scale): 160 blocks of 32 tokens
#: (5,120 tokens: about five 1,024-token prompts), at most 8 running requests, no watermark.
POOL = dict(pool_blocks=160, block_size=32, max_num_seqs=8, watermark_blocks=0)


def pressure_schedules(n: int, prompt_len: int, K: int, budget: int, *, pool_blocks: int, block_size: int,
                       max_num_seqs: int, watermark_blocks: int = 0) -> tuple[list[dict[int, int]], dict]:
    """Per-request eviction schedules (decode step -> tokens) that pressure pacing produces when
    ``n`` requests of ``prompt_len`` prompt tokens and ``K`` output tokens arrive together and
    share a pool of ``pool_blocks`` blocks.

    A step model of the engine's rule (``VTokenSchedulerMixin._vt_pressure_plan``): the step's
    block demand is each running request's growth plus the next waiting prompt (when fewer than
    ``max_num_seqs`` run) plus the watermark; a demand above the free blocks is covered by
    :func:`vtoken.pacing.plan_pressure_evictions` (never below ``budget``), emptied blocks go
    back to the pool, then running requests grow by one token and at most one waiting request
    is admitted (its prompt's blocks must be free). Decode step ``d`` is the request's ``d``-th
    decode forward, the numbering of ``oracle_generate(evict_schedule=...)``.

    Returns:
        (one schedule per request in arrival order, stats: steps, peak running, pressure
        events, evicted tokens).

    Raises:
        RuntimeError: the pool cannot hold the running requests at their budget (vLLM would
            preempt; the model does not), or a prompt never fits.
    """
    from collections import deque

    from vtoken.pacing import Candidate, plan_pressure_evictions

    B = block_size
    cd = lambda a: -(-a // B)  # noqa: E731
    if cd(prompt_len) + watermark_blocks > pool_blocks:
        raise RuntimeError(f"pool_blocks = {pool_blocks}: a {prompt_len}-token prompt never fits")
    free = pool_blocks
    waiting = deque(range(n))
    running: list[dict] = []
    sched: list[dict[int, int]] = [dict() for _ in range(n)]
    st = dict(steps=0, peak_running=0, pressure_events=0, evicted_tokens=0)
    while waiting or running:
        st["steps"] += 1
        demand = sum(max(0, cd(r["live"] + 1) - r["held"]) for r in running)
        if waiting and len(running) < max_num_seqs:
            demand += cd(prompt_len)
        shortfall = demand + watermark_blocks - free
        if shortfall > 0 and running:
            cands = [Candidate(str(r["i"]), o, r["live"], r["held"], budget) for o, r in enumerate(running)]
            plan, _ = plan_pressure_evictions(cands, shortfall, B)
            st["pressure_events"] += 1
            for r in running:
                k = plan.get(str(r["i"]), 0)
                if k > 0:
                    sched[r["i"]][r["d"] + 1] = k
                    st["evicted_tokens"] += k
                    r["live"] -= k
                    free += r["held"] - cd(r["live"])
                    r["held"] = cd(r["live"])
        for r in list(running):
            need = cd(r["live"] + 1) - r["held"]
            if need > free:
                raise RuntimeError(f"pool_blocks = {pool_blocks} cannot hold {len(running)} requests at budget "
                                   f"{budget} (vLLM would preempt); use a larger pool or fewer max_num_seqs")
            free -= need
            r["held"] += need
            r["live"] += 1
            r["d"] += 1
            if r["d"] == K - 1:  # its last token: the request finishes and frees its blocks
                free += r["held"]
                running.remove(r)
        if waiting and len(running) < max_num_seqs and free - watermark_blocks >= cd(prompt_len):
            i = waiting.popleft()
            running.append(dict(i=i, live=prompt_len, held=cd(prompt_len), d=0))
            free -= cd(prompt_len)
        st["peak_running"] = max(st["peak_running"], len(running))
    return sched, st


class PrefillMemo:
    """Wraps a HF causal LM: a forward of more than one input token into an **empty** cache (a
    prompt, or a chunked prompt's first chunk) is computed once per input, with attention
    probabilities, and replayed into later runs' empty caches (the K/V of every layer cloned), so
    the configurations of one conversation share one prefill. Forwards into a non-empty cache
    (later prefill chunks, decode steps) always run. Outputs are the same tensors a fresh forward
    computes (same inputs, same model, deterministic CPU). Keeps the last ``keep`` inputs."""

    def __init__(self, model, keep: int = 2):
        self._model = model
        self._keep = keep
        self._memo: dict[tuple, tuple] = {}  # input ids -> (K/V per layer, outputs)

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *, input_ids, past_key_values, output_attentions=False, **kw):
        if input_ids.shape[1] == 1 or past_key_values.get_seq_length() > 0:
            return self._model(input_ids=input_ids, past_key_values=past_key_values,
                               output_attentions=output_attentions, **kw)
        key = tuple(input_ids[0].tolist())
        projs = [m for name, m in self._model.named_modules() if name.endswith("self_attn.q_proj")]
        if key not in self._memo:
            # the queries too (Expected Attention's oracle reads them through forward hooks on q_proj)
            qs: list = [None] * len(projs)
            hooks = [m.register_forward_hook(lambda _m, _i, o, j=j: qs.__setitem__(j, o.detach().clone()))
                     for j, m in enumerate(projs)]
            try:
                out = self._model(input_ids=input_ids, past_key_values=past_key_values, output_attentions=True,
                                  **kw)
            finally:
                for h in hooks:
                    h.remove()
            kv = [(layer.keys.clone(), layer.values.clone()) for layer in past_key_values.layers]
            while len(self._memo) >= self._keep:
                self._memo.pop(next(iter(self._memo)))
            self._memo[key] = (kv, out, qs)
        else:
            kv, out, qs = self._memo[key]
            for i, (k, v) in enumerate(kv):
                past_key_values.update(k.clone(), v.clone(), i)
            for m, q in zip(projs, qs):  # replay the q_proj outputs to whatever hooks the caller holds
                for hook in list(m._forward_hooks.values()):
                    hook(m, (), q)
        from types import SimpleNamespace

        return SimpleNamespace(logits=out.logits, attentions=out.attentions if output_attentions else None)


class TeacherForced:
    """Wraps a HF causal LM: decode-step inputs (one token) are replaced by ``forced`` in order.

    ``oracle_generate`` feeds its own greedy sample at each decode step; with this wrapper the
    ``d``-th decode forward receives ``forced[d - 1]`` instead, at the same logical position.
    Everything else (config, parameters, the cache) is the wrapped model's.
    """

    def __init__(self, model, forced: list[int]):
        self._model = model
        self._forced = list(forced)
        self._d = 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *, input_ids, **kw):
        import torch

        if input_ids.shape[1] == 1:  # a decode step
            input_ids = torch.tensor([[self._forced[self._d]]], dtype=input_ids.dtype, device=input_ids.device)
            self._d += 1
        return self._model(input_ids=input_ids, **kw)


#: block size of the retained-blocks figures of the granularity run (the engine's CPU block size)
RETAINED_BLOCK = 32


def retained_blocks(res, block_size: int) -> dict:
    """Blocks held after the last step by vToken and by Naive-Evict for the same decisions.

    vToken: ``ceil(live / B)`` (every set dense in slots ``0..live-1``). Naive-Evict: tokens stay
    at their logical slot (``position // B`` is the block), and a block returns to the pool only
    when no token in it is live in **any** token set (``docs/granularity.md``: with per-head sets
    the survivors scatter over more blocks). The last generated token (not yet cached) counts in
    neither.
    """
    sets = res.live_positions_sets if res.live_positions_sets is not None else [res.live_positions]
    naive = len({int(p) // block_size for s in sets for p in s})
    return dict(vtoken_blocks=cdiv(len(res.live_positions), block_size), naive_blocks=naive)


def peak_live(res, chunks: list[int] | None) -> int:
    """The most tokens the request held at once (prefill chunks included): each chunk is
    appended after the eviction before it (``res.prefill_evicted_positions``, one entry per chunk
    boundary when evicting by chunks), then the decode steps' ``res.num_live``."""
    live, peak = 0, 0
    evicted = res.prefill_evicted_positions or []
    for i, q in enumerate(chunks or [res.prompt_len]):
        if i and evicted:
            live -= len(evicted[i - 1])
        live += q
        peak = max(peak, live)
    return max(peak, max(res.num_live))


def plan_settings(p: dict) -> dict:
    """The plan's settings for every configuration (``slack``, ``score_every``; --compress)."""
    return {k: p[k] for k in ("slack", "score_every") if k in p}


def oracle_configs(p: dict) -> list:
    """``None`` (the full cache) then every (policy, budget, pacing, granularity, prefill
    eviction) of the plan (``None`` for an axis the plan does not have)."""
    pacings = p.get("pacings", ["fixed"])
    grans = p.get("granularities", [None])
    prefill = p.get("prefill", [None])
    return [None] + [(pol, b, pc, g, pe) for pol in p["policies"] for b in p["budgets"] for pc in pacings
                     for g in grans for pe in prefill]


def summarize(configs: list, rows: list[dict], p: dict | None = None) -> list[dict]:
    """Per configuration: means over its rows (conversations), ΔNLL against the same
    conversation's full-cache row; with a granularity, the retained-blocks means too."""
    summary = []
    full = {r["conv"]: r for r in rows if r["policy"] == "full"}
    for conf in configs:
        pol, b, pc, g, pe = conf if conf else ("full", None, None, None, None)
        rs = [r for r in rows if r["policy"] == pol and r["budget"] == b and r["pacing"] == pc
              and r.get("granularity") == g and r.get("prefill_eviction") == pe]
        nll = mean(r["nll"] for r in rs)
        summary.append(dict(policy=pol, budget=b, pacing=pc, **({} if g is None else dict(granularity=g)),
                            **({} if pe is None else dict(prefill_eviction=pe)),
                            **({} if conf is None else plan_settings(p or {})),
                            n=len(rs), nll=nll, ppl=math.exp(nll),
                            delta_nll=mean(r["nll"] - full[r["conv"]]["nll"] for r in rs),
                            top1_acc=mean(r["top1_acc"] for r in rs), agree_full=mean(r["agree_full"] for r in rs),
                            mean_final_live=mean(r["final_live"] for r in rs),
                            **({} if g is None or conf is None else dict(
                                vtoken_blocks=mean(r["vtoken_blocks"] for r in rs),
                                naive_blocks=mean(r["naive_blocks"] for r in rs))),
                            **({} if pe is None or conf is None else dict(
                                mean_peak_live=mean(r["peak_live"] for r in rs)))))
    return summary


def from_partial(path: Path, out_path: Path) -> dict:
    """The result of an interrupted run from its ``.partial.json`` (rows of the conversations it
    finished): summary over those conversations only; ``meta.partial`` says how many of how many."""
    part = json.loads(Path(path).read_text())
    p, done = part["config"], part["done_convs"]
    rows = [r for r in part["rows"] if r["conv"] < done]
    pool_stats = {}
    if "pressure" in p.get("pacings", []):
        for b in p["budgets"]:
            pool_stats[b] = pressure_schedules(p["n_conv"], p["prompt_len"], p["K"], b, **p["pool"])[1]
    orc = dict(config=p, rows=rows, summary=summarize(oracle_configs(p), rows, p), pool_stats=pool_stats)
    size = ("keyonly" if p.get("keyonly") else "granularity" if "granularities" in p else "compress" if "slack" in p
            else "prefill" if "prefill" in p
            else "scale")
    res = dict(meta=run_metadata(benchmark="quality", size=size,
                                 seeds=dict(data_shuffle=SEED + 1, engine=0, random_policy=0),
                                 model="SmolLM2-135M-Instruct (oracle fp32 HF eager)", plan=dict(oracle=p),
                                 partial=dict(done_convs=done, n_conv=p["n_conv"], from_file=str(path)),
                                 total_wall_s=sum(r["wall_s"] for r in rows), load_average_at_end=os.getloadavg()),
               oracle=orc)
    write_json(out_path, res)
    return res


def oracle_part(p: dict, bar, partial: Path | None = None, resume: dict | None = None) -> dict:
    """Every conversation through every config of plan ``p`` on the fp32 oracle; after each
    conversation the rows so far go to ``partial``. ``resume`` (a ``.partial.json`` of the same
    plan) keeps its finished conversations and runs the others.

    Raises:
        ValueError: ``resume`` was written for another plan.
    """
    import torch

    from vtoken.config import VTokenConfig
    from reference.oracle import load_oracle_model, oracle_generate

    model = PrefillMemo(load_oracle_model(smollm2(), dtype=torch.float32))
    convs = load_long_conversations(p["n_conv"], p["prompt_len"] + p["K"], seed=SEED + 1)
    rows, done = [], 0
    if resume is not None:
        if resume["config"] != json.loads(json.dumps(p)):
            raise ValueError(f"--resume: the partial file's plan {resume['config']} is not this run's plan {p}")
        rows, done = resume["rows"], resume["done_convs"]
    pacings = p.get("pacings", ["fixed"])
    configs = oracle_configs(p)
    schedules, pool_stats = {}, {}
    if "pressure" in pacings:
        for b in p["budgets"]:
            schedules[b], pool_stats[b] = pressure_schedules(p["n_conv"], p["prompt_len"], p["K"], b, **p["pool"])
    if done:
        bar.update(done * len(configs))
    for ci, c in enumerate(convs):
        if ci < done:
            continue
        prompt = c["ids"][: p["prompt_len"]]
        target = c["ids"][p["prompt_len"]: p["prompt_len"] + p["K"]]
        full_argmax = None
        for conf in configs:
            bar.set_postfix_str(f"oracle c{ci} {conf}")
            pol, b, pc, g, pe = conf if conf else ("full", None, None, None, None)
            # no granularity on an axis: one token set per request (what the committed runs of
            # those axes used); the prefill axis runs both of its arms at the policies' defaults
            cfg = None if conf is None else VTokenConfig(policy=pol, budget=b, pacing=pc, **(
                dict(granularity="request") if g is None and pe is None else {} if g is None else dict(granularity=g)),
                **({} if pe is None else dict(prefill_eviction=pe, prefill_eviction_every=p["prefill_chunk"])),
                **plan_settings(p))
            sched = schedules[b][ci] if pc == "pressure" else None
            chunks = None
            if pe is not None:  # the eviction points: full chunks, then the rest (the oracle cuts there too)
                C = p["prefill_chunk"]
                chunks = [C] * (p["prompt_len"] // C) + ([p["prompt_len"] % C] if p["prompt_len"] % C else [])
            t0 = time.perf_counter()
            res = oracle_generate(TeacherForced(model, target[:-1]), prompt, p["K"], cfg, return_logits=True,
                                  evict_schedule=sched)
            lp = [torch.log_softmax(lg.double(), dim=-1) for lg in res.logits]
            nll = [-float(l[t]) for l, t in zip(lp, target)]
            am = [int(torch.argmax(lg)) for lg in res.logits]
            if conf is None:
                full_argmax = am
            rows.append(dict(conv=ci, conv_id=c["id"], policy=pol, budget=b, pacing=pc, **(
                             {} if g is None else dict(granularity=g)), nll=mean(nll),
                             nll_per_pos=nll, top1_acc=mean(a == t for a, t in zip(am, target)),
                             agree_full=mean(a == f for a, f in zip(am, full_argmax)),
                             evicted=res.num_evicted, final_live=res.num_live[-1],
                             **({} if g is None else retained_blocks(res, RETAINED_BLOCK)),
                             **({} if pe is None else dict(prefill_eviction=pe, peak_live=peak_live(res, chunks),
                                                           prefill_evicted=sum(len(e) for e in
                                                                               res.prefill_evicted_positions))),
                             wall_s=time.perf_counter() - t0))
            bar.update(1)
        if partial is not None:
            write_json(partial, dict(config=p, rows=rows, done_convs=ci + 1))
    summary = summarize(configs, rows, p)
    return dict(config=p, rows=rows, summary=summary, pool_stats=pool_stats)


def engine_part(p: dict, bar) -> dict:
    model = smollm2()
    convs = load_long_conversations(p["n_conv"], p["prompt_len"], seed=SEED + 1)
    reqs, meta = [], {}
    configs = [None] + [(pol, b) for pol in p["policies"] for b in p["budgets"]]
    for ci, c in enumerate(convs):
        for conf in configs:
            rid = f"c{ci}.full" if conf is None else f"c{ci}.{conf[0]}.{conf[1]}"
            ex = dict(vtoken_enable=False) if conf is None else dict(vtoken_policy=conf[0], vtoken_budget=conf[1])
            reqs.append(dict(id=rid, prompt_token_ids=c["ids"][: p["prompt_len"]], max_tokens=p["K"],
                             ignore_eos=True, extra_args=ex))
            meta[rid] = (ci, conf)
    B = 32
    nb = len(reqs) * (cdiv(p["prompt_len"] + p["K"], B) + 1) + 16
    spec = dict(engine=engine_kwargs(model, dtype="bfloat16", block_size=B, max_model_len=p["prompt_len"] + p["K"] + B,
                                     num_blocks=nb),
                vtoken=dict(policy="h2o", budget=256), requests=reqs, check=False)
    bar.set_postfix_str("engine")
    t0 = time.perf_counter()
    out = run_engine(spec)
    bar.update(1)
    rows = []
    for rid, (ci, conf) in meta.items():
        if conf is None:
            continue
        ref = out["tokens"][f"c{ci}.full"]
        got = out["tokens"][rid]
        first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        rows.append(dict(conv=ci, policy=conf[0], budget=conf[1], first_divergence=first,
                         prefix_agreement=first / len(ref), positional_agreement=mean(a == b for a, b in zip(got, ref))))
    summary = []
    for conf in configs[1:]:
        rs = [r for r in rows if r["policy"] == conf[0] and r["budget"] == conf[1]]
        summary.append(dict(policy=conf[0], budget=conf[1], n=len(rs),
                            prefix_agreement=mean(r["prefix_agreement"] for r in rs),
                            positional_agreement=mean(r["positional_agreement"] for r in rs),
                            mean_first_divergence=mean(r["first_divergence"] for r in rs)))
    return dict(config=p, rows=rows, summary=summary, engine_wall_s=time.perf_counter() - t0,
                preemptions=out["preemptions"], tokens=out["tokens"])


#: line style per policy: distinct markers and dashes so that equal series stay visible
_STYLES = {"h2o": dict(marker="o", ls="-", ms=11, lw=2.5), "scissorhands": dict(marker="^", ls="--", ms=7, lw=2),
           "random": dict(marker="s", ls=":", ms=7, lw=2), "tova": dict(marker="D", ls="-.", ms=6, lw=2),
           "streaming": dict(marker="v", ls=(0, (5, 2, 1, 2)), ms=6, lw=2)}


def plot(res: dict, path: Path) -> None:
    """Three panels over the budget (tokens; ticks at the measured budgets): teacher-forced NLL
    (nats/token, y from 0, the full cache dashed), next-token agreement with the full cache and
    greedy prefix agreement inside vLLM (fractions, y from 0 to 1). Series that coincide are
    named in the panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    osum = [s for s in res["oracle"]["summary"] if s["policy"] != "full"]
    esum = res["engine"]["summary"]
    full_nll = next(s["nll"] for s in res["oracle"]["summary"] if s["policy"] == "full")
    panels = [(axes[0], osum, "nll"), (axes[1], osum, "agree_full"), (axes[2], esum, "prefix_agreement")]
    budgets = sorted({s["budget"] for s in osum} | {s["budget"] for s in esum})
    for ax, summ, key in panels:
        series: dict[str, tuple] = {}
        for pol in dict.fromkeys(s["policy"] for s in summ):
            ss = sorted((s for s in summ if s["policy"] == pol), key=lambda s: s["budget"])
            xs, ys = [s["budget"] for s in ss], [s[key] for s in ss]
            series[pol] = (tuple(xs), tuple(round(y, 9) for y in ys))
            ax.plot(xs, ys, label=pol, **_STYLES.get(pol, dict(marker="o", ls="-")))
        same = [[p for p, v in series.items() if v == val] for val in dict.fromkeys(series.values())]
        same = [g for g in same if len(g) > 1]
        if same:
            ax.text(0.03, 0.97, "; ".join(" = ".join(g) for g in same) + " (lines overlap)", transform=ax.transAxes,
                    fontsize=10, va="top")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_xlim(budgets[0] / 1.25, budgets[-1] * 1.25)
        ax.set_xlabel("budget (tokens)", fontsize=11)
        ax.tick_params(labelsize=10)
    axes[0].axhline(full_nll, color="k", ls="--", label="full cache")
    axes[0].set_ylim(0, 1.1 * max(max(s["nll"] for s in osum), full_nll))
    axes[0].set_ylabel("NLL (nats/token)", fontsize=11)
    for ax in axes[1:]:
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("fraction", fontsize=11)
    oc, ec = res["oracle"]["config"], res["engine"]["config"]
    axes[0].set_title(f"A: teacher-forced NLL of the next {oc['K']} real tokens\n"
                      f"(prompt {oc['prompt_len']}, fp32 oracle)", fontsize=11)
    axes[1].set_title(f"A: next-token agreement with the full cache\n({oc['K']} positions, fp32 oracle)", fontsize=11)
    axes[2].set_title(f"B: greedy prefix agreement, {ec['K']} tokens\n(vLLM bf16, prompt {ec['prompt_len']})",
                      fontsize=11)
    for ax in axes:
        ax.legend(fontsize=10, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def plot_scale(res: dict, path: Path) -> None:
    """Two panels over the budget (tokens): teacher-forced NLL (nats/token; the full cache dashed)
    and next-token agreement with the full cache, one colour per policy, solid = fixed pacing,
    dotted = pressure pacing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = [s for s in res["oracle"]["summary"] if s["policy"] != "full"]
    full_nll = next(s["nll"] for s in res["oracle"]["summary"] if s["policy"] == "full")
    budgets = sorted({s["budget"] for s in summ})
    colours = dict(zip(ALL_POLICIES, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key in ((axes[0], "nll"), (axes[1], "agree_full")):
        for pol in dict.fromkeys(s["policy"] for s in summ):
            for pc, ls in (("fixed", "-"), ("pressure", ":")):
                ss = sorted((s for s in summ if s["policy"] == pol and s["pacing"] == pc), key=lambda s: s["budget"])
                if ss:
                    ax.plot([s["budget"] for s in ss], [s[key] for s in ss], ls=ls, marker="o",
                            color=colours.get(pol), label=f"{pol}, {pc}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("budget (tokens)")
    axes[0].axhline(full_nll, color="k", ls="--", label="full cache")
    axes[0].set_ylim(0, 1.1 * max(max(s["nll"] for s in summ), full_nll))
    axes[0].set_ylabel("NLL (nats/token)")
    axes[1].set_ylim(0, 1.05)
    axes[1].set_ylabel("fraction")
    c = res["oracle"]["config"]
    pool = c.get("pool", {})
    axes[0].set_title(f"teacher-forced NLL of the next {c['K']} real tokens\n"
                      f"({c['n_conv']} conversations, prompt {c['prompt_len']}, fp32 oracle)", fontsize=10)
    axes[1].set_title(f"next-token agreement with the full cache\n(pressure: {c['n_conv']} requests share "
                      f"{pool.get('pool_blocks')} blocks x {pool.get('block_size')}, max {pool.get('max_num_seqs')} running)",
                      fontsize=10)
    axes[1].legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def plot_granularity(res: dict, path: Path) -> None:
    """ΔNLL over the full cache (left) and next-token agreement (right) per (policy, budget,
    pacing), one bar per granularity (request / layer / head), so the three sit side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = [s for s in res["oracle"]["summary"] if s["policy"] != "full"]
    grans = list(dict.fromkeys(s["granularity"] for s in summ))
    groups = list(dict.fromkeys((s["policy"], s["budget"], s["pacing"]) for s in summ))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    w = 0.8 / len(grans)
    for ax, key, label in ((axes[0], "delta_nll", "ΔNLL vs full cache (nats/token)"),
                           (axes[1], "agree_full", "next-token agreement with the full cache")):
        for i, g in enumerate(grans):
            vals = [next(s[key] for s in summ if (s["policy"], s["budget"], s["pacing"]) == grp and s["granularity"] == g)
                    for grp in groups]
            ax.bar([x + (i - (len(grans) - 1) / 2) * w for x in range(len(groups))], vals, w, label=g)
        ax.set_xticks(range(len(groups)), [f"{p}\n{b}, {pc}" for p, b, pc in groups], fontsize=7)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[1].set_ylim(0, 1.05)
    axes[0].legend(title="token sets")
    c = res["oracle"]["config"]
    n = max(s["n"] for s in summ)  # (an interrupted run's result: the conversations it finished)
    fig.suptitle(f"{'key-only policies' if c.get('keyonly') else 'granularity'}: {n} conversations, prompt "
                 f"{c['prompt_len']}, next {c['K']} real tokens teacher-forced (fp32 oracle)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def plot_prefill(res: dict, path: Path) -> None:
    """ΔNLL over the full cache (left) and next-token agreement (right) per (policy, budget), one
    bar for eviction after the whole prompt and one for eviction between prefill chunks; the
    mean peak tokens held is written above each pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = [s for s in res["oracle"]["summary"] if s["policy"] != "full"]
    modes = list(dict.fromkeys(s["prefill_eviction"] for s in summ))
    groups = list(dict.fromkeys((s["policy"], s["budget"]) for s in summ))
    c = res["oracle"]["config"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    w = 0.8 / len(modes)
    label_of = dict(after="after the whole prompt", chunks=f"between {c['prefill_chunk']}-token chunks")
    for ax, key, label in ((axes[0], "delta_nll", "ΔNLL vs full cache (nats/token)"),
                           (axes[1], "agree_full", "next-token agreement with the full cache")):
        for i, m in enumerate(modes):
            ss = [next(s for s in summ if (s["policy"], s["budget"]) == g and s["prefill_eviction"] == m)
                  for g in groups]
            xs = [x + (i - (len(modes) - 1) / 2) * w for x in range(len(groups))]
            bars = ax.bar(xs, [s[key] for s in ss], w, label=f"{label_of.get(m, m)}")
            if key == "delta_nll":
                ax.bar_label(bars, [f"peak {s['mean_peak_live']:.0f}" for s in ss], fontsize=7, rotation=90,
                             padding=2)
        ax.set_xticks(range(len(groups)), [f"{p}\nbudget {b}" for p, b in groups], fontsize=8)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylim(0, 1.3 * max(s["delta_nll"] for s in summ))
    axes[1].set_ylim(0, 1.05)
    axes[0].legend(title="prompt cut to the budget", fontsize=8)
    n = max(s["n"] for s in summ)  # (an interrupted run's result: the conversations it finished)
    fig.suptitle(f"prefill eviction: {n} conversations, prompt {c['prompt_len']}, next {c['K']} real "
                 "tokens teacher-forced (fp32 oracle, decide_on worker, each policy's default token sets)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def plot_result(res: dict, path: Path) -> None:
    """The plot of a result, by its plan: granularity, prefill, scale (oracle only) or the
    small/full two-part figure."""
    c = res["oracle"]["config"]
    if "granularities" in c:
        plot_granularity(res, path)
    elif "prefill" in c:
        plot_prefill(res, path)
    else:
        (plot if "engine" in res else plot_scale)(res, path)


def main(argv=None) -> int:
    args, out_path = parse_size_args(argv, __doc__.splitlines()[0], "quality", extra_sizes=("scale", "granularity", "prefill", "keyonly", "compress"),
                                     from_partial=True)
    if args.from_partial:
        plot_result(from_partial(args.from_partial, out_path), out_path.with_suffix(".png"))
        return 0
    if args.replot:
        plot_result(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return 0
    from tqdm import tqdm

    p = plan(args.size)
    t_start = time.perf_counter()
    o = p["oracle"]
    runs = o["n_conv"] * (1 + len(o["policies"]) * len(o["budgets"]) * len(o.get("pacings", ["fixed"]))
                          * len(o.get("granularities", [None])) * len(o.get("prefill", [None])))
    bar = tqdm(total=runs + ("engine" in p), desc="runs", unit="run")
    eng = engine_part(p["engine"], bar) if "engine" in p else None
    resume = json.loads(args.resume.read_text()) if args.resume else None
    orc = oracle_part(o, bar, partial=out_path.with_suffix(".partial.json"), resume=resume)
    bar.close()
    res = dict(meta=run_metadata(benchmark="quality", size=args.size, seeds=dict(data_shuffle=SEED + 1, engine=0,
                                 random_policy=0), model="SmolLM2-135M-Instruct (oracle fp32 HF eager; engine bf16)",
                                 plan=p, total_wall_s=time.perf_counter() - t_start,
                                 resumed_convs=resume["done_convs"] if resume else 0,
                                 load_average_at_end=os.getloadavg()),
               oracle=orc)
    if eng is not None:
        res["engine"] = eng
    write_json(out_path, res)
    out_path.with_suffix(".partial.json").unlink(missing_ok=True)
    plot_result(res, out_path.with_suffix(".png"))
    print(f"{'policy':13} {'budget':>6} {'pacing':>8} {'gran':>8} {'prefill':>7} {'NLL':>6} {'dNLL':>6} {'agree':>6} {'top1':>6} | {'greedy prefix':>13} {'positional':>10}")
    for s in orc["summary"]:
        e = next((x for x in (eng or {}).get("summary", []) if x["policy"] == s["policy"] and x["budget"] == s["budget"]), None)
        es = f"{e['prefix_agreement']:13.2f} {e['positional_agreement']:10.2f}" if e else ""
        print(f"{s['policy']:13} {str(s['budget']):>6} {str(s['pacing']):>8} {str(s.get('granularity')):>8} {str(s.get('prefill_eviction')):>7} {s['nll']:6.3f} {s['delta_nll']:+6.3f} "
              f"{s['agree_full']:6.2f} {s['top1_acc']:6.2f} | {es}")
    print(f"total {res['meta']['total_wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
