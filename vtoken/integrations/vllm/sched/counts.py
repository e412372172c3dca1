"""The scheduler's per-request integers in one numpy array, a row per request.

The scheduler works from a few integers per request and step
(``docs/eviction.md``). Kept as attributes of one Python object per request, every step
walks a dozen objects per request (state, token table, log list, boxed ints) that the stock
``schedule()`` between two visits pushes out of the CPU caches. :class:`CountColumns` keeps them
in one int64 array ``data[column, row]`` instead, so the per-step passes
(``VTokenSchedulerMixin._vt_evict_fixed_counts`` and ``_vt_after_scheduled_counts``) take the
rows of all requests at once (a view when they are consecutive, as they are while the same
requests run), compute with a few numpy operations over contiguous columns and write back.

:class:`CountState` is the :class:`~vtoken.integrations.vllm.sched.state.RequestState` of such a
request: the fields in :data:`COLUMN_FIELDS` are properties over its row (reads return Python
ints and bools, writes go to the row), every other field is an ordinary attribute, so all code
that reads or writes a state field works unchanged. Its ``table`` is a :class:`ColumnCountTable`
(the counts of :class:`vtoken.counts.CountTable`, in the row). ``evict_log`` is kept in runs
(first decode step, tokens, steps): a request evicting the same count at consecutive decode
steps extends its current run in the row (:meth:`CountColumns.log_evictions`); reading
``evict_log`` expands the runs into the ``(decode step, tokens)`` pairs of a plain state. When the
scheduler drops a state (finish, preemption) :meth:`CountState.detach` copies its row into a
private one-row :class:`CountColumns` and frees the row for reuse.

This module never imports vllm.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from vtoken.integrations.vllm.sched.state import RequestState
from vtoken.counts import CountTable

__all__ = ["COLUMNS", "COLUMN_FIELDS", "FLAG_FIELDS", "ColumnCountTable", "CountColumns", "CountNaive", "CountState"]

#: the columns of :attr:`CountColumns.data`: the table counts, the ``RequestState`` fields of
#: :data:`COLUMN_FIELDS`, the flags (:data:`FLAG_FIELDS`, one bit each), the current
#: eviction-log run (first decode step, tokens, steps, last decode step; tokens 0: no run), the
#: blocks the request holds (as of the scheduler's last look: the bookkeeping after
#: ``schedule()``, or a tail freed since), its Naive-Evict figures (retained blocks
#: ``cdiv(logical, B) - naive_freed``, the freed blocks the worker last reported, and their
#: lifetime sums; :class:`CountNaive`) and three figures derived from the fields
#: (:func:`derived`), kept by the fields' setters
COLUMNS = ("live", "logical", "budget", "slack", "floor", "recent", "score_need", "score_every", "decode_steps",
           "steps", "held_block_steps", "peak_blocks", "full_block_steps", "full_peak_blocks", "evicted",
           "clean_len", "min_dst_slot", "flags", "run_start", "run_k", "run_len", "run_last", "held", "naive_blocks",
           "naive_freed", "naive_block_steps", "naive_peak_blocks", "threshold", "cap_over", "ask_every", "point_every")
(LIVE, LOGICAL, BUDGET, SLACK, FLOOR, RECENT, SCORE_NEED, SCORE_EVERY, DECODE_STEPS, STEPS, HELD_BLOCK_STEPS,
 PEAK_BLOCKS, FULL_BLOCK_STEPS, FULL_PEAK_BLOCKS, EVICTED, CLEAN_LEN, MIN_DST_SLOT, FLAGS, RUN_START, RUN_K,
 RUN_LEN, RUN_LAST, HELD, NAIVE_BLOCKS, NAIVE_FREED, NAIVE_BLOCK_STEPS, NAIVE_PEAK_BLOCKS, THRESHOLD, CAP_OVER,
 ASK_EVERY, POINT_EVERY) = range(len(COLUMNS))
#: ``RequestState`` bool fields kept as bits of the ``flags`` column
FLAG_FIELDS = {"decoding": 1, "may_evict": 2, "faulted": 4, "chunk_evict": 8}
DECODING, MAY_EVICT, FAULTED, CHUNK_EVICT = 1, 2, 4, 8
#: a threshold no live count reaches
NEVER = 1 << 62


def at_point(flags, logical, every):
    """Whether a request may evict now: it decodes, or (``prefill_eviction: chunks``) its prefill
    stands at one of its eviction points, a logical position that is a positive multiple of
    ``every`` (``prefill_eviction_every``; ints or arrays)."""
    return ((flags & DECODING) != 0) | (((flags & CHUNK_EVICT) != 0) & (every > 0) & (logical > 0)
                                        & (logical % np.maximum(every, 1) == 0))


def threshold(budget, slack, flags, logical=0, every=0):
    """Fixed pacing evicts from a request whose live count exceeds this: ``budget + slack`` once
    it decodes (or, with ``prefill_eviction: chunks``, at one of its prefill eviction points,
    :func:`at_point`) and may evict and has no fault, else :data:`NEVER` (ints or arrays)."""
    return np.where(at_point(flags, logical, every) & ((flags & (MAY_EVICT | FAULTED)) == MAY_EVICT),
                    budget + slack, NEVER)


def derived(row: np.ndarray) -> tuple[int, int, int]:
    """A row's derived columns from its fields:

    * ``threshold`` (:func:`threshold`);
    * ``cap_over`` = ``floor + recent - budget``: when it is <= 0, fixed pacing's count
      ``live - budget`` never exceeds the tokens no protection covers
      (:func:`vtoken.counts.evictable`: ``live - floor - recent`` once ``live > budget + slack
      >= floor + recent``), so it needs no cap;
    * ``ask_every`` = ``score_every`` (at least 1) for a request whose policy needs statistics,
      that may evict and has no fault, else 0: a decode step ``d`` asks for statistics when
      ``d % ask_every == 0``, every prefill chunk when it is > 0.
    """
    flags = int(row[FLAGS])
    ask = row[SCORE_NEED] != 0 and (flags & (MAY_EVICT | FAULTED)) == MAY_EVICT
    return (int(threshold(row[BUDGET], row[SLACK], flags, row[LOGICAL], row[POINT_EVERY])), int(row[FLOOR] + row[RECENT] - row[BUDGET]),
            max(int(row[SCORE_EVERY]), 1) if ask else 0)
#: ``RequestState`` fields a :class:`CountState` keeps in its row (``clean_len``: -1 is None)
COLUMN_FIELDS = ("budget", "slack", "floor", "recent", "score_need", "score_every", "decode_steps", "steps",
                 "held_block_steps", "peak_blocks", "full_block_steps", "full_peak_blocks", "evicted", "clean_len",
                 "min_dst_slot", "naive_block_steps", "naive_peak_blocks", "point_every") + tuple(FLAG_FIELDS)


class CountColumns:
    """Per-request integers: ``data[column, row]`` (int64, columns :data:`COLUMNS`), a row per
    live request state, reused after :meth:`release`. ``data`` is replaced (grown) by
    :meth:`alloc`: a caller must not keep it across an ``alloc``."""

    def __init__(self, capacity: int = 64):
        self.data = np.zeros((len(COLUMNS), 0), dtype=np.int64)
        #: per row: the closed eviction-log runs ``(first decode step, tokens, steps)``
        self.runs: list[list[tuple[int, int, int]]] = []
        self._free: list[int] = []
        self._used = 0
        self._grow(max(1, capacity))

    @property
    def capacity(self) -> int:
        return self.data.shape[1]

    def _grow(self, capacity: int) -> None:
        old = self.data.shape[1]
        data = np.zeros((len(COLUMNS), capacity), dtype=np.int64)
        data[:, :old] = self.data
        self.runs.extend([] for _ in range(capacity - old))
        self.data = data

    def alloc(self) -> int:
        """A free row, zeroed."""
        if self._free:
            row = self._free.pop()
        else:
            if self._used == self.data.shape[1]:
                self._grow(2 * self.data.shape[1])
            row = self._used
            self._used += 1
        self.data[:, row] = 0
        refresh_derived(self.data, row)
        self.runs[row] = []
        return row

    def release(self, row: int) -> None:
        self._free.append(row)

    def copy_row(self, row: int) -> "CountColumns":
        """A one-row copy of ``row`` (row 0)."""
        c = CountColumns(1)
        c._used = 1
        c.data[:, 0] = self.data[:, row]
        c.runs[0] = list(self.runs[row])
        return c

    # -- evict_log in runs
    def log_evictions(self, rows: np.ndarray, m: np.ndarray, prev_steps: np.ndarray, ks: np.ndarray) -> None:
        """Record that row ``rows[i]`` asked to evict ``ks[i] > 0`` tokens at decode step
        ``prev_steps[i] + 1`` (``RequestState.evict_log``), in ``m`` (``data[:, rows]``, written
        back by the caller): a row whose current run has the same count and ends at
        ``prev_steps[i]`` extends it; the others close their run (in ``runs``) and start one."""
        cont = (m[RUN_K] == ks) & (m[RUN_LAST] == prev_steps)  # (no run: run_k 0, never a count)
        if np.count_nonzero(cont) == len(cont):
            m[RUN_LEN] += 1
            m[RUN_LAST] += 1
            return
        m[RUN_LEN, cont] += 1
        m[RUN_LAST, cont] += 1
        new = ~cont
        for i in np.flatnonzero(new & (m[RUN_LEN] > 0)).tolist():
            self.runs[int(rows[i])].append((int(m[RUN_START, i]), int(m[RUN_K, i]), int(m[RUN_LEN, i])))
        m[RUN_START, new] = prev_steps[new] + 1
        m[RUN_LAST, new] = prev_steps[new] + 1
        m[RUN_K, new] = ks[new]
        m[RUN_LEN, new] = 1

    def log_eviction(self, row: int, step: int, k: int) -> None:
        """:meth:`log_evictions` for one row (in ``data``)."""
        d = self.data
        n = int(d[RUN_LEN, row])
        if n and int(d[RUN_K, row]) == k and int(d[RUN_LAST, row]) + 1 == step:
            d[RUN_LEN, row] = n + 1
            d[RUN_LAST, row] = step
            return
        if n:
            self.runs[row].append((int(d[RUN_START, row]), int(d[RUN_K, row]), n))
        d[RUN_START, row], d[RUN_LAST, row], d[RUN_K, row], d[RUN_LEN, row] = step, step, k, 1

    def clear_log(self, row: int) -> None:
        self.runs[row] = []
        self.data[[RUN_START, RUN_K, RUN_LEN, RUN_LAST], row] = 0

    def evict_log(self, row: int) -> list[tuple[int, int]]:
        """Row ``row``'s ``(decode step, tokens)`` pairs, oldest first (a new list)."""
        runs = self.runs[row]
        d = self.data
        n = int(d[RUN_LEN, row])
        if n:
            runs = runs + [(int(d[RUN_START, row]), int(d[RUN_K, row]), n)]
        return [(s + j, k) for s, k, m in runs for j in range(m)]


