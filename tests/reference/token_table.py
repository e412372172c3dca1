"""Per-request token table: physical slot <-> logical position of every live token.

Block size B = 4. Ten tokens appended (logical positions 0..9), then slots 1, 2
and 7 (logical 1, 2, 7) evicted; the repack moves the tail tokens into the holes::

    slot              0  1  2  3 |  4  5  6  7 |  8  9
    logical_pos       0  1  2  3 |  4  5  6  7 |  8  9      num_live = 10, offset 0
    evict slots          x  x    |           x |
    moves                8->1, 9->2
    logical_pos       0  8  9  3 |  4  5  6    |            num_live = 7, offset 3
                                                 block 2 freed
    append 2          0  8  9  3 |  4  5  6 10 | 11         logical 10, 11 at slots 7, 8

``logical_pos[s]`` (slot -> position) covers the live slots ``0..num_live-1``
densely. ``slot_of(p)`` (position -> slot) is -1 for evicted positions. New tokens
take logical positions ``num_logical..`` (their RoPE positions) at physical slots
``num_live..``; moves only lower a token's slot, so ``slot <= logical position``.

Both maps are growable numpy buffers (capacity doubles), so ``append`` is amortised
O(n) and an eviction of k tokens costs O(k log k), never O(context length): the
plan only inspects the tail ``[num_live - k, num_live)`` and the update only writes
the k evicted positions and the moved slots.

This module never imports vllm.
"""

from __future__ import annotations

import numpy as np

from reference.repack import (
    RepackPlan,
    _as_index_array,
    _SMALL,
    _check_block_size,
    _sorted_unique,
    _sorted_unique_small,
    cdiv,
    plan_repack,
)

__all__ = ["TokenTable"]

_INITIAL_CAPACITY = 64


