"""Debug checks of the scheduler's block accounting (``VTOKEN_CHECK=1``) and the step trace.

``VTOKEN_CHECK=1`` (tests, soak): after every ``schedule()``, :func:`check_invariants` asserts
that every held block's ``ref_cnt`` equals the number of requests holding it (1, or the
sharers of a prefix-cache block, which the pool counts once), that free + distinct held
blocks == the pool, that each scheduled request holds exactly the blocks the accounting
says, and, with prefix caching, that a request that has evicted holds only private, unhashed
blocks past its never-evicted prefix, and that every block a copy of a cached block writes is
held by the request that planned it alone, unhashed (the worker checks its own moves:
``WorkerEviction``, ``VTOKEN_CHECK``). It also checks the figures the hot paths keep on the side:
the KV manager's delta per request (``BlockAccounting.deltas``) and each request row's blocks held
and derived columns (``sched/counts.py``). ``VTOKEN_TRACE=<path>``: one JSON line per step
(:func:`trace_record`).
"""

from __future__ import annotations

from typing import Any, Mapping


from vtoken.integrations.vllm.sched.accounting import BlockAccounting
from vtoken.integrations.vllm.sched.counts import (ASK_EVERY, CAP_OVER, HELD, NAIVE_BLOCKS, THRESHOLD, CountState,
                                                   derived)
from vtoken.integrations.vllm.sched.state import RequestState

__all__ = ["check_invariants", "trace_record"]


def check_invariants(req_to_blocks: Mapping[str, list], block_pool, states: Mapping[str, RequestState],
                     accounting: BlockAccounting, scheduled: Mapping[str, int], moves=None) -> None:
    """Check block accounting, ownership and sharing (O(total blocks + moves)).

    Args:
        req_to_blocks: the full-attention manager's request id -> list of ``KVCacheBlock``.
        block_pool: vLLM's ``BlockPool``.
        states: request id -> :class:`RequestState`.
        accounting: the scheduler's :class:`BlockAccounting`.
        scheduled: this step's ``num_scheduled_tokens``.
        moves: this step's :class:`~vtoken.integrations.vllm.protocol.StepPayload` (or None).

    Raises:
        AssertionError: naming the request or block and the broken invariant.
    """
    holders: dict[int, list[str]] = {}
    by_id: dict[int, object] = {}
    for rid, blocks in req_to_blocks.items():
        for b in blocks:
            h = holders.setdefault(b.block_id, [])
            assert rid not in h, f"block {b.block_id} appears twice in the block list of {rid}"
            h.append(rid)
            by_id[b.block_id] = b
    for bid, h in holders.items():
        b = by_id[bid]
        assert b.ref_cnt == len(h), (
            f"block {bid} has ref_cnt {b.ref_cnt} but is held by {len(h)} request(s) {sorted(h)[:4]}"
        )
        assert len(h) == 1 or b.block_hash is not None, (
            f"block {bid} is shared by {sorted(h)[:4]} but has no block hash (only prefix-cache hits are shared)"
        )
    held = len(holders)  # a shared block is counted once by the pool
    free = block_pool.get_num_free_blocks()
    assert free + held == block_pool.num_gpu_blocks - 1, (
        f"block leak: free {free} + held {held} (distinct) != pool {block_pool.num_gpu_blocks} - 1 (null block)"
    )
    bs = accounting.block_size
    for rid, st in states.items():
        st.table.check_invariants()
        d = accounting.deltas.get(rid)
        assert d == accounting.expected_delta_entry(st), (
            f"{rid}: the KV manager's delta entry is {d}, expected {accounting.expected_delta_entry(st)} "
            f"(mode={st.plan.mode}, live={st.table.num_live}, logical={st.table.num_logical})")
        if isinstance(st, CountState):  # the row's derived columns
            row = st._cols.data[:, st.row]
            held = len(req_to_blocks.get(rid, ()))
            assert row[HELD] == held, f"{rid}: its row says it holds {row[HELD]} blocks, it holds {held}"
            assert row[NAIVE_BLOCKS] == st.naive.num_retained_blocks, (
                f"{rid}: its row's Naive-Evict blocks {row[NAIVE_BLOCKS]} != {st.naive.num_retained_blocks}")
            want = derived(row)
            assert tuple(row[[THRESHOLD, CAP_OVER, ASK_EVERY]].tolist()) == want, (
                f"{rid}: its row's (threshold, cap_over, ask_every) are {row[[THRESHOLD, CAP_OVER, ASK_EVERY]].tolist()}, "
                f"expected {want}")
        P = st.protected
        assert P % bs == 0 and P <= st.table.num_live, f"{rid}: protected prefix {P} (live {st.table.num_live})"
        cap = accounting.cache_cap.get(rid)
        if cap is not None:  # it has evicted: every block from its first evictable position on is its own
            for i, b in enumerate(req_to_blocks.get(rid, ())[cap // bs:], start=cap // bs):
                assert b.ref_cnt == 1 and b.block_hash is None, (
                    f"{rid}: block {b.block_id} (index {i}) past its never-evicted prefix ({cap} tokens) is "
                    f"{'shared' if b.ref_cnt > 1 else 'hashed'}; it may be written"
                )
        if rid in scheduled:
            n = len(req_to_blocks.get(rid, ()))
            exp = accounting.target_blocks(st)
            assert n == exp, (
                f"{rid}: holds {n} blocks, expected {exp} (mode={st.plan.mode}, live={st.table.num_live}, "
                f"logical={st.table.num_logical}, naive={st.naive.num_retained_blocks})"
            )
    for rid, pairs in (getattr(moves, "unshare", None) or {}).items():
        blocks = req_to_blocks.get(rid, ())
        for i, old, new in pairs:
            b = by_id.get(new) or block_pool.blocks[new]
            assert i < len(blocks) and blocks[i].block_id == new and holders.get(new) == [rid] and b.block_hash is None, (
                f"{rid}: the copy of cached block {old} goes to block {new} (index {i}), which is not its own "
                f"unhashed block (held by {holders.get(new)}, hash {b.block_hash})")


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