def refresh_derived(d: np.ndarray, row: int) -> None:
    """Recompute row ``row``'s :func:`derived` columns of ``data`` ``d``."""
    d[THRESHOLD, row], d[CAP_OVER, row], d[ASK_EVERY, row] = derived(d[:, row])


def _int_field(col: int, name: str) -> property:
    def get(self) -> int:
        return int(self._cols.data[col, self._row])

    if col in (BUDGET, SLACK, FLOOR, RECENT, SCORE_NEED, SCORE_EVERY):
        def set(self, value: int) -> None:
            d = self._cols.data
            d[col, self._row] = value
            refresh_derived(d, self._row)
    else:
        def set(self, value: int) -> None:
            self._cols.data[col, self._row] = value

    return property(get, set, doc=f"``{name}`` (in the request's row)")


def _flag_field(bit: int, name: str) -> property:
    def get(self) -> bool:
        return bool(self._cols.data[FLAGS, self._row] & bit)

    def set(self, value: bool) -> None:
        d = self._cols.data
        if value:
            d[FLAGS, self._row] |= bit
        else:
            d[FLAGS, self._row] &= ~bit
        refresh_derived(d, self._row)

    return property(get, set, doc=f"``{name}`` (a bit of the request's row)")


class ColumnCountTable(CountTable):
    """:class:`vtoken.counts.CountTable` whose live and logical counts are a :class:`CountState`'s
    row (every method is ``CountTable``'s, through the two properties)."""

    def __init__(self, st: "CountState", block_size: int):  # (no CountTable.__init__: the row holds the counts)
        self._st = st
        self.block_size = block_size

    @property
    def num_live(self) -> int:
        st = self._st
        return int(st._cols.data[LIVE, st._row])

    @num_live.setter
    def num_live(self, value: int) -> None:
        st = self._st
        st._cols.data[LIVE, st._row] = value

    @property
    def num_logical(self) -> int:
        st = self._st
        return int(st._cols.data[LOGICAL, st._row])

    @num_logical.setter
    def num_logical(self, value: int) -> None:
        st = self._st
        st._cols.data[LOGICAL, st._row] = value


