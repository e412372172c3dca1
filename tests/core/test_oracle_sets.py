"""Per-set token sets in the dense oracle (``granularity``: layer, head, head_shared; docs/granularity.md).

* the oracle (per-head gather of a compacted cache) equals an independent reference that
  keeps the full cache and masks each (layer, KV head)'s evicted keys
  (tests/core/masked_reference.py): same greedy tokens, same evictions per set and step,
  same live positions per set;
* the sets really are separate on a 2-KV-head model, and collapse as they must on a
  1-KV-head one (head == layer, head_shared == request, bit for bit);
* :func:`attention_stats_sets` on a hand-made attention tensor, exact values;
* without ``granularity`` a config takes its policy's own token sets.

CPU only, tiny models, one thread.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from masked_reference import masked_generate
from vtoken.policies import get_policy_class
from vtoken.config import parse_config
from reference.oracle import attention_stats, attention_stats_sets, load_oracle_model, oracle_generate
from vtoken.policies.base import AttentionNeed

torch.set_num_threads(1)

PROMPT_LEN = 60
NEW = 24
POLICIES = ["h2o", "tova", "scissorhands", "random", "streaming"]
SET_GRANULARITIES = ["layer", "head", "head_shared"]
BOTH = AttentionNeed.COL_SUM | AttentionNeed.LAST_ROW


@pytest.fixture(scope="module")
def gqa():
    """The tiny Llama with 2 layers, 4 query heads, 2 KV heads."""
    from vtoken.assets import ensure_tiny_gqa_model

    m = load_oracle_model(str(ensure_tiny_gqa_model()))
    c = m.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (2, 4, 2)
    return m


@pytest.fixture(scope="module")
def mha1():
    """The tiny Llama with 2 layers, 2 query heads, 1 KV head."""
    from vtoken.assets import ensure_tiny_model

    m = load_oracle_model(str(ensure_tiny_model()))
    assert (m.config.num_hidden_layers, m.config.num_key_value_heads) == (2, 1)
    return m


def _prompt(seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (PROMPT_LEN,), generator=g).tolist()


def _cfg(policy: str, budget: int, granularity: str, **kw):
    return parse_config({"policy": policy, "budget": budget, "granularity": granularity, **kw})


def _num_sets(granularity: str, L: int, Hkv: int) -> int:
    return {"request": 1, "layer": L, "head": L * Hkv, "head_shared": Hkv}[granularity]


def _assert_same_as_reference(res, ref, S: int) -> None:
    assert res.token_ids == ref.token_ids
    assert len(res.live_positions_sets) == len(ref.live_sets) == S
    for s in range(S):
        np.testing.assert_array_equal(res.live_positions_sets[s], ref.live_sets[s], err_msg=f"set {s}")
    assert len(res.evicted_positions_sets) == len(ref.evicted_sets) == len(res.token_ids)
    for i, (a, b) in enumerate(zip(res.evicted_positions_sets, ref.evicted_sets)):
        assert len(a) == S
        for s in range(S):
            np.testing.assert_array_equal(a[s], b[s], err_msg=f"step {i} set {s}")
    # set 0 is what the request-level fields report; every set holds num_live tokens
    np.testing.assert_array_equal(res.live_positions, res.live_positions_sets[0])
    for i in range(len(res.token_ids)):
        np.testing.assert_array_equal(res.evicted_positions[i], res.evicted_positions_sets[i][0])
    assert {len(p) for p in res.live_positions_sets} == {res.num_live[-1]}


# --------------------------------------------------------------------------- oracle == masked reference


@pytest.mark.parametrize("budget", [24, 40])
@pytest.mark.parametrize("granularity", SET_GRANULARITIES)
@pytest.mark.parametrize("policy", POLICIES)
def test_oracle_equals_masked_reference(gqa, policy, granularity, budget):
    prompt = _prompt()
    cfg = _cfg(policy, budget, granularity)
    res = oracle_generate(gqa, prompt, NEW, cfg)
    ref = masked_generate(gqa, prompt, NEW, cfg)
    assert res.num_evicted > 0
    _assert_same_as_reference(res, ref, _num_sets(granularity, 2, 2))


def test_oracle_equals_masked_reference_schedule_and_score_every(gqa):
    prompt = _prompt(seed=1)
    schedule = {2: 30, 3: 1, 6: 4, 11: 2}
    for cfg, sched in [(_cfg("h2o", 24, "head"), schedule), (_cfg("tova", 24, "layer"), schedule),
                       (_cfg("h2o", 24, "head", score_every=3), None)]:
        res = oracle_generate(gqa, prompt, NEW, cfg, evict_schedule=sched)
        ref = masked_generate(gqa, prompt, NEW, cfg, evict_schedule=sched)
        _assert_same_as_reference(res, ref, len(res.live_positions_sets))
        if sched is not None:
            assert [len(e) for e in res.evicted_positions] == [sched.get(i, 0) for i in range(NEW)]


@pytest.mark.parametrize("budget,kw", [(24, {}), (40, {}), (24, {"sink_tokens": 4, "recent_tokens": 3}),
                                       (40, {"recent_tokens": 0, "slack": 5})])
def test_masked_reference_request_equals_oracle(gqa, budget, kw):
    """Request sets (one set: the mean over every layer and query head, tests/reference/oracle/__init__.py "Token-set
    conventions"): the oracle equals the masked reference, every token and every eviction."""
    prompt = _prompt()
    cfg = _cfg("h2o", budget, "request", **kw)
    res = oracle_generate(gqa, prompt, NEW, cfg)
    ref = masked_generate(gqa, prompt, NEW, cfg)
    assert res.num_evicted > 0
    assert res.token_ids == ref.token_ids
    np.testing.assert_array_equal(res.live_positions, ref.live_sets[0])
    for i in range(NEW):
        np.testing.assert_array_equal(res.evicted_positions[i], ref.evicted_sets[i][0])


# --------------------------------------------------------------------------- the sets are separate (2 KV heads)


def test_sets_differ_from_request_on_gqa(gqa):
    prompt = _prompt()
    req = oracle_generate(gqa, prompt, NEW, _cfg("h2o", 24, "request"))
    for granularity in ("layer", "head", "head_shared"):
        res = oracle_generate(gqa, prompt, NEW, _cfg("h2o", 24, granularity))
        S = _num_sets(granularity, 2, 2)
        assert len(res.live_positions_sets) == S
        # some set evicts other tokens than the request-level set at some step
        differ = [(i, s) for i in range(NEW) for s in range(S)
                  if not np.array_equal(res.evicted_positions_sets[i][s], req.evicted_positions[i])]
        assert differ, granularity
        # and the sets are not one shared set
        assert len({tuple(p.tolist()) for p in res.live_positions_sets}) > 1, granularity
        assert any(not np.array_equal(p, req.live_positions) for p in res.live_positions_sets), granularity


# --------------------------------------------------------------------------- 1 KV head: the sets collapse


@pytest.mark.parametrize("policy", ["h2o", "tova", "scissorhands"])
def test_one_kv_head_collapses(mha1, policy):
    prompt = _prompt(seed=2)
    head = oracle_generate(mha1, prompt, NEW, _cfg(policy, 24, "head"), return_logits=True)
    layer = oracle_generate(mha1, prompt, NEW, _cfg(policy, 24, "layer"), return_logits=True)
    assert head.num_evicted > 0 and len(head.live_positions_sets) == len(layer.live_positions_sets) == 2
    assert head.token_ids == layer.token_ids
    assert all(torch.equal(a, b) for a, b in zip(head.logits, layer.logits))
    for s in range(2):
        np.testing.assert_array_equal(head.live_positions_sets[s], layer.live_positions_sets[s])
        for i in range(NEW):
            np.testing.assert_array_equal(head.evicted_positions_sets[i][s], layer.evicted_positions_sets[i][s])

    shared = oracle_generate(mha1, prompt, NEW, _cfg(policy, 24, "head_shared"), return_logits=True)
    req = oracle_generate(mha1, prompt, NEW, _cfg(policy, 24, "request"), return_logits=True)
    assert req.live_positions_sets is None and req.evicted_positions_sets is None
    assert len(shared.live_positions_sets) == 1
    assert shared.token_ids == req.token_ids
    assert all(torch.equal(a, b) for a, b in zip(shared.logits, req.logits))
    np.testing.assert_array_equal(shared.live_positions_sets[0], req.live_positions)
    for i in range(NEW):
        np.testing.assert_array_equal(shared.evicted_positions_sets[i][0], req.evicted_positions[i])


# --------------------------------------------------------------------------- attention_stats_sets


def _expected_stats(p: np.ndarray, granularity: str, Hkv: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Plain loops over the table of docs/granularity.md: p is [L, Hq, q, k] float64."""
    L, Hq = p.shape[:2]
    G = Hq // Hkv
    if granularity == "request":
        covers = [[(l, h) for l in range(L) for h in range(Hq)]]
    elif granularity == "layer":
        covers = [[(l, h) for h in range(Hq)] for l in range(L)]
    elif granularity == "head":
        covers = [[(l, h) for h in range(g * G, (g + 1) * G)] for l in range(L) for g in range(Hkv)]
    else:
        covers = [[(l, h) for l in range(L) for h in range(Hq) if h // G == g] for g in range(Hkv)]
    out = []
    for pairs in covers:
        mean = np.zeros(p.shape[2:])
        for l, h in pairs:
            mean += p[l, h]
        mean /= len(pairs)
        out.append((mean.sum(axis=0), mean[-1]))
    return out


@pytest.mark.parametrize("Hkv", [1, 2, 4])
@pytest.mark.parametrize("granularity", ["request", "layer", "head", "head_shared"])
def test_attention_stats_sets_exact(granularity, Hkv):
    L, Hq, q, k = 3, 4, 3, 5
    g = torch.Generator().manual_seed(7)
    # dyadic values (n / 64): every sum and every mean below is exact in float64
    p = torch.randint(0, 64, (L, Hq, q, k), generator=g).to(torch.float32) / 64
    attn = [p[l][None] for l in range(L)]
    got = attention_stats_sets(attn, BOTH, granularity, Hkv)
    expect = _expected_stats(p.double().numpy(), granularity, Hkv)
    S = {"request": 1, "layer": L, "head": L * Hkv, "head_shared": Hkv}[granularity]
    assert len(got) == len(expect) == S
    for s, (st, (col, last)) in enumerate(zip(got, expect)):
        assert st.col_sum.dtype == np.float64 and st.last_row.dtype == np.float64
        assert st.col_sum.shape == st.last_row.shape == (k,)
        np.testing.assert_array_equal(st.col_sum, col, err_msg=f"set {s}")
        np.testing.assert_array_equal(st.last_row, last, err_msg=f"set {s}")
    only = attention_stats_sets(attn, AttentionNeed.LAST_ROW, granularity, Hkv)
    assert len(only) == S and all(st.col_sum is None and st.last_row is not None for st in only)
    none = attention_stats_sets(attn, AttentionNeed.NONE, granularity, Hkv)
    assert len(none) == S and all(st.col_sum is None and st.last_row is None for st in none)


def test_attention_stats_sets_literal_and_errors():
    # L = 1, Hq = 2, q = 2, k = 2; Hkv = 2 (G = 1): head h is its own set
    a = torch.tensor([[[[0.5, 0.5], [0.25, 0.75]], [[1.0, 0.0], [0.0, 1.0]]]])
    head = attention_stats_sets([a], BOTH, "head", 2)
    np.testing.assert_array_equal(head[0].col_sum, [0.75, 1.25])
    np.testing.assert_array_equal(head[0].last_row, [0.25, 0.75])
    np.testing.assert_array_equal(head[1].col_sum, [1.0, 1.0])
    np.testing.assert_array_equal(head[1].last_row, [0.0, 1.0])
    (layer,) = attention_stats_sets([a], BOTH, "layer", 2)
    np.testing.assert_array_equal(layer.col_sum, [0.875, 1.125])
    np.testing.assert_array_equal(layer.last_row, [0.125, 0.875])
    (req,) = attention_stats_sets([a], BOTH, "request", 2)
    ref = attention_stats([a], BOTH)
    np.testing.assert_array_equal(req.col_sum, ref.col_sum)
    np.testing.assert_array_equal(req.last_row, ref.last_row)
    with pytest.raises(ValueError, match="granularity"):
        attention_stats_sets([a], BOTH, "tile", 2)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        attention_stats_sets([a], BOTH, "head", 3)
    with pytest.raises(ValueError, match="no layers"):
        attention_stats_sets([], AttentionNeed.NONE, "head", 2)
    with pytest.raises(ValueError, match="layer shapes differ"):
        attention_stats_sets([a, a[:, :, :1]], BOTH, "layer", 2)


# --------------------------------------------------------------------------- request unchanged, refusals


@pytest.mark.parametrize("policy", ["h2o", "tova", "scissorhands"])
def test_default_granularity_is_the_policys(gqa, policy):
    """Without ``granularity`` a config takes its policy's own token sets (``default_granularity``:
    H2O and Scissorhands per (layer, KV head), TOVA per layer): the same tokens, logits and sets
    as naming that granularity."""
    prompt = _prompt(seed=3)
    default = get_policy_class(policy).default_granularity()
    assert default == {"h2o": "head", "tova": "layer", "scissorhands": "head"}[policy]
    new = oracle_generate(gqa, prompt, NEW, _cfg(policy, 24, default), return_logits=True)
    today = oracle_generate(gqa, prompt, NEW, parse_config({"policy": policy, "budget": 24}), return_logits=True)
    assert today.num_evicted > 0
    assert new.token_ids == today.token_ids
    assert all(torch.equal(a, b) for a, b in zip(new.logits, today.logits))
    assert len(new.live_positions_sets) == len(today.live_positions_sets) > 1
    for a, b in zip(new.live_positions_sets, today.live_positions_sets):
        np.testing.assert_array_equal(a, b)


def test_key_norm_sets_exact():
    """K-norm's statistic in the oracle: the mean L2 norm of the step's keys over each set's
    (layer, KV head) pairs, from keys whose norms are known by construction (3-4-12 and 5-12-13
    triangles scaled per layer and head)."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from reference.oracle import key_norm_sets, set_index_map

    L, H, T, q = 2, 2, 5, 2
    layers = []
    want = np.zeros((L, H, q))
    for l_ in range(L):
        k = torch.zeros(1, H, T, 3, dtype=torch.float64)
        for g in range(H):
            for j in range(q):
                f = 1 + l_ + 2 * g + 4 * j
                k[0, g, T - q + j] = torch.tensor([3.0, 4.0, 12.0]) * f  # norm 13 f
                want[l_, g, j] = 13 * f
            k[0, g, : T - q] = 100.0  # older tokens: never read
        layers.append(SimpleNamespace(keys=k))
    cache = SimpleNamespace(layers=layers)
    assert [x.tolist() for x in key_norm_sets(cache, q, set_index_map("head", L, H))] == \
        [want[l_, g].tolist() for l_ in range(L) for g in range(H)]
    got = key_norm_sets(cache, q, set_index_map("layer", L, H))
    assert [x.tolist() for x in got] == [want[l_].mean(axis=0).tolist() for l_ in range(L)]
    got = key_norm_sets(cache, q, set_index_map("head_shared", L, H))
    assert [x.tolist() for x in got] == [want[:, g].mean(axis=0).tolist() for g in range(H)]
    got = key_norm_sets(cache, q, set_index_map("request", L, 1))
    assert [x.tolist() for x in got] == [want.reshape(-1, q).mean(axis=0).tolist()]


def test_key_sim_sets_equal_an_independent_reference():
    """KeyDiff's statistic in the oracle (Park et al., arXiv 2504.15364, Sec. 3): per (layer, KV
    head), cos(k_i, mean_j k_j / |k_j|), averaged per set as the worker does, against a numpy
    reference written from the paper's formula; plus one case known in closed form."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from reference.oracle import key_sim_sets

    rng = np.random.default_rng(5)
    L, H, T, D = 3, 2, 7, 4
    keys = rng.normal(size=(L, H, T, D))
    cache = SimpleNamespace(layers=[SimpleNamespace(keys=torch.from_numpy(keys[l_][None])) for l_ in range(L)])
    unit = keys / np.linalg.norm(keys, axis=-1, keepdims=True)
    mu = unit.mean(axis=2, keepdims=True)
    cos = (keys * mu).sum(-1) / (np.linalg.norm(keys, axis=-1) * np.linalg.norm(mu, axis=-1))  # [L, H, T]
    close = lambda got, want: np.testing.assert_allclose(np.stack(got), np.stack(want), rtol=1e-12, atol=1e-14)  # noqa: E731
    close(key_sim_sets(cache, "head"), [cos[l_, g] for l_ in range(L) for g in range(H)])
    close(key_sim_sets(cache, "head_shared"), [cos[:, g].mean(axis=0) for g in range(H)])
    close(key_sim_sets(cache, "layer"), [cos[l_].mean(axis=0) for l_ in range(L)])
    close(key_sim_sets(cache, "request"), [cos.reshape(L * H, T).mean(axis=0)])
    # closed form: unit keys e1, 2 e1, e2, -3 e1: anchor (e1 + e2) / 4, cosines 1/sqrt2, 1/sqrt2, 1/sqrt2, -1/sqrt2
    k = torch.tensor([[1.0, 0], [2, 0], [0, 1], [-3, 0]], dtype=torch.float64)[None, None]
    got = key_sim_sets(SimpleNamespace(layers=[SimpleNamespace(keys=k)]), "head")[0]
    np.testing.assert_allclose(got, np.array([1, 1, 1, -1]) / np.sqrt(2), rtol=1e-15)