class TokenTable:
    """Logical <-> physical map of one request's live tokens.

    Attributes:
        block_size: B, tokens per block (>= 1).
        num_live: live tokens == the request's physical length in slots.
        num_logical: tokens ever appended (the next token's logical position).
        offset: ``num_logical - num_live`` (tokens evicted so far).
        logical_pos: read-only int64 ``[num_live]`` view, slot -> logical position.
            The view is only valid until the next mutating call.

    Invariants (checked by :meth:`check_invariants`):
        * ``logical_pos[:num_live]`` are distinct, in ``[0, num_logical)``, and
          ``slot_of(logical_pos[s]) == s``;
        * every other position in ``[0, num_logical)`` maps to -1;
        * ``num_logical - num_live == offset``.
    """

    def __init__(self, block_size: int):
        self.block_size = _check_block_size(block_size)
        self._pos_of_slot = np.full(_INITIAL_CAPACITY, -1, dtype=np.int64)  # [cap] slot -> pos
        self._slot_of_pos = np.full(_INITIAL_CAPACITY, -1, dtype=np.int64)  # [cap] pos -> slot
        self.num_live = 0
        self.num_logical = 0

    # ------------------------------------------------------------------ queries
    @property
    def offset(self) -> int:
        """``num_logical - num_live``: how many tokens have been evicted."""
        return self.num_logical - self.num_live

    @property
    def logical_pos(self) -> np.ndarray:
        """Read-only int64 ``[num_live]`` view: ``logical_pos[slot]`` = logical position."""
        view = self._pos_of_slot[: self.num_live]
        view.setflags(write=False)
        return view

    def slot_of(self, pos: int) -> int:
        """The slot holding logical position ``pos``; -1 if evicted or never appended."""
        pos = int(pos)
        if pos < 0 or pos >= self.num_logical:
            return -1
        return int(self._slot_of_pos[pos])

    def slots_of(self, positions: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`slot_of`: int64 ``[k]`` slots (-1 for dead / out of range)."""
        pos = _as_index_array(positions, "positions")
        out = np.full(pos.shape[0], -1, dtype=np.int64)
        ok = (pos >= 0) & (pos < self.num_logical)
        out[ok] = self._slot_of_pos[pos[ok]]
        return out

    def num_blocks(self) -> int:
        """``cdiv(num_live, block_size)``: the blocks the live tokens fill (what the
        scheduler's check expects a request to hold once a step's tokens are appended;
        right after an eviction it keeps ``cdiv(num_live + 1, B)``, see :meth:`evict_slots`)."""
        return cdiv(self.num_live, self.block_size)

    # ---------------------------------------------------------------- mutation
    @staticmethod
    def _grown(buf: np.ndarray, used: int, needed: int) -> np.ndarray:
        cap = buf.shape[0]
        if needed <= cap:
            return buf
        new = np.full(max(needed, 2 * cap), -1, dtype=np.int64)
        new[:used] = buf[:used]
        return new

    def append(self, n: int) -> None:
        """Append ``n >= 0`` tokens: logical ``num_logical..+n`` go to slots ``num_live..+n``.

        Amortised O(n).

        Raises:
            ValueError: ``n < 0``.
        """
        if n < 0:
            raise ValueError(f"append count must be >= 0, got {n}")
        n = int(n)
        if n == 0:
            return
        live, logical = self.num_live, self.num_logical
        self._pos_of_slot = self._grown(self._pos_of_slot, live, live + n)
        self._slot_of_pos = self._grown(self._slot_of_pos, logical, logical + n)
        self._pos_of_slot[live : live + n] = np.arange(logical, logical + n, dtype=np.int64)
        self._slot_of_pos[logical : logical + n] = np.arange(live, live + n, dtype=np.int64)
        self.num_live = live + n
        self.num_logical = logical + n

    def evict_slots(self, slots: np.ndarray) -> RepackPlan:
        """Evict the tokens in ``slots``, plan the repack and apply it to the table.

        Args:
            slots: integer ``[k]`` distinct slots in ``[0, num_live)``, any order.

        Returns:
            The :class:`RepackPlan` (already applied here; the caller applies it to the
            KV cache and per-slot state). The vLLM scheduler then keeps
            ``cdiv(num_live + 1, B)`` blocks (room for the step's next token) and frees the
            rest of the request's tail through the KV manager
            (``VTokenFullAttentionManager.vt_free_tail``); it does not read
            ``plan.freed_block_indices``.

        Raises:
            ValueError / TypeError: as :func:`vtoken.repack.plan_repack`; the table is
                unchanged on error.

        Cost: O(k log k), independent of ``num_live``.
        """
        plan = plan_repack(slots, self.num_live, self.block_size)
        self._apply(plan, np.asarray(slots))
        return plan

    def evict_positions(self, positions: np.ndarray) -> RepackPlan:
        """Evict the live tokens at logical ``positions``; see :meth:`evict_slots`.

        Args:
            positions: integer ``[k]`` distinct live logical positions, any order.

        Raises:
            ValueError: a position out of ``[0, num_logical)``, given twice, or already
                evicted (the message names it); the table is unchanged on error.
        """
        arr = _as_index_array(positions, "positions")
        if arr.shape[0] <= _SMALL:
            pos = _sorted_unique_small(arr, 0, self.num_logical, "position") if arr.shape[0] else arr
        else:
            pos = _sorted_unique(arr, 0, self.num_logical, "position")
        slots = self._slot_of_pos[pos]
        if slots.shape[0] and slots.min() < 0:
            raise ValueError(f"position {int(pos[int(np.argmin(slots))])} is already evicted")
        return self.evict_slots(slots)

    def _apply(self, plan: RepackPlan, evicted_slots: np.ndarray) -> None:
        """Apply a validated plan: kill the evicted positions, then move src -> dst."""
        if plan.num_evicted == 0:
            return
        evicted = evicted_slots.astype(np.int64, copy=False)
        self._slot_of_pos[self._pos_of_slot[evicted]] = -1
        if plan.num_moves:
            moved = self._pos_of_slot[plan.src]  # gather (fancy indexing copies) ...
            self._pos_of_slot[plan.dst] = moved  # ... then scatter
            self._slot_of_pos[moved] = plan.dst
        self._pos_of_slot[plan.new_num_live : plan.old_num_live] = -1
        self.num_live = plan.new_num_live

    def sort_by_position(self) -> np.ndarray:
        """Reorder the live slots by ascending logical position (a preempted request resumes
        by re-prefilling its live tokens into dense slots ``0..num_live-1`` in logical order).

        Returns:
            int64 ``[num_live]`` permutation: new slot ``i`` holds the token of old slot
            ``order[i]`` (apply it to per-slot state with ``SlotState.compact(order)``).

        Cost: O(n log n) in ``num_live``; only at a preemption.
        """
        n = self.num_live
        pos = self._pos_of_slot[:n]
        order = np.argsort(pos, kind="stable").astype(np.int64)
        sorted_pos = pos[order]
        self._pos_of_slot[:n] = sorted_pos
        self._slot_of_pos[sorted_pos] = np.arange(n, dtype=np.int64)
        return order

    def reset(self) -> None:
        """Back to empty. Keeps capacity."""
        self._pos_of_slot[: self.num_live] = -1
        self._slot_of_pos[: self.num_logical] = -1
        self.num_live = 0
        self.num_logical = 0

    # -------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Verify the table in O(num_logical); for tests and debugging.

        Raises:
            AssertionError: naming the broken invariant.
        """
        n, L = self.num_live, self.num_logical
        assert 0 <= n <= L, f"counts: need 0 <= num_live ({n}) <= num_logical ({L})"
        assert L - n == self.offset, f"offset: num_logical - num_live != offset ({self.offset})"
        pos = self._pos_of_slot[:n]
        assert np.all((pos >= 0) & (pos < L)), (
            "logical_pos: a live slot holds a position out of [0, num_logical)"
        )
        assert np.unique(pos).size == n, "logical_pos: positions of live slots are not distinct"
        assert np.array_equal(self._slot_of_pos[pos], np.arange(n)), (
            "pos->slot: a live position does not map back to its slot"
        )
        dead = np.ones(L, dtype=bool)
        dead[pos] = False
        assert np.all(self._slot_of_pos[:L][dead] == -1), (
            "pos->slot: an evicted position does not map to -1"
        )
        assert np.all(self._pos_of_slot[n:] == -1), (
            "slot->pos: a slot at or above num_live is not cleared"
        )

    def __len__(self) -> int:
        return self.num_live

    def __repr__(self) -> str:
        return (
            f"TokenTable(block_size={self.block_size}, num_live={self.num_live}, "
            f"num_logical={self.num_logical}, offset={self.offset})"
        )
