"""vToken with vLLM prefix caching on (issues 12, 24; docs/integration.md, "Prefix caching").

The rule under test: a block that is hashed or shared is never written. Until its first eviction
a request caches its blocks as stock vLLM does; at its first eviction it copies the cached blocks
it may write into private ones (the cached ones keep their hash and contents) and caches nothing
more. A policy that needs the statistics of the prompt (H2O) keeps its hit (protected); one that
does not (TOVA, Scissorhands, StreamingLLM) evicts inside it, and its tokens equal the dense
oracle's for the prompt alone. With ``prefix_hits: skip`` a request that would keep its hit
computes its prompt instead.

Engines (each one process, ``tests/integration/_prefix_driver.py``, ``VTOKEN_CHECK=1``:
ref_cnt == holders for every held block, shared blocks counted once in the pool, nothing past a
request's never-evicted prefix shared or hashed once it evicted, every block a move or a copy
writes held by its planner alone and unhashed). With ``digests`` the driver hashes the contents
of every hashed block a request holds after every step and fails if one changes.

* ``default_run`` (v1-sync): A (it evicts inside its prompt), B (A's prefix), A again, A's second
  turn (A's prompt + answer + a question), B and A with TOVA, one after the other; then four
  requests sharing the prefix decode and evict together. Also on mrv2-async and under
  ``protect_cached_prefix: true``.
* Sharers of one policy: a request's hit is read-only for it (its side-cache state belongs to the
  request that computed the blocks) and protected; sharers of one policy beside their owner.
* A pool too small for the copies: first evictions deferred, no lost request, no write to a
  cached block, tokens equal the oracle replaying the logged evictions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from vtoken.assets.paths import ensure_tiny_model
from vtoken.config import parse_config, parse_request_overrides

from execution_paths import EXPECTED, path_env

pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent
BLOCK = 32
NEW = 64
VT = {"policy": "h2o", "budget": 176, "recent_tokens": 8, "prefix_hits": "protect"}  # (the protect rule under test)
PREFIX = [(j * 29 + 7) % 250 + 1 for j in range(128)]


def _suffix(seed: int, n: int) -> list[int]:
    return [((seed + 5) * 41 + j * (13 + seed)) % 250 + 1 for j in range(n)]


A = PREFIX + _suffix(1, 40)  # 168 tokens: full prompt blocks = 160
B = PREFIX + _suffix(2, 50)  # 178 tokens
TOVA = {"vtoken_policy": "tova"}


def _req(rid, prompt, extra=None, max_tokens=NEW):
    return dict(id=rid, prompt_token_ids=prompt, max_tokens=max_tokens, extra_args=extra)


# A's second turn: A's prompt + A's answer + a new question
TURN2 = dict(_req("A-turn2", _suffix(3, 20)), **{"continue": "A"})
SEQUENCE = [[_req("A", A)], [_req("B", B)], [_req("A2", A)], [TURN2], [_req("B-tova", B, TOVA)],
            [_req("A-tova", A, TOVA)]]
SEQ_IDS = ("A", "B", "A2", "A-turn2", "B-tova", "A-tova")
#: the requests whose policy needs the prompt's statistics (H2O): their hit is protected
KEEPS_HIT = ("B", "A2", "A-turn2")
# suffix length, policy, budget, new tokens. Scissorhands' default slack (budget // 2) lets C2
# grow to 300 live tokens and then cut back to 200, which frees tail blocks while C0, C1, C3
# share the prefix blocks with it.
_C = [(30, "h2o", 100, NEW), (45, "tova", 100, NEW), (60, "scissorhands", 200, 128), (75, "streaming", 100, NEW)]
CONCURRENT = [[_req(f"C{i}", PREFIX + _suffix(10 + i, n), {"vtoken_policy": pol, "vtoken_budget": b}, max_tokens=m)
               for i, (n, pol, b, m) in enumerate(_C)]]


def _run(tiny: str, vt: dict, phases: list, path: str, digests: bool, num_blocks: int = 256,
         max_model_len: int = 1024, kv_events: bool = False) -> dict:
    engine = dict(model=tiny, dtype="float32", max_model_len=max_model_len, block_size=BLOCK, enforce_eager=True,
                  gpu_memory_utilization=0.1, num_gpu_blocks_override=num_blocks, skip_tokenizer_init=True,
                  enable_prefix_caching=True)
    spec = dict(engine=engine, vtoken=vt, phases=phases, digests=digests)
    if kv_events:  # vLLM's ZMQ publisher on the loopback interface, on a free port
        from drivers.launcher import free_port

        spec["kv_events"] = f"tcp://127.0.0.1:{free_port()}"
        spec["kv_events_replay"] = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as d:
        sp, op = Path(d) / "spec.json", Path(d) / "out.json"
        sp.write_text(json.dumps(spec))
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))
        env.update(path_env(path))
        p = subprocess.run([sys.executable, str(HERE / "_prefix_driver.py"), str(sp), str(op)], env=env,
                           capture_output=True, text=True, timeout=1200)
        if p.returncode != 0 or not op.exists():
            raise RuntimeError(f"prefix driver failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-6000:]}")
        return json.loads(op.read_text())


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(ensure_tiny_model())


PROTECT = dict(VT, protect_cached_prefix=True)
# a budget below the shared prefix: every request evicts inside the cached blocks it got or made
VT_DEFAULT = dict(VT, budget=96)


@pytest.fixture(scope="module")
def default_run(tiny):
    return _run(tiny, VT_DEFAULT, SEQUENCE + CONCURRENT, "v1-sync", digests=True)


@pytest.fixture(scope="module")
def protect_run(tiny):
    return _run(tiny, PROTECT, SEQUENCE + CONCURRENT, "v1-sync", digests=True)


_oracle: dict = {}


def _oracle_tokens(tiny, prompt, extra, vt, protected, new=NEW, schedule=None):
    import torch

    from reference.oracle import load_oracle_model, oracle_generate

    cfg = parse_request_overrides(extra).apply(parse_config(vt))
    key = (tuple(prompt), cfg.model_dump_json(), protected, new, None if schedule is None else tuple(schedule.items()))
    if key not in _oracle:
        if "model" not in _oracle:
            torch.set_num_threads(2)
            _oracle["model"] = load_oracle_model(tiny)
        res = oracle_generate(_oracle["model"], prompt, new, cfg, protected_prefix=protected,
                              evict_schedule=schedule)
        _oracle[key] = (list(res.token_ids), res.evicted_positions)
    return _oracle[key]


def _check_against_oracle(tiny, out, phases, vt):
    """Every request's tokens equal the dense oracle's for its prompt alone: no prefix cache and,
    under the default rule, nothing protected (``protected`` is 0 there)."""
    mismatches = []
    for phase in phases:
        for r in phase:
            fin = out["finished"][r["id"]]
            toks, _ = _oracle_tokens(tiny, out["prompts"][r["id"]], r["extra_args"], vt, fin["protected"],
                                     r["max_tokens"])
            if out["tokens"][r["id"]] != toks:
                mismatches.append((r["id"], fin["protected"], out["tokens"][r["id"]][:12], toks[:12]))
    assert mismatches == []


#: num_cached_tokens under the default rule: B hits the shared prefix, A again and B again their
#: full prompt blocks (a hit stops one token short of the prompt: (prompt - 1) // 32 blocks), as
#: stock vLLM; A's second turn hits A's full prompt blocks but not its answer (KV computed after
#: A's first eviction is never cached; stock vLLM would hit 224 tokens there)
SEQ_HITS = {"A": 0, "B": 128, "A2": 160, "A-turn2": 160, "B-tova": 160, "A-tova": 160}


def _check_sequence(out):
    assert {rid: out["num_cached_tokens"][rid] for rid in SEQ_IDS} == SEQ_HITS
    for rid in SEQ_IDS:
        fin = out["finished"][rid]
        assert fin["cached_tokens"] == SEQ_HITS[rid], rid
        assert fin["evicted"] > 0, rid
    assert len(out["prompts"]["A-turn2"]) == len(A) + NEW + 20


def _check_sharers(out, protected: bool):
    # C0..C3 hit the same four prefix blocks. Under protect_cached_prefix all keep them (ref_cnt 4
    # while they decode and evict); under the default rule H2O (C0) keeps its hit and the others
    # copy theirs into private blocks in the step that starts them (their policies need no
    # statistics of the hit's tokens), so only C0 holds the cached blocks then
    assert all(out["num_cached_tokens"][f"C{i}"] == 128 for i in range(4))
    if protected:
        assert out["max_ref_cnt"] >= 4 and out["shared_steps"] > 0
    else:
        assert out["max_ref_cnt"] >= 1 and out["stats"]["unshared_blocks"] >= 3 * 4
    # H2O (C0) keeps its hit; TOVA (C1), Scissorhands (C2: its prompt adds only the last query's row)
    # and StreamingLLM (C3) copy it
    assert [out["finished"][f"C{i}"]["protected"] >= 128 for i in range(4)] == (
        [True] * 4 if protected else [True, False, False, False])
    assert all(out["finished"][f"C{i}"]["evicted"] > 0 for i in range(4))
    assert out["stats"]["request_faults"] == 0 and out["stats"]["freed_blocks"] > 0
    # blocks go back through BlockPool.free_blocks: the pool returns to its start after each
    # phase (cached blocks count as free)
    assert out["free_after_phase"] == [out["free_start"]] * len(out["free_after_phase"])


def test_default_sequence_hits_like_stock_and_tokens_are_cache_independent(tiny, default_run):
    """A evicts inside its prompt; B (A's prefix), A again, A's second turn and B with TOVA hit
    what stock vLLM hits (A's second turn: A's prompt, not its answer); nothing is protected and
    every request's tokens equal the dense oracle's for it alone, without a prefix cache."""
    out = default_run
    assert out["paths"] == EXPECTED["v1-sync"]
    _check_sequence(out)
    assert {rid: out["finished"][rid]["protected"] for rid in SEQ_IDS} == {
        rid: SEQ_HITS[rid] if rid in KEEPS_HIT else 0 for rid in SEQ_IDS}
    # TOVA needs no statistics of the prompt: A with TOVA after a 160-token hit answers as the
    # oracle does for A alone (no cache, nothing protected)
    assert out["finished"]["A-tova"]["protected"] == 0
    _check_against_oracle(tiny, out, SEQUENCE + CONCURRENT, VT_DEFAULT)
    # the rule binds: alone, A evicts inside the 128-token prefix that B hits, so A's and B's
    # first evictions had to copy cached blocks (and never wrote them: the driver's digests)
    _, evicted = _oracle_tokens(tiny, A, None, VT_DEFAULT, 0)
    assert min(int(e.min()) for e in evicted if len(e)) < 128
    assert out["stats"]["unshared_blocks"] >= len(SEQ_IDS) + 4
    assert out["stats"]["unshare_deferred"] == 0


def test_default_concurrent_sharers_never_write_a_cached_block(default_run):
    _check_sharers(default_run, protected=False)
    # every held hashed block was checked after every step (the driver fails on a change)
    assert default_run["digest_checks"] > 0


def test_protect_cached_prefix_keeps_prompt_blocks_shared(tiny, protect_run):
    """``protect_cached_prefix: true``: a request never evicts its full prompt blocks (a function
    of the prompt alone), so they stay shared and are never copied; the same hits as the default."""
    out = protect_run
    _check_sequence(out)
    for rid in SEQ_IDS:
        fin = out["finished"][rid]
        assert fin["protected"] == len(out["prompts"][rid]) // BLOCK * BLOCK, rid
    _check_against_oracle(tiny, out, SEQUENCE + CONCURRENT, PROTECT)
    # the rule is binding: without the protection the oracle evicts inside A's prompt blocks
    _, evicted = _oracle_tokens(tiny, A, None, PROTECT, 0)
    assert min(int(e.min()) for e in evicted if len(e)) < 160
    _check_sharers(out, protected=True)
    assert out["digest_checks"] > 0


def test_default_on_mrv2_async(tiny, default_run):
    """The default rule's sequence and sharers on Model Runner V2 with async scheduling (which
    decides as sync: the same oracle)."""
    out = _run(tiny, VT_DEFAULT, SEQUENCE + CONCURRENT, "mrv2-async", digests=False)
    assert out["paths"] == EXPECTED["mrv2-async"]
    _check_sequence(out)
    _check_sharers(out, protected=False)
    _check_against_oracle(tiny, out, SEQUENCE + CONCURRENT, VT_DEFAULT)


# vToken keeps per-token policy state in side caches indexed by KV slot, so requests
# holding the same cached blocks address the same state. W (H2O, budget 96, slack 120) computes and
# caches the prefix and decodes without evicting for ~48 steps, then evicts 120 tokens at once; four H2O requests (one side cache: same
# policy, same token sets) arrive after W's prefill, hit the prefix and evict beside it (their hit
# is kept: never written, never read for them). W's first eviction, inside the prefix, then
# follows W's own statistics for those slots: its tokens equal the oracle's for W alone. (Before
# the hit was read-only, the sharers' statistics were folded into W's state there.)
WORKER_VT = dict(VT, budget=96, slack=120)
WORKER_PHASES = [[_req("W", PREFIX + _suffix(20, 40))] + [
    dict(_req(f"S{i}", PREFIX + _suffix(21 + i, 60 + 10 * i), {"vtoken_budget": 100}), arrive_after=2)
    for i in range(4)]]


@pytest.mark.parametrize("path", ["v1-sync", "mrv2-async"])
def test_worker_decisions_share_cached_blocks_read_only(tiny, path):
    """Async scheduling decides as sync, so both paths equal the same oracle; block digests are
    taken under sync scheduling only."""
    out = _run(tiny, WORKER_VT, WORKER_PHASES, path, digests=path == "v1-sync")
    assert out["paths"] == EXPECTED[path]
    fin = out["finished"]
    assert out["num_cached_tokens"]["W"] == 0 and fin["W"]["protected"] == 0
    assert all(out["num_cached_tokens"][f"S{i}"] == 128 and fin[f"S{i}"]["protected"] == 128 for i in range(4))
    assert out["max_ref_cnt"] >= 5 and out["shared_steps"] > 0  # W and the four sharers at once
    assert all(fin[r]["evicted"] > 0 for r in ["W"] + [f"S{i}" for i in range(4)])
    assert out["stats"]["request_faults"] == 0 and (out["digest_checks"] > 0) == (path == "v1-sync")
    _check_against_oracle(tiny, out, WORKER_PHASES, WORKER_VT)
    # the case binds: alone, W evicts inside the prefix the sharers hold
    _, evicted = _oracle_tokens(tiny, out["prompts"]["W"], None, WORKER_VT, 0)
    assert min(int(e.min()) for e in evicted if len(e)) < 128
    assert out["free_after_phase"] == [out["free_start"]]


# prefix_hits: skip: a request that would keep (protect) its hit does not read the prefix cache:
# the sequence (A, B, A again, A's second turn compute their prompts; the TOVA requests still hit
# the blocks the H2O requests cached), and the sharers (W's H2O sharers compute the prefix too).
# Every request's tokens equal the oracle's for it alone.
SKIP_CASES = {"sequence": (dict(VT_DEFAULT, prefix_hits="skip"), SEQUENCE,
                           dict(SEQ_HITS, B=0, A2=0, **{"A-turn2": 0}), 4),
              "sharers": (dict(WORKER_VT, prefix_hits="skip"), WORKER_PHASES,
                          {"W": 0, "S0": 0, "S1": 0, "S2": 0, "S3": 0}, 5)}


@pytest.mark.parametrize("case", ["sequence", "sharers"])
def test_prefix_hits_skip_makes_tokens_cache_independent(tiny, case):
    vt, phases, hits, skipped = SKIP_CASES[case]
    out = _run(tiny, vt, phases, "v1-sync", digests=False)
    assert out["num_cached_tokens"] == hits
    assert {rid: f["protected"] for rid, f in out["finished"].items()} == dict.fromkeys(hits, 0)
    assert all(f["evicted"] > 0 for f in out["finished"].values())
    # A (sequence) and W (sharers) have no hit to skip but are counted: they did not read the cache
    assert out["stats"]["prefix_reads_skipped"] == skipped and out["stats"]["request_faults"] == 0
    assert out["free_after_phase"] == [out["free_start"]] * len(phases)
    _check_against_oracle(tiny, out, phases, vt)


# Policies that need no statistics of the hit's tokens: a sharer copies its hit
# into private blocks in the step that starts it (the cached blocks keep their hash for others),
# its policy state covers the hit as its own tokens, and it evicts inside the hit: its tokens equal
# the oracle's for it alone. W (H2O) computes and caches the prefix; six sharers of six policies
# (budget 100, below the 128-token hit) arrive after its prefill. SnapKV's observation window (25
# queries) lies after the hit, so it needs nothing of the hit's tokens (EvictionPolicy.keeps_hit).
COPY_POLICIES = ("tova", "scissorhands", "streaming", "random", "keydiff", "snapkv")
COPY_PHASES = [[_req("W", PREFIX + _suffix(20, 40))] + [
    dict(_req(f"K{i}", PREFIX + _suffix(40 + i, 60 + 10 * i), {"vtoken_policy": pol, "vtoken_budget": 100}),
         arrive_after=2) for i, pol in enumerate(COPY_POLICIES)]]


@pytest.mark.parametrize("path", ["v1-sync", "mrv2-async"])
def test_worker_decisions_copy_the_hit_of_policies_without_prompt_statistics(tiny, path):
    out = _run(tiny, WORKER_VT, COPY_PHASES, path, digests=path == "v1-sync")
    assert out["paths"] == EXPECTED[path]
    fin = out["finished"]
    sharers = [f"K{i}" for i in range(len(COPY_POLICIES))]
    assert all(out["num_cached_tokens"][r] == 128 and fin[r]["protected"] == 0 for r in sharers)
    assert all(fin[r]["evicted"] > 0 for r in ["W"] + sharers)
    st = out["stats"]
    # each sharer copied its 4 hit blocks when it started (W's first eviction copies more)
    assert st["unshared_blocks"] >= 4 * len(sharers) and st["unshare_deferred"] == 0 and st["request_faults"] == 0
    assert (out["digest_checks"] > 0) == (path == "v1-sync")
    assert out["free_after_phase"] == [out["free_start"]]
    _check_against_oracle(tiny, out, COPY_PHASES, WORKER_VT)
    # the case binds: alone, every sharer evicts inside the 128-token prefix it hit
    for r in COPY_PHASES[0][1:]:
        _, evicted = _oracle_tokens(tiny, r["prompt_token_ids"], r["extra_args"], WORKER_VT, 0)
        assert min(int(e.min()) for e in evicted if len(e)) < 128, r["id"]


def test_worker_naive_mode_with_hit_copies(tiny):
    """``mode: naive`` with prefix caching: the same hit copies and
    decisions as vToken (tokens equal the same oracle, block digests checked), while the engine
    holds Naive-Evict's blocks; every block comes back."""
    vt = dict(WORKER_VT, mode="naive")
    out = _run(tiny, vt, COPY_PHASES, "v1-sync", digests=True)
    fin = out["finished"]
    sharers = [f"K{i}" for i in range(len(COPY_POLICIES))]
    assert all(out["num_cached_tokens"][r] == 128 and fin[r]["protected"] == 0 for r in sharers)
    assert all(fin[r]["evicted"] > 0 for r in ["W"] + sharers)
    assert out["stats"]["request_faults"] == 0 and out["digest_checks"] > 0
    assert out["free_after_phase"] == [out["free_start"]]
    _check_against_oracle(tiny, out, COPY_PHASES, WORKER_VT)


