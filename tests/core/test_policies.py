"""Eviction policies: interface conformance for every registered policy, then
hand-computed cases per policy from the paper's definition, and the config errors."""

from __future__ import annotations

import random as pyrandom

import numpy as np
import pytest

from vtoken.config import VTokenConfig, VTokenConfigError, num_to_evict, parse_config
from reference.policies import AttentionStats, SlotState, TokenView, position_hash, reference
from vtoken.policies import AttentionNeed, available_policies, get_policy_class
from vtoken.policies import h2o, random, scissorhands, streaming, tova


def _ref(cls):
    """``cls(**kw)`` in its reference form (tests/reference/policies.py); the class's own fields."""
    def make(**kw):
        return reference(cls(**kw))
    make.needs = cls.needs
    return make


H2OPolicy, RandomPolicy, TOVAPolicy = _ref(h2o.H2OPolicy), _ref(random.RandomPolicy), _ref(tova.TOVAPolicy)
ScissorhandsPolicy, StreamingLLMPolicy = _ref(scissorhands.ScissorhandsPolicy), _ref(streaming.StreamingLLMPolicy)

ALL = sorted(available_policies())


# --------------------------------------------------------------------------- helpers
def view_of(logical_pos, num_logical=None, prompt_len=0) -> TokenView:
    pos = np.asarray(logical_pos, dtype=np.int64)
    if num_logical is None:
        num_logical = int(pos.max()) + 1 if len(pos) else 0
    return TokenView(logical_pos=pos, num_logical=num_logical, prompt_len=prompt_len)


def stats_for(policy, pos: np.ndarray, step: int, sample: bool = True) -> AttentionStats:
    """Stats that depend only on (logical position, step), laid out by slot."""
    vals = np.array([((p * 7 + step * 3) % 11 + 1) / 64.0 for p in pos])  # dyadic, exact sums
    col = vals if policy.needs & AttentionNeed.COL_SUM else None
    last = vals / vals.sum() if (sample and policy.needs & AttentionNeed.LAST_ROW) else None
    kn = vals.copy() if policy.needs & AttentionNeed.KEY_NORM else None
    ks = vals.copy() if policy.eviction_keys else None  # (KeyDiff: set before an eviction in the engine)
    return AttentionStats(col_sum=col, last_row=last, key_norm=kn, key_sim=ks)


def append(policy, state: SlotState, pos: np.ndarray, n: int, step: int, sample: bool = True) -> np.ndarray:
    """One step that writes ``n`` tokens at the end of the slots, then observe."""
    live = len(pos)
    start = int(pos.max()) + 1 if live else 0
    state.reset_slots(live, live + n)
    pos = np.concatenate([pos, np.arange(start, start + n, dtype=np.int64)])
    policy.observe(state, len(pos), stats_for(policy, pos, step, sample), view_of(pos))
    return pos


def check_victims(policy, view: TokenView, victims: np.ndarray, k: int) -> None:
    assert victims.dtype == np.int64
    assert len(victims) == k
    assert len(np.unique(victims)) == k
    assert np.all(np.diff(victims) > 0), "victims must be sorted ascending"
    assert np.all((victims >= 0) & (victims < view.num_live))
    assert not policy.protected_mask(view)[victims].any(), "a protected slot was chosen"


def policy_for(name: str, **kw):
    cfg = VTokenConfig(policy=name, **kw)
    return cfg, reference(cfg.make_policy())


