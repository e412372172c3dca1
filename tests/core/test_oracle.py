"""Tests of the dense oracle (tests/reference/oracle/).

* no eviction (cfg=None, or a budget above the total length): tokens equal HF's own
  greedy ``generate`` (test model built here, the project's tiny model, SmolLM2);
* eviction on: every step's logits equal an independent reference that never
  touches the oracle's cache surgery:
  - 1-layer model: a cache-free forward over the kept tokens only, at their
    logical positions (exact for one layer: a token's K/V depend only on the token
    and its position);
  - multi-layer model: a never-evicted HF cache with a 4D mask that hides the
    evicted tokens (a no-cache recompute over the kept tokens is *not* a valid
    reference there: the K/V of layer >= 2 were computed while since-evicted
    tokens were still attended);
* exact eviction bookkeeping (pacing, disjoint victims, sinks, recent window).

CPU only, small shapes, one thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch

from vtoken.config import VTokenConfig, effective_budget
from reference.oracle import OracleResult, attention_stats, load_oracle_model, oracle_generate
from vtoken.policies import available_policies, get_policy_class
from reference.policies import AttentionStats, SlotState, TokenView, reference
from vtoken.policies.base import AttentionNeed, EvictionPolicy

torch.set_num_threads(1)

PROMPT_LEN = 40
BUDGET = 23  # smaller than the prompt, not a multiple of 16
SINKS = 4
RECENT = 8


# --------------------------------------------------------------------------- policies used by the tests


@dataclass
class _StreamingLike(EvictionPolicy):
    """StreamingLLM-like: keep the sinks and the most recent tokens (evict the oldest)."""

    name: ClassVar[str] = "oracle_test_streaming"
    needs: ClassVar[AttentionNeed] = AttentionNeed.NONE

    def score(self, state: SlotState, view: TokenView) -> np.ndarray:
        return view.logical_pos.astype(np.float64)


@dataclass
class _AccumLike(EvictionPolicy):
    """H2O-like: keep-score = accumulated ``col_sum``; also records what it observed.

    ``state.extra["log"]``: list of (logical_pos copy, col_sum, last_row) per observe.
    """

    name: ClassVar[str] = "oracle_test_accum"
    needs: ClassVar[AttentionNeed] = AttentionNeed.COL_SUM | AttentionNeed.LAST_ROW

    def state_specs(self):
        return {"acc": ((), np.float64)}

    def observe(self, state: SlotState, num_live: int, stats: AttentionStats, view: TokenView) -> None:
        assert view.num_live == num_live
        assert stats.col_sum is not None and stats.col_sum.shape == (num_live,)
        assert stats.last_row is not None and stats.last_row.shape == (num_live,)
        assert stats.col_sum.dtype == np.float64 and stats.last_row.dtype == np.float64
        state["acc"][:num_live] += stats.col_sum
        state.extra.setdefault("log", []).append(
            (view.logical_pos.copy(), stats.col_sum.copy(), stats.last_row.copy())
        )

    def score(self, state: SlotState, view: TokenView) -> np.ndarray:
        return state["acc"][: view.num_live].copy()


_TEST_POLICIES = {c.name: c for c in (_StreamingLike, _AccumLike)}


@pytest.fixture
def test_policies(monkeypatch):
    """Register the test policies under their names for the duration of a test."""
    table = available_policies()
    for name in _TEST_POLICIES:
        monkeypatch.setitem(table, name, f"{_StreamingLike.__module__}:{_TEST_POLICIES[name].__name__}")
    get_policy_class.cache_clear()
    yield
    get_policy_class.cache_clear()


# --------------------------------------------------------------------------- models


def _llama(num_layers: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,  # GQA: exercises repeat_kv
        head_dim=64,
        max_position_embeddings=1024,
        initializer_range=0.1,  # sharper attention than the default 0.02
        attn_implementation="eager",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(cfg).to(torch.float32).eval()


@pytest.fixture(scope="module")
def model2():
    return _llama(2)


@pytest.fixture(scope="module")
def model1():
    return _llama(1, seed=1)


def _prompt(n: int = PROMPT_LEN, seed: int = 0, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    from transformers import GenerationConfig

    ids = torch.tensor([prompt], dtype=torch.long)
    gc = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=0
    )
    with torch.inference_mode():
        out = model.generate(ids, generation_config=gc, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt) :].tolist()


# --------------------------------------------------------------------------- independent references


def _kept_tokens_logits(model, seq: list[int], live: np.ndarray) -> torch.Tensor:
    """Cache-free forward over the tokens at logical positions ``live`` (ascending), at those positions.

    Returns the float32 ``[vocab]`` logits of the last one. Uses an explicit 4D causal
    mask, so HF neither infers positions nor detects "packed sequences".
    """
    n = len(live)
    ids = torch.tensor([[seq[p] for p in live]], dtype=torch.long)
    pos = torch.from_numpy(np.asarray(live, dtype=np.int64)).unsqueeze(0)
    mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.inference_mode():
        out = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False)
    return out.logits[0, -1].float()


def _masked_full_cache_logits(model, prompt: list[int], res: OracleResult) -> list[torch.Tensor]:
    """Teacher-forced reference: a never-evicted cache, evicted tokens hidden by a 4D mask.

    Step ``i`` feeds ``res.token_ids[i-1]`` at position ``P + i - 1`` (physical = logical,
    nothing is ever removed) with a mask of 0 on live keys and -inf-like on keys
    evicted up to step ``i``. Returns each step's float32 ``[vocab]`` logits.
    """
    from transformers import DynamicCache

    P = len(prompt)
    cache = DynamicCache(config=model.config)
    neg = torch.finfo(torch.float32).min
    logits = []
    with torch.inference_mode():
        out = model(
            input_ids=torch.tensor([prompt]),
            position_ids=torch.arange(P).unsqueeze(0),
            attention_mask=torch.ones((1, P), dtype=torch.long),
            past_key_values=cache,
            use_cache=True,
        )
        logits.append(out.logits[0, -1].float())
        dead = np.zeros(0, dtype=np.int64)
        for i in range(1, len(res.token_ids)):
            dead = np.union1d(dead, res.evicted_positions[i])
            kv_len = P + i
            mask = torch.zeros((1, 1, 1, kv_len))
            mask[0, 0, 0, torch.from_numpy(dead)] = neg
            out = model(
                input_ids=torch.tensor([[res.token_ids[i - 1]]]),
                position_ids=torch.tensor([[P + i - 1]]),
                attention_mask=mask,
                past_key_values=cache,
                use_cache=True,
            )
            logits.append(out.logits[0, -1].float())
    return logits


def _live_before(res: OracleResult, i: int) -> np.ndarray:
    """Logical positions the step producing token ``i`` attended over (from the reported evictions)."""
    dead = np.zeros(0, dtype=np.int64)
    for e in res.evicted_positions[: i + 1]:
        dead = np.union1d(dead, e)
    return np.setdiff1d(np.arange(res.num_logical[i], dtype=np.int64), dead)


def _check_bookkeeping(res: OracleResult, P: int, budget: int, slack: int, sinks: int, recent: int) -> None:
    n = len(res.token_ids)
    assert len(res.num_live) == len(res.num_logical) == len(res.evicted_positions) == n
    assert res.num_live[0] == P and res.num_logical[0] == P and len(res.evicted_positions[0]) == 0
    seen = np.zeros(0, dtype=np.int64)
    for i in range(1, n):
        ev = res.evicted_positions[i]
        assert ev.dtype == np.int64 and np.all(np.diff(ev) > 0), f"step {i}: not ascending/unique {ev}"
        assert res.num_logical[i] == P + i
        before = res.num_live[i - 1]
        # pacing: evict down to the budget iff over budget + slack (enough unprotected tokens here)
        expect_k = before - budget if before > budget + slack else 0
        assert len(ev) == expect_k, f"step {i}: evicted {len(ev)}, expected {expect_k}"
        assert res.num_live[i] == before - len(ev) + 1
        assert res.num_live[i] <= budget + slack + 1
        # victims existed and were live before this step; never evicted twice
        assert np.all(ev < res.num_logical[i - 1])
        assert len(np.intersect1d(ev, seen)) == 0, f"step {i}: evicted again {np.intersect1d(ev, seen)}"
        # protections: sinks and the `recent` most recent live tokens
        assert np.all(ev >= sinks), f"step {i}: sink evicted {ev}"
        live_prev = _live_before(res, i - 1)
        if recent:
            assert len(np.intersect1d(ev, live_prev[-recent:])) == 0, f"step {i}: recent token evicted"
        seen = np.union1d(seen, ev)
    assert res.num_evicted == len(seen)
    expect_live = np.setdiff1d(np.arange(res.num_logical[-1], dtype=np.int64), seen)
    np.testing.assert_array_equal(res.live_positions, expect_live)
    assert len(res.live_positions) == res.num_live[-1]


def _cfg(policy: str, budget: int = BUDGET, slack: int = 0, **kw) -> VTokenConfig:
    kw.setdefault("granularity", "request")  # one token set: what the masked full-cache reference models
    return VTokenConfig(policy=policy, budget=budget, slack=slack, sink_tokens=SINKS, recent_tokens=RECENT, **kw)


# --------------------------------------------------------------------------- no eviction == HF greedy


def test_no_eviction_matches_hf_generate(model2):
    prompt = _prompt()
    res = oracle_generate(model2, prompt, 72, None)
    assert res.token_ids == _hf_greedy(model2, prompt, 72)
    assert res.num_live == list(range(PROMPT_LEN, PROMPT_LEN + 72))
    assert res.num_evicted == 0 and res.budget is None
    np.testing.assert_array_equal(res.live_positions, np.arange(PROMPT_LEN + 71))


@pytest.mark.parametrize("policy", ["oracle_test_streaming", "oracle_test_accum"])
def test_budget_above_length_matches_hf_generate(model2, test_policies, policy):
    prompt = _prompt(seed=1)
    res = oracle_generate(model2, prompt, 64, _cfg(policy, budget=PROMPT_LEN + 64 + 1))
    assert res.num_evicted == 0
    assert res.token_ids == _hf_greedy(model2, prompt, 64)


def test_eos_stops_like_hf_generate(model2):
    prompt = _prompt(seed=2)
    free = oracle_generate(model2, prompt, 40, None)
    eos = free.token_ids[17]
    first = free.token_ids.index(eos)
    res = oracle_generate(model2, prompt, 40, None, eos_token_id=eos, ignore_eos=False)
    assert res.token_ids == free.token_ids[: first + 1] and res.stop_reason == "eos"
    assert res.token_ids == _hf_greedy(model2, prompt, 40, eos_token_id=eos)
    # ignore_eos (the default) keeps going
    assert oracle_generate(model2, prompt, 40, None, eos_token_id=eos).token_ids == free.token_ids


def _tiny_asset_dir():
    paths = pytest.importorskip("vtoken.assets.paths", reason="asset pipeline (vtoken/assets/paths.py) not present")
    if not hasattr(paths, "ensure_tiny_model"):
        pytest.skip("vtoken.assets.paths.ensure_tiny_model not present")
    d = paths.tiny_model_dir()
    if (d / "config.json").exists():
        return d
    try:
        return paths.ensure_tiny_model()
    except ImportError as e:  # the asset pipeline is incomplete
        pytest.skip(f"cannot build the tiny model: {e}")


def test_tiny_asset_matches_hf_generate():
    d = _tiny_asset_dir()
    model = load_oracle_model(str(d))
    vocab = model.config.vocab_size
    prompt = _prompt(32, seed=3, vocab=vocab)
    res = oracle_generate(model, prompt, 64, None)
    assert res.token_ids == _hf_greedy(model, prompt, 64)


@pytest.fixture(scope="module")
def smollm2():
    """(model fp32 eager, tokenizer) of SmolLM2-135M-Instruct, or skip when the assets are missing."""
    paths = pytest.importorskip("vtoken.assets.paths", reason="asset pipeline (vtoken/assets/paths.py) not present")
    d = paths.smollm2_dir()
    if not (d / "config.json").exists():
        pytest.skip(f"SmolLM2 assets missing ({d}/config.json); run `vtoken assets`")
    from transformers import AutoTokenizer

    return load_oracle_model(str(d), dtype=torch.float32), AutoTokenizer.from_pretrained(str(d))


@pytest.mark.smollm2
def test_smollm2_matches_hf_generate(smollm2, test_policies):
    model, tok = smollm2
    prompt = tok("The capital of France is Paris. The capital of Germany is")["input_ids"]
    expect = _hf_greedy(model, prompt, 32)
    assert oracle_generate(model, prompt, 32, None).token_ids == expect
    big = _cfg("oracle_test_accum", budget=len(prompt) + 64)
    res = oracle_generate(model, prompt, 32, big)
    assert res.num_evicted == 0 and res.token_ids == expect


@pytest.mark.smollm2
def test_smollm2_eviction_equals_masked_full_cache(smollm2):
    model, tok = smollm2
    text = (
        "Once upon a time, in a small village by the sea, there lived an old fisherman who told "
        "stories to the children every evening. One day he said"
    )
    prompt = tok(text)["input_ids"]
    assert len(prompt) > BUDGET
    cfg = VTokenConfig(policy="h2o", budget=BUDGET, slack=0, sink_tokens=SINKS, recent_tokens=RECENT, granularity="request")
    res = oracle_generate(model, prompt, 24, cfg, return_logits=True)
    _check_bookkeeping(res, len(prompt), BUDGET, 0, SINKS, RECENT)
    ref = _masked_full_cache_logits(model, prompt, res)
    for i, (a, b) in enumerate(zip(res.logits, ref)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=f"step {i}")
        assert int(b.argmax()) == res.token_ids[i], f"step {i}"


# --------------------------------------------------------------------------- eviction == independent references


@pytest.mark.parametrize("slack", [0, 3])
def test_eviction_one_layer_equals_forward_on_kept_tokens(model1, test_policies, slack):
    prompt = _prompt(seed=4)
    res = oracle_generate(model1, prompt, 48, _cfg("oracle_test_streaming", slack=slack), return_logits=True)
    assert res.num_evicted > 0
    seq = prompt + res.token_ids
    for i in range(len(res.token_ids)):
        live = _live_before(res, i)
        assert len(live) == res.num_live[i]
        ref = _kept_tokens_logits(model1, seq, live)
        torch.testing.assert_close(res.logits[i], ref, atol=1e-4, rtol=0, msg=f"step {i}")
        assert int(ref.argmax()) == res.token_ids[i], f"step {i}"


@pytest.mark.parametrize("policy", ["oracle_test_streaming", "oracle_test_accum"])
@pytest.mark.parametrize("slack", [0, 5])
def test_eviction_equals_masked_full_cache(model2, test_policies, policy, slack):
    prompt = _prompt(seed=5)
    res = oracle_generate(model2, prompt, 48, _cfg(policy, slack=slack), return_logits=True)
    assert res.num_evicted > 0
    ref = _masked_full_cache_logits(model2, prompt, res)
    for i, (a, b) in enumerate(zip(res.logits, ref)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=f"step {i}")
        assert int(b.argmax()) == res.token_ids[i], f"step {i}"


def test_eviction_changes_output(model2, test_policies):
    """Sanity of the references: eviction does change the logits on this model."""
    prompt = _prompt(seed=5)
    full = oracle_generate(model2, prompt, 8, None, return_logits=True)
    ev = oracle_generate(model2, prompt, 8, _cfg("oracle_test_accum"), return_logits=True)
    assert not torch.allclose(full.logits[1], ev.logits[1], atol=1e-3)


# --------------------------------------------------------------------------- bookkeeping


@pytest.mark.parametrize("policy", ["oracle_test_streaming", "oracle_test_accum"])
@pytest.mark.parametrize("slack", [0, 1, 7])
def test_bookkeeping(model2, test_policies, policy, slack):
    prompt = _prompt(seed=6)
    res = oracle_generate(model2, prompt, 60, _cfg(policy, slack=slack))
    assert res.budget == BUDGET and res.slack == slack
    _check_bookkeeping(res, PROMPT_LEN, BUDGET, slack, SINKS, RECENT)
    if policy == "oracle_test_streaming":  # keeps exactly sinks + the most recent tokens
        n = len(res.live_positions)
        np.testing.assert_array_equal(res.live_positions[:SINKS], np.arange(SINKS))
        tail = res.live_positions[SINKS:]
        np.testing.assert_array_equal(tail, np.arange(res.num_logical[-1] - len(tail), res.num_logical[-1]))
        assert n == res.num_live[-1]


def test_prompt_within_budget_no_early_eviction(model2, test_policies):
    prompt = _prompt(16, seed=7)
    res = oracle_generate(model2, prompt, 30, _cfg("oracle_test_streaming", budget=BUDGET))
    _check_bookkeeping(res, 16, BUDGET, 0, SINKS, RECENT)
    first = next(i for i, e in enumerate(res.evicted_positions) if len(e))
    assert res.num_live[first - 1] == BUDGET + 1 and len(res.evicted_positions[first]) == 1


def test_budget_ratio_resolves_per_request(model2, test_policies):
    prompt = _prompt(seed=8)
    cfg = VTokenConfig(policy="oracle_test_streaming", budget_ratio=0.6, slack=0, sink_tokens=SINKS, recent_tokens=RECENT)
    res = oracle_generate(model2, prompt, 20, cfg)
    assert res.budget == effective_budget(cfg, PROMPT_LEN) == 24
    _check_bookkeeping(res, PROMPT_LEN, 24, 0, SINKS, RECENT)


def test_policy_state_follows_compaction(model2, test_policies):
    """The accumulated score of each live token equals the sum of its observed col_sums."""
    prompt = _prompt(seed=9)
    cfg = _cfg("oracle_test_accum", slack=2)
    policy = reference(cfg.make_policy(BUDGET))
    states = []
    orig_init = policy.init_state

    def init_state():
        s = orig_init()
        states.append(s)
        return s

    policy.init_state = init_state  # type: ignore[method-assign]
    res = oracle_generate(model2, prompt, 40, cfg, policy=policy)
    (state,) = states
    log = state.extra["log"]
    assert len(log) == len(res.token_ids)
    total: dict[int, float] = {}
    for i, (pos, col, last) in enumerate(log):
        q = PROMPT_LEN if i == 0 else 1
        # each softmax row sums to 1 (float32 probabilities), so col_sum sums to the query rows
        assert col.sum() == pytest.approx(q, abs=1e-5 * q) and last.sum() == pytest.approx(1.0, abs=1e-5)
        np.testing.assert_array_equal(pos, _live_before(res, i))
        if i > 0:
            np.testing.assert_allclose(col, last, rtol=0, atol=1e-15)
        for p, c in zip(pos.tolist(), col.tolist()):
            total[p] = total.get(p, 0.0) + c
    live = res.live_positions
    np.testing.assert_allclose(state["acc"][: len(live)], [total[p] for p in live.tolist()], rtol=1e-12, atol=0)


def test_score_every(model2, test_policies):
    prompt = _prompt(seed=10)
    cfg = _cfg("oracle_test_accum", score_every=3)
    policy = reference(cfg.make_policy(BUDGET))
    states = []
    orig_init = policy.init_state
    policy.init_state = lambda: states.append(orig_init()) or states[-1]  # type: ignore[method-assign]
    res = oracle_generate(model2, prompt, 20, cfg, policy=policy)
    observed_steps = [len(pos) for pos, _, _ in states[0].extra["log"]]
    expect = [res.num_live[i] for i in range(len(res.token_ids)) if i % 3 == 0]
    assert observed_steps == expect


def test_attention_stats_reduction():
    g = torch.Generator().manual_seed(0)
    attn = [torch.rand(1, 3, 4, 6, generator=g).softmax(-1) for _ in range(2)]
    st = attention_stats(attn, AttentionNeed.COL_SUM | AttentionNeed.LAST_ROW)
    mean = sum(a[0].double().sum(0) for a in attn) / 6.0
    np.testing.assert_allclose(st.col_sum, mean.sum(0).numpy(), rtol=0, atol=1e-15)
    np.testing.assert_allclose(st.last_row, mean[-1].numpy(), rtol=0, atol=1e-15)
    only = attention_stats(attn, AttentionNeed.LAST_ROW)
    assert only.col_sum is None and only.last_row is not None
    none = attention_stats(attn, AttentionNeed.NONE)
    assert none.col_sum is None and none.last_row is None


# --------------------------------------------------------------------------- project policies (when present)

_BUILTINS = ["streaming", "h2o", "tova", "scissorhands", "random"]


@pytest.mark.parametrize("defaults", [False, True], ids=["explicit", "defaults"])
@pytest.mark.parametrize("name", _BUILTINS)
def test_builtin_policy_bookkeeping_and_reference(model2, name, defaults):
    try:
        cls = get_policy_class(name)
    except ModuleNotFoundError as e:
        pytest.skip(f"policy {name!r} not implemented yet ({e})")
    if defaults:  # the policy's own sink / recent / slack defaults
        cfg = VTokenConfig(policy=name, budget=BUDGET, granularity="request")
    else:
        cfg = VTokenConfig(policy=name, budget=BUDGET, slack=0, sink_tokens=SINKS, recent_tokens=RECENT,
                           granularity="request")
    built = cfg.make_policy(BUDGET)
    slack = cfg.resolved_slack()
    prompt = _prompt(seed=11)
    res = oracle_generate(model2, prompt, 40, cfg, return_logits=True)
    assert res.slack == slack
    _check_bookkeeping(res, PROMPT_LEN, BUDGET, slack, built.sink_tokens, built.recent_tokens)
    ref = _masked_full_cache_logits(model2, prompt, res)
    for i, (a, b) in enumerate(zip(res.logits, ref)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=f"{name} step {i}")
    assert res.token_ids == oracle_generate(model2, prompt, 40, cfg).token_ids  # deterministic


# --------------------------------------------------------------------------- errors


def test_errors(model2, test_policies):
    with pytest.raises(ValueError, match="empty"):
        oracle_generate(model2, [], 4, None)
    with pytest.raises(ValueError, match="max_new_tokens"):
        oracle_generate(model2, [1, 2], 0, None)
    with pytest.raises(ValueError, match="without cfg"):
        oracle_generate(model2, [1, 2], 2, None, policy=_StreamingLike())
    sdpa = _llama(1)
    sdpa.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="eager"):
        oracle_generate(sdpa, [1, 2], 2, None)

    @dataclass
    class Bad(_StreamingLike):
        def select_victims(self, state, view, k):
            return np.array([0, 0], dtype=np.int64)

    with pytest.raises(RuntimeError, match="invalid victims"):
        oracle_generate(model2, _prompt(), 3, _cfg("oracle_test_streaming"), policy=Bad(sink_tokens=0))
