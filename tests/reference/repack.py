"""Repack planning (holes <- tail) and Naive-Evict block accounting.

One request, block size B = 4, ten live tokens, slots 1, 2 and 7 evicted::

    block        0             1             2
    slot     0  1  2  3 |  4  5  6  7 |  8  9
    before   L  x  x  L |  L  L  L  x |  L  L       x = evicted, L = live
                ^  ^                     |  |
                |  +---------------------|--+       move 9 -> 2
                +------------------------+          move 8 -> 1
    after    L  L  L  L |  L  L  L  . |  .  .       new num_live = 7;
                                                    block 2 is empty: freed

Only holes **below** the new live count (``new_num_live = old - #evicted``) are
filled; a hole at or above it (slot 7 here) lies in the tail and simply drops off
(``.`` = past the new end).
The live tokens of the tail range ``[new_num_live, old_num_live)`` are exactly as
many as the holes below ``new_num_live``, so one move per hole is both necessary and
sufficient. Holes (ascending) are paired with live tail slots (ascending), which
makes the plan deterministic. Every ``dst < new_num_live <= src``, so the source
and destination sets are disjoint and "gather every src, then scatter to every dst"
is a safe way to apply the plan in one pass.

Afterwards the live tokens fill ``cdiv(new_num_live, B)`` blocks; the plan's
``freed_block_indices`` are the block-table entries ``cdiv(new_num_live, B) ..
cdiv(old_num_live, B) - 1`` that it empties. The vLLM scheduler does not read them: after
an eviction it keeps ``cdiv(new_num_live + 1, B)`` blocks (room for the token the request
writes in the same step, so a budget that is a multiple of B does not free a block and
take it back every step; at least Naive-Evict's count under ``mode: naive``) and frees the rest of
its tail through the KV manager (``VTokenFullAttentionManager.vt_free_tail``).

:class:`NaiveEvictCounter` is the baseline's accounting: tokens stay where they
were appended (logical position ``p`` lives in block ``p // B``) and a block is
released only once it is full and every token ever placed in it is dead.

Slots are request-relative (block ``s // B`` of the request's block table, offset
``s % B``); see ``docs/core-contracts.md``. This module never imports vllm.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

__all__ = ["cdiv", "RepackPlan", "plan_repack", "NaiveEvictCounter"]

_EMPTY_I64 = np.zeros(0, dtype=np.int64)
_EMPTY_I64.setflags(write=False)
_SMALL = 32  # up to this many indices, Python ints beat numpy call overhead


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b`` (``-(-a // b)``)."""
    return -(-a // b)


def _check_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return int(block_size)


def _as_index_array(values, what: str) -> np.ndarray:
    """``values`` as a 1-D int64 array (a copy only when a conversion is needed).

    Raises:
        TypeError: a non-integer dtype (an empty sequence of any dtype is accepted).
        ValueError: not one-dimensional.
    """
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return _EMPTY_I64
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must have an integer dtype, got {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _sorted_unique(arr: np.ndarray, lo: int, hi: int, what: str) -> np.ndarray:
    """Sorted copy of ``arr`` after checking ``lo <= v < hi`` and distinctness.

    Cost O(k log k) for k = ``arr.size``; never looks at the range ``[lo, hi)`` itself.

    Raises:
        ValueError: naming the first out-of-range or duplicated value.
    """
    s = np.sort(arr)
    if s.size == 0:
        return s
    if s[0] < lo:
        raise ValueError(f"{what} {int(s[0])} is out of range [{lo}, {hi})")
    if s[-1] >= hi:
        raise ValueError(f"{what} {int(s[-1])} is out of range [{lo}, {hi})")
    if s.size > 1:
        dup = np.flatnonzero(s[1:] == s[:-1])
        if dup.size:
            raise ValueError(f"{what} {int(s[dup[0]])} is given more than once")
    return s


@dataclass(frozen=True)
class RepackPlan:
    """The moves that make one request's live tokens dense again after an eviction.

    Attributes:
        src: int64 ``[M]`` request-relative slots of live tail tokens, ascending;
            every ``new_num_live <= src < old_num_live``.
        dst: int64 ``[M]`` holes (evicted slots) below the new live count, ascending;
            every ``dst < new_num_live``. ``dst[i] < src[i]``; src and dst disjoint.
        old_num_live: live tokens (physical length) before the eviction.
        new_num_live: live tokens after it (``old_num_live - #evicted``).
        block_size: B, tokens per block.

    One move copies one token's K and V in every layer. The arrays are read-only.
    """

    src: np.ndarray
    dst: np.ndarray
    old_num_live: int
    new_num_live: int
    block_size: int

    @property
    def num_moves(self) -> int:
        """M, the number of (src -> dst) token copies (== holes below ``new_num_live``)."""
        return int(self.src.shape[0])

    @property
    def tokens_moved(self) -> int:
        """Tokens copied by the plan (same as :attr:`num_moves`)."""
        return int(self.src.shape[0])

    @property
    def num_evicted(self) -> int:
        """Tokens evicted by this step (``old_num_live - new_num_live``)."""
        return self.old_num_live - self.new_num_live

    @property
    def num_blocks_before(self) -> int:
        """Blocks held before: ``cdiv(old_num_live, block_size)``."""
        return cdiv(self.old_num_live, self.block_size)

    @property
    def num_blocks_after(self) -> int:
        """Blocks held after: ``cdiv(new_num_live, block_size)``."""
        return cdiv(self.new_num_live, self.block_size)

    @property
    def freed_block_indices(self) -> np.ndarray:
        """int64 ``[num_blocks_before - num_blocks_after]``: indices into the request's
        block table of the tail blocks that the plan empties (ascending). The scheduler
        does not free these: it keeps one more block when ``new_num_live`` is a multiple
        of B (``cdiv(new_num_live + 1, B)``, module docstring)."""
        return np.arange(self.num_blocks_after, self.num_blocks_before, dtype=np.int64)

    @property
    def num_freed_blocks(self) -> int:
        """``num_blocks_before - num_blocks_after``."""
        return self.num_blocks_before - self.num_blocks_after

    def bytes_moved(self, bytes_per_token: int) -> int:
        """Bytes copied when applying the plan: ``num_moves * bytes_per_token``.

        Args:
            bytes_per_token: KV bytes of one token summed over everything that moves
                with it (all layers, K and V, any score buffers), >= 0.

        Raises:
            ValueError: ``bytes_per_token < 0``.
        """
        if bytes_per_token < 0:
            raise ValueError(f"bytes_per_token must be >= 0, got {bytes_per_token}")
        return self.num_moves * int(bytes_per_token)

    @staticmethod
    def make_empty(num_live: int, block_size: int) -> "RepackPlan":
        """A plan that evicts and moves nothing (``old_num_live == new_num_live == num_live``)."""
        block_size = _check_block_size(block_size)
        if num_live < 0:
            raise ValueError(f"num_live must be >= 0, got {num_live}")
        return RepackPlan(_EMPTY_I64, _EMPTY_I64, int(num_live), int(num_live), block_size)


def plan_repack(evicted_slots: np.ndarray, num_live: int, block_size: int) -> RepackPlan:
    """Plan the moves that fill every hole below the new live count from the tail.

    Pure: reads ``evicted_slots`` and allocates new arrays only.

    Args:
        evicted_slots: integer ``[k]`` distinct request-relative slots in
            ``[0, num_live)``, any order (an empty sequence means "no eviction").
        num_live: live tokens (physical length) before the eviction, >= 0.
        block_size: B, tokens per block, >= 1.

    Returns:
        A :class:`RepackPlan` with ``new_num_live = num_live - k`` and exactly one move
        per evicted slot below ``new_num_live``; holes ascending paired with the live
        slots of ``[new_num_live, num_live)`` ascending.

    Raises:
        ValueError: a slot out of ``[0, num_live)`` or given twice (the message names
            it), a negative ``num_live``, a multi-dimensional ``evicted_slots``, or
            ``block_size < 1``.
        TypeError: a non-integer ``evicted_slots`` dtype or ``block_size``.

    Cost: O(k log k) in k = #evicted (a sort of the evicted slots); independent of
    ``num_live``: only the tail range ``[num_live - k, num_live)`` (k slots) is examined.
    Up to 32 slots are handled with Python ints (less per-call overhead than numpy);
    the result is identical.
    """
    block_size = _check_block_size(block_size)
    if num_live < 0:
        raise ValueError(f"num_live must be >= 0, got {num_live}")
    num_live = int(num_live)
    arr = _as_index_array(evicted_slots, "evicted_slots")
    k = arr.shape[0]
    if k == 0:
        return RepackPlan.make_empty(num_live, block_size)
    if k <= _SMALL:
        return _plan_small(arr, num_live, block_size)
    slots = _sorted_unique(arr, 0, num_live, "slot")
    new_num_live = num_live - k
    n_holes = int(np.searchsorted(slots, new_num_live))  # evicted slots below new_num_live
    if n_holes == 0:
        return RepackPlan(_EMPTY_I64, _EMPTY_I64, num_live, new_num_live, block_size)
    dst = slots[:n_holes]
    # The tail [new_num_live, num_live) has k slots; k - n_holes of them are evicted,
    # the other n_holes are live and are the sources.
    tail_live = np.ones(k, dtype=bool)
    tail_live[slots[n_holes:] - new_num_live] = False
    src = np.flatnonzero(tail_live).astype(np.int64, copy=False) + new_num_live
    return _frozen_plan(src, dst, num_live, new_num_live, block_size)


def _frozen_plan(src, dst, old_num_live: int, new_num_live: int, block_size: int) -> RepackPlan:
    src.setflags(write=False)
    dst.setflags(write=False)
    return RepackPlan(src, dst, old_num_live, new_num_live, block_size)


def _sorted_unique_small(arr: np.ndarray, lo: int, hi: int, what: str) -> list:
    """:func:`_sorted_unique` for a few values, with Python ints (less call overhead)."""
    vals = sorted(arr.tolist())
    if vals[0] < lo:
        raise ValueError(f"{what} {vals[0]} is out of range [{lo}, {hi})")
    if vals[-1] >= hi:
        raise ValueError(f"{what} {vals[-1]} is out of range [{lo}, {hi})")
    for a, b in zip(vals, vals[1:]):
        if a == b:
            raise ValueError(f"{what} {a} is given more than once")
    return vals


def _plan_small(arr: np.ndarray, num_live: int, block_size: int) -> RepackPlan:
    """The same plan as the vectorised path, computed with Python ints (k <= _SMALL)."""
    slots = _sorted_unique_small(arr, 0, num_live, "slot")
    new_num_live = num_live - len(slots)
    n_holes = bisect_left(slots, new_num_live)
    if n_holes == 0:
        return RepackPlan(_EMPTY_I64, _EMPTY_I64, num_live, new_num_live, block_size)
    tail_dead = set(slots[n_holes:])
    src = [s for s in range(new_num_live, num_live) if s not in tail_dead]
    return _frozen_plan(
        np.array(src, dtype=np.int64), np.array(slots[:n_holes], dtype=np.int64),
        num_live, new_num_live, block_size,
    )


class NaiveEvictCounter:
    """Naive-Evict accounting: the blocks the baseline keeps on the append-only layout.

    Logical position ``p`` stays in block ``p // B`` for ever. Block ``b`` (``b <
    cdiv(num_logical, B)``) is freed only when it is full (``b < num_logical // B``)
    and all B tokens ever placed in it are dead; the partially filled last block is
    always retained. Freed blocks never come back (the positions in them are dead and
    new tokens go to later blocks).

    Attributes:
        block_size: B.
        num_logical: tokens ever appended.
        num_dead: tokens evicted so far.
        num_retained_blocks: ``cdiv(num_logical, B) - #freed blocks``.

    Cost: ``append`` O(n) amortised, ``evict_positions`` O(k log k) for k positions
    (per-block live counters and a running freed-block count; never a scan of the
    context).
    """

    def __init__(self, block_size: int):
        self.block_size = _check_block_size(block_size)
        self._dead = np.zeros(64, dtype=bool)  # [capacity] by logical position
        self._live_in_block = np.zeros(cdiv(64, self.block_size), dtype=np.int64)
        self.num_logical = 0
        self.num_dead = 0
        self._num_freed = 0

    @property
    def num_blocks_appended(self) -> int:
        """``cdiv(num_logical, B)``: blocks the append-only layout has ever used."""
        return cdiv(self.num_logical, self.block_size)

    @property
    def num_retained_blocks(self) -> int:
        """Blocks the baseline holds: ``cdiv(num_logical, B)`` minus the freed ones."""
        return cdiv(self.num_logical, self.block_size) - self._num_freed

    @property
    def num_freed_blocks(self) -> int:
        """Blocks the baseline has returned to the pool so far."""
        return self._num_freed

    def append(self, n: int) -> None:
        """Place ``n >= 0`` new live tokens at logical positions ``num_logical..``.

        Raises:
            ValueError: ``n < 0``.
        """
        if n < 0:
            raise ValueError(f"append count must be >= 0, got {n}")
        n = int(n)
        if n == 0:
            return
        B = self.block_size
        old, new = self.num_logical, self.num_logical + n
        if new > self._dead.shape[0]:
            cap = max(new, 2 * self._dead.shape[0])
            dead = np.zeros(cap, dtype=bool)
            dead[:old] = self._dead[:old]
            self._dead = dead
            live = np.zeros(cdiv(cap, B), dtype=np.int64)
            nb = cdiv(old, B)
            live[:nb] = self._live_in_block[:nb]
            self._live_in_block = live
        first, last = old // B, (new - 1) // B
        if first == last:
            self._live_in_block[first] += n
        else:
            self._live_in_block[first] += (first + 1) * B - old
            self._live_in_block[first + 1 : last] = B
            self._live_in_block[last] = new - last * B
        self.num_logical = new
        # A block filled here holds a new (live) token, so appending frees nothing.

    def evict_positions(self, positions: np.ndarray) -> np.ndarray:
        """Mark the logical ``positions`` dead; return the blocks this frees.

        Args:
            positions: integer ``[k]`` distinct live logical positions.

        Returns:
            int64 ``[f]`` ascending indices (``p // B`` numbering) of the blocks freed by
            this call.

        Raises:
            ValueError: a position out of ``[0, num_logical)``, given twice or already
                dead (the message names it). The counter is unchanged on error.
        """
        arr = _as_index_array(positions, "positions")
        if arr.shape[0] == 0:
            return _EMPTY_I64
        B = self.block_size
        full = self.num_logical // B
        if arr.shape[0] <= _SMALL:
            vals = _sorted_unique_small(arr, 0, self.num_logical, "position")
            dead = self._dead
            for p in vals:
                if dead[p]:
                    raise ValueError(f"position {p} is already evicted")
            dead[vals] = True
            live = self._live_in_block
            freed_list = []
            for p in vals:
                b = p // B
                c = int(live[b]) - 1
                live[b] = c
                if c == 0 and b < full:
                    freed_list.append(b)
            self.num_dead += len(vals)
            self._num_freed += len(freed_list)
            return np.array(freed_list, dtype=np.int64)
        pos = _sorted_unique(arr, 0, self.num_logical, "position")
        already = self._dead[pos]
        if already.any():
            raise ValueError(f"position {int(pos[np.argmax(already)])} is already evicted")
        self._dead[pos] = True
        self.num_dead += int(pos.size)
        blocks = pos // B  # ascending, with repeats
        np.subtract.at(self._live_in_block, blocks, 1)
        freed = blocks[(self._live_in_block[blocks] == 0) & (blocks < full)]
        if freed.size > 1:  # a freed block appears once per position evicted in it
            freed = freed[np.concatenate(([True], freed[1:] != freed[:-1]))]
        self._num_freed += int(freed.size)
        return freed

    def reset(self) -> None:
        """Back to empty (preemption); keeps the allocated capacity."""
        self._dead[: self.num_logical] = False
        self._live_in_block[: cdiv(self.num_logical, self.block_size)] = 0
        self.num_logical = 0
        self.num_dead = 0
        self._num_freed = 0

    def __repr__(self) -> str:
        return (
            f"NaiveEvictCounter(block_size={self.block_size}, num_logical={self.num_logical}, "
            f"num_dead={self.num_dead}, num_retained_blocks={self.num_retained_blocks})"
        )
