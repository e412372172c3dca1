"""vtoken.side_cache: random traces replayed through the batched device path (side cache, batched
policies, select_victims, plan_moves) and through the per-request reference of ``tests/reference/``
(TokenTable + each policy's numpy form + SlotState + plan_repack): the same victims, moves and tables."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vtoken.policies import available_policies
from vtoken.config import VTokenConfig
from vtoken.side_cache import DeviceDecider, SideCache
from reference.policies import AttentionStats, TokenView, reference
from vtoken.policies.base import AttentionNeed
from reference.repack import NaiveEvictCounter
from reference.token_table import TokenTable

B = 4
POLICIES = sorted(available_policies())  # every registered policy, a new one included
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class _Ref:
    """One request on the per-request path (what VTokenSchedulerMixin does per request)."""

    def __init__(self, policy):
        self.pol = reference(policy)
        self.table, self.state = TokenTable(B), self.pol.init_state()
        self.table_evicted: list[np.ndarray] = []

    def append(self, n):
        old = self.table.num_live
        self.table.append(n)
        self.state.reset_slots(old, old + n)

    def view(self, prefix=0):
        t = self.table
        return TokenView(t.logical_pos, t.num_logical, 0, prefix)

    def observe(self, col, last, kn=None, ks=None):
        self.pol.observe(self.state, self.table.num_live,
                         AttentionStats(col_sum=col, last_row=last, key_norm=kn, key_sim=ks), self.view())

    def evict(self, k, prefix):
        victims = self.pol.select_victims(self.state, self.view(prefix), k)
        positions = self.table.logical_pos[victims].copy()
        self.table_evicted.append(positions)
        plan = self.table.evict_slots(victims)
        self.state.apply_moves(plan.src, plan.dst)
        return positions, plan


def _run(policy_name, seed, device, steps=12, num_req=5, budget=10, sets=1, window=3):
    rng = np.random.default_rng(seed)
    cfg = VTokenConfig(policy=policy_name, budget=budget, seed=seed % 7,
                       **({"policy_args": {"window": window}} if policy_name == "scissorhands" else {}),)
    pol = cfg.make_policy()
    sinks, recent = cfg.protections()
    max_blocks = max(16, 2 * budget // B + 8)
    num_blocks = num_req * max_blocks + 3
    # each request's block table: distinct random block ids (as vLLM's pool hands them out)
    perm = rng.permutation(num_blocks)[: num_req * max_blocks].reshape(num_req, max_blocks)
    bt = torch.tensor(perm, dtype=torch.int64, device=device)
    dec = DeviceDecider(pol, num_blocks * B, B, max_requests=num_req + 2, device=device, num_sets=sets)
    rows_all = torch.arange(num_req, device=device) + 2  # rows need not start at 0
    dec.reset(rows_all)
    # one independent per-request reference per (request, token set): each set decides alone
    refs_sets = [[_Ref(pol) for _ in range(sets)] for _ in range(num_req)]
    refs = [r[0] for r in refs_sets]
    prefix = rng.integers(0, 6, num_req)
    prefill = rng.integers(1, 20, num_req)
    counts_log = []
    dead = [[set() for _ in range(sets)] for _ in range(num_req)]  # per (request, set): positions evicted
    for step in range(steps):
        # which requests run this step, and how many tokens they write (a 2-chunk prefill too)
        if step == 0:
            counts = np.minimum(prefill, 9)
        elif step == 1:
            counts = np.maximum(prefill - 9, 0) + 1
        else:
            counts = np.ones(num_req, dtype=np.int64)
        run = np.flatnonzero(rng.random(num_req) < 0.85) if step > 1 else np.arange(num_req)
        if len(run) == 0:
            continue
        rows = rows_all[run]
        # 1. evict: k from a random mix of "over budget" and random amounts (pressure pacing)
        live = np.array([refs[i].table.num_live for i in run])
        k = np.where(rng.random(len(run)) < 0.5, np.maximum(live - budget, 0), rng.integers(0, 4, len(run)))
        if pol.eviction_keys:  # KeyDiff: similarities from the cached keys, set right before the eviction
            ks = np.round(rng.random((len(run), sets, max(live.max(), 1))) * 8) / 8  # (ties on purpose)
            ks[rng.random(ks.shape) < 0.05] = np.nan  # a zero key: no cosine
            for j, i in enumerate(run):
                ks[j, :, live[j]:] = np.nan
                for s_, ref in enumerate(refs_sets[i]):
                    ref.observe(None, None, None, ks[j, s_, : live[j]].copy())
            dec.observe(rows, bt[run], None, None,
                        key_sim=torch.tensor(ks[:, 0] if sets == 1 else ks, device=device))
        ev = dec.evict(rows, bt[run], torch.tensor(k, device=device), sink_tokens=sinks, recent_tokens=recent,
                       protected_prefix=torch.tensor(prefix[run], device=device))
        for j, i in enumerate(run):
            all_pos = []
            for s_ in range(sets):
                pos, plan = refs_sets[i][s_].evict(int(k[j]), int(prefix[i]))
                all_pos += pos.tolist()
                sel = (ev.rows == j) & (ev.sets == s_)
                assert ev.src_slot[sel].tolist() == plan.src.tolist() and ev.dst_slot[sel].tolist() == plan.dst.tolist()
                ids = bt[i].cpu().numpy()
                assert ev.src[sel].tolist() == (ids[plan.src // B] * B + plan.src % B).tolist()
                assert ev.dst[sel].tolist() == (ids[plan.dst // B] * B + plan.dst % B).tolist()
                assert int(ev.new_live[j]) == refs_sets[i][s_].table.num_live
            got_pos = sorted(ev.evicted_pos[ev.evicted_rows == j].tolist())
            assert got_pos == sorted(all_pos), (policy_name, step, i)
            for s_ in range(sets):
                dead[i][s_].update(int(p) for p in refs_sets[i][s_].table_evicted[-1])
        # 2. append this step's tokens
        c = counts[run]
        dec.append(rows, bt[run], torch.tensor(c, device=device))
        for j, i in enumerate(run):
            for ref in refs_sets[i]:
                ref.append(int(c[j]))
        # 3. the forward's statistics, in slot order (ties on purpose: a coarse grid)
        width = max(r.table.num_live for r in refs) + 2
        # (one row per set: [R, S, N]; with one set also the [R, N] form)
        col = np.round(rng.random((len(run), sets, width)) * 4) / 4
        last = np.round(rng.random((len(run), sets, width)) * 8) / 8 / 4
        samples = (prefill[run] <= 9) | (step != 0)  # a non-final prefill chunk has no last row
        # key norms: the step's own keys only (its last c slots), NaN elsewhere and in the padding
        kn = np.round(rng.random((len(run), sets, width)) * 8) / 8
        for j, i in enumerate(run):
            kn[j, :, : refs[i].table.num_live - c[j]] = np.nan
            kn[j, :, refs[i].table.num_live:] = np.nan
        use_kn = bool(pol.needs & AttentionNeed.KEY_NORM)
        for j, i in enumerate(run):
            n = refs[i].table.num_live
            for s_, ref in enumerate(refs_sets[i]):
                ref.observe(col[j, s_, :n].copy() if pol.needs & AttentionNeed.COL_SUM else None,
                            last[j, s_, :n].copy() if pol.needs & AttentionNeed.LAST_ROW and samples[j] else None,
                            kn[j, s_, :n].copy() if use_kn else None)
        if sets == 1:
            col, last, kn = col[:, 0], last[:, 0], kn[:, 0]
        if pol.needs != AttentionNeed.NONE:
            # the batch shares one kind of step: observe sampling and non-sampling rows apart
            for part in (np.flatnonzero(samples), np.flatnonzero(~samples)):
                if len(part) == 0:
                    continue
                dec.observe(rows[part], bt[run][part],
                            torch.tensor(col[part], device=device) if pol.needs & AttentionNeed.COL_SUM else None,
                            torch.tensor(last[part], device=device)
                            if pol.needs & AttentionNeed.LAST_ROW and samples[part[0]] else None,
                            torch.tensor(kn[part], device=device) if use_kn else None)
        counts_log.append(len(run))
        # 4. the token tables agree; Naive-Evict's freed blocks: a logical block every set evicted
        # whole (from the positions; with one set also NaiveEvictCounter's count)
        freed = dec.naive_freed_blocks(rows_all).tolist()
        for i in range(num_req):
            n_logical = refs[i].table.num_logical
            want = sum(all(set(range(b * B, b * B + B)) <= d for d in dead[i]) for b in range(n_logical // B))
            assert freed[i] == want, (policy_name, step, i, freed[i], want)
            if sets == 1:
                counter = NaiveEvictCounter(B)
                counter.append(n_logical)
                if dead[i][0]:
                    counter.evict_positions(np.array(sorted(dead[i][0]), dtype=np.int64))
                assert freed[i] == counter.num_freed_blocks
        for i in range(num_req):
            for s_ in range(sets):
                got = dec.logical_pos(int(rows_all[i]), bt[i], s_).tolist()
                assert got == refs_sets[i][s_].table.logical_pos.tolist(), (policy_name, step, i, s_)
    return sum(r.table.offset for r in refs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy_name", POLICIES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31))
def test_batched_path_equals_per_request_path(policy_name, device, seed):
    _run(policy_name, seed, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy_name", POLICIES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), sets=st.integers(2, 4))
def test_token_sets_each_equal_an_independent_request(policy_name, device, seed, sets):
    """``num_sets`` > 1 (issue 23, ``docs/granularity.md``): each set of a request, fed its own
    statistics, decides, moves and keeps its table exactly as an independent per-request
    reference would; all sets keep the same count."""
    _run(policy_name, seed, device, sets=sets)


def test_token_sets_differ_when_their_statistics_differ():
    """Not vacuous: with per-set statistics, H2O's sets hold different positions."""
    cfg = VTokenConfig(policy="h2o", budget=6, recent_tokens=1)
    dec = DeviceDecider(cfg.make_policy(), 64, B, max_requests=2, num_sets=2)
    rows, bt = torch.tensor([0]), torch.arange(8)[None, :]
    dec.reset(rows)
    dec.append(rows, bt, torch.tensor([10]))
    col = torch.zeros(1, 2, 10, dtype=torch.float64)
    col[0, 0, :5] = 1.0  # set 0 keeps the first tokens, set 1 the last ones
    col[0, 1, 5:] = 1.0
    dec.observe(rows, bt, col, None)
    ev = dec.evict(rows, bt, torch.tensor([4]))
    assert ev.new_live.tolist() == [6]
    assert sorted(dec.logical_pos(0, bt[0], 0).tolist()) == [0, 1, 2, 3, 4, 9]
    assert sorted(dec.logical_pos(0, bt[0], 1).tolist()) == [4, 5, 6, 7, 8, 9]
    assert ev.sets.tolist().count(0) == 1 and ev.sets.tolist().count(1) == 4  # set 0: 9 -> 5; set 1: 4..9 -> 0..3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [64, 70, 129])
