"""The protocol: the per-step data the vToken scheduler and the vToken model runner exchange.

Scheduler -> worker: :class:`StepPayload`, attached as ``SchedulerOutput.vtoken``
(a dynamic attribute; ``SchedulerOutput`` is a plain dataclass that the ``mp``
executor pickles with its ``__dict__``; patches/ entry ``vllm.v1.core.sched.output.SchedulerOutput``).
Worker -> scheduler: only Naive-Evict's changed freed-block counts,
``ModelRunnerOutput.vtoken_naive_freed`` (``{req_id: blocks}``); statistics never leave the worker
(:data:`ScoreMap` is the worker's own per-step format).

Only diffs travel: counts to evict, block-table truncations of this step, and the
offsets that changed. ``None`` (no attribute) means nothing to do: the stock path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import numpy as np

__all__ = ["StepPayload", "ScoreMap", "WorkerSpec"]


class WorkerSpec(NamedTuple):
    """What the worker needs to decide for one request: its plan, and what its first scheduled
    step found in the prefix cache.

    Attributes:
        plan: the request's :class:`vtoken.config.RequestPlan` (its policy, a small dataclass
            whose batched methods the worker runs, grouping requests by policy; its protections;
            its token sets, ``docs/granularity.md``).
        protected_prefix: logical positions below it are never evicted (prefix caching), in tokens.
        cached_tokens: prefix-cache hit: its first tokens whose KV is already in its first
            blocks (computed by an earlier request); the worker appends them with the step's.
        shared_tokens: the first cached tokens whose blocks it shares with other requests (their
            policy state is read-only for it, ``DeviceDecider.share_prefix``); None: all of them.
            The rest of the hit was copied into its private blocks in this step
            (``StepPayload.unshare``), so the worker writes their state as for its own tokens.
    """

    plan: Any
    protected_prefix: int = 0
    cached_tokens: int = 0
    shared_tokens: Optional[int] = None


#: req_id -> (col_sum or None, last_row or None); float64 ``[num_live]`` indexed by physical slot
#: (with several token sets: ``[S, num_live]``, each set in its own slot order).
ScoreMap = dict[str, tuple[Optional[np.ndarray], Optional[np.ndarray]]]


@dataclass
class StepPayload:
    """What the worker must do for vToken in this step, **before any KV write of the step**.

    Worker order: (0) copy the ``unshare`` blocks (every layer, every KV head, the side
    caches; one gather-then-scatter batch) and put the new block ids in the rows; (1)
    select ``evict[req]`` victims per token set and apply the moves it plans to every layer
    (they may read blocks freed in this step and already handed to another request: reading
    before writing keeps that safe); (2) truncate block-table rows per ``truncate``; (3)
    record ``offsets``; then the stock ``_update_states`` appends this step's new blocks.

    Attributes:
        truncate: req_id -> number of blocks the request keeps (a prefix of its row).
        kept_blocks: req_id -> the block ids it keeps (Model Runner V2 keeps no host copy
            of its block tables, so it rewrites the row from these).
        offsets: req_id -> new offset (logical tokens minus live tokens); 0 resets.
        scores: req_id -> ``AttentionNeed`` value (int) of the statistics to compute
            for that request in this step.
        states: req_id -> :class:`WorkerSpec` of a request whose state the
            scheduler made in this step (first scheduled, or again after a preemption): the
            worker starts its token table empty (counting this step's tokens).
        evict: req_id -> ``k``, the tokens to evict before this step's forward; the worker
            picks which (:mod:`vtoken.side_cache`) and moves K/V and policy state itself.
        suspend: requests vLLM preempted in this step whose state the scheduler keeps (``mode:
            vtoken``): after this step's eviction of them (``evict``), the worker saves their live
            K/V and side-cache state (their blocks are back in the pool) and restores both into
            the blocks vLLM gives them when it resumes them (``scheduled_cached_reqs.
            resumed_req_ids``), before that step's forward: nothing is recomputed, and the
            tokens equal a run without the preemption. Other preempted requests start again.
        unshare: prefix caching, a request's first eviction: req_id -> ``[(block index, old
            block id, new block id), ...]``: the hashed or shared blocks it may write from now on
            (docs/integration.md, "Prefix caching"). The worker copies each old block into the
            new one before any move and puts the new id at that index of the request's row; the
            old block keeps its hash and contents (other requests still hit it).
        windows: req_id -> query rows of this prefill step that make its ``AttentionNeed.WINDOW``
            statistic (SnapKV): the step's last rows that lie in the observation window before the
            request's next prefill eviction point (``prefill_eviction_every``) or its prompt's end,
            so the window does not depend on where vLLM cut the chunk. Absent: the policy's window.
    """

    truncate: dict[str, int] = field(default_factory=dict)
    kept_blocks: dict[str, list[int]] = field(default_factory=dict)
    offsets: dict[str, int] = field(default_factory=dict)
    scores: dict[str, int] = field(default_factory=dict)
    states: dict[str, WorkerSpec] = field(default_factory=dict)
    evict: dict[str, int] = field(default_factory=dict)
    unshare: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    suspend: list[str] = field(default_factory=list)
    windows: dict[str, int] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (self.truncate or self.offsets or self.scores or self.states or self.evict or self.unshare
                    or self.suspend)

    def __repr__(self) -> str:  # counts only, never token data
        return (
            f"StepPayload(truncate={len(self.truncate)}, "
            f"offsets={len(self.offsets)}, scores={len(self.scores)}, "
            f"states={len(self.states)}, evict={len(self.evict)}, unshare={len(self.unshare)}, "
            f"suspend={len(self.suspend)})"
        )
