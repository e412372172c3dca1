"""Per-step data exchanged between the vToken scheduler and the vToken model runner.

Scheduler -> worker: :class:`StepPayload`, attached as ``SchedulerOutput.vtoken``
(a dynamic attribute; ``SchedulerOutput`` is a plain dataclass that the ``mp``
executor pickles with its ``__dict__``; patches/ entry ``vllm.v1.core.sched.output.SchedulerOutput``).
Worker -> scheduler: ``ModelRunnerOutput.vtoken_scores`` (dict, see :data:`ScoreMap`).

Only diffs travel: the moves and block-table truncations of this step, and the
offsets that changed. ``None`` (no attribute) means nothing to do: the stock path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import numpy as np

__all__ = ["StepPayload", "ScoreMap", "WorkerSpec"]


class WorkerSpec(NamedTuple):
    """What the worker needs to decide for one request under ``decide_on: worker``.

    Attributes:
        policy: the request's :class:`~vtoken.policies.base.EvictionPolicy` (a small dataclass;
            the worker uses its batched methods, grouping requests by policy).
        sink_tokens, recent_tokens, protected_prefix: its protections, in tokens.
        cached_tokens: prefix-cache hit: its first tokens whose KV is already in its first
            blocks (computed by an earlier request); the worker appends them with the step's.
        granularity: its token sets (``request``, ``layer``, ``head``, ``head_shared``;
            ``docs/granularity.md``), resolved from the config.
        shared_tokens: the first cached tokens whose blocks it shares with other requests (their
            policy state is read-only for it, ``DeviceDecider.share_prefix``); None: all of them.
            The rest of the hit was copied into its private blocks in this step
            (``StepPayload.unshare``), so the worker writes their state as for its own tokens.
    """

    policy: Any
    sink_tokens: int
    recent_tokens: int
    protected_prefix: int
    cached_tokens: int = 0
    granularity: str = "request"
    shared_tokens: Optional[int] = None

#: req_id -> (col_sum or None, last_row or None); float64 ``[num_live]`` indexed by physical slot
#: (``decide_on: worker`` with several token sets: ``[S, num_live]``, each set in its own slot order).
ScoreMap = dict[str, tuple[Optional[np.ndarray], Optional[np.ndarray]]]


@dataclass
class StepPayload:
    """What the worker must do for vToken in this step, **before any KV write of the step**.

    Worker order: (0) copy the ``unshare`` blocks (every layer, every KV head, the side
    caches; one gather-then-scatter batch) and put the new block ids in the rows; (1)
    apply ``moves`` to every layer (they may read blocks freed in this step and already
    handed to another request: reading before writing keeps that safe); (2) truncate
    block-table rows per ``truncate``; (3) record ``offsets``; then the stock
    ``_update_states`` appends this step's new blocks.

    Attributes:
        src, dst: int64 ``[M]`` global slot ids (``block_id * block_size + offset``)
            of all token moves of this step, every request concatenated; disjoint.
        truncate: req_id -> number of blocks the request keeps (a prefix of its row).
        kept_blocks: req_id -> the block ids it keeps (Model Runner V2 keeps no host copy
            of its block tables, so it rewrites the row from these).
        offsets: req_id -> new offset (logical tokens minus live tokens); 0 resets.
        scores: req_id -> ``AttentionNeed`` value (int) of the statistics to compute
            for that request in this step.
        refill: req_id -> (logical positions, token ids), int64 ``[r]`` each: the request is
            resuming after a preemption and its first ``r`` scheduled tokens of this step
            re-prefill live tokens. vLLM schedules them at positions ``offset..`` (its
            ``num_computed_tokens`` was set to the offset), so ``position - offset`` is
            already their dense physical slot; the worker replaces their input ids and
            (RoPE) positions with these.
        score_steps: req_id -> (state generation, request-step index) of this step's
            scores; scheduler-side bookkeeping (the worker ignores it) that files the
            statistics under the step they came from when they return, possibly a step
            late under async scheduling.
        states: ``decide_on: worker``: req_id -> :class:`WorkerSpec` of a request whose state the
            scheduler made in this step (first scheduled, or again after a preemption): the
            worker starts its token table empty (counting this step's tokens).
        evict: ``decide_on: worker``: req_id -> ``k``, the tokens to evict before this step's
            forward; the worker picks which (:mod:`vtoken.decider`) and moves K/V and policy
            state itself, so ``src``/``dst`` stay empty.
        unshare: prefix caching, a request's first eviction: req_id -> ``[(block index, old
            block id, new block id), ...]``: the hashed or shared blocks it may write from now on
            (docs/integration.md, "Prefix caching"). The worker copies each old block into the
            new one before any move and puts the new id at that index of the request's row; the
            old block keeps its hash and contents (other requests still hit it). ``src``/``dst``
            (``decide_on: scheduler``) already address the new blocks.
    """

    src: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    dst: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    truncate: dict[str, int] = field(default_factory=dict)
    kept_blocks: dict[str, list[int]] = field(default_factory=dict)
    offsets: dict[str, int] = field(default_factory=dict)
    scores: dict[str, int] = field(default_factory=dict)
    refill: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    score_steps: dict[str, tuple[int, int]] = field(default_factory=dict)
    states: dict[str, WorkerSpec] = field(default_factory=dict)
    evict: dict[str, int] = field(default_factory=dict)
    unshare: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)

    @property
    def num_moves(self) -> int:
        return int(self.src.shape[0])

    def is_empty(self) -> bool:
        return not (self.num_moves or self.truncate or self.offsets or self.scores or self.refill or self.states
                    or self.evict or self.unshare)

    def __repr__(self) -> str:  # counts only, never token data
        return (
            f"StepPayload(moves={self.num_moves}, truncate={len(self.truncate)}, "
            f"offsets={len(self.offsets)}, scores={len(self.scores)}, refill={len(self.refill)}, "
            f"states={len(self.states)}, evict={len(self.evict)}, unshare={len(self.unshare)})"
        )