class CountNaive:
    """Naive-Evict's figures of a :class:`CountState`, in its row: the worker
    keeps the evicted positions and reports how many logical blocks are entirely dead
    (``DeviceDecider.naive_freed_blocks``, through ``ModelRunnerOutput.vtoken_naive_freed``), so
    the retained blocks are ``cdiv(logical, B) - freed``, as
    ``NaiveEvictCounter`` (``tests/reference/repack.py``) counts them from the positions. The report of a step
    arrives after its forward: one step after the scheduler path would count the same eviction
    (two under async scheduling). Until it arrives Naive-Evict is charged the blocks it held
    before, so the lag only ever adds blocks to the baseline."""

    def __init__(self, st: "CountState", block_size: int):
        self._st = st
        self.block_size = block_size

    @property
    def num_logical(self) -> int:
        return self._st.table.num_logical

    @property
    def num_retained_blocks(self) -> int:
        st = self._st
        d = st._cols.data
        return -(-int(d[LOGICAL, st._row]) // self.block_size) - int(d[NAIVE_FREED, st._row])

    def set_freed(self, freed: int) -> None:
        """The worker's report: ``freed`` logical blocks are entirely dead (updates the row's
        ``naive_blocks``)."""
        st = self._st
        d = st._cols.data
        d[NAIVE_FREED, st._row] = freed
        d[NAIVE_BLOCKS, st._row] = self.num_retained_blocks

    def append(self, n: int) -> None:
        """Nothing to do: the logical count is the table's (the row's)."""


class CountState(RequestState):
    """A :class:`RequestState` whose :data:`COLUMN_FIELDS` and table counts live in a row of
    ``cols`` (module docstring). Made as a ``RequestState`` is, plus ``cols`` and ``block_size``;
    its ``table`` is a :class:`ColumnCountTable`."""

    def __init__(self, *args: Any, cols: CountColumns, block_size: int, **kwargs: Any):
        self._cols = cols
        self._row = cols.alloc()
        kwargs["table"] = ColumnCountTable(self, block_size)
        super().__init__(*args, **kwargs)
        self.naive = CountNaive(self, block_size)

    @property
    def row(self) -> int:
        """This state's row in the scheduler's :class:`CountColumns` (until :meth:`detach`)."""
        return self._row

    def detach(self) -> None:
        """The scheduler dropped this state: keep its figures in a private copy, free the row."""
        cols, row = self._cols, self._row
        self._cols = cols.copy_row(row)
        self._row = 0
        cols.release(row)

    def log_eviction(self, step: int, k: int) -> None:
        """Append ``(step, k)`` to ``evict_log``."""
        self._cols.log_eviction(self._row, step, k)

    @property
    def evict_log(self) -> list:
        """``(decode step, tokens asked of the policy)`` of every eviction (a new list: append
        with :meth:`log_eviction`)."""
        return self._cols.evict_log(self._row)

    @evict_log.setter
    def evict_log(self, value: list) -> None:
        c, r = self._cols, self._row
        c.clear_log(r)
        for step, k in value:
            c.log_eviction(r, int(step), int(k))

    @property
    def clean_len(self) -> Optional[int]:
        v = int(self._cols.data[CLEAN_LEN, self._row])
        return None if v < 0 else v

    @clean_len.setter
    def clean_len(self, value: Optional[int]) -> None:
        self._cols.data[CLEAN_LEN, self._row] = -1 if value is None else value


for _name in COLUMN_FIELDS:
    if _name in FLAG_FIELDS:
        setattr(CountState, _name, _flag_field(FLAG_FIELDS[_name], _name))
    elif _name != "clean_len":
        setattr(CountState, _name, _int_field(COLUMNS.index(_name), _name))
del _name