# The copies of a hit need free blocks in the step that starts the request. W caches the prefix
# and finishes; Q0 and Q1 (TOVA, budget 64) start in one step, sharing the 4 hit blocks, with 4
# blocks left free: Q0 copies its hit, Q1 cannot and keeps its hit (protected, as H2O does).
ADMIT_VT = dict(VT)
ADMIT_PHASES = [[_req("W", PREFIX + _suffix(20, 8), {"vtoken_budget": 256}, max_tokens=2)],
                [_req(f"Q{i}", PREFIX + _suffix(50 + i, 30), {"vtoken_policy": "tova", "vtoken_budget": 64},
                      max_tokens=8) for i in range(2)]]


def test_worker_hit_copies_short_of_blocks_keep_the_hit(tiny):
    out = _run(tiny, ADMIT_VT, ADMIT_PHASES, "v1-sync", digests=True, num_blocks=11, max_model_len=256)
    fin = out["finished"]
    assert [out["num_cached_tokens"][f"Q{i}"] for i in range(2)] == [128, 128]
    assert [fin[f"Q{i}"]["protected"] for i in range(2)] == [0, 128]
    st = out["stats"]
    assert st["unshare_deferred"] == 1 and st["request_faults"] == 0 and st["unshared_blocks"] >= 4
    assert out["digest_checks"] > 0 and out["free_after_phase"] == [out["free_start"]] * 2
    _check_against_oracle(tiny, out, ADMIT_PHASES, ADMIT_VT)