def test_scissorhands_packed_history_equals_the_boolean_window(device, window):
    """Scissorhands' batched history is packed 64 steps to an int64 word with a running count:
    over more steps than the window, windows that fill one word exactly (bit 63 included), spill
    into a second or a third word, give the per-request path's boolean window counts."""
    _run("scissorhands", window, device, steps=3 * window, num_req=3, budget=64, sets=2, window=window)


@pytest.mark.parametrize("policy_name", POLICIES)
def test_traces_evict(policy_name):
    """The traces above are not vacuous: requests do evict, and tokens do move."""
    assert _run(policy_name, 1234, "cpu", steps=20) > 20


def test_side_cache_moves_every_field_and_counts_bytes():
    sc = SideCache(8, {"acc": ((), torch.float64), "hist": ((3,), torch.bool)})
    assert sc.bytes_per_token == 8 + 8 + 3
    sc.fields["pos"][0] = torch.arange(8)
    sc.fields["acc"][0] = torch.arange(8, dtype=torch.float64) / 2
    sc.fields["hist"][0, 5] = torch.tensor([True, False, True])
    sc.move(torch.tensor([5, 7]), torch.tensor([1, 2]))
    assert sc.fields["pos"][0].tolist() == [0, 5, 7, 3, 4, 5, 6, 7]
    assert sc.fields["acc"][0, 1:3].tolist() == [2.5, 3.5]
    assert sc.fields["hist"][0, 1].tolist() == [True, False, True]
    # two sets: a move of set 1 leaves set 0's slots alone
    two = SideCache(4, {}, num_sets=2)
    assert two.bytes_per_token == 16
    two.fields["pos"][:] = torch.tensor([[0, 1, 2, 3], [10, 11, 12, 13]])
    two.move(torch.tensor([3]), torch.tensor([0]), torch.tensor([1]))
    assert two.fields["pos"].tolist() == [[0, 1, 2, 3], [13, 11, 12, 13]]
    with pytest.raises(ValueError, match="num_sets = 0"):
        SideCache(4, {}, num_sets=0)
    with pytest.raises(ValueError, match="'pos' is reserved"):
        SideCache(4, {"pos": ((), torch.int64)})