# ------------------------------------------------------- conformance (every policy)
@pytest.mark.parametrize("name", ALL)
def test_interface_conformance_and_apply_moves(name):
    kw = {"policy_args": {"window": 3}} if name == "scissorhands" else {}
    cfg, pol = policy_for(name, budget=6, sink_tokens=1, recent_tokens=2, **kw)
    assert pol.name == name and isinstance(pol.needs, AttentionNeed)
    assert type(pol.policy) is get_policy_class(name)
    assert isinstance(pol.policy.__doc__, str) and len(pol.policy.__doc__) > 200

    # identity layout (the dense oracle): prefill of 10 tokens then 2 decode steps
    s_id = pol.init_state()
    pos = append(pol, s_id, np.zeros(0, np.int64), 10, step=0)
    for step in (1, 2):
        pos = append(pol, s_id, pos, 1, step)
    v = view_of(pos)
    k = 4
    victims = pol.select_victims(s_id, v, k)
    check_victims(pol, v, victims, k)
    assert len(pol.select_victims(s_id, v, 0)) == 0
    # asking for more than exists: all unprotected, still distinct and sorted
    many = pol.select_victims(s_id, v, 100)
    assert len(many) == int((~pol.protected_mask(v)).sum())

    # run the same request twice from the identical state: evict positions 2 and 5,
    # (a) dense oracle: compact, logical order; (b) engine: fill holes from the tail
    def build():
        s = pol.init_state()
        p = append(pol, s, np.zeros(0, np.int64), 10, step=0)
        for st in (1, 2):
            p = append(pol, s, p, 1, st)
        return s, p

    s_a, p_a = build()
    keep = np.array([i for i in range(12) if i not in (2, 5)], dtype=np.int64)
    s_a.compact(keep)
    p_a = p_a[keep]

    s_b, p_b = build()
    src, dst = np.array([10, 11], np.int64), np.array([2, 5], np.int64)  # by hand: tail -> holes
    s_b.apply_moves(src, dst)
    p_b = p_b.copy()
    p_b[dst] = p_b[src]
    p_b = p_b[:10]
    assert sorted(p_b.tolist()) == p_a.tolist() and p_b.tolist() != p_a.tolist()

    # more steps on both layouts, with stats laid out by each layout's slots
    for st in (3, 4, 5):
        p_a = append(pol, s_a, p_a, 1, st)
        p_b = append(pol, s_b, p_b, 1, st)
    for k in (1, 3, 5):
        va, vb = view_of(p_a), view_of(p_b)
        ea, eb = pol.select_victims(s_a, va, k), pol.select_victims(s_b, vb, k)
        check_victims(pol, va, ea, k)
        check_victims(pol, vb, eb, k)
        assert sorted(p_a[ea].tolist()) == sorted(p_b[eb].tolist())
        np.testing.assert_array_equal(np.sort(pol.score(s_a, va)), np.sort(pol.score(s_b, vb)))


@pytest.mark.parametrize("name", ALL)
def test_prompt_shorter_than_budget_evicts_nothing(name):
    cfg, pol = policy_for(name, budget=16)
    state = pol.init_state()
    pos = append(pol, state, np.zeros(0, np.int64), 9, step=0)
    k = num_to_evict(len(pos), cfg.budget, cfg.resolved_slack())
    assert k == 0
    assert pol.select_victims(state, view_of(pos), k).shape == (0,)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("budget", [5, 7, 13])
def test_budget_not_multiple_of_block_size_steady_state(name, budget):
    """Block size 4: the live count is brought back to exactly the budget each time."""
    kw = {"policy_args": {"window": 2}} if name == "scissorhands" else {}
    cfg, pol = policy_for(name, budget=budget, **kw)
    slack = cfg.resolved_slack()
    state = pol.init_state()
    pos = append(pol, state, np.zeros(0, np.int64), budget + 3, step=0)
    for step in range(1, 12):
        k = num_to_evict(len(pos), budget, slack)
        if k:
            vic = pol.select_victims(state, view_of(pos), k)
            check_victims(pol, view_of(pos), vic, k)
            keep = np.setdiff1d(np.arange(len(pos)), vic)
            state.compact(keep)
            pos = pos[keep]
            assert len(pos) == budget
        assert len(pos) <= budget + slack
        pos = append(pol, state, pos, 1, step)


def test_field_checks_name_field_value_and_allowed():
    with pytest.raises(ValueError, match=r"window = 0; allowed: an integer >= 1"):
        ScissorhandsPolicy(window=0)
    with pytest.raises(ValueError, match=r"sink_tokens = -1; allowed"):
        H2OPolicy(sink_tokens=-1)
    with pytest.raises(ValueError, match=r"recent_tokens = 'x'"):
        TOVAPolicy(recent_tokens="x")
    with pytest.raises(ValueError, match=r"seed = 1.5"):
        RandomPolicy(seed=1.5)


