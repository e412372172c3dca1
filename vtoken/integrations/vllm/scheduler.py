"""The vToken scheduler: runs the eviction policies, keeps the token tables, frees tail blocks.

``VTokenScheduler`` subclasses vLLM's V1 ``Scheduler`` (patches/ entry
``vllm.v1.core.sched.scheduler.Scheduler``). Per step, before the stock schedule:

1. for each running request past its prefill whose live count exceeds
   ``budget + slack``: ask its policy for victims, evict them from the token table
   (which plans the repack moves), move the policy state with the tokens, and free
   the request's tail blocks to vLLM's block pool (Naive-Evict mode keeps exactly
   the blocks the baseline would);
2. the stock ``schedule()`` runs; allocation counts live tokens because the
   request's full-attention manager is a :class:`VTokenFullAttentionManager`;
3. the tokens scheduled in this step are appended to the token tables, and a
   :class:`~vtoken.integrations.vllm.payload.StepPayload` rides on the
   ``SchedulerOutput`` to the worker.

``update_from_output`` folds the attention statistics the worker sends back into
each request's policy state. Preemption and finish both go through
``_free_request_blocks``, where the request's vToken state is dropped (a preempted
request re-prefills all its logical tokens from scratch and is evicted again).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from vtoken.config import (
    VTokenConfig,
    VTokenConfigError,
    effective_budget,
    num_to_evict,
    parse_config,
    parse_request_overrides,
)
from vtoken.integrations.vllm.metrics import VTokenMetrics
from vtoken.integrations.vllm.payload import StepPayload
from vtoken.policies.base import AttentionNeed, AttentionStats, EvictionPolicy, SlotState, TokenView
from vtoken.repack import NaiveEvictCounter
from vtoken.token_table import TokenTable

logger = logging.getLogger("vllm.vtoken")  # a child of vLLM's logger: same handlers and format

__all__ = ["VTokenScheduler", "VTokenFullAttentionManager", "RequestState", "VTokenStats"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class RequestState:
    """vToken's per-request state in the scheduler (keyed by request id, never by batch row)."""

    cfg: VTokenConfig
    budget: int  # tokens
    slack: int  # tokens
    policy: EvictionPolicy
    pstate: SlotState
    table: TokenTable
    naive: NaiveEvictCounter
    prompt_len: int
    #: set once a step sampled a token (prefill or re-prefill after preemption complete);
    #: eviction starts only then, as in the dense oracle.
    decoding: bool = False
    #: decode forwards scheduled so far (1 = the first decode step); scores are computed on
    #: every prefill chunk and on decode steps d with d % score_every == 0 (as the oracle).
    decode_steps: int = 0
    #: False when prompt + max_tokens can never exceed budget + slack: the request will
    #: never evict, so no attention scores are computed for it (exact: they would go unused).
    may_evict: bool = True
    # lifetime accounting (for retained-blocks figures)
    steps: int = 0
    held_block_steps: int = 0  # sum over scheduled steps of blocks held
    peak_blocks: int = 0
    naive_block_steps: int = 0  # the same for Naive-Evict's retained blocks
    naive_peak_blocks: int = 0
    full_block_steps: int = 0  # the same with no eviction: ceil(logical/B)
    full_peak_blocks: int = 0
    evicted: int = 0
    moved: int = 0


