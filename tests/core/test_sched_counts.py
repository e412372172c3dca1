"""The scheduler's per-request columns (``vtoken/integrations/vllm/sched/counts.py``).

A :class:`CountState` reads and writes as a plain ``RequestState`` with a ``CountTable``: the same
fields after the same writes, the same ``evict_log`` after the same evictions (kept in runs,
also through the vectorized :meth:`CountColumns.log_evictions`), its figures kept after
:meth:`CountState.detach`, rows reused and the array grown under live states. No vLLM.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st_

from vtoken.config import VTokenConfig
from vtoken.integrations.vllm.sched import counts as C
from vtoken.integrations.vllm.sched.counts import COLUMN_FIELDS, CountColumns, CountState
from vtoken.integrations.vllm.sched.state import RequestState
from vtoken.counts import CountTable
from reference.repack import NaiveEvictCounter

BS = 16


def _args(budget: int = 64, slack: int = 0) -> dict:
    plan = VTokenConfig(policy="h2o", budget=budget, slack=slack).plan()
    return dict(plan=plan, budget=budget, slack=slack, prompt_len=100)


def _pair(cols: CountColumns, budget: int = 64, slack: int = 0) -> tuple[RequestState, CountState]:
    return (RequestState(**_args(budget, slack), table=CountTable(BS), naive=NaiveEvictCounter(BS)),
            CountState(**_args(budget, slack), cols=cols, block_size=BS))


def _fields(st) -> dict:
    d = {f: getattr(st, f) for f in COLUMN_FIELDS}
    d.update(live=st.table.num_live, logical=st.table.num_logical, offset=st.table.offset,
             evict_log=list(st.evict_log))
    return d


def test_fields_read_and_write_as_a_plain_state():
    cols = CountColumns(2)
    plain, row = _pair(cols)
    assert _fields(plain) == _fields(row)
    for st in (plain, row):
        st.decoding = True
        st.may_evict = True
        st.decode_steps += 3
        st.held_block_steps += 7
        st.clean_len = 40
        st.min_dst_slot = min(st.min_dst_slot, 32)
        st.table.append(100)
        st.table.evict(30)
        st.floor = 16
        st.recent = 8
    assert _fields(plain) == _fields(row)
    assert isinstance(row.decoding, bool) and type(row.steps) is int and type(row.table.num_live) is int
    row.clean_len = None
    assert row.clean_len is None
    row.faulted = True
    assert row.faulted and row.decoding and row.may_evict
    row.faulted = False
    assert not row.faulted and row.decoding


def test_threshold_follows_flags_budget_and_slack():
    cols = CountColumns(1)
    _, row = _pair(cols, budget=50, slack=5)
    thr = lambda: int(cols.data[C.THRESHOLD, row.row])  # noqa: E731
    assert thr() == C.NEVER  # not decoding yet
    row.may_evict = True
    row.decoding = True
    assert thr() == 55
    row.slack = 0
    assert thr() == 50
    row.faulted = True
    assert thr() == C.NEVER


def test_derived_columns_follow_their_fields():
    cols = CountColumns(1)
    _, row = _pair(cols, budget=50)
    d = lambda c: int(cols.data[c, row.row])  # noqa: E731
    row.floor, row.recent = 32, 10
    assert d(C.CAP_OVER) == 32 + 10 - 50  # <= 0: fixed pacing's count needs no cap
    row.recent = 30
    assert d(C.CAP_OVER) == 12
    assert d(C.ASK_EVERY) == 0  # may not evict yet
    row.may_evict = True
    row.score_need, row.score_every = 1, 3
    assert d(C.ASK_EVERY) == 3
    row.faulted = True
    assert d(C.ASK_EVERY) == 0
    row.faulted = False
    row.score_need = 0
    assert d(C.ASK_EVERY) == 0
    assert C.derived(cols.data[:, row.row]) == (d(C.THRESHOLD), d(C.CAP_OVER), d(C.ASK_EVERY))


@settings(max_examples=60, deadline=None)
@given(st_.lists(st_.tuples(st_.integers(1, 3), st_.integers(1, 3)), min_size=0, max_size=40))
def test_evict_log_runs_equal_the_plain_log(events):
    cols = CountColumns(1)
    plain, row = _pair(cols)
    step = 0
    for gap, k in events:
        step += gap
        plain.log_eviction(step, k)
        row.log_eviction(step, k)
    assert row.evict_log == plain.evict_log


@settings(max_examples=40, deadline=None)
@given(st_.lists(st_.lists(st_.tuples(st_.booleans(), st_.integers(1, 3)), min_size=5, max_size=5),
                 min_size=1, max_size=20))
def test_vectorized_log_equals_one_at_a_time(steps):
    cols = CountColumns(2)
    plain = [_pair(cols)[0] for _ in range(5)]
    rows = [CountState(**_args(), cols=cols, block_size=BS) for _ in range(5)]
    r = np.array([st.row for st in rows])
    for d, step in enumerate(steps, start=1):
        who = [i for i, (ev, _) in enumerate(step) if ev]
        for i in who:
            plain[i].log_eviction(d, step[i][1])
        if who:
            sel = r[who]
            m = cols.data[:, sel]
            cols.log_evictions(sel, m, np.full(len(who), d - 1), np.array([step[i][1] for i in who]))
            cols.data[:, sel] = m
    assert [st.evict_log for st in rows] == [st.evict_log for st in plain]


def test_detach_keeps_the_figures_and_frees_the_row():
    cols = CountColumns(1)
    a = CountState(**_args(), cols=cols, block_size=BS)
    a.table.append(80)
    a.table.evict(10)
    a.log_eviction(1, 10)
    a.steps = 5
    before = _fields(a)
    row = a.row
    a.detach()
    assert _fields(a) == before
    assert a.lifetime("r")["evict_log"] == [[1, 10]]
    b = CountState(**_args(), cols=cols, block_size=BS)  # reuses the row, zeroed
    assert b.row == row and b.table.num_live == 0 and b.evict_log == [] and b.steps == 0
    assert _fields(a) == before


def test_growth_keeps_live_rows():
    cols = CountColumns(1)
    sts = []
    for i in range(37):
        st = CountState(**_args(), cols=cols, block_size=BS)
        st.table.append(i)
        st.log_eviction(i + 1, i % 3 + 1)
        sts.append(st)
    assert cols.capacity >= 37
    assert [st.table.num_live for st in sts] == list(range(37))
    assert [st.evict_log for st in sts] == [[(i + 1, i % 3 + 1)] for i in range(37)]