# A pool too small for every first eviction's copies: W caches the 128-token prefix; then four
# requests that need no prompt statistics (their hits are copied, not kept) share it and reach
# their first eviction in the same step. Each holds 4 shared + 1 own block; budget 64 keeps 3
# blocks, so each first eviction copies 3 cached blocks. 12 usable blocks: after the prefills 3
# are free, enough for the first request's copies only.
PRESSURE_VT = dict(VT, policy="tova", budget=64, sink_tokens=4)
PRESSURE = [[_req("W", PREFIX + _suffix(20, 8), {"vtoken_budget": 256}, max_tokens=2)],
            [_req(f"P{i}", PREFIX + _suffix(21 + i, 30), {"vtoken_policy": ("tova", "streaming")[i % 2]},
                  max_tokens=48) for i in range(4)]]


def test_first_evictions_under_pressure_defer_and_never_write_a_cached_block(tiny):
    """Copies that the free blocks cannot cover defer the first eviction (counted); no request is
    lost, no cached block is written (contents hashed after every step), the pool returns, and
    every request's tokens equal the oracle replaying its evictions as logged (a preempted request
    resumes with its saved K/V: no replay needed)."""
    from reference.oracle import oracle_generate

    out = _run(tiny, PRESSURE_VT, PRESSURE, "v1-sync", digests=True, num_blocks=13, max_model_len=384)
    assert all(len(out["tokens"][f"P{i}"]) == 48 for i in range(4))
    assert all(out["num_cached_tokens"][f"P{i}"] >= 128 for i in range(4))
    st = out["stats"]
    assert st["unshare_deferred"] > 0 and st["unshared_blocks"] >= 3, st
    assert st["request_faults"] == 0
    assert out["digest_checks"] > 0
    assert out["free_after_phase"] == [out["free_start"]] * 2
    _oracle_tokens(tiny, PREFIX, None, PRESSURE_VT, 0)  # (loads the model)
    for phase in PRESSURE:
        for r in phase:
            fin = out["finished"][r["id"]]
            cfg = parse_request_overrides(r["extra_args"]).apply(parse_config(PRESSURE_VT))
            # (a request whose hit copies the free blocks could not cover at its start keeps its
            # hit, protected, as H2O does: the oracle protects the same prefix)
            ref = oracle_generate(_oracle["model"], r["prompt_token_ids"], r["max_tokens"], cfg,
                                  evict_schedule={d: k for d, k in fin["evict_log"]},
                                  protected_prefix=fin["protected"])
            assert out["tokens"][r["id"]] == list(ref.token_ids), (r["id"], fin["evict_log"])


