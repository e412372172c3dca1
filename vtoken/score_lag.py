"""Attention statistics that arrive late: keyed by logical position, applied after a fixed lag.

Under vLLM's async scheduling (``AsyncScheduler``, batch queue 2) the scheduler plans step
``N+1`` (its evictions and repack moves included) before step ``N``'s outputs, and with
them its attention statistics, come back. Step ``N``'s arrays are indexed by **step N's**
physical slots; by the time they arrive the slots may have been repacked. So:

* at schedule time, a scored step records the request's slot -> logical-position map
  (:meth:`ScoreLagQueue.expect`);
* when its statistics arrive they are stored against that map (:meth:`ScoreLagQueue.deliver`);
* before the request's eviction decision for its request-step ``j``, every delivered step
  ``k <= j - 1 - lag`` is folded into the policy state, in step order, remapped onto the
  current slots through the logical positions (:func:`remap_stats`). Tokens evicted since
  step ``k`` are dropped; slots that step ``k`` did not cover (tokens appended since) get
  ``NaN``, which every policy leaves untouched (``vtoken.policies.base``).

The lag is a fixed number of the **request's own** scheduled steps, not "whatever has
arrived", so the decisions are a deterministic function of scores and positions and the
dense oracle can replay them exactly (``oracle_generate(score_lag=...)``). vLLM's batch
queue of 2 guarantees that when step ``M`` is scheduled every step ``<= M - 2`` has been
processed, hence ``lag = 1`` under async scheduling and ``lag = 0`` under sync scheduling
(where this reduces to "fold each step's statistics before the next decision", on an
unchanged layout).

A scoring policy under ``lag = L`` also starts evicting only at decode step ``L + 1``
(``d = 1`` is the first decode forward), so that the first eviction of a long prompt is
decided on the prefill's statistics rather than on none (:func:`first_evicting_decode_step`).

This module never imports vllm.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import numpy as np

from vtoken.policies.base import AttentionNeed, AttentionStats

__all__ = ["LaggedStats", "ScoreLagQueue", "remap_stats", "first_evicting_decode_step"]


def first_evicting_decode_step(needs: AttentionNeed, lag: int) -> int:
    """First decode step ``d`` (``d = 1``: the first decode forward) at which a policy may evict.

    Score-free policies (``needs == NONE``) evict from ``d = 1`` whatever the lag, so async
    and sync scheduling give them identical decisions. Scoring policies wait ``lag`` more
    steps, until the prefill's statistics have been folded in.
    """
    if lag < 0:
        raise ValueError(f"lag = {lag}: allowed: >= 0")
    return 1 if needs == AttentionNeed.NONE else 1 + lag


@dataclass
class LaggedStats:
    """One scored step's statistics, keyed by the logical positions of the step's slots.

    Attributes:
        step: the request-step index the statistics come from (0 = first scheduled step).
        logical_pos: int64 ``[n]``, slot -> logical position at that step (``n`` = keys attended).
        sampled: whether the step sampled a token (False for a non-final prefill chunk:
            its ``last_row`` is then dropped).
        stats: the statistics, ``None`` until delivered.
    """

    step: int
    logical_pos: np.ndarray
    sampled: bool
    stats: Optional[AttentionStats] = None


def remap_stats(stats: AttentionStats, from_logical_pos: np.ndarray, to_logical_pos: np.ndarray,
                num_logical: int) -> AttentionStats:
    """Re-index per-slot statistics from one slot layout to another via logical positions.

    Args:
        stats: ``col_sum`` / ``last_row``, float64 ``[len(from_logical_pos)]`` (or None).
        from_logical_pos: int64 ``[n_from]``, slot -> logical position when the stats were computed.
        to_logical_pos: int64 ``[n_to]``, slot -> logical position now.
        num_logical: an upper bound (exclusive) on every logical position involved.

    Returns:
        :class:`AttentionStats` over ``[n_to]`` slots: a token present in both layouts carries
        its value; a token absent from ``from_logical_pos`` (appended since) gets ``NaN``.
        ``num_keys`` is ``n_from`` (the number of keys the step attended over). Tokens
        evicted since are dropped. When the layouts are identical the arrays are returned
        unchanged (no copy).

    Raises:
        ValueError: an array's length differs from ``len(from_logical_pos)``.
    """
    n_from = len(from_logical_pos)
    for name in ("col_sum", "last_row", "key_norm"):
        a = getattr(stats, name)
        if a is not None and len(a) != n_from:
            raise ValueError(f"remap_stats: {name} covers {len(a)} slots; the step had {n_from}")
    same = len(to_logical_pos) == n_from and np.array_equal(to_logical_pos, from_logical_pos)
    if same:
        return AttentionStats(col_sum=stats.col_sum, last_row=stats.last_row, num_keys=n_from,
                              key_norm=stats.key_norm)
    index = np.full(num_logical, -1, dtype=np.int64)
    index[from_logical_pos] = np.arange(n_from)
    src = index[to_logical_pos]  # [n_to]: slot in the old layout, -1 if new
    missing = src < 0

    def remap(a: Optional[np.ndarray]) -> Optional[np.ndarray]:
        if a is None:
            return None
        out = np.asarray(a, dtype=np.float64)[np.where(missing, 0, src)]
        out[missing] = np.nan
        return out

    return AttentionStats(col_sum=remap(stats.col_sum), last_row=remap(stats.last_row), num_keys=n_from,
                          key_norm=remap(stats.key_norm))


class ScoreLagQueue:
    """Per-request queue of scored steps awaiting their statistics or their turn.

    Args:
        lag: request-steps between a scored step and the decision that first uses it
            (0: sync scheduling; 1: async scheduling with vLLM's batch queue of 2).
    """

    def __init__(self, lag: int = 0):
        if lag < 0:
            raise ValueError(f"score lag = {lag}: allowed: >= 0")
        self.lag = lag
        self._entries: "OrderedDict[int, LaggedStats]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def expect(self, step: int, logical_pos: np.ndarray, sampled: bool) -> None:
        """Record a scored step at schedule time (``logical_pos`` is copied)."""
        self._entries[step] = LaggedStats(step, np.array(logical_pos, dtype=np.int64, copy=True), sampled)

    def deliver(self, step: int, stats: AttentionStats) -> bool:
        """Attach the statistics of ``step``; False if that step is not expected (stale output).

        Raises:
            ValueError: an array's length differs from the step's number of slots.
        """
        e = self._entries.get(step)
        if e is None:
            return False
        n = len(e.logical_pos)
        for name in ("col_sum", "last_row"):
            a = getattr(stats, name)
            if a is not None and len(a) != n:
                raise ValueError(f"{name} covers {len(a)} slots; step {step} had {n} live tokens")
        e.stats = stats if e.sampled else AttentionStats(col_sum=stats.col_sum, last_row=None)
        return True

    def clear(self) -> None:
        """Drop every pending entry (a preempted request: statistics of steps before the
        preemption, delivered or in flight, are never folded in)."""
        self._entries.clear()

    def ready(self, current_step: int) -> list[LaggedStats]:
        """Pop, in step order, every delivered entry with ``step <= current_step - 1 - lag``.

        An entry that is due but not delivered stays queued (it is folded in once it arrives,
        still before any later entry). Raises nothing.
        """
        limit = current_step - 1 - self.lag
        out: list[LaggedStats] = []
        while self._entries:
            step, e = next(iter(self._entries.items()))
            if step > limit or e.stats is None:
                break
            self._entries.popitem(last=False)
            out.append(e)
        return out