# ----------------------------------------------------------------------- pacing
def test_pacing_num_to_evict_with_slack():
    assert num_to_evict(8, 8, 0) == 0
    assert num_to_evict(9, 8, 0) == 1
    assert num_to_evict(10, 8, 2) == 0
    assert num_to_evict(11, 8, 2) == 3
    # Scissorhands compresses once every m = budget // 2 tokens, back to the budget
    cfg = VTokenConfig(policy="scissorhands", budget=10)
    assert cfg.resolved_slack() == 5
    ks = [num_to_evict(n, 10, 5) for n in range(10, 22)]
    assert ks == [0, 0, 0, 0, 0, 0, 6, 7, 8, 9, 10, 11]
    assert VTokenConfig(policy="scissorhands", budget=10, slack=0).resolved_slack() == 0
    for name in ("h2o", "tova", "random", "streaming"):
        assert VTokenConfig(policy=name, budget=10).resolved_slack() == 0
    # under budget_ratio the default slack follows each request's budget, not the configured one
    ratio = VTokenConfig(policy="scissorhands", budget=10, budget_ratio=0.5)
    assert ratio.plan(1000).budget == 500 and ratio.plan(1000).slack == 250
    assert ratio.plan(100).budget == 50 and ratio.plan(100).slack == 25
    assert ratio.plan().slack == 5  # (no prompt: the budget as given)


# ------------------------------------------------------------------------- H2O
def test_h2o_defaults_and_needs():
    assert H2OPolicy.needs == AttentionNeed.COL_SUM
    assert VTokenConfig(policy="h2o", budget=10).protections() == (0, 5)
    assert VTokenConfig(policy="h2o", budget=7).protections() == (0, 3)
    assert VTokenConfig(policy="h2o", budget=1).protections() == (0, 0)


def test_h2o_accumulates_exactly_over_steps():
    pol = H2OPolicy()
    st = pol.init_state()
    # prefill of 3 tokens (3 query rows, causal): column sums
    st.reset_slots(0, 3)
    pol.observe(st, 3, AttentionStats(col_sum=np.array([1.75, 0.75, 0.5])), view_of([0, 1, 2]))
    # a non-sampling step without col_sum changes nothing
    pol.observe(st, 3, AttentionStats(), view_of([0, 1, 2]))
    st.reset_slots(3, 4)
    pol.observe(st, 4, AttentionStats(col_sum=np.array([0.5, 0.125, 0.25, 0.125])), view_of([0, 1, 2, 3]))
    st.reset_slots(4, 5)
    pol.observe(st, 5, AttentionStats(col_sum=np.array([0.25, 0.25, 0.25, 0.125, 0.125])), view_of(range(5)))
    v = view_of(range(5))
    np.testing.assert_array_equal(pol.score(st, v), [2.5, 1.125, 1.0, 0.25, 0.125])
    # budget 3 with the default recent window 3 // 2 = 1: keep the newest + 2 heavy hitters
    pol = H2OPolicy(recent_tokens=1)
    np.testing.assert_array_equal(pol.select_victims(st, v, 2), [2, 3])  # scores 1.0 and 0.25
    # a slot reused after eviction starts from 0 (reset_slots)
    st.reset_slots(3, 4)
    assert pol.score(st, view_of(range(4)))[3] == 0.0


def test_h2o_ties_evict_smaller_logical_position_first():
    pol = H2OPolicy()
    st = pol.init_state()
    st.reset_slots(0, 5)
    # slots hold logical positions out of order; all scores equal except one
    pos = [4, 0, 3, 1, 2]
    pol.observe(st, 5, AttentionStats(col_sum=np.array([0.5, 0.5, 0.5, 0.5, 0.25])), view_of(pos))
    vic = pol.select_victims(st, view_of(pos), 3)
    # lowest score (pos 2, slot 4) then the ties by logical position 0, 1 (slots 1, 3)
    np.testing.assert_array_equal(vic, [1, 3, 4])


# ------------------------------------------------------------------------ TOVA
def test_tova_defaults_and_last_row_overwrite():
    assert TOVAPolicy.needs == AttentionNeed.LAST_ROW
    assert VTokenConfig(policy="tova", budget=10).protections() == (0, 0)
    pol = TOVAPolicy()
    st = pol.init_state()
    st.reset_slots(0, 4)
    pol.observe(st, 4, AttentionStats(last_row=np.array([0.1, 0.2, 0.3, 0.4])), view_of(range(4)))
    st.reset_slots(4, 5)
    pol.observe(st, 5, AttentionStats(last_row=np.array([0.5, 0.05, 0.1, 0.15, 0.2])), view_of(range(5)))
    v = view_of(range(5))
    np.testing.assert_array_equal(pol.score(st, v), [0.5, 0.05, 0.1, 0.15, 0.2])
    # budget 3: drop the two least attended by the last query (positions 1, 2)
    np.testing.assert_array_equal(pol.select_victims(st, v, 2), [1, 2])
    # a non-final prefill chunk (no last row) leaves the scores; new tokens score 0
    st.reset_slots(5, 7)
    pol.observe(st, 7, AttentionStats(col_sum=np.ones(7)), view_of(range(7)))
    np.testing.assert_array_equal(pol.score(st, view_of(range(7))), [0.5, 0.05, 0.1, 0.15, 0.2, 0, 0])
    # ties at 0: the smaller logical position goes first
    np.testing.assert_array_equal(pol.select_victims(st, view_of(range(7)), 1), [5])