@dataclass
class VTokenStats:
    """Engine-wide counters (monotonic) and gauges (last step), exported as ``vtoken:`` metrics."""

    evicted_tokens: int = 0
    moved_tokens: int = 0
    freed_blocks: int = 0
    evictions: int = 0
    repack_seconds: float = 0.0
    preemption_resets: int = 0
    live_tokens: int = 0
    logical_tokens: int = 0
    retained_blocks: int = 0
    naive_retained_blocks: int = 0
    dense_blocks: int = 0
    num_evicting_requests: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class VTokenFullAttentionManager(FullAttentionManager):
    """Full-attention KV manager whose allocation counts live (physical) tokens.

    Installed by ``__class__`` swap on the scheduler's manager (the spec registry refuses a
    second ``FullAttentionSpec`` manager; patches/ entry
    ``vllm.v1.core.single_type_kv_cache_manager.FullAttentionManager``). Token counts
    arrive logical; ``_vt_delta`` (tokens) is subtracted so blocks cover
    ``live + new`` tokens under vToken, or Naive-Evict's retained blocks under ``naive``.
    """

    _vt_sched: "VTokenScheduler"

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   num_local_computed_tokens, num_tokens_main_model, *args, **kwargs):
        d = self._vt_sched._vt_delta(request_id, num_tokens)
        if d:
            num_tokens -= d
            total_computed_tokens = max(total_computed_tokens - d, 0)
            num_local_computed_tokens = max(num_local_computed_tokens - d, 0)
            num_tokens_main_model -= d
        return super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                                  num_local_computed_tokens, num_tokens_main_model, *args, **kwargs)

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model, *args, **kwargs):
        d = self._vt_sched._vt_delta(request_id, num_tokens)
        return super().allocate_new_blocks(request_id, num_tokens - d, num_tokens_main_model - d, *args, **kwargs)


