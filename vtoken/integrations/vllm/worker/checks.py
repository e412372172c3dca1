"""The worker's debug checks of its own moves (``VTOKEN_CHECK=1``; tests, soak).

The scheduler checks its block accounting after every ``schedule()``
(:mod:`vtoken.integrations.vllm.sched.checks`); the moves are decided on the worker, so the worker
checks them, in :meth:`~vtoken.integrations.vllm.worker.eviction.WorkerEviction.begin`, before
the caller applies them to the KV cache:

* **Owners.** Every move of a request reads and writes slots of that request's own blocks, as
  the worker's copy of its block table holds them before the step's truncation: the global slot
  is ``table[row, rel // B] * B + rel % B`` of its request-relative slot ``rel``.
* **Repack.** A move fills a hole below the request's new live count from a live slot at or past
  it (``dst < new_live <= src < old_live``); within a token set no two moves share a source or a
  destination; no move writes a shared prefix-cache slot (``rel >= shared``).
* **Blocks freed and reused within one step.** A destination block stays the request's after the
  step's truncation and is held by no other request (tracked, or given a block in this step's
  ``SchedulerOutput``), unless the request is suspended in this step (preempted, its state saved
  after the moves); no move writes a block that another request's prefix-cache copy of this step
  writes first (a request's own copies, its first eviction under prefix caching, are where its
  moves go next). A source block may have been truncated off the request and given to
  another in the same step: legal, since the moves run before the step's forward writes any
  K/V; counted in ``WorkerEviction.check_stats["freed_reused_same_step"]`` (tests show they
  exercise that ordering).

A failed check raises ``AssertionError`` naming the request, the set and the slots (as the
scheduler's checks do). Python loops are fine here: this runs only under ``VTOKEN_CHECK=1``.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import numpy as np

__all__ = ["check_group_moves", "check_step_blocks", "new_blocks_of_step"]


def check_group_moves(rids: list[str], rows: np.ndarray, table: np.ndarray, block_size: int,
                      live_before: np.ndarray, shared: np.ndarray, ev: Any) -> list[tuple[str, int, int]]:
    """Check one group's eviction (module docstring: owners, repack).

    Args:
        rids: the batch's request ids (``ev.rows`` indexes them).
        rows: int64 ``[R]`` the requests' rows in the group.
        table: int64 ``[R, W]`` their block ids before the step's truncation.
        block_size: ``B``.
        live_before: int64 ``[R]`` live tokens before the eviction.
        shared: int64 ``[R]`` shared prefix-cache slots of each request.
        ev: the :class:`vtoken.side_cache.Eviction`.

    Returns:
        ``(req_id, dst block, src block)`` per move, for :func:`check_step_blocks`.

    Raises:
        AssertionError: a move outside its request's blocks, not a repack, or a duplicate.
    """
    src, dst = ev.src.cpu().numpy(), ev.dst.cpu().numpy()
    r = ev.rows.cpu().numpy()
    s_rel, d_rel = ev.src_slot.cpu().numpy(), ev.dst_slot.cpu().numpy()
    sets = ev.sets.cpu().numpy()
    new_live = ev.new_live.cpu().numpy()
    bs = int(block_size)
    out = []
    seen: set[tuple[int, int, str, int]] = set()
    for i in range(len(src)):
        j = int(r[i])
        rid, live0, live1 = rids[j], int(live_before[j]), int(new_live[j])
        where = f"vToken check: request {rid!r} (row {int(rows[j])}), set {int(sets[i])}, move {int(s_rel[i])} -> {int(d_rel[i])}"
        assert 0 <= int(d_rel[i]) < live1 <= int(s_rel[i]) < live0, (
            f"{where}: not a repack (needs dst < new live {live1} <= src < old live {live0})")
        assert int(d_rel[i]) >= int(shared[j]), f"{where}: writes a shared prefix-cache slot (shared {int(shared[j])})"
        for name, rel, glob in (("src", s_rel[i], src[i]), ("dst", d_rel[i], dst[i])):
            blk = int(rel) // bs
            assert blk < table.shape[1], f"{where}: {name} block index {blk} past the request's table"
            want = int(table[j, blk]) * bs + int(rel) % bs
            assert int(glob) == want, f"{where}: {name} global slot {int(glob)} is not the request's slot {want}"
            key = (int(sets[i]), j, name, int(rel))
            assert key not in seen, f"{where}: a second move with the same {name} in this set"
            seen.add(key)
        out.append((rid, int(dst[i]) // bs, int(src[i]) // bs))
    return out


def new_blocks_of_step(scheduler_output: Any) -> dict[int, set[str]]:
    """Block id -> the requests this step's ``SchedulerOutput`` gives it to (new requests' block
    ids, cached requests' new block ids)."""
    out: dict[int, set[str]] = {}
    for nr in scheduler_output.scheduled_new_reqs:
        for group in nr.block_ids or ():
            for b in group:
                out.setdefault(int(b), set()).add(nr.req_id)
    cr = scheduler_output.scheduled_cached_reqs
    for rid, ids in zip(cr.req_ids, cr.new_block_ids):
        for group in ids or ():
            for b in group:
                out.setdefault(int(b), set()).add(rid)
    return out


def check_step_blocks(moved: Iterable[tuple[str, int, int]], held: dict[str, set[int]],
                      given: dict[int, set[str]], suspended: frozenset[str] = frozenset(),
                      copy_targets: Optional[dict[int, str]] = None) -> int:
    """The step's cross-request check (module docstring: blocks freed and reused).

    Args:
        moved: ``(req_id, dst block, src block)`` of every move of the step.
        held: request id -> the blocks the worker's tables hold after the step's truncation and
            block assignment (every tracked request).
        given: :func:`new_blocks_of_step`.
        suspended: requests preempted in this step whose state the worker saves after their
            eviction (``StepPayload.suspend``): their blocks go back to the pool in this step and
            may be given to another request at once, which is legal because the moves and the
            save run before the forward writes; only a block that another request's prefix-cache
            copy of this step writes before the moves (``copy_targets``) may not take one of their moves.
        copy_targets: block -> the request whose prefix-cache copy (``StepPayload.unshare``) writes
            it in this step, before the moves (a request's own copies are where its moves go next).

    Returns:
        The source blocks truncated off their request and given to another in this step.

    Raises:
        AssertionError: a destination block the request no longer holds, or one another request
            holds or is given in this step.
    """
    owners: dict[int, set[str]] = {}
    for rid, blocks in held.items():
        for b in blocks:
            owners.setdefault(b, set()).add(rid)
    reused = set()
    for rid, dst_blk, src_blk in moved:
        assert (copy_targets or {}).get(dst_blk, rid) == rid, (
            f"vToken check: request {rid!r} moves a token into block {dst_blk}, which request "
            f"{(copy_targets or {})[dst_blk]!r}'s prefix-cache copy of this step writes first")
        if rid in suspended:
            continue
        others = (owners.get(dst_blk, set()) | given.get(dst_blk, set())) - {rid}
        assert rid in owners.get(dst_blk, set()), (
            f"vToken check: request {rid!r} moves a token into block {dst_blk}, which it no longer holds after the step")
        assert not others, (f"vToken check: request {rid!r} moves a token into block {dst_blk}, which "
                            f"{sorted(others)} also hold(s) in this step")
        if src_blk not in held.get(rid, ()) and given.get(src_blk, set()) - {rid}:
            reused.add(src_blk)
    return len(reused)
