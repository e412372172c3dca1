"""Pressure pacing: evict only when the block pool is short, and only as much as it needs.

With ``pacing: "pressure"`` a request's budget is a floor that applies under memory pressure
only: without pressure a request keeps every token. Before each schedule the integration
estimates the blocks this step needs (running requests' new tokens, the head of the waiting
queue, plus a watermark) against the pool's free blocks; a shortfall of ``S`` blocks is
covered by evicting from the requests with the most reclaimable blocks first (the blocks
they would free if cut down to their budget), just enough tokens from each to free the blocks
still missing (:func:`plan_pressure_evictions`), before vLLM preempts anything.

Decisions are a deterministic function of positions, scores and pool state: the amounts per
request and step are recorded (``RequestState.evict_log``) and the dense oracle replays them
(``oracle_generate(evict_schedule=...)``), so tests compare tokens exactly.

This is the "adaptive pacing" the vToken paper leaves as future work; the rule here is ours.
This module never imports vllm.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Candidate", "plan_pressure_evictions", "tokens_to_free_blocks"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Candidate:
    """A decoding request that may be evicted under pressure.

    Attributes:
        req_id: request id.
        order: its position in the running queue (ties go to the earlier one).
        live: live tokens now (physical), including in-flight ones.
        held: KV blocks it holds.
        budget: its budget (the floor), in tokens.
    """

    req_id: str
    order: int
    live: int
    held: int
    budget: int

    def reclaimable(self, block_size: int) -> int:
        """Blocks it frees if cut down to its budget, keeping room for this step's token."""
        return max(0, self.held - _cdiv(min(self.live, self.budget) + 1, block_size))


def tokens_to_free_blocks(live: int, held: int, blocks: int, budget: int, block_size: int) -> int:
    """Tokens to evict so that a request keeps ``held - blocks`` blocks (room for one new token),
    never going below ``budget`` live tokens.

    >>> tokens_to_free_blocks(live=100, held=4, blocks=1, budget=10, block_size=32)  # 3 blocks: 95 slots + 1
    5
    >>> tokens_to_free_blocks(live=100, held=4, blocks=3, budget=40, block_size=32)  # floor: the budget
    60
    """
    keep_slots = (held - blocks) * block_size - 1  # live tokens that fit with one slot to spare
    return max(0, min(live - budget, live - keep_slots))


def plan_pressure_evictions(candidates: list[Candidate], shortfall_blocks: int,
                            block_size: int) -> tuple[dict[str, int], int]:
    """Tokens to evict per request so that ``shortfall_blocks`` blocks are freed, if possible.

    Requests with the most reclaimable blocks go first (ties: earlier in the running queue);
    each gives ``min(its reclaimable blocks, blocks still missing)``. A request is never cut
    below its budget, so the plan may free fewer blocks than asked (vLLM then preempts as usual).

    Args:
        candidates: decoding requests eligible for eviction.
        shortfall_blocks: blocks missing for this step (<= 0: nothing to do).
        block_size: tokens per block.

    Returns:
        (req_id -> tokens to evict, only positive amounts; blocks the plan frees).
    """
    plan: dict[str, int] = {}
    missing = shortfall_blocks
    for c in sorted(candidates, key=lambda c: (-c.reclaimable(block_size), c.order)):
        if missing <= 0:
            break
        m = min(c.reclaimable(block_size), missing)
        if m <= 0:
            break
        k = tokens_to_free_blocks(c.live, c.held, m, c.budget, block_size)
        if k > 0:
            plan[c.req_id] = k
            missing -= m
    return plan, shortfall_blocks - max(missing, 0) if shortfall_blocks > 0 else 0