def test_shared_prefix_state_is_read_only_for_the_sharer():
    """A prefix-cache hit (``share_prefix``): the sharer writes the shared slots' logical
    positions but never their policy state (append zeroes only its own slots, observe folds
    only into them), so the owner's H2O scores there stay its own; the sharer's own slots fold
    as usual."""
    cfg = VTokenConfig(policy="h2o", budget=8, recent_tokens=1)
    dec = DeviceDecider(cfg.make_policy(), 64, B, max_requests=2)
    owner, sharer = torch.tensor([0]), torch.tensor([1])
    bt_owner = torch.tensor([[0, 1, 2, 3]])
    bt_sharer = torch.tensor([[0, 5, 6, 7]])  # block 0 (slots 0..B-1) shared
    dec.reset(torch.tensor([0, 1]))
    dec.append(owner, bt_owner, torch.tensor([B + 2]))
    dec.observe(owner, bt_owner, torch.arange(B + 2, dtype=torch.float64)[None, :] + 1, None)
    before = dec.side.fields["acc"][0, :B].clone()
    dec.share_prefix(sharer, B)
    dec.append(sharer, bt_sharer, torch.tensor([B + 3]))  # the hit's B tokens and 3 of its own
    dec.observe(sharer, bt_sharer, torch.full((1, B + 3), 100.0, dtype=torch.float64), None)
    assert torch.equal(dec.side.fields["acc"][0, :B], before)  # the owner's scores, untouched
    assert dec.side.fields["acc"][0, 5 * B: 5 * B + 3].tolist() == [100.0] * 3  # the sharer's own
    assert dec.logical_pos(1, bt_sharer[0]).tolist() == list(range(B + 3))
    # without share_prefix the sharer's append would have zeroed the owner's scores
    dec.reset(sharer)
    dec.append(sharer, bt_sharer, torch.tensor([B]))
    assert dec.side.fields["acc"][0, :B].abs().sum() == 0