# ------------------------------------------------------------------ StreamingLLM
def test_streaming_defaults():
    assert StreamingLLMPolicy.needs == AttentionNeed.NONE
    assert VTokenConfig(policy="streaming", budget=10).protections() == (4, 6)
    assert VTokenConfig(policy="streaming", budget=3).protections() == (3, 0)
    # explicit sinks: the defaulted recent window takes the rest of the budget
    assert VTokenConfig(policy="streaming", budget=16, sink_tokens=8).protections() == (8, 8)
    assert VTokenConfig(policy="streaming", budget=16, recent_tokens=5).protections() == (4, 5)


def test_streaming_keeps_sinks_and_recent_window():
    cfg, pol = policy_for("streaming", budget=8)
    st = pol.init_state()
    # 12 live tokens in a permuted slot layout
    pos = np.array([0, 11, 2, 9, 4, 5, 6, 1, 8, 3, 10, 7], dtype=np.int64)
    v = view_of(pos)
    k = num_to_evict(12, 8, cfg.resolved_slack())
    assert k == 4
    vic = pol.select_victims(st, v, k)
    assert sorted(pos[vic].tolist()) == [4, 5, 6, 7]
    kept = sorted(np.delete(pos, vic).tolist())
    assert kept == [0, 1, 2, 3, 8, 9, 10, 11]


def test_sinks_plus_recent_over_budget_is_rejected():
    with pytest.raises(VTokenConfigError) as ei:
        parse_config({"policy": "streaming", "budget": 10, "sink_tokens": 4, "recent_tokens": 7})
    msg = str(ei.value)
    assert "vtoken.sink_tokens + vtoken.recent_tokens = 4 + 7 = 11" in msg
    assert "vtoken.budget = 10" in msg and "allowed" in msg
    assert "(root)" not in msg and "Value error" not in msg


# ------------------------------------------------------------------------ Random
def test_random_deterministic_across_slot_permutations_and_seeds():
    pol = RandomPolicy(seed=7)
    st = pol.init_state()
    ident = np.arange(20, dtype=np.int64)
    perm = np.array([0, 19, 2, 17, 4, 15, 6, 13, 8, 11, 10, 9, 12, 7, 14, 5, 16, 3, 18, 1], dtype=np.int64)
    s_id, s_pm = pol.score(st, view_of(ident)), pol.score(st, view_of(perm))
    np.testing.assert_array_equal(s_pm, s_id[perm])
    assert np.all((s_id >= 0) & (s_id < 1)) and len(np.unique(s_id)) == 20
    v_id = pol.select_victims(st, view_of(ident), 6)
    v_pm = pol.select_victims(st, view_of(perm), 6)
    assert sorted(ident[v_id].tolist()) == sorted(perm[v_pm].tolist())
    # same seed -> same scores (a fresh object); another seed -> different choices
    np.testing.assert_array_equal(RandomPolicy(seed=7).score(st, view_of(ident)), s_id)
    other = RandomPolicy(seed=8)
    assert not np.array_equal(other.score(st, view_of(ident)), s_id)
    assert sorted(other.select_victims(st, view_of(ident), 6).tolist()) != sorted(v_id.tolist())
    # a pure function of (seed, position): scoring a subset gives the same values
    np.testing.assert_array_equal(position_hash(7, [3, 5]), s_id[[3, 5]])
    # negative and huge seeds are fine
    assert position_hash(-1, [0]).shape == (1,) and position_hash(2**70, [0]).shape == (1,)