# Four requests that share a 192-token prefix (6 blocks) and keep 2 blocks at budget 40: at their
# first evictions, in one step, each copies the 2 prefix blocks it keeps and releases the other 4
# shared ones (so those are released several times in the step, and reach ref_cnt 0 with the last
# sharer), while the later ones still have blocks to copy: the blocks set aside from the free queue
# are each removed once (vLLM's queue raises on a second removal): E, after them in the running
# order, copies its own hashed prompt blocks in that step.
LONG_PREFIX = [(j * 17 + 3) % 250 + 1 for j in range(192)]
SHARED_TAIL = [[_req("W6", LONG_PREFIX + _suffix(30, 8), {"vtoken_budget": 512}, max_tokens=2)],
               [_req(f"D{i}", LONG_PREFIX + _suffix(31 + i, 10), TOVA, max_tokens=24) for i in range(4)]
               + [_req("E", _suffix(40, 202), TOVA, max_tokens=24)]]


def test_sharers_releasing_the_same_blocks_in_one_step(tiny):
    vt = dict(VT, budget=40, recent_tokens=8)
    out = _run(tiny, vt, SHARED_TAIL, "v1-sync", digests=True)
    assert all(out["num_cached_tokens"][f"D{i}"] == 192 for i in range(4))
    assert out["stats"]["request_faults"] == 0 and out["stats"]["unshared_blocks"] >= 2 * 4
    assert out["free_after_phase"] == [out["free_start"]] * 2
    assert out["digest_checks"] > 0
    _check_against_oracle(tiny, out, SHARED_TAIL, vt)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# KV events (issue 45): the prefix-caching workload above (evictions inside cached prompts, sharers
