"""Debug checks of the scheduler's block accounting (``VTOKEN_CHECK=1``) and the step trace.

``VTOKEN_CHECK=1`` (tests, soak): after every ``schedule()``, :func:`check_invariants` asserts
that no block has two owners, that free + held blocks == the pool, that every block a
request holds has ``ref_cnt == 1``, and that each scheduled request holds exactly the
blocks the accounting says. ``VTOKEN_TRACE=<path>``: one JSON line per step
(:func:`trace_record`).
"""

from __future__ import annotations

from typing import Any, Mapping

from vtoken.integrations.vllm.accounting import BlockAccounting
from vtoken.integrations.vllm.state import RequestState

__all__ = ["check_invariants", "trace_record"]


def check_invariants(req_to_blocks: Mapping[str, list], block_pool, states: Mapping[str, RequestState],
                     accounting: BlockAccounting, scheduled: Mapping[str, int]) -> None:
    """Check block accounting and ownership (O(total blocks)).

    Args:
        req_to_blocks: the full-attention manager's request id -> list of ``KVCacheBlock``.
        block_pool: vLLM's ``BlockPool``.
        states: request id -> :class:`RequestState`.
        accounting: the scheduler's :class:`BlockAccounting`.
        scheduled: this step's ``num_scheduled_tokens``.

    Raises:
        AssertionError: naming the request or block and the broken invariant.
    """
    owners: dict[int, str] = {}
    held = 0
    for rid, blocks in req_to_blocks.items():
        for b in blocks:
            assert b.block_id not in owners, f"block {b.block_id} owned by {owners[b.block_id]} and {rid}"
            assert b.ref_cnt == 1, f"block {b.block_id} of {rid} has ref_cnt {b.ref_cnt}"
            owners[b.block_id] = rid
        held += len(blocks)
    free = block_pool.get_num_free_blocks()
    assert free + held == block_pool.num_gpu_blocks - 1, (
        f"block leak: free {free} + held {held} != pool {block_pool.num_gpu_blocks} - 1 (null block)"
    )
    for rid, st in states.items():
        st.table.check_invariants()
        if rid in scheduled:
            n = len(req_to_blocks.get(rid, ()))
            exp = accounting.target_blocks(st)
            assert n == exp, (
                f"{rid}: holds {n} blocks, expected {exp} (mode={st.cfg.mode}, live={st.table.num_live}, "
                f"logical={st.table.num_logical}, naive={st.naive.num_retained_blocks})"
            )


def trace_record(step: int, free_blocks: int, num_moves: int, scheduled: Mapping[str, int],
                 req_to_blocks: Mapping[str, list], states: Mapping[str, RequestState],
                 accounting: BlockAccounting) -> dict[str, Any]:
    """One step's trace: per scheduled request ``[live, logical, blocks held, naive blocks, expected]``."""
    reqs = {}
    for rid in scheduled:
        st = states.get(rid)
        if st is None:
            continue
        reqs[rid] = [st.table.num_live, st.table.num_logical, len(req_to_blocks.get(rid, ())),
                     st.naive.num_retained_blocks, accounting.target_blocks(st)]
    return dict(step=step, free=free_blocks, moves=num_moves, reqs=reqs)
