"""The vToken scheduler: counts how many tokens each request evicts and frees tail blocks.

:class:`VTokenSchedulerMixin` holds the logic; vLLM's choice of scheduling picks the class:
:class:`VTokenScheduler` (``Scheduler``, sync scheduling) or :class:`VTokenAsyncScheduler`
(``AsyncScheduler``, async scheduling with a batch queue of 2); patches/ entries
``vllm.v1.core.sched.scheduler.Scheduler`` and ``vllm.v1.core.sched.async_scheduler.AsyncScheduler``.

One eviction path (``docs/eviction.md``): the scheduler decides **how many**, the worker
decides **which**. Per step, before the stock ``schedule()``, for each running request past its
prefill (or, with ``prefill_eviction: chunks``, between two chunks of its prompt): ``k`` from
fixed pacing (``live > budget + slack``: down to the budget) or the pressure plan, capped at the
tokens no protection covers (:func:`vtoken.counts.evictable`); the request's tail blocks past
``cdiv(live - k + 1, B)`` go back to vLLM's block pool (Naive-Evict mode keeps the blocks the
worker reports still hold a live token). The per-request integers are rows of one numpy array
(``sched/counts.py``); nothing here touches a token, a score or a policy's state.

Then the stock ``schedule()`` runs; allocation counts live tokens
(:class:`~vtoken.integrations.vllm.sched.accounting.VTokenFullAttentionManager`). The step's
tokens are counted, scored steps are asked for, and a
:class:`~vtoken.integrations.vllm.protocol.StepPayload` rides on the ``SchedulerOutput`` to the
workers, which select, move and fold statistics on the device. Whether a request is past its
prefill, and so when eviction starts, is decided here from scheduler state, never from when
outputs arrive, so async and sync scheduling make the same decisions.

A preempted request keeps its state under ``mode: vtoken``: the worker saves its live K/V and
policy state and restores them when vLLM resumes it, which recomputes nothing
(:meth:`_preempt_request`); under ``mode: naive`` it restarts from its prompt. A fault confined
to one request is logged naming it and counted in ``vtoken:request_faults_total``: a bad
override or a failure here turns eviction off for that request; a failure on the worker (a
policy exception, non-finite statistics) ends the request with an error; every other request
continues untouched.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from itertools import repeat
from typing import Any, Optional

import numpy as np

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from vtoken.config import RequestPlan, VTokenConfig, VTokenConfigError, parse_config, parse_request_overrides
from vtoken.integrations.vllm.sched.accounting import BlockAccounting, VTokenFullAttentionManager
from vtoken.integrations.vllm.sched.checks import check_invariants, trace_record
from vtoken.integrations.vllm.sched import counts as C
from vtoken.integrations.vllm.sched.counts import CountColumns, CountState
from vtoken.integrations.vllm.sched.metrics import VTokenMetrics
from vtoken.integrations.vllm.protocol import StepPayload, WorkerSpec
from vtoken.integrations.vllm.sched.state import RequestState, VTokenStats, cdiv
from vtoken.policies.base import AttentionNeed
from vtoken.pacing import Candidate, plan_pressure_evictions
from vtoken.counts import evictable

logger = logging.getLogger("vllm.vtoken")  # a child of vLLM's logger: same handlers and format

__all__ = ["VTokenScheduler", "VTokenAsyncScheduler", "VTokenSchedulerMixin", "VTokenFullAttentionManager",
           "RequestState", "VTokenStats"]



def _as_slice(rows: np.ndarray) -> Optional[slice]:
    """``rows`` as a slice when they are consecutive ascending rows (all >= 0), else None."""
    n = len(rows)
    if n == 0 or rows[0] < 0 or rows[n - 1] - rows[0] != n - 1 or (n > 1 and not (np.diff(rows) == 1).all()):
        return None
    return slice(int(rows[0]), int(rows[0]) + n)


class VTokenSchedulerMixin:
    """Token-level eviction and block reclamation for a V1 ``Scheduler`` (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        raw = (self.vllm_config.additional_config or {}).get("vtoken", {})
        self.vt_cfg: VTokenConfig = parse_config(raw)
        mgrs = self.kv_cache_manager.coordinator.single_type_managers
        if len(mgrs) != 1 or type(mgrs[0]) is not FullAttentionManager:
            raise ValueError(
                "vToken supports models whose only KV-cache group is full attention; got managers "
                f"{[type(m).__name__ for m in mgrs]} (sliding-window, hybrid and Mamba models are not supported)"
            )
        self._vt_states: dict[str, RequestState] = {}
        mgr = mgrs[0]
        mgr.__class__ = VTokenFullAttentionManager
        self._vt_accounting = BlockAccounting(self._vt_states, mgr.block_size)
        mgr.vt_attach(self._vt_accounting)
        self._vt_mgr = mgr
        self._vt_bs: int = mgr.block_size
        #: vLLM prefix caching on (the user's choice; vToken keeps it): see _vt_prefix_rule
        self._vt_caching: bool = bool(self.kv_cache_manager.enable_caching)
        #: prefill_eviction: chunks: requests evict between prefill chunks too
        self._vt_chunks: bool = self.vt_cfg.resolved_prefill_eviction() == "chunks"
        self._vt_is_async: bool = isinstance(self, AsyncScheduler)
        self._vt_gauges_at = float("-inf")
        #: requests the stock schedule() preempted in this step (their evictions are dropped)
        self._vt_preempted_now: set[str] = set()
        #: preempted requests whose state is kept (mode vtoken), until vLLM resumes them; and
        #: those preempted in this schedule() (announced to the worker: payload.suspend)
        self._vt_suspended: dict[str, RequestState] = {}
        self._vt_suspended_now: set[str] = set()
        #: prefix caching: tail blocks vToken returned to the pool in this schedule() (this step's
        #: moves may still read them, so a copy of a cached block never goes to one)
        self._vt_released_now: list = []
        #: each request's plan (its config resolved once when it arrives; None: no eviction) and
        #: whether it may evict (``RequestPlan.may_evict``, computed then too)
        self._vt_plans: dict[str, tuple[Optional[RequestPlan], bool]] = {}
        #: prefill_eviction chunks, a request that may evict: req_id -> prefill_eviction_every
        #: (its eviction points; vLLM's chunks are cut there: _reserve_prefill_lookahead)
        self._vt_points: dict[str, int] = {}
        self._vt_offset_updates: dict[str, int] = {}
        #: states made in this schedule() (announced to the worker on the payload)
        self._vt_new_states: dict[str, RequestState] = {}
        #: mode naive: requests whose Naive-Evict count the worker lowered
        #: since the last schedule() (their released tail blocks go back to the pool in the next)
        self._vt_naive_pending: set[str] = set()
        #: hit copies made in this step (_vt_copy_hit), rid -> unshare entries
        self._vt_hit_copies: dict[str, list[tuple[int, int, int]]] = {}
        #: the states' per-request integers (sched/counts.py) and each state's row
        self._vt_cols = CountColumns()
        self._vt_rows: dict[str, int] = {}
        #: bumped whenever _vt_rows changes (the per-step row look-ups are cached against it)
        self._vt_rows_version = 0
        self._vt_rows_cache: dict[str, tuple] = {}
        self._vt_run_cache: Optional[tuple] = None
        self.vt_stats = VTokenStats()
        self._vt_metrics = VTokenMetrics.from_vllm_config(self.vllm_config)
        # Debug aids (tests, soak): VTOKEN_CHECK=1 checks the invariants after every
        # schedule(); VTOKEN_TRACE=<path> appends one JSON line per step.
        self._vt_check = os.environ.get("VTOKEN_CHECK", "0") not in ("", "0")
        trace = os.environ.get("VTOKEN_TRACE")
        self._vt_trace = open(trace, "a", buffering=1) if trace else None
        self._vt_step_no = 0
        self._vt_freed_this_step: list[int] = []
        #: finished requests' lifetime figures with their eviction logs (the oracle tests and the
        #: benchmarks replay them): kept only under ``VTOKEN_RECORD_FINISHED=1`` (the harness sets
        #: it), so a serving engine keeps nothing per finished request (its memory stays flat)
        self.vt_finished: list[dict[str, Any]] = []
        self._vt_record = os.environ.get("VTOKEN_RECORD_FINISHED", "0") not in ("", "0")

    # ------------------------------------------------------------------ requests
    def add_request(self, request) -> None:
        cfg: Optional[VTokenConfig] = self.vt_cfg
        extra = getattr(request.sampling_params, "extra_args", None) if request.sampling_params else None
        try:
            ov = parse_request_overrides(extra)
            cfg = ov.apply(self.vt_cfg) if ov.vtoken_enable else None
        except VTokenConfigError as e:  # the front end validates first; never crash the engine here
            logger.error("vToken: request %s: %s; eviction off for this request", request.request_id, e)
            self.vt_stats.request_faults += 1
            cfg = None
        if cfg is not None and getattr(request, "resumable", False):
            # The front end refuses streaming-input requests by name; a path that skips it
            # (e.g. an in-process engine) still never evicts one.
            logger.error("vToken: request %s is a streaming-input (resumable) request, which vToken does not "
                         "support yet; eviction off for this request", request.request_id)
            self.vt_stats.request_faults += 1
            cfg = None
        plan: Optional[RequestPlan] = None
        if cfg is not None:
            try:
                plan = cfg.plan(request.num_prompt_tokens)
            except ValueError as e:  # the front end and the start-up check validate first
                logger.error("vToken: request %s: %s; eviction off for this request", request.request_id, e)
                self.vt_stats.request_faults += 1
        may_evict = plan is not None and plan.may_evict(request.num_prompt_tokens, self._vt_max_tokens(request))
        self._vt_plans[request.request_id] = (plan, may_evict)
        if (may_evict and self._vt_caching and plan.prefix_hits == "skip" and not request.skip_reading_prefix_cache
                and plan.policy.prompt_statistics):
            # A hit would be kept (protected, _vt_state), so the request's tokens would depend on
            # what the cache holds; with prefix_hits: skip it computes its prompt instead. vLLM
            # still hashes and caches its blocks for others (only the lookup is skipped).
            request.skip_reading_prefix_cache = True
            self.vt_stats.prefix_reads_skipped += 1
        if may_evict and plan.chunks:
            self._vt_points[request.request_id] = plan.point_every
            if plan.mode == "vtoken":
                # (Naive-Evict frees a block only once every token in it is dead: no bound; stock admission)
                self._vt_accounting.admission_cap[request.request_id] = plan.bound()
        super().add_request(request)

    @staticmethod
    def _vt_max_tokens(request) -> Optional[int]:
        max_tokens = getattr(request, "max_tokens", None)
        if max_tokens is None and request.sampling_params is not None:
            max_tokens = request.sampling_params.max_tokens
        return max_tokens

    def _vt_prompt_protected(self, plan: RequestPlan, request) -> int:
        """Prefix caching, a request that may evict: the prompt tokens it never evicts, a function
        of the request alone (never of what the cache holds): its full prompt blocks under
        ``protect_cached_prefix`` (they stay shared with every request that hits them), else none."""
        if not plan.protect_cached_prefix:
            return 0
        return request.num_prompt_tokens // self._vt_bs * self._vt_bs

    def _vt_state(self, request, scheduled: int) -> Optional[RequestState]:
        """The request's state; made when it is first scheduled (again after a preemption),
        ``scheduled`` being the tokens scheduled for it in this step."""
        rid = request.request_id
        st = self._vt_states.get(rid)
        if st is not None:
            return st
        plan, may_evict = self._vt_plans.get(rid, (None, False))
        if plan is None:
            return None
        prompt_len = request.num_prompt_tokens
        pol = plan.policy
        # the counts and per-step fields in a row of self._vt_cols
        st = CountState(plan=plan, budget=plan.budget, slack=plan.slack, prompt_len=prompt_len,
                        cols=self._vt_cols, block_size=self._vt_bs)
        st.may_evict = may_evict
        st.chunk_evict = plan.chunks
        st.point_every = plan.point_every
        st.score_need = pol.needs.value
        st.score_every = plan.score_every
        st.recent = pol.recent_tokens
        # Prefix-cache hit: num_computed_tokens already counts this step's tokens. The hit
        # tokens sit in the request's first blocks (slots == positions), computed by others.
        # A hit supplies the KV the request would have computed; its first eviction copies the
        # cached blocks it may write (_vt_ready_to_evict). A policy whose state needs the
        # statistics of the hit's tokens (EvictionPolicy.keeps_hit: H2O's column sums, SnapKV's
        # window when the rest of the prompt is shorter) never got them, so the hit is kept
        # (protected): its blocks stay shared, never copied. The side cache is indexed by KV slot, so a shared block's policy state
        # belongs to the request that computed it (worker/eviction.py, "Prefix caching"); any
        # other policy's hit is copied into private blocks now (_vt_copy_hit), and kept as under
        # prompt_statistics only when the free blocks cannot cover the copies.
        hit = max(0, request.num_computed_tokens - scheduled)
        if hit:
            st.cached_tokens = hit
            st.table.append(hit)
        if self._vt_caching and st.may_evict:
            bs = self._vt_bs
            own = self._vt_prompt_protected(plan, request)
            keep_hit = pol.keeps_hit(prompt_len, hit) if hit else False
            if not keep_hit and hit > own:
                keep_hit = not self._vt_copy_hit(rid, own // bs, hit // bs)
                if not keep_hit:
                    st.shared_tokens = own // bs * bs
            st.protected = max(own, hit // bs * bs if keep_hit else 0)
        st.floor = max(pol.sink_tokens, st.protected)
        self._vt_states[rid] = st
        self._vt_accounting.track(rid, st)
        self._vt_cols.data[C.NAIVE_BLOCKS, st.row] = st.naive.num_retained_blocks  # (for the gauges)
        st.born_step = self._vt_step_no  # (the worker's reports of earlier steps are not its own)
        self._vt_rows[rid] = st.row
        self._vt_rows_version += 1
        self._vt_new_states[rid] = st
        return st

    def _vt_pressure_plan(self, eligible: list[tuple[int, Any, RequestState]]) -> dict[str, int]:
        """Pressure pacing (:mod:`vtoken.pacing`): tokens to evict per request this step.

        Block demand of this step: each running request's blocks for its live tokens plus the
        tokens it computes now, beyond what it holds; plus the first waiting request's prompt
        (when a sequence slot is free); plus the watermark. A demand above the free blocks is
        the shortfall; it is covered from the requests with the most reclaimable blocks.
        """
        bs = self._vt_bs
        pool = self.kv_cache_manager.block_pool
        sc = self.scheduler_config
        cap = sc.max_num_batched_tokens
        demand = 0
        for req in self.running:
            rid = req.request_id
            held = len(self._vt_mgr.req_to_blocks.get(rid, ()))
            st = self._vt_states.get(rid)
            placeholders = getattr(req, "num_output_placeholders", 0)
            new = max(0, min(req.num_tokens + placeholders - req.num_computed_tokens, cap))
            live = st.table.num_live if st is not None else req.num_computed_tokens
            demand += max(0, cdiv(live + new, bs) - held)
        if len(self.running) < sc.max_num_seqs:
            head = next(iter(self.waiting), None)
            if head is not None:
                demand += cdiv(min(head.num_tokens - head.num_computed_tokens, cap), bs)
        cfg = self.vt_cfg
        watermark = max(cfg.watermark_blocks, math.ceil(cfg.watermark_fraction * pool.num_gpu_blocks))
        shortfall = demand + watermark - pool.get_num_free_blocks()
        above = sum(max(0, st.table.num_live - st.budget) for _, _, st in eligible)
        self.vt_stats.tokens_above_budget = above
        if shortfall <= 0:
            return {}
        # The floor is the budget or the protected prefix (prefix caching), whichever is larger:
        # protected positions are never evicted, so they are never counted as reclaimable.
        cands = [Candidate(req.request_id, order, st.table.num_live, len(self._vt_mgr.req_to_blocks.get(req.request_id, ())),
                           max(st.budget, st.protected)) for order, req, st in eligible]
        plan, freed = plan_pressure_evictions(cands, shortfall, bs)
        s = self.vt_stats
        s.pressure_events += 1
        s.shortfalls_covered += freed >= shortfall
        s.pressure_evictions += len(plan)
        return plan

    @staticmethod
    def _vt_done_in_flight(req) -> bool:
        """Under async scheduling: the in-flight steps already produce the request's last token
        (``max_tokens`` reached once their outputs land), so it gets no further step to evict for."""
        placeholders = getattr(req, "num_output_placeholders", 0)
        max_tokens = getattr(req, "max_tokens", None)
        return bool(placeholders) and max_tokens is not None and (
            req.num_tokens + placeholders - req.num_prompt_tokens >= max_tokens)

    def _vt_fault(self, rid: str, st: RequestState, exc: BaseException) -> None:
        """Turn eviction off for one request after a fault confined to it; count and log it."""
        st.faulted = True
        self.vt_stats.request_faults += 1
        logger.error("vToken: request %s: %s: %s; eviction off for this request (it keeps running with the "
                     "tokens it has)", rid, type(exc).__name__, exc)

    # ------------------------------------------------------------------ schedule
    #: gauges and metrics are refreshed at most this often (seconds), and
    #: whenever the scheduler goes idle; Prometheus scrapes far less often
    GAUGE_INTERVAL_S = 0.05

    def schedule(self, *args, **kwargs):
        """Integers only, a few per request (module docstring).

        Per running request past its prefill (or, with ``prefill_eviction: chunks``, between two
        chunks of its prompt): ``k`` from fixed pacing (or the pressure plan), the
        count-only eviction (:meth:`_vt_evict_count`); then the stock ``schedule()``; then per
        scheduled request the count of its new tokens, whether it scores, and its lifetime block
        figures (a preempted request restarts; Naive-Evict's figures from the worker's reports,
        ``CountNaive``). Nothing here
        touches a token.

        The per-request integers live in one numpy array, a row per request
        (``sched/counts.py``): fixed pacing's eviction (:meth:`_vt_evict_fixed_counts`) and the
        bookkeeping after the stock ``schedule()`` (:meth:`_vt_after_scheduled_counts`) are a few
        array operations over all rows, plus one pass over the request ids to build the
        payload's dicts; Python per request only where one needs it (a state made, a prefill
        ending, a tail of blocks freed, an eviction log run ending). Pressure pacing goes through
        the states one by one.
        """
        payload = StepPayload()
        t0 = time.perf_counter()
        states = self._vt_states
        is_async = self._vt_is_async
        self._vt_preempted_now.clear()
        self._vt_released_now = []
        if self._vt_accounting.cached_now:
            self._vt_accounting.cached_now.clear()
        if self.vt_cfg.pacing == "pressure":
            eligible = []
            for order, req in enumerate(self.running):
                st = states.get(req.request_id)
                # decoding, or (prefill_eviction: chunks) between two chunks of its prompt
                if st is not None and (st.decoding or (st.chunk_evict and st.table.num_logical % st.point_every == 0
                                                       and st.table.num_logical > 0)) and st.may_evict and not st.faulted and not (
                        is_async and self._vt_done_in_flight(req)):
                    eligible.append((order, req, st))
            plan = self._vt_pressure_plan(eligible)
            for _, req, st in eligible:
                k = plan.get(req.request_id, 0)
                if k > 0:
                    try:
                        self._vt_evict_count(req.request_id, st, k, payload)
                    except Exception as e:  # noqa: BLE001 - confined to this request
                        self._vt_fault(req.request_id, st, e)
        else:
            self._vt_evict_fixed_counts(payload, is_async)
        if self._vt_naive_pending:
            self._vt_free_naive_pending(payload)
        self.vt_stats.repack_seconds += time.perf_counter() - t0

        out = super().schedule(*args, **kwargs)
        out.vtoken_step = self._vt_step_no  # (the worker's reports of this step name it: _vt_take_naive_freed)

        if self._vt_preempted_now:
            self._vt_collect_counts(payload)
        if self._vt_suspended:
            self._vt_resume(out.num_scheduled_tokens)
        self._vt_after_scheduled_counts(out.num_scheduled_tokens, payload)
        if self._vt_hit_copies:
            self._vt_apply_hit_copies(out, payload)
        self._vt_finish_payload(payload)
        out.vtoken = None if payload.is_empty() else payload
        now = time.monotonic()
        if now - self._vt_gauges_at >= self.GAUGE_INTERVAL_S:
            self._vt_gauges_at = now
            self._vt_update_gauges()
            self._vt_metrics.update(self.vt_stats)
        self._vt_step_no += 1
        if self._vt_check:
            self.vt_check_invariants(out)
            if self._vt_freed_this_step:  # (shows the tests exercise the block-reuse ordering)
                freed = set(self._vt_freed_this_step)
                self.vt_stats.freed_blocks_reused_same_step += sum(
                    b.block_id in freed for blocks in self._vt_mgr.req_to_blocks.values() for b in blocks)
        self._vt_freed_this_step = []
        if self._vt_trace is not None:
            rec = trace_record(self._vt_step_no - 1, self.kv_cache_manager.block_pool.get_num_free_blocks(), 0,
                               out.num_scheduled_tokens, self._vt_mgr.req_to_blocks, states, self._vt_accounting)
            self._vt_trace.write(json.dumps(rec) + "\n")
        return out

    def _vt_free_naive_pending(self, payload: StepPayload) -> None:
        """``mode: naive``: the blocks Naive-Evict no longer keeps
        by the worker's latest counts go back to the pool (``_vt_free_tail``), in the running
        order."""
        pending, self._vt_naive_pending = self._vt_naive_pending, set()
        states = self._vt_states
        freed = 0
        for req in self.running:
            rid = req.request_id
            if rid in pending and (st := states.get(rid)) is not None and not st.faulted:
                try:
                    freed += self._vt_free_tail(rid, st, payload)
                except Exception as e:  # noqa: BLE001 - confined to this request
                    self._vt_fault(rid, st, e)
        self.vt_stats.freed_blocks += freed

    def _vt_rows_of(self, rids: list, cache: str) -> tuple[np.ndarray, Optional[slice]]:
        """``self._vt_rows`` of each of ``rids`` (-1: no state), and the same as a slice when they
        are consecutive rows (then ``data[:, slice]`` is a view); remembered per ``cache`` slot
        while the id list (element by element the same objects) and the rows stay the same, as
        they do from one decode step to the next."""
        hit = self._vt_rows_cache.get(cache)
        if hit is not None and hit[1] == self._vt_rows_version and hit[0] == rids:
            return hit[2], hit[3]
        rows = np.fromiter(map(self._vt_rows.get, rids, repeat(-1)), dtype=np.int64, count=len(rids))
        rows.setflags(write=False)
        sl = _as_slice(rows)
        self._vt_rows_cache[cache] = (rids, self._vt_rows_version, rows, sl)
        return rows, sl

    def _vt_after_scheduled_counts(self, scheduled: dict[str, int], payload: StepPayload) -> None:
        """After the stock ``schedule()``, for every scheduled request at once (numpy over the rows of ``self._vt_cols``): make the
        states of requests scheduled for the first time (in the scheduled order), append the
        step's tokens, count decode steps, ask for this step's statistics (``payload.scores``, in
        the scheduled order), detect the end of the prefill (Python, per prefilling request), and
        add the lifetime block figures (blocks held, ``cdiv(logical, B)``). No refill (a preempted
        request restarts), and Naive-Evict's retained blocks ``cdiv(logical, B) - freed`` from the
        worker's last report (``CountNaive``) with their lifetime figures."""
        if not scheduled:
            return
        keys = list(scheduled)
        rows, sl = self._vt_rows_of(keys, "scheduled")
        n = np.fromiter(scheduled.values(), dtype=np.int64, count=len(keys))
        if sl is None and np.count_nonzero(rows < 0):
            requests = self.requests
            rows = rows.copy()
            for i in np.flatnonzero(rows < 0).tolist():
                rid = keys[i]
                req = requests.get(rid)
                st = self._vt_state(req, int(n[i])) if req is not None and n[i] > 0 else None
                if st is not None:
                    rows[i] = st.row
            sel = np.flatnonzero(rows >= 0)
            if len(sel) < len(keys):
                if not len(sel):
                    return
                keys = [keys[i] for i in sel.tolist()]
                rows, n = rows[sel], n[sel]
            sl = _as_slice(rows)
        data = self._vt_cols.data  # (after any state was made: it may have grown)
        m = data[:, sl] if sl is not None else data[:, rows]  # a view, or a copy written back below
        m[C.LIVE] += n
        logical = m[C.LOGICAL]
        logical += n
        flags = m[C.FLAGS]
        decoding = flags & C.DECODING  # 0 / 1
        decode_steps = m[C.DECODE_STEPS]
        decode_steps += decoding
        all_decoding = np.count_nonzero(decoding) == len(decoding)
        every = m[C.ASK_EVERY]  # > 0: its policy needs statistics, it may evict, no fault (counts.derived)
        if all_decoding and not np.count_nonzero(every != 1):  # every step asks, as in steady decoding
            ask = None
        else:  # a decode step d asks when d % every == 0, a prefill chunk always
            ask = every > 0
            if np.count_nonzero(ask):
                ask &= (decoding == 0) | (decode_steps % np.maximum(every, 1) == 0)
        if ask is None or np.count_nonzero(ask):
            need = m[C.SCORE_NEED]
            if ask is None and not np.count_nonzero(need != need[0]):  # (one policy's needs for all: one C call)
                payload.scores.update(dict.fromkeys(scheduled if len(keys) == len(scheduled) else keys,
                                                    int(need[0])))
            else:
                if ask is None:
                    ask = np.ones(len(keys), dtype=bool)
                payload.scores.update(zip([keys[i] for i in np.flatnonzero(ask).tolist()], need[ask].tolist()))
        if not all_decoding:
            # every token has KV once this step ran: the step samples, the prefill is done
            requests = self.requests
            states = self._vt_states
            scores = payload.scores
            for i in np.flatnonzero(decoding == 0).tolist():
                rid = keys[i]
                req = requests[rid]
                st = states[rid]
                st.chunk_log.append(int(n[i]))
                if rid in scores:
                    self._vt_prefill_scores(rid, st, req, int(n[i]), payload)
                if req.num_computed_tokens >= req.num_tokens:
                    flags[i] |= C.DECODING
            m[C.THRESHOLD] = C.threshold(m[C.BUDGET], m[C.SLACK], flags, logical, m[C.POINT_EVERY])
        held = np.fromiter(map(len, map(self._vt_mgr.req_to_blocks.get, keys, repeat(()))), dtype=np.int64,
                           count=len(keys))
        m[C.HELD] = held
        full = logical + (self._vt_bs - 1)
        full //= self._vt_bs
        m[C.STEPS] += 1
        m[C.HELD_BLOCK_STEPS] += held
        np.maximum(m[C.PEAK_BLOCKS], held, out=m[C.PEAK_BLOCKS])
        m[C.FULL_BLOCK_STEPS] += full
        np.maximum(m[C.FULL_PEAK_BLOCKS], full, out=m[C.FULL_PEAK_BLOCKS])
        # Naive-Evict (CountNaive): cdiv(logical, B) minus the freed blocks the worker reported
        naive = np.subtract(full, m[C.NAIVE_FREED], out=m[C.NAIVE_BLOCKS])
        naive_b = m[C.LIVE] + (self._vt_bs - 1)
        naive_b //= self._vt_bs
        np.maximum(naive_b, naive, out=naive_b)
        m[C.NAIVE_BLOCK_STEPS] += naive_b
        np.maximum(m[C.NAIVE_PEAK_BLOCKS], naive_b, out=m[C.NAIVE_PEAK_BLOCKS])
        if sl is None:
            data[:, rows] = m

    @staticmethod
    def _vt_prefill_scores(rid: str, st: RequestState, req, n: int, payload: StepPayload) -> None:
        """The statistics a prefill step of rows ``[end - n, end)`` (logical) asks for, so that they
        follow the request's eviction points, never the chunks vLLM scheduled (a chunk never
        crosses a point: ``_reserve_prefill_lookahead``). The next point ``P`` is the next multiple
        of ``point_every`` at or after ``end``, or the end of the prompt:

        * the last query row (``AttentionNeed.LAST_ROW``: TOVA, Scissorhands' history row) only
          from a step that ends at ``P``, as when the prompt is cut at the points only;
        * an observation window (``AttentionNeed.WINDOW``, SnapKV): the step's rows that lie in the
          ``window`` rows before ``P`` (``payload.windows[rid]``).

        A step left with nothing to compute asks for nothing."""
        end = req.num_computed_tokens
        every = st.point_every
        prompt = req.num_prompt_tokens
        point = min(-(-end // every) * every, prompt) if every else prompt
        need = payload.scores[rid]
        if end != point:
            need &= ~AttentionNeed.LAST_ROW.value
        w = getattr(st.plan.policy, "window", None) if need & AttentionNeed.WINDOW.value else None
        if w:
            rows = end - max(end - n, point - w)
            if rows <= 0:
                need = 0
            elif rows != w:
                payload.windows[rid] = rows
        if not need & (AttentionNeed.COL_SUM.value | AttentionNeed.LAST_ROW.value | AttentionNeed.KEY_NORM.value
                       | AttentionNeed.QUERY_MOMENTS.value):
            del payload.scores[rid]
        else:
            payload.scores[rid] = need

    def _get_local_prefix_cache_hit(self, request, *args, **kwargs):
        """vLLM's prefix-cache hit of a waiting request, then, for a request that may evict: the hit
        ends before the first block vLLM hashed in this very ``schedule()`` (``cached_now``).

        vLLM hashes a block when it schedules the tokens that fill it, so a request admitted later in
        the same step can hit a block whose KV this step's forward is still to compute (stock vLLM
        reads it after the forward wrote it). A vToken request copies its hit into private blocks
        before the forward (``_vt_copy_hit``), and would copy a block not yet written: the second
        child of an ``n = 2`` request, or the same prompt sent twice at once. It computes those
        tokens itself instead, exactly as if it had come alone."""
        hit = super()._get_local_prefix_cache_hit(request, *args, **kwargs)  # (0.33: max_cache_hit_length)
        now = self._vt_accounting.cached_now
        if not now or not hit[1] or self._vt_plans.get(request.request_id, (None,))[0] is None:
            return hit
        blocks, num_local, boundary, diverged = hit
        first = blocks.blocks[0]
        keep = next((j for j, b in enumerate(first) if b.block_id in now), None)
        if keep is None:
            return hit
        tokens = min(num_local, keep * self._vt_bs)
        blocks = type(blocks)(tuple(list(g[:keep]) for g in blocks.blocks))
        self.vt_stats.same_step_hits_trimmed += 1
        return blocks, tokens, min(boundary, tokens), diverged

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """vLLM's last cut of a step's tokens for a request (both its running and waiting passes
        call it), then: a prefill chunk of a request with ``prefill_eviction: chunks`` never
        crosses one of its eviction points (multiples of ``prefill_eviction_every``), so it
        evicts at the same logical positions whatever else runs (``counts.at_point``)."""
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if n > 1 and self._vt_points and num_computed_tokens < request.num_prompt_tokens:
            every = self._vt_points.get(request.request_id)
            if every:
                n = min(n, every - num_computed_tokens % every)
        return n

    def _vt_evict_fixed_counts(self, payload: StepPayload, is_async: bool) -> None:
        """Fixed pacing: every running request past its prefill whose live
        count exceeds ``budget + slack`` evicts ``live - budget`` tokens, capped as
        :meth:`_vt_evict_count` caps them.

        :meth:`_vt_evict_count` for all of them at once, over the rows of ``self._vt_cols``
        (``sched/counts.py``): numpy over the rows; Python only per request whose tail blocks go
        back to the pool, in the running order, as one request at a time would free them. The
        payload's dicts get the requests in the running order.
        """
        running = self.running
        if not running:
            return
        cache = self._vt_run_cache
        if cache is not None and cache[0] == self._vt_rows_version and cache[1] == running:
            rids, pos, r, sl = cache[2:]
        else:  # the running list or the states changed
            rids = [req.request_id for req in running]
            rows, _ = self._vt_rows_of(rids, "running")
            pos = np.flatnonzero(rows >= 0)  # running index of each request with a state
            r = rows[pos]
            sl = _as_slice(r)
            self._vt_run_cache = (self._vt_rows_version, list(running), rids, pos, r, sl)
        if not len(r):
            return
        data = self._vt_cols.data
        m = data[:, sl] if sl is not None else data[:, r]  # a view, or a copy written back below
        view = sl is not None
        live = m[C.LIVE]
        ev = live > m[C.THRESHOLD]  # budget + slack, for a request that decodes, may evict, no fault
        if is_async and np.count_nonzero(ev):  # async: its last token is in flight; it will not be scheduled again
            for i in np.flatnonzero(ev).tolist():
                if self._vt_done_in_flight(running[int(pos[i])]):
                    ev[i] = False
        if self._vt_caching:  # prefix caching: a first eviction may copy cached blocks (_vt_ready_to_evict)
            first = ev & (m[C.EVICTED] == 0)
            if np.count_nonzero(first):
                ev &= ~first
                states = self._vt_states
                for p_i, live_i, budget_i in zip(pos[first].tolist(), live[first].tolist(), m[C.BUDGET, first].tolist()):
                    rid = rids[p_i]
                    st = states[rid]
                    try:
                        self._vt_evict_count(rid, st, live_i - budget_i, payload)
                    except Exception as e:  # noqa: BLE001 - confined to this request
                        self._vt_fault(rid, st, e)
        nev = np.count_nonzero(ev)
        if nev < len(ev):
            if not nev:
                return
            pos, r, m, view = pos[ev], r[ev], m[:, ev], False
            live = m[C.LIVE]
        k = live - m[C.BUDGET]
        # evict_log: the count asked, before the cap, at decode step d (0: before a prefill chunk)
        prefill = (m[C.FLAGS] & C.DECODING) == 0
        self._vt_cols.log_evictions(r, m, m[C.DECODE_STEPS] - prefill, k)
        if self._vt_chunks and np.count_nonzero(prefill):  # before a prefill chunk: which boundary (few rows)
            states = self._vt_states
            for i, ki in zip(np.flatnonzero(prefill).tolist(), k[prefill].tolist()):
                st = states[rids[int(pos[i])]]
                st.prefill_evict_log.append((int(m[C.LOGICAL, i]) // st.point_every, ki))
        if np.count_nonzero(m[C.CAP_OVER] > 0):  # (else no protection can cap k: counts.derived)
            # evictable(live, logical, 0, recent, floor): positions below the floor are all live,
            # so min(floor, logical, live) == min(floor, live)
            floor = m[C.FLOOR]
            np.minimum(k, np.where(floor < live, live - floor, 0) - m[C.RECENT], out=k)
            ok = k > 0
            nok = np.count_nonzero(ok)
            if nok < len(ok):
                if not view:  # the requests asked for more than they can give still log the count they asked
                    data[:, r[~ok]] = m[:, ~ok]
                if not nok:
                    return
                pos, r, m, k, view = pos[ok], r[ok], m[:, ok], k[ok], False
                live = m[C.LIVE]
        live -= k
        off = m[C.LOGICAL] - live
        floor = m[C.FLOOR]
        clean = m[C.CLEAN_LEN]  # -1: None
        upd = clean.view(np.uint64) > floor.view(np.uint64)  # None (-1: 2**64 - 1) or above the floor (>= 0)
        if np.count_nonzero(upd):
            fu = floor[upd]
            clean[upd] = np.minimum(m[C.LOGICAL, upd], fu)
            m[C.MIN_DST_SLOT, upd] = np.minimum(m[C.MIN_DST_SLOT, upd], fu)
        m[C.EVICTED] += k  # (undone below for a request whose eviction faults)
        # tail blocks past cdiv(live + 1, B) go back to the pool
        free = m[C.HELD] > (live + self._vt_bs) // self._vt_bs
        if not view:
            data[:, r] = m
        ev_rids = rids if len(pos) == len(rids) else [rids[i] for i in pos.tolist()]
        offsets = dict(zip(ev_rids, off.tolist()))
        if self.vt_cfg.mode == "vtoken":  # BlockAccounting.set_offset (mode is engine-wide; off > 0)
            self._vt_accounting.deltas.update(offsets)
        else:
            for rid in ev_rids:
                self._vt_accounting.set_offset(rid, self._vt_states[rid])
        uniform = not np.count_nonzero(k != k[0])
        if uniform:  # (the same count for all, as in steady decoding: one C call)
            payload.evict.update(dict.fromkeys(offsets, int(k[0])))
        else:
            payload.evict.update(zip(ev_rids, k.tolist()))
        freed = 0
        if np.count_nonzero(free):
            done = None  # the requests whose eviction completed (a fault stops one here)
            states = self._vt_states
            for i in np.flatnonzero(free).tolist():
                rid = ev_rids[i]
                st = states[rid]
                try:
                    freed += self._vt_free_tail(rid, st, payload)
                except Exception as e:  # noqa: BLE001 - confined to this request (module docstring)
                    self._vt_fault(rid, st, e)
                    data[C.EVICTED, r[i]] -= k[i]
                    del offsets[rid]
                    if done is None:
                        done = np.ones(len(ev_rids), dtype=bool)
                    done[i] = False
            if done is not None:
                k, uniform = k[done], False
        self._vt_offset_updates.update(offsets)
        stats = self.vt_stats
        stats.evicted_tokens += int(k[0]) * len(k) if uniform else int(np.add.reduce(k))
        stats.freed_blocks += freed
        stats.evictions += len(offsets)
        if self._vt_chunks:  # prefill_eviction: chunks: the rows that evicted before a prefill chunk
            stats.prefill_evictions += int(np.count_nonzero((m[C.FLAGS] & C.DECODING) == 0))

    def _vt_free_tail(self, rid: str, st: RequestState, payload: StepPayload) -> int:
        """After an eviction: the KV manager frees the request's blocks past what it must keep
        (``cdiv(live + 1, B)``, or Naive-Evict's count); the payload tells the workers. Returns
        the number of blocks freed."""
        keep = self._vt_accounting.target_blocks(st, upcoming=1)
        tail = self._vt_mgr.vt_free_tail(rid, keep)
        if self._vt_caching:
            self._vt_released_now.extend(tail)
        if tail and rid in payload.unshare:  # (mode naive: copies made past what it keeps)
            payload.unshare[rid] = [e for e in payload.unshare[rid] if e[0] < keep]
        if tail:
            self._vt_cols.data[C.HELD, st.row] = keep  # the blocks it holds (sched/counts.py)
            if self._vt_check:
                self._vt_freed_this_step.extend(b.block_id for b in tail)
            payload.truncate[rid] = keep
            payload.kept_blocks[rid] = [b.block_id for b in self._vt_mgr.req_to_blocks[rid]]
        return len(tail)

    def _vt_finish_payload(self, payload: StepPayload) -> None:
        """The step's changed offsets and the request states made in it."""
        if self._vt_offset_updates:
            payload.offsets = self._vt_offset_updates
            self._vt_offset_updates = {}
        if self._vt_new_states:
            payload.states = {rid: WorkerSpec(st.plan, st.protected, st.cached_tokens, st.shared_tokens)
                              for rid, st in self._vt_new_states.items() if self._vt_states.get(rid) is st}
            self._vt_new_states = {}

    def _vt_resume(self, scheduled: dict[str, int]) -> None:
        """Kept states whose request vLLM resumed in this step: their offset goes to the worker
        again (a runner forgets a preempted request's); the worker restores their K/V and
        policy state before the forward (``WorkerEviction``, resumed requests)."""
        for rid in [r for r in self._vt_suspended if r in scheduled]:
            st = self._vt_suspended.pop(rid)
            if st.table.offset:
                self._vt_offset_updates[rid] = st.table.offset

    def _vt_collect_counts(self, payload: StepPayload) -> None:
        """Requests the stock ``schedule()`` preempted after this step's eviction was planned.

        A kept state (``mode: vtoken``, :meth:`_free_request_blocks`) keeps its eviction: the
        worker applies it in the request's old blocks (every such write comes before any write
        of the step) and then saves the live K/V and side-cache state (``payload.suspend``), so
        the eviction the scheduler counted is the one that happened. A dropped state restarts
        from its prompt: its eviction, truncation and copies are dropped (the worker must not
        touch its old slots)."""
        for rid in self._vt_preempted_now:
            if rid in self._vt_suspended_now:
                payload.suspend.append(rid)
                payload.truncate.pop(rid, None)  # (the worker forgets its blocks when it saves them)
                payload.kept_blocks.pop(rid, None)
                continue
            self.vt_stats.moves_dropped_preempted += payload.evict.pop(rid, 0)
            payload.truncate.pop(rid, None)
            payload.kept_blocks.pop(rid, None)
            payload.unshare.pop(rid, None)
        self._vt_preempted_now.clear()
        self._vt_suspended_now.clear()

    def _vt_ready_to_evict(self, rid: str, st: RequestState, live_after: int, payload: StepPayload) -> bool:
        """Prefix caching: before a request's first eviction, copy the cached blocks it may write.

        The rule (docs/integration.md, "Prefix caching"): a block that is hashed or shared is
        never written. Until its first eviction a request's blocks hold the KV that any request
        with the same prefix computes, so vLLM hashes them as they fill, as stock vLLM does.
        From its first eviction on the request writes its blocks from its first evictable
        position (``st.floor``: sinks, protected prefix) on: repack moves fill holes, its next
        tokens go to freed slots. So each hashed or shared block it keeps from index
        ``floor // B`` on (up to ``cdiv(live_after + 1, B)``, the blocks it keeps; under
        ``mode: naive`` every block it holds) is replaced now by a fresh private block holding a
        copy (``payload.unshare``: the worker copies before any move). The old block loses this
        holder (``ref_cnt`` down) and keeps its hash and contents, so others still hit it; at
        ``ref_cnt`` 0 it waits in the free queue as an evictable cached block, as a finished
        request's blocks do. Blocks past what it keeps go back to the pool with the tail, and
        from now on vLLM hashes only its blocks below ``floor`` (``BlockAccounting.cache_cap``),
        which nothing writes. So a hit needs no protection where the policy needs no statistics of
        the hit's tokens: tokens do not depend on the cache.

        The copies need fresh blocks in this step (:meth:`_vt_copy_cached`). When the free
        blocks do not cover the copies, the eviction is deferred
        (``vtoken:unshare_deferred_total``): the request keeps its tokens for now and tries
        again at its next eviction; under pool pressure vLLM may preempt it or another request
        instead, as it would without vToken.

        Returns:
            True when the eviction may go ahead (no prefix caching, not the first eviction, no
            cached block to copy, or copied), False when deferred.
        """
        if not self._vt_caching or rid in self._vt_accounting.cache_cap:
            return True
        bs = self._vt_bs
        blocks = self._vt_mgr.req_to_blocks.get(rid, [])
        lo = st.floor // bs
        keep = len(blocks) if st.plan.mode == "naive" else min(len(blocks), cdiv(live_after + 1, bs))
        entries = self._vt_copy_cached(blocks, lo, keep)
        if entries is None:
            return False
        if entries:
            payload.unshare[rid] = entries
            payload.kept_blocks[rid] = [b.block_id for b in blocks]
        self._vt_accounting.cache_cap[rid] = lo * bs
        return True

    def _vt_copy_cached(self, blocks: list, lo: int, hi: int) -> Optional[list[tuple[int, int, int]]]:
        """Replace each hashed or shared block among a request's ``blocks[lo:hi]`` (its
        ``req_to_blocks`` list, changed in place) by a fresh private block; the old ones lose this
        holder and keep their hash. Returns the copies ``(index, old block id, new block id)`` for
        ``StepPayload.unshare`` (empty when there is nothing to copy), or None, changing nothing
        and counting ``vtoken:unshare_deferred_total``, when the free blocks cannot cover them.

        The copies never take a tail block that went back to the pool earlier in this step: this
        step's moves may still read that one after the copies wrote it (vLLM reuses a freed
        unhashed block first, ``BlockPool.free_blocks``). Those are set aside from the free queue
        while the copies' blocks are taken, and put back.
        """
        idx = [i for i in range(lo, min(hi, len(blocks))) if blocks[i].block_hash is not None or blocks[i].ref_cnt > 1]
        if not idx:
            return []
        pool = self.kv_cache_manager.block_pool
        queue = pool.free_block_queue
        # (in the free queue: ref_cnt 0; once each, though a block shared by two requests that
        # both released it is listed twice)
        aside = list({b.block_id: b for b in self._vt_released_now if b.ref_cnt == 0}.values())
        removed = []
        try:
            for b in aside:
                queue.remove(b)
                removed.append(b)
            if len(idx) > pool.get_num_free_blocks():
                self.vt_stats.unshare_deferred += 1
                return None
            new = pool.get_new_blocks(len(idx))
        finally:  # back where vLLM put them: unhashed first in line, hashed last
            queue.prepend_n([b for b in removed if b.block_hash is None])
            queue.append_n([b for b in removed if b.block_hash is not None])
        old = [blocks[i] for i in idx]
        for i, b in zip(idx, new):
            blocks[i] = b
        pool.free_blocks(old)
        # a later copy in this step never lands on one of these either: the copies run as one
        # batch, which a GPU kernel does not order between a block one copy reads and another writes
        self._vt_released_now.extend(old)
        self.vt_stats.unshared_blocks += len(idx)
        return [(i, o.block_id, b.block_id) for i, o, b in zip(idx, old, new)]

    def _vt_copy_hit(self, rid: str, lo: int, hi: int) -> bool:
        """A request starting with a prefix-cache hit, for a policy that
        needs no statistics of the hit's tokens: copy its hit blocks ``lo..hi-1`` into private
        blocks in this step (``_vt_copy_cached``), so the worker writes their policy state as
        for the request's own tokens and the request may evict inside its hit
        (worker/eviction.py, "Prefix caching"). The copies reach the worker as
        ``StepPayload.unshare`` (K/V copied before the forward) and as the block ids of the
        step's ``SchedulerOutput`` (:meth:`_vt_apply_hit_copies`). Returns False, changing
        nothing, when the free blocks cannot cover the copies (counted in
        ``vtoken:unshare_deferred_total``; the hit is then kept, as for H2O).
        """
        entries = self._vt_copy_cached(self._vt_mgr.req_to_blocks.get(rid, []), lo, hi)
        if entries is None:
            return False
        if entries:
            self._vt_hit_copies[rid] = entries
        return True

    def _vt_apply_hit_copies(self, out, payload: StepPayload) -> None:
        """The hit copies made in this step (:meth:`_vt_copy_hit`): on the payload, and in the
        block ids the step's ``SchedulerOutput`` carries for those requests (a new request's
        ``block_ids``, a resumed one's ``new_block_ids``), which the stock ``schedule()`` built
        before the copies."""
        copies, self._vt_hit_copies = self._vt_hit_copies, {}
        found = set()
        for nrd in out.scheduled_new_reqs:
            entries = copies.get(nrd.req_id)
            if entries is not None:
                for i, _, new in entries:
                    nrd.block_ids[0][i] = new
                found.add(nrd.req_id)
        cached = out.scheduled_cached_reqs
        for j, rid in enumerate(cached.req_ids):
            entries = copies.get(rid)
            if entries is not None and rid in cached.resumed_req_ids and cached.new_block_ids[j] is not None:
                for i, _, new in entries:
                    cached.new_block_ids[j][0][i] = new
                found.add(rid)
        for rid, entries in copies.items():
            payload.unshare[rid] = entries
            if rid not in found:  # (a state starts with a new or a resumed request; else as a first eviction's)
                payload.kept_blocks[rid] = [b.block_id for b in self._vt_mgr.req_to_blocks[rid]]

    def _vt_evict_count(self, rid: str, st: RequestState, k: int, payload: StepPayload) -> None:
        """Evict ``k`` tokens of ``rid`` in counts; the worker picks which.

        ``k`` (logged as asked, :meth:`RequestState.log_eviction`) is capped at the tokens no
        protection covers (:func:`vtoken.counts.evictable`), which is what the worker's
        selection evicts; the request's tail blocks past ``cdiv(live + 1, B)`` go back to the
        pool now. Prefix caching: a first eviction first
        copies the cached blocks the request may write (:meth:`_vt_ready_to_evict`), or is
        deferred (nothing logged).
        """
        table = st.table
        bound = st.floor  # max(sink_tokens, protected): positions below it are never evicted
        asked = k
        k = min(k, evictable(table.num_live, table.num_logical, 0, st.recent, bound))
        if k > 0 and not self._vt_ready_to_evict(rid, st, table.num_live - k, payload):
            return
        st.log_eviction(st.decode_steps + 1 if st.decoding else 0, asked)  # (0: before a prefill chunk)
        if not st.decoding:
            st.prefill_evict_log.append((table.num_logical // st.point_every, asked))
        if k <= 0:
            return
        table.evict(k)
        self._vt_accounting.set_offset(rid, st)
        live = table.num_live
        payload.evict[rid] = k
        if st.clean_len is None or st.clean_len > bound:
            st.clean_len = min(table.num_logical, bound)
            st.min_dst_slot = min(st.min_dst_slot, bound)
        freed = 0
        if len(self._vt_mgr.req_to_blocks[rid]) > -(-(live + 1) // self._vt_bs):
            freed = self._vt_free_tail(rid, st, payload)
        self._vt_offset_updates[rid] = table.num_logical - live
        st.evicted += k
        s = self.vt_stats
        s.evicted_tokens += k
        s.freed_blocks += freed
        s.evictions += 1
        s.prefill_evictions += not st.decoding

    def vt_expected_blocks(self, st: RequestState) -> int:
        """Blocks a scheduled request must hold after schedule(): ceil(live/B) under vToken
        (live includes this step's tokens, so this covers the block the next token needs),
        or max(that, Naive-Evict's retained blocks) under ``naive``."""
        return self._vt_accounting.target_blocks(st)

    def vt_check_invariants(self, out=None) -> None:
        """:func:`~vtoken.integrations.vllm.sched.checks.check_invariants` on this scheduler.

        Raises:
            AssertionError: naming the request and the broken invariant.
        """
        check_invariants(self._vt_mgr.req_to_blocks, self.kv_cache_manager.block_pool, self._vt_states,
                         self._vt_accounting, out.num_scheduled_tokens if out is not None else {},
                         moves=getattr(out, "vtoken", None))

    # ------------------------------------------------------------------ feedback
    def update_from_output(self, scheduler_output, model_runner_output):
        faults = getattr(model_runner_output, "vtoken_faults", None)
        if faults:
            self._vt_worker_faults(faults)
        rep = getattr(model_runner_output, "vtoken_worker", None)
        if rep:  # the worker's moves and selection time (metrics)
            self.vt_stats.moved_tokens += rep["moved"]
            self.vt_stats.repack_seconds += rep["seconds"]
        naive = getattr(model_runner_output, "vtoken_naive_freed", None)
        if naive:
            self._vt_take_naive_freed(naive, getattr(scheduler_output, "vtoken_step", -1))
        res = super().update_from_output(scheduler_output, model_runner_output)
        self._vt_publish_if_idle()
        return res

    def _vt_worker_faults(self, faults: dict[str, str]) -> None:
        """Faults the worker confined to one request (its state there is gone, so its KV cache
        no longer follows the counts here): each is logged naming the request, counted in
        ``vtoken:request_faults_total``, and the request ends with an error (vLLM's
        ``FINISHED_ERROR``, through the scheduler's own set of requests to fail in this
        ``update_from_output``); every other request goes on."""
        fail = getattr(self, "encoder_cache_mismatch_reqs", None)
        for rid, msg in faults.items():
            st = self._vt_states.get(rid)
            if st is None:
                continue
            st.faulted = True
            self.vt_stats.request_faults += 1
            logger.error("vToken: request %s: %s; the request ends with an error", rid, msg)
            if fail is not None and rid in self.requests:
                fail.add(rid)

    def _vt_take_naive_freed(self, freed: dict[str, int], step: int) -> None:
        """The worker's Naive-Evict freed-block counts of step ``step``
        (``WorkerEviction.take_naive_freed``), read before vLLM finishes requests (so a finished
        request's figures include its last eviction). A count for a state made after that step
        (the request was preempted and started again since) is stale and dropped. Under
        ``mode: naive`` the tail blocks the new count releases go back to the pool at the start
        of the next ``schedule()`` (:attr:`_vt_naive_pending`)."""
        states = self._vt_states
        naive_mode = self.vt_cfg.mode == "naive"
        for rid, n in freed.items():
            st = states.get(rid)
            if st is None or not isinstance(st, CountState) or st.born_step > step:
                continue
            st.naive.set_freed(n)
            if naive_mode:
                self._vt_naive_pending.add(rid)

    def finish_requests(self, *args, **kwargs):
        res = super().finish_requests(*args, **kwargs)
        self._vt_publish_if_idle()
        return res

    def _vt_publish_if_idle(self) -> None:
        """The EngineCore calls ``schedule()`` only while it has requests: publish the gauges
        once more when the last request finished or was aborted."""
        if not self.has_requests():
            self._vt_update_gauges()
            self._vt_metrics.update(self.vt_stats)
            self._vt_run_cache = None  # (it holds the last running requests)
            self._vt_rows_cache.clear()

    # ------------------------------------------------------------------ free / preempt
    def _free_request_blocks(self, request):
        rid = request.request_id
        st = self._vt_states.get(rid)
        super()._free_request_blocks(request)
        if st is not None and not request.is_finished() and st.plan.mode == "vtoken":
            # Preempted: keep the state; the worker saves the live K/V and policy state and
            # restores them at the resume (payload.suspend), which recomputes nothing
            # (_preempt_request: num_computed_tokens = the logical tokens).
            self._vt_suspended[rid] = st
            self._vt_suspended_now.add(rid)
            self._vt_cols.data[C.HELD, st.row] = 0
            self.vt_stats.preemption_resets += 1
            return
        st = self._vt_states.pop(rid, None)
        self._vt_suspended.pop(rid, None)
        # a dropped state restarts from its prompt, clean: vLLM hashes its blocks again as they fill
        self._vt_accounting.cache_cap.pop(rid, None)
        if st is not None:
            self._vt_accounting.forget(rid)
            if st.table.offset:
                self._vt_offset_updates[rid] = 0
            if request.is_finished():
                self._vt_record_finished(rid, st)
            else:
                self.vt_stats.preemption_resets += 1
            if self._vt_rows.pop(rid, None) is not None:
                self._vt_rows_version += 1
                st.detach()  # its figures stay readable; the row is reused
        if request.is_finished():
            self._vt_plans.pop(rid, None)
            self._vt_points.pop(rid, None)
            self._vt_accounting.cache_cap.pop(rid, None)
            self._vt_accounting.admission_cap.pop(rid, None)

    def _preempt_request(self, request, *args, **kwargs):
        """vLLM's preemption, then: a request whose state was kept resumes at its logical length.

        Its ``num_computed_tokens`` becomes its logical token count (vLLM reset it to 0): every
        token with KV counts as done, since the worker restores the live tokens' K/V; at the
        resume vLLM schedules only the tokens that have none yet (the last sampled one), the KV
        manager allocates blocks for ``live`` plus those (:class:`BlockAccounting`), and no
        prefix-cache lookup is made (vLLM looks up only requests with ``num_computed_tokens ==
        0``). A dropped state (``mode: naive``) starts again from its prompt, as stock."""
        super()._preempt_request(request, *args, **kwargs)
        rid = request.request_id
        self._vt_preempted_now.add(rid)
        st = self._vt_suspended.get(rid)
        if st is not None:
            request.num_computed_tokens = st.table.num_logical

    def _vt_record_finished(self, rid: str, st: RequestState) -> None:
        """The finished request's figures go to the ``vtoken:request_peak_blocks`` histogram;
        the record itself is kept only under ``VTOKEN_RECORD_FINISHED=1`` (:attr:`vt_finished`)."""
        if self._vt_record:
            rec = st.lifetime(rid)
            self.vt_finished.append(rec)
            self._vt_metrics.observe_finished(rec)
        else:
            self._vt_metrics.observe_finished({"peak_blocks": st.peak_blocks})

    def _vt_update_gauges(self) -> None:
        s = self.vt_stats
        # the counts from the rows of self._vt_cols, every state at once
        hit = self._vt_rows_cache.get("states")
        if hit is None or hit[0] != self._vt_rows_version:
            rows = np.fromiter(self._vt_rows.values(), dtype=np.int64, count=len(self._vt_rows))
            hit = self._vt_rows_cache["states"] = (self._vt_rows_version, _as_slice(rows) or rows)
        data = self._vt_cols.data
        lv, lg, held, nv = (data[c, hit[1]] for c in (C.LIVE, C.LOGICAL, C.HELD, C.NAIVE_BLOCKS))
        live, logical = int(np.add.reduce(lv)), int(np.add.reduce(lg))
        retained, naive = int(np.add.reduce(held)), int(np.add.reduce(nv))  # (held: len(req_to_blocks))
        dense = int(np.add.reduce((lv + (self._vt_bs - 1)) // self._vt_bs))
        evicting = int(np.count_nonzero(lg > lv))
        s.live_tokens, s.logical_tokens, s.retained_blocks = live, logical, retained
        s.naive_retained_blocks, s.dense_blocks, s.num_evicting_requests = naive, dense, evicting
        if self._vt_caching:
            s.shared_blocks = len({b.block_id for blocks in self._vt_mgr.req_to_blocks.values() for b in blocks
                                   if b.ref_cnt > 1})

    # ------------------------------------------------------------------ introspection (tests, benchmarks)
    def vt_snapshot(self) -> dict[str, Any]:
        """Per-request live/logical/blocks and pool state (for tests and benchmarks)."""
        return dict(
            free_blocks=self.kv_cache_manager.block_pool.get_num_free_blocks(),
            requests={
                rid: dict(
                    num_live=st.table.num_live,
                    num_logical=st.table.num_logical,
                    blocks=len(self._vt_mgr.req_to_blocks.get(rid, ())),
                    naive_blocks=st.naive.num_retained_blocks,
                )
                for rid, st in self._vt_states.items()
            },
            stats=self.vt_stats.as_dict(),
        )


class VTokenScheduler(VTokenSchedulerMixin, Scheduler):
    """vLLM's ``Scheduler`` (sync scheduling) with vToken (see :class:`VTokenSchedulerMixin`)."""


class VTokenAsyncScheduler(VTokenSchedulerMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (async scheduling, batch queue 2) with vToken. The worker folds
    each step's statistics before the next step's decision, so async decides exactly as sync."""