def test_random_never_touches_global_rng():
    pyrandom.seed(123)
    np.random.seed(123)
    py_state, np_state = pyrandom.getstate(), np.random.get_state()
    pol = RandomPolicy(seed=3)
    st = pol.init_state()
    pol.select_victims(st, view_of(range(50)), 10)
    assert pyrandom.getstate() == py_state
    after = np.random.get_state()
    assert after[0] == np_state[0] and np.array_equal(after[1], np_state[1]) and after[2:] == np_state[2:]
    assert RandomPolicy.needs == AttentionNeed.NONE
    assert VTokenConfig(policy="random", budget=10, seed=5).make_policy().seed == 5


def test_random_distribution_is_roughly_uniform():
    s = position_hash(0, np.arange(4000))
    hist, _ = np.histogram(s, bins=4, range=(0, 1))
    assert np.all(np.abs(hist - 1000) < 150)


# ------------------------------------------------------------------ Scissorhands
def test_scissorhands_defaults():
    assert ScissorhandsPolicy.needs == AttentionNeed.LAST_ROW
    cfg = VTokenConfig(policy="scissorhands", budget=100)
    pol = cfg.make_policy()
    assert pol.window == 50 and cfg.protections() == (0, 25) and cfg.resolved_slack() == 50
    assert VTokenConfig(policy="scissorhands", budget=1).make_policy().window == 1
    assert VTokenConfig(policy="scissorhands", budget=100, policy_args={"window": 7}).make_policy().window == 7
    assert cfg.make_policy(40).window == 20


def test_scissorhands_counts_below_uniform_and_window_expiry():
    pol = ScissorhandsPolicy(window=2)
    st = pol.init_state()
    # step 1: 3 keys, threshold 1/3: 0.2 and 0.3 below, 0.5 not
    st.reset_slots(0, 3)
    pol.observe(st, 3, AttentionStats(last_row=np.array([0.2, 0.3, 0.5])), view_of(range(3)))
    np.testing.assert_array_equal(pol.counts(st, view_of(range(3))), [1, 1, 0])
    # step 2: 4 keys, threshold 1/4 (0.25 itself is not below)
    st.reset_slots(3, 4)
    pol.observe(st, 4, AttentionStats(last_row=np.array([0.1, 0.25, 0.2, 0.45])), view_of(range(4)))
    np.testing.assert_array_equal(pol.counts(st, view_of(range(4))), [2, 1, 1, 0])
    # step 3: 5 keys, threshold 1/5; step 1's row leaves the window of 2
    st.reset_slots(4, 5)
    pol.observe(st, 5, AttentionStats(last_row=np.array([0.1, 0.1, 0.3, 0.3, 0.2])), view_of(range(5)))
    np.testing.assert_array_equal(pol.counts(st, view_of(range(5))), [2, 1, 1, 0, 0])
    # step 4: step 2's row leaves; position 4 was absent at step 2 and counts 0 there
    st.reset_slots(5, 6)
    pol.observe(st, 6, AttentionStats(last_row=np.array([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])), view_of(range(6)))
    v = view_of(range(6))
    np.testing.assert_array_equal(pol.counts(st, v), [1, 2, 1, 1, 1, 1])
    np.testing.assert_array_equal(pol.score(st, v), [-1, -2, -1, -1, -1, -1])
    # evict 3 (no protections): count 2 (pos 1) first, then ties at 1 by position (0, 2)
    np.testing.assert_array_equal(pol.select_victims(st, v, 3), [0, 1, 2])
    # with the recent window r = 2 protecting positions 4, 5
    pol_r = ScissorhandsPolicy(window=2, recent_tokens=2)
    np.testing.assert_array_equal(pol_r.select_victims(st, v, 4), [0, 1, 2, 3])
    assert st.extra["ring"] == 0  # 4 rows written into a ring of 2


def test_scissorhands_history_moves_with_tokens():
    pol = ScissorhandsPolicy(window=3)
    st = pol.init_state()
    st.reset_slots(0, 4)
    pol.observe(st, 4, AttentionStats(last_row=np.array([0.1, 0.5, 0.1, 0.3])), view_of(range(4)))
    pol.observe(st, 4, AttentionStats(last_row=np.array([0.1, 0.7, 0.1, 0.1])), view_of(range(4)))
    assert pol.counts(st, view_of(range(4))).tolist() == [2, 0, 2, 1]
    # evict slot 0: the tail token (pos 3) moves into slot 0 with its history
    st.apply_moves(np.array([3]), np.array([0]))
    assert pol.counts(st, view_of([3, 1, 2])).tolist() == [1, 0, 2]


