"""vToken's per-request and engine-wide state in the scheduler (plain data, no vLLM import).

:class:`RequestState` holds one request's counts (live and logical tokens, budget, pacing,
protections, lifetime block figures, the eviction log; the integers live in a row of
:class:`~vtoken.integrations.vllm.sched.counts.CountColumns`, :class:`CountState`); the policy
state, token tables and statistics live on the worker. :class:`VTokenStats` holds the
engine-wide counters and gauges exported as ``vtoken:`` metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from vtoken.config import RequestPlan

__all__ = ["RequestState", "VTokenStats", "cdiv"]



def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


@dataclass
class RequestState:
    """vToken's state for one request (keyed by request id, never by batch row).

    A state is made when a request is first scheduled. A preemption keeps it under ``mode:
    vtoken`` (the worker saves and restores the request's live K/V) and drops it under ``mode:
    naive`` (a new one is made when the request, restarting from its prompt, is scheduled again). Its ``table``
    (live and logical counts) and ``naive`` (Naive-Evict's retained blocks, from the worker's
    reports) are set by the subclass that keeps the counts
    (:class:`~vtoken.integrations.vllm.sched.counts.CountState`).
    """

    #: the request's settings, resolved once (:class:`vtoken.config.RequestPlan`)
    plan: RequestPlan
    budget: int  # tokens (``plan.budget``; a column of the scheduler's counts)
    slack: int  # tokens (``plan.slack``)
    prompt_len: int
    table: Any = None
    naive: Any = None
    #: set once a scheduled step completes the (re-)prefill, i.e. samples a token; decided
    #: at schedule time, so async scheduling starts eviction at the same step as sync.
    decoding: bool = False
    #: ``prefill_eviction: chunks``: it may also evict between its prefill chunks, at its
    #: eviction points (logical positions that are multiples of ``point_every``)
    chunk_evict: bool = False
    #: ``prefill_eviction_every`` of a ``chunk_evict`` request (0: none)
    point_every: int = 0
    #: decode forwards scheduled so far (1 = the first decode step); scores are computed on
    #: every prefill chunk and on decode steps d with d % score_every == 0 (as the oracle).
    decode_steps: int = 0
    #: False when prompt + max_tokens can never exceed budget + slack: the request will
    #: never evict, so no attention scores are computed for it (exact: they would go unused).
    may_evict: bool = True
    #: set when a fault confined to this request turned its eviction off (it keeps running).
    faulted: bool = False
    #: ``policy.needs.value`` (the ``AttentionNeed`` bits a scored step asks for; 0: none)
    score_need: int = 0
    #: copies the per-step code reads (``cfg.score_every``, ``policy.recent_tokens``,
    #: ``max(policy.sink_tokens, protected)``: positions below it are never evicted)
    score_every: int = 1
    recent: int = 0
    floor: int = 0
    #: prefix caching with ``protect_cached_prefix``: the first ``protected`` logical positions
    #: (its full prompt blocks, a multiple of the block size) are never evicted. Slots
    #: ``< protected`` hold their own position for ever, so those blocks are never written and
    #: stay shared with every request that hits them.
    protected: int = 0
    #: prefix-cache hit when this state was made (tokens whose KV came from cached blocks).
    cached_tokens: int = 0
    #: the hit's first tokens whose blocks the request still shares (their
    #: policy state on the worker is read-only for it); None: the whole hit. The rest of the hit
    #: was copied into private blocks when the state was made (``VTokenScheduler._vt_copy_hit``).
    shared_tokens: Optional[int] = None
    #: tokens at the start whose KV was computed over the full context and still sits at its
    #: own slot (None: nothing evicted yet, so all). Only these may be cached for later
    #: requests: a token computed after an eviction attended over a cut context.
    clean_len: Optional[int] = None
    #: smallest slot any repack move planned for this request writes (a large number: none
    #: yet). Blocks from here on are never hashed for later requests, even once it ends.
    min_dst_slot: int = 1 << 62
    #: the scheduler step that made this state (the worker's reports of
    #: earlier steps belong to an earlier state of the same request)
    born_step: int = 0
    # lifetime accounting (for retained-blocks figures); ``steps`` is also the request-step index
    steps: int = 0
    held_block_steps: int = 0  # sum over scheduled steps of blocks held
    peak_blocks: int = 0
    naive_block_steps: int = 0  # the same for Naive-Evict's retained blocks
    naive_peak_blocks: int = 0
    full_block_steps: int = 0  # the same with no eviction: ceil(logical/B)
    full_peak_blocks: int = 0
    evicted: int = 0
    #: (decode step, tokens asked of the policy) of every eviction: the oracle replays it
    evict_log: list = field(default_factory=list)
    #: tokens scheduled in each prefill step (vLLM's chunks, which never cross an eviction point;
    #: the oracle does not need them: it cuts the prompt at the points)
    chunk_log: list = field(default_factory=list)
    #: ``prefill_eviction: chunks``: ``(point, k)`` per eviction during the prefill, ``point`` the
    #: eviction point's index (logical position // ``point_every``), ``k`` the count asked (as
    #: ``evict_log``, which logs the same evictions at decode step 0); the oracle's
    #: ``prefill_evict_schedule`` (pressure pacing decides these counts from pool state)
    prefill_evict_log: list = field(default_factory=list)

    def log_eviction(self, step: int, k: int) -> None:
        """Append ``(step, k)`` to :attr:`evict_log` (a :class:`~vtoken.integrations.vllm.sched.counts.CountState`
        keeps the log in runs)."""
        self.evict_log.append((step, k))

    def lifetime(self, req_id: str) -> dict[str, Any]:
        """The finished request's lifetime figures (blocks are time averages over its steps)."""
        n = max(self.steps, 1)
        return dict(
            req_id=req_id, steps=self.steps, mode=self.plan.mode, policy=self.plan.policy.name, budget=self.budget,
            prompt_len=self.prompt_len, avg_blocks=self.held_block_steps / n, peak_blocks=self.peak_blocks,
            naive_avg_blocks=self.naive_block_steps / n, naive_peak_blocks=self.naive_peak_blocks,
            naive_blocks=self.naive.num_retained_blocks,
            full_avg_blocks=self.full_block_steps / n, full_peak_blocks=self.full_peak_blocks,
            evicted=self.evicted, num_logical=self.table.num_logical, num_live=self.table.num_live,
            protected=self.protected, cached_tokens=self.cached_tokens,
            evict_log=[list(e) for e in self.evict_log],
            prefill_chunks=list(self.chunk_log), prefill_evict_log=[list(e) for e in self.prefill_evict_log],
        )


@dataclass
class VTokenStats:
    """Engine-wide counters (monotonic) and gauges (last step), exported as ``vtoken:`` metrics."""

    evicted_tokens: int = 0
    moved_tokens: int = 0
    freed_blocks: int = 0
    evictions: int = 0
    repack_seconds: float = 0.0
    preemption_resets: int = 0
    request_faults: int = 0
    #: prefix caching: hashed or shared blocks a request copied into private ones at its first
    #: eviction (the cached block stays for others)
    unshared_blocks: int = 0
    #: prefix caching: first evictions deferred because the free blocks could not cover the copies
    unshare_deferred: int = 0
    #: prefix caching, prefix_hits skip: requests that did not read the prefix cache
    prefix_reads_skipped: int = 0
    #: prefix caching: hits cut short at a block hashed in the same step (not yet computed)
    same_step_hits_trimmed: int = 0
    #: repack moves left off a step's payload because the stock schedule() preempted their
    #: request after they were planned (its blocks were already back in the pool)
    moves_dropped_preempted: int = 0
    #: prefill_eviction: chunks: eviction events before a prefill chunk
    prefill_evictions: int = 0
    pressure_events: int = 0  # steps where the pool was short (pressure pacing)
    pressure_evictions: int = 0  # eviction events decided under pressure
    shortfalls_covered: int = 0  # short steps fully covered by eviction (preemptions avoided)
    tokens_above_budget: int = 0  # gauge: tokens kept above budget because there was no pressure
    #: blocks freed by an eviction and handed to a request in the same schedule() (counted
    #: only with VTOKEN_CHECK=1; shows the tests exercise the block-reuse ordering)
    freed_blocks_reused_same_step: int = 0
    live_tokens: int = 0
    logical_tokens: int = 0
    retained_blocks: int = 0
    naive_retained_blocks: int = 0
    dense_blocks: int = 0
    num_evicting_requests: int = 0
    #: blocks held by more than one request (prefix caching), counted once
    shared_blocks: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