@pytest.mark.parametrize("policy_name", POLICIES)
@pytest.mark.parametrize("sets", [1, 3])
def test_side_bytes_per_token_is_what_the_side_cache_holds(policy_name, sets):
    """The start-up reservation (``side_bytes_per_token``) equals what a made side cache reports,
    and H2O's is an int64 position plus a float64 accumulator per set."""
    from vtoken.side_cache import side_bytes_per_token

    pol = VTokenConfig(policy=policy_name, budget=8,).make_policy()
    made = SideCache(64, pol.side_specs(), num_sets=sets).bytes_per_token
    assert side_bytes_per_token(pol, sets) == made
    if policy_name == "h2o":
        assert made == 16 * sets


@pytest.mark.parametrize("same_block", [True, False])
def test_naive_freed_blocks_needs_the_block_dead_in_every_set(same_block):
    """Two token sets evict 4 tokens each (B = 4) from 12: the same block in both (freed: 1) or
    different blocks (freed: 0, each set keeps a token of the other's block)."""
    pol = VTokenConfig(policy="h2o", budget=8, sink_tokens=0, recent_tokens=0).make_policy()
    dec = DeviceDecider(pol, 16 * B, B, max_requests=3, num_sets=2)
    rows = torch.tensor([2])
    dec.reset(rows)
    bt = torch.arange(4)[None]
    dec.append(rows, bt, torch.tensor([12]))
    col = np.ones((1, 2, 12))
    col[0, 0, 0:4] = 0.0
    col[0, 1, slice(0, 4) if same_block else slice(4, 8)] = 0.0
    dec.observe(rows, bt, torch.tensor(col), None)
    ev = dec.evict(rows, bt, torch.tensor([4]))
    assert sorted(ev.evicted_pos.tolist()) == sorted(list(range(4)) + (list(range(4)) if same_block else list(range(4, 8))))
    assert dec.naive_freed_blocks(rows).tolist() == [1 if same_block else 0]