# ------------------------------------------------------------------------ config
def test_config_unknown_policy_message():
    with pytest.raises(VTokenConfigError) as ei:
        parse_config({"policy": "xx"})
    assert str(ei.value) == (
        "vtoken.policy = 'xx': unknown policy; allowed: " + str(sorted(available_policies()))
    )


def test_config_bad_policy_args_key_and_value():
    with pytest.raises(VTokenConfigError) as ei:
        parse_config({"policy": "h2o", "policy_args": {"heavy": 3}})
    msg = str(ei.value)
    assert msg.startswith("vtoken.policy_args.heavy = 3: unknown argument for policy 'h2o'; allowed: []")
    with pytest.raises(VTokenConfigError, match=r"allowed: \['window'\]"):
        parse_config({"policy": "scissorhands", "policy_args": {"w": 3}})
    with pytest.raises(VTokenConfigError, match=r"window = -2; allowed: an integer >= 1"):
        parse_config({"policy": "scissorhands", "policy_args": {"window": -2}})


def test_config_negative_budget_message():
    with pytest.raises(VTokenConfigError) as ei:
        parse_config({"budget": -5})
    msg = str(ei.value)
    assert msg.startswith("vtoken.budget = -5:") and "greater than or equal to 1" in msg


def test_registry_lists_all_builtins():
    assert {"h2o", "scissorhands", "random", "streaming", "tova"} <= set(ALL)
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'"):
        get_policy_class("nope")


def test_snapkv_pooling_equals_a_logical_order_reference():
    """SnapKV's pooling (Li et al., arXiv 2404.14469, Sec. 4.2): an average over ``kernel``
    neighbours in logical order among the live tokens, zero-padded, divided by ``kernel``;
    checked on shuffled slots (a repacked request) against a loop written from that rule."""
    import torch

    from vtoken.policies.snapkv import pool_logical

    rng = np.random.default_rng(3)
    for n, live, kernel in ((12, 12, 7), (12, 9, 3), (5, 5, 7), (1, 1, 7), (10, 0, 5)):
        pos = rng.permutation(100)[:n]
        x = rng.random(n)
        got = pool_logical(torch.tensor(x)[None], torch.tensor(pos)[None], torch.tensor([live]), kernel)[0].numpy()
        order = np.argsort(pos[:live], kind="stable")  # live slots in logical order
        want = np.zeros(n)
        for rank, slot in enumerate(order):
            nb = [order[j] for j in range(rank - kernel // 2, rank + kernel // 2 + 1) if 0 <= j < live]
            want[slot] = sum(x[s] for s in nb) / kernel
        np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-16)


def test_snapkv_window_is_the_last_queries():
    """The oracle's WINDOW statistic sums the last ``window`` query rows only."""
    import torch

    from reference.oracle import attention_stats

    a = torch.zeros(1, 2, 4, 5, dtype=torch.float64)
    for q in range(4):
        a[0, :, q, q] = 1.0  # row q attends to key q only
    need = AttentionNeed.COL_SUM | AttentionNeed.LAST_ROW | AttentionNeed.WINDOW
    assert attention_stats([a], need, window=2).col_sum.tolist() == [0, 0, 1, 1, 0]
    assert attention_stats([a], AttentionNeed.COL_SUM).col_sum.tolist() == [1, 1, 1, 1, 0]


def test_known_weaknesses_name_snapkv_with_chunks_and_per_set_scores_only():
    """The start-up warning's rule (``RequestPlan.known_weaknesses``): SnapKV, prefill eviction in
    chunks and token sets other than ``request``; nothing for any other combination."""
    from vtoken.config import parse_config

    def weak(**kw):
        return parse_config(dict({"policy": "snapkv", "budget": 256}, **kw)).plan(1024).known_weaknesses()

    (msg,) = weak(prefill_eviction="chunks")  # the policy's default sets: head
    assert "snapkv" in msg and "'head'" in msg and "prefill_eviction 'after' or granularity 'request'" in msg
    assert len(weak(prefill_eviction="chunks", granularity="layer")) == 1
    assert len(weak()) == 1  # prefill_eviction's default is chunks
    assert weak(prefill_eviction="after") == [] and weak(prefill_eviction="chunks", granularity="request") == []
    assert parse_config({"policy": "tova", "prefill_eviction": "chunks"}).plan(1024).known_weaknesses() == []