class VTokenScheduler(Scheduler):
    """V1 ``Scheduler`` with token-level eviction and block reclamation (see module docstring)."""

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
        mgr = mgrs[0]
        mgr.__class__ = VTokenFullAttentionManager
        mgr._vt_sched = self
        self._vt_mgr = mgr
        self._vt_bs: int = mgr.block_size
        self._vt_states: dict[str, RequestState] = {}
        self._vt_req_cfg: dict[str, Optional[VTokenConfig]] = {}
        self._vt_offset_updates: dict[str, int] = {}
        self._vt_policy_cache: dict[tuple, EvictionPolicy] = {}
        self.vt_stats = VTokenStats()
        self._vt_metrics = VTokenMetrics.from_vllm_config(self.vllm_config).attach(self)
        # Debug aids (tests, soak): VTOKEN_CHECK=1 checks the invariants after every
        # schedule(); VTOKEN_TRACE=<path> appends one JSON line per step.
        self._vt_check = os.environ.get("VTOKEN_CHECK", "0") not in ("", "0")
        trace = os.environ.get("VTOKEN_TRACE")
        self._vt_trace = open(trace, "a", buffering=1) if trace else None
        self._vt_step_no = 0
        #: finished requests' lifetime figures (bounded; read by benchmarks through collective RPC-free stats)
        self.vt_finished: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ requests
    def add_request(self, request) -> None:
        cfg: Optional[VTokenConfig] = self.vt_cfg
        extra = getattr(request.sampling_params, "extra_args", None) if request.sampling_params else None
        try:
            ov = parse_request_overrides(extra)
            cfg = ov.apply(self.vt_cfg) if ov.vtoken_enable else None
        except VTokenConfigError as e:  # the frontend validates first; never crash the engine here
            logger.error("vToken: request %s: %s; eviction off for this request", request.request_id, e)
            cfg = None
        self._vt_req_cfg[request.request_id] = cfg
        super().add_request(request)

    def _vt_policy(self, cfg: VTokenConfig, budget: int) -> EvictionPolicy:
        key = (cfg.policy, budget, cfg.sink_tokens, cfg.recent_tokens, cfg.seed, tuple(sorted(cfg.policy_args.items())))
        pol = self._vt_policy_cache.get(key)
        if pol is None:
            pol = type(cfg.make_policy()).from_config(cfg, budget=budget)
            self._vt_policy_cache[key] = pol
        return pol

    def _vt_state(self, request) -> Optional[RequestState]:
        rid = request.request_id
        st = self._vt_states.get(rid)
        if st is not None:
            return st
        cfg = self._vt_req_cfg.get(rid)
        if cfg is None:
            return None
        prompt_len = request.num_prompt_tokens
        budget = effective_budget(cfg, prompt_len)
        pol = self._vt_policy(cfg, budget)
        st = RequestState(
            cfg=cfg,
            budget=budget,
            slack=cfg.resolved_slack(),
            policy=pol,
            pstate=pol.init_state(),
            table=TokenTable(self._vt_bs),
            naive=NaiveEvictCounter(self._vt_bs),
            prompt_len=prompt_len,
        )
        max_tokens = getattr(request, "max_tokens", None)
        if max_tokens is None and request.sampling_params is not None:
            max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            st.may_evict = prompt_len + max_tokens > budget + st.slack
        self._vt_states[rid] = st
        return st

    # ------------------------------------------------------------------ allocation
    def _vt_delta(self, request_id: str, num_tokens: int) -> int:
        """Tokens to subtract from a logical token count to get the slots to allocate."""
        st = self._vt_states.get(request_id)
        if st is None or st.table.offset == 0 and st.cfg.mode == "vtoken":
            return 0
        phys = num_tokens - st.table.offset
        if st.cfg.mode == "naive":
            bs = self._vt_bs
            extra_blocks = max(0, _cdiv(num_tokens, bs) - _cdiv(st.naive.num_logical, bs))
            need = (st.naive.num_retained_blocks + extra_blocks) * bs
            phys = max(phys, min(need, num_tokens))
        return num_tokens - phys

    def _vt_target_blocks(self, st: RequestState, upcoming: int = 0) -> int:
        """Blocks the request should hold for its live tokens plus ``upcoming`` tokens.

        Eviction keeps room for the one token a decoding request writes in this step
        (``upcoming=1``), so a budget that is a multiple of the block size does not free a
        block and allocate it back every step.
        """
        dense = _cdiv(st.table.num_live + upcoming, self._vt_bs)
        if st.cfg.mode == "naive":
            return max(dense, st.naive.num_retained_blocks)
        return dense

    # ------------------------------------------------------------------ schedule
    def schedule(self, *args, **kwargs):
        payload = StepPayload()
        srcs: list[np.ndarray] = []
        dsts: list[np.ndarray] = []
        t0 = time.perf_counter()
        for req in self.running:
            st = self._vt_state(req)
            if st is None or not st.decoding:
                continue
            k = num_to_evict(st.table.num_live, st.budget, st.slack)
            if k > 0:
                self._vt_evict(req.request_id, st, k, payload, srcs, dsts)
        if srcs:
            payload.src = np.concatenate(srcs)
            payload.dst = np.concatenate(dsts)
        self.vt_stats.repack_seconds += time.perf_counter() - t0

        out = super().schedule(*args, **kwargs)

        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            st = self._vt_state(req) if req is not None else None
            if st is None or n <= 0:
                continue
            old = st.table.num_live
            st.table.append(n)
            st.naive.append(n)
            st.pstate.reset_slots(old, old + n)
            if st.decoding:
                st.decode_steps += 1
            if st.may_evict and st.policy.needs != AttentionNeed.NONE and (
                not st.decoding or st.decode_steps % st.cfg.score_every == 0
            ):
                payload.scores[rid] = st.policy.needs.value
            held = len(self._vt_mgr.req_to_blocks.get(rid, ()))
            naive_b = max(st.naive.num_retained_blocks, _cdiv(st.table.num_live, self._vt_bs))
            full_b = _cdiv(st.table.num_logical, self._vt_bs)
            st.steps += 1
            st.held_block_steps += held
            st.peak_blocks = max(st.peak_blocks, held)
            st.naive_block_steps += naive_b
            st.naive_peak_blocks = max(st.naive_peak_blocks, naive_b)
            st.full_block_steps += full_b
            st.full_peak_blocks = max(st.full_peak_blocks, full_b)
        if self._vt_offset_updates:
            payload.offsets = self._vt_offset_updates
            self._vt_offset_updates = {}
        out.vtoken = None if payload.is_empty() else payload
        self._vt_update_gauges()
        self._vt_metrics.update(self.vt_stats)
        self._vt_step_no += 1
        if self._vt_check:
            self.vt_check_invariants(out)
        if self._vt_trace is not None:
            self._vt_write_trace(out, payload)
        return out

    def vt_expected_blocks(self, st: RequestState) -> int:
        """Blocks a scheduled request must hold after schedule(): ceil(live/B) under vToken
        (live includes this step's tokens, so this covers the block the next token needs),
        or max(that, Naive-Evict's retained blocks) under ``naive``."""
        return self._vt_target_blocks(st)

    def vt_check_invariants(self, out=None) -> None:
        """Check block accounting and ownership (O(total blocks); tests and soak only).

        Raises:
            AssertionError: naming the request and the broken invariant.
        """
        pool = self.kv_cache_manager.block_pool
        owners: dict[int, str] = {}
        held = 0
        for rid, blocks in self._vt_mgr.req_to_blocks.items():
            for b in blocks:
                assert b.block_id not in owners, f"block {b.block_id} owned by {owners[b.block_id]} and {rid}"
                assert b.ref_cnt == 1, f"block {b.block_id} of {rid} has ref_cnt {b.ref_cnt}"
                owners[b.block_id] = rid
            held += len(blocks)
        free = pool.get_num_free_blocks()
        assert free + held == pool.num_gpu_blocks - 1, (
            f"block leak: free {free} + held {held} != pool {pool.num_gpu_blocks} - 1 (null block)"
        )
        scheduled = out.num_scheduled_tokens if out is not None else {}
        for rid, st in self._vt_states.items():
            st.table.check_invariants()
            if rid in scheduled:
                n = len(self._vt_mgr.req_to_blocks.get(rid, ()))
                exp = self.vt_expected_blocks(st)
                assert n == exp, (
                    f"{rid}: holds {n} blocks, expected {exp} (mode={st.cfg.mode}, live={st.table.num_live}, "
                    f"logical={st.table.num_logical}, naive={st.naive.num_retained_blocks})"
                )

    def _vt_write_trace(self, out, payload: StepPayload) -> None:
        reqs = {}
        for rid in out.num_scheduled_tokens:
            st = self._vt_states.get(rid)
            if st is None:
                continue
            reqs[rid] = [st.table.num_live, st.table.num_logical, len(self._vt_mgr.req_to_blocks.get(rid, ())),
                         st.naive.num_retained_blocks, self.vt_expected_blocks(st)]
        rec = dict(step=self._vt_step_no, free=self.kv_cache_manager.block_pool.get_num_free_blocks(),
                   moves=payload.num_moves, reqs=reqs)
        self._vt_trace.write(json.dumps(rec) + "\n")

    def _vt_evict(self, rid: str, st: RequestState, k: int, payload: StepPayload,
                  srcs: list[np.ndarray], dsts: list[np.ndarray]) -> None:
        table = st.table
        view = TokenView(logical_pos=table.logical_pos, num_logical=table.num_logical, prompt_len=st.prompt_len)
        victims = st.policy.select_victims(st.pstate, view, k)
        if len(victims) == 0:
            return
        positions = table.logical_pos[victims].copy()
        blocks = self._vt_mgr.req_to_blocks[rid]
        plan = table.evict_slots(victims)
        st.naive.evict_positions(positions)
        st.pstate.apply_moves(plan.src, plan.dst)
        bs = self._vt_bs
        if plan.num_moves:
            ids = np.fromiter((b.block_id for b in blocks), dtype=np.int64, count=len(blocks))
            srcs.append(ids[plan.src // bs] * bs + plan.src % bs)
            dsts.append(ids[plan.dst // bs] * bs + plan.dst % bs)
        keep = min(len(blocks), self._vt_target_blocks(st, upcoming=1))
        freed = len(blocks) - keep
        if freed > 0:
            tail = blocks[keep:]
            del blocks[keep:]
            self.kv_cache_manager.block_pool.free_blocks(reversed(tail))
            payload.truncate[rid] = keep
        self._vt_offset_updates[rid] = table.offset
        st.evicted += len(victims)
        st.moved += plan.num_moves
        s = self.vt_stats
        s.evicted_tokens += len(victims)
        s.moved_tokens += plan.num_moves
        s.freed_blocks += freed
        s.evictions += 1

    # ------------------------------------------------------------------ feedback
    def update_from_output(self, scheduler_output, model_runner_output):
        scores = getattr(model_runner_output, "vtoken_scores", None) or {}
        for rid in scheduler_output.num_scheduled_tokens:
            st = self._vt_states.get(rid)
            req = self.requests.get(rid)
            if st is None or req is None:
                continue
            # This step sampled a token iff every token now has KV: the (re-)prefill is complete.
            sampled = req.num_computed_tokens >= req.num_tokens
            st.decoding |= sampled
            if rid not in scores:
                continue
            col_sum, last_row = scores[rid]
            n = st.table.num_live
            for name, arr in (("col_sum", col_sum), ("last_row", last_row)):
                if arr is not None and len(arr) != n:
                    raise AssertionError(f"vToken: {name} for {rid} covers {len(arr)} slots, table holds {n} live tokens")
            if not sampled:
                last_row = None  # a non-final prefill chunk samples no token
            view = TokenView(st.table.logical_pos, st.table.num_logical, st.prompt_len)
            st.policy.observe(st.pstate, n, AttentionStats(col_sum=col_sum, last_row=last_row), view)
        return super().update_from_output(scheduler_output, model_runner_output)

    # ------------------------------------------------------------------ free / preempt
    def _free_request_blocks(self, request):
        super()._free_request_blocks(request)
        rid = request.request_id
        st = self._vt_states.pop(rid, None)
        if st is not None:
            if st.table.offset:
                self._vt_offset_updates[rid] = 0
            if request.is_finished():
                self._vt_record_finished(rid, st)
            else:
                self.vt_stats.preemption_resets += 1
        if request.is_finished():
            self._vt_req_cfg.pop(rid, None)

    def _vt_record_finished(self, rid: str, st: RequestState) -> None:
        if len(self.vt_finished) >= 100_000:
            del self.vt_finished[: len(self.vt_finished) // 2]
        self.vt_finished.append(
            dict(
                req_id=rid,
                steps=st.steps,
                mode=st.cfg.mode,
                policy=st.cfg.policy,
                budget=st.budget,
                prompt_len=st.prompt_len,
                avg_blocks=st.held_block_steps / max(st.steps, 1),
                peak_blocks=st.peak_blocks,
                naive_avg_blocks=st.naive_block_steps / max(st.steps, 1),
                naive_peak_blocks=st.naive_peak_blocks,
                full_avg_blocks=st.full_block_steps / max(st.steps, 1),
                full_peak_blocks=st.full_peak_blocks,
                evicted=st.evicted,
                moved=st.moved,
                num_logical=st.table.num_logical,
                num_live=st.table.num_live,
            )
        )

    def _vt_update_gauges(self) -> None:
        s = self.vt_stats
        live = logical = retained = naive = dense = evicting = 0
        for rid, st in self._vt_states.items():
            live += st.table.num_live
            logical += st.table.num_logical
            retained += len(self._vt_mgr.req_to_blocks.get(rid, ()))
            naive += st.naive.num_retained_blocks
            dense += _cdiv(st.table.num_live, self._vt_bs)
            evicting += st.table.offset > 0
        s.live_tokens, s.logical_tokens, s.retained_blocks = live, logical, retained
        s.naive_retained_blocks, s.dense_blocks, s.num_evicting_requests = naive, dense, evicting

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
                    logical_pos=st.table.logical_pos.tolist(),
                )
                for rid, st in self._vt_states.items()
            },
            stats=self.vt_stats.as_dict(),
        )