@pytest.mark.parametrize("sets", [1, 3])
def test_observe_written_equals_observe_for_knorm(sets):
    """K-norm folds a step's key norms straight into the written slots
    (``observe_written``); the side cache ends as :meth:`DeviceDecider.observe` leaves it when
    given the same norms at those slots and ``NaN`` elsewhere (two steps: a prompt, then a
    decode token), and the rounding to 12 bits happens on both paths."""
    import copy

    cfg = VTokenConfig(policy="knorm", budget=8)
    g = torch.Generator().manual_seed(0)
    a = DeviceDecider(cfg.make_policy(), 64, B, max_requests=2, num_sets=sets)
    rows = torch.tensor([0, 1])
    bt = torch.tensor([[0, 1, 2, 3], [7, 5, 6, 4]])
    a.reset(rows)
    b = copy.deepcopy(a)
    for counts in ([5, 3], [1, 1]):
        old = a.live[rows].clone()
        for d in (a, b):
            d.append(rows, bt, torch.tensor(counts))
        n = int(a.live.max())
        kn = torch.full((2, sets, n), float("nan"), dtype=torch.float64)
        slots, vals = [], []
        for r, c in enumerate(counts):
            v = torch.rand(sets, c, generator=g, dtype=torch.float64) + 1
            kn[r, :, old[r]: old[r] + c] = v
            rel = torch.arange(int(old[r]), int(old[r]) + c)
            slots.append(bt[r, rel // B] * B + rel % B)
            vals.append(v)
        a.observe(rows, bt, None, None, key_norm=kn)
        b.observe_written(torch.cat(slots), torch.cat(vals, dim=1))
        assert torch.equal(a.side.fields["norm"], b.side.fields["norm"])
        assert torch.equal(a.side.fields["pos"], b.side.fields["pos"])
    assert bool((b.side.fields["norm"][:, :6] != 0).all())  # request 0's 6 tokens: blocks 0, 1
    with pytest.raises(ValueError, match="expected \\[%d, 2\\]" % sets):
        b.observe_written(torch.tensor([0, 1]), torch.ones(sets + 1, 2, dtype=torch.float64))
    h2o = DeviceDecider(VTokenConfig(policy="h2o", budget=8).make_policy(), 64, B, max_requests=2)
    with pytest.raises(ValueError, match="reads more than the written slots"):
        h2o.observe_written(torch.tensor([0]), torch.ones(1, 1, dtype=torch.float64))