# of different policies), an abort, then the pool-pressure phases (deferred first evictions,
# preemption), and four sharers of the prefix that outgrow the pool together (preempted, resumed
# with their saved K/V), in a pool of 16 blocks.
KV_EVENTS_PHASES = (SEQUENCE + [CONCURRENT[0] + [dict(_req("X", PREFIX + _suffix(50, 40), TOVA, max_tokens=60),
                                                      abort_after=6)]] + PRESSURE
                    + [[_req(f"G{i}", PREFIX + _suffix(60 + i, 30), {"vtoken_budget": 300}, max_tokens=100)
                        for i in range(4)]])


def test_kv_events_match_the_block_pool(tiny):
    """vLLM's KV events, read from its own ZMQ publisher as a KV-aware router reads them, describe
    the block pool's cached blocks exactly after every step: the multiset of (block hash, group)
    rebuilt from ``BlockStored`` / ``BlockRemoved`` equals ``BlockPool.cached_block_hash_to_block``.
    Every stored block names tokens that a request really has at that block of its sequence (its
    prompt and answer, block-aligned): vToken hashes a request's blocks only before its first
    eviction position, so no private copy or repacked block is ever announced; and no hashed block
    a request holds changes its contents (digests)."""
    out = _run(tiny, VT_DEFAULT, KV_EVENTS_PHASES, "v1-sync", digests=True, num_blocks=16, max_model_len=384,
               kv_events=True)
    ev = out["kv_events"]
    assert ev["checks"] > 100 and ev["mismatches"] == 0, ev["first"]
    assert ev["stored"] > 10 and ev["removed"] > 0, (ev["stored"], ev["removed"])
    st = out["stats"]
    assert out["aborted"] == ["X"] and st["request_faults"] == 0
    assert st["preemption_resets"] > 0 and st["unshared_blocks"] > 0, {k: v for k, v in st.items() if "pre" in k or "unsh" in k}
    assert out["digest_checks"] > 0 and out["free_after_phase"][-1] == out["free_start"]
    # every announced block: a block-aligned run of a request's own tokens (prompt, then answer)
    seqs = [out["prompts"][rid] + out["tokens"].get(rid, []) for rid in out["prompts"]]
    chunks = {tuple(s[i:i + BLOCK]) for s in seqs for i in range(0, len(s) - BLOCK + 1, BLOCK)}
    bad = [h for h, toks in ev["tokens"].items() if tuple(toks) not in chunks]
    assert len(ev["tokens"]) == ev["stored"] or len(ev["tokens"]) > 10
    assert not bad, f"{len(bad)} stored blocks name tokens no request has there"
