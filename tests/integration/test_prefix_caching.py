"""vToken with vLLM prefix caching on (issue 12; docs/integration.md, "Prefix caching").

Rules under test: a request that may evict never evicts its protected prefix (the blocks it
got from the prefix cache, which may be shared, and, with ``protect_cached_prefix: true``, its
own full prompt blocks); no repack writes a shared, hashed or foreign block; blocks past the
protected prefix are kept out of the cache while the request runs and the clean ones (below
its first evicted position) are cached when it ends. The dense oracle replays the same rule
(``oracle_generate(protected_prefix=P)``), so tokens are compared exactly.

Engines (each one process, ``tests/integration/_prefix_driver.py``, ``VTOKEN_CHECK=1``:
ref_cnt == holders for every held block, shared blocks counted once in the pool, no block
past a protected prefix shared or hashed, every block a move writes held by its planner alone
and unhashed):

* ``default_run`` (the default rule, protect the hit only), v1-sync: a short request that
  never evicts caches the 128-token prefix; then A (the prefix + its own suffix), B (same
  prefix, another suffix), A again, B with TOVA, one after the other, each hitting the cache
  and evicting inside its own prompt blocks; then four requests sharing the prefix decode and
  evict together. The contents of every hashed block a request holds are hashed after every
  step and must not change while the block keeps its hash. The same on mrv2-async.
* ``protect_run`` (``protect_cached_prefix: true``), v1-sync: A, B, A again, B with TOVA and
  the four sharers; the protected prefix is then a function of the prompt alone, so A again
  gives exactly A's tokens from the fresh engine.
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

from execution_paths import EXPECTED, SCORE_LAG, path_env

pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent
BLOCK = 32
NEW = 64
VT = {"policy": "h2o", "budget": 176, "recent_tokens": 8}
PREFIX = [(j * 29 + 7) % 250 + 1 for j in range(128)]


def _suffix(seed: int, n: int) -> list[int]:
    return [((seed + 5) * 41 + j * (13 + seed)) % 250 + 1 for j in range(n)]


A = PREFIX + _suffix(1, 40)  # 168 tokens: full prompt blocks = 160
B = PREFIX + _suffix(2, 50)  # 178 tokens
TOVA = {"vtoken_policy": "tova"}


def _req(rid, prompt, extra=None, max_tokens=NEW):
    return dict(id=rid, prompt_token_ids=prompt, max_tokens=max_tokens, extra_args=extra)


SEQUENCE = [[_req("A", A)], [_req("B", B)], [_req("A2", A)], [_req("B-tova", B, TOVA)]]
# suffix length, policy, budget, new tokens. Scissorhands' default slack (budget // 2) lets C2
# grow to 300 live tokens and then cut back to 200, which frees tail blocks past its
# protected prefix while C0, C1, C3 share the prefix blocks with it.
_C = [(30, "h2o", 100, NEW), (45, "tova", 100, NEW), (60, "scissorhands", 200, 128), (75, "streaming", 100, NEW)]
CONCURRENT = [[_req(f"C{i}", PREFIX + _suffix(10 + i, n), {"vtoken_policy": pol, "vtoken_budget": b}, max_tokens=m)
               for i, (n, pol, b, m) in enumerate(_C)]]


def _run(tiny: str, vt: dict, phases: list, path: str, digests: bool) -> dict:
    engine = dict(model=tiny, dtype="float32", max_model_len=1024, block_size=BLOCK, enforce_eager=True,
                  gpu_memory_utilization=0.1, num_gpu_blocks_override=256, skip_tokenizer_init=True,
                  enable_prefix_caching=True)
    spec = dict(engine=engine, vtoken=vt, phases=phases, digests=digests)
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


# W: 140 tokens within its budget: it never evicts, so it caches its full blocks like stock
WARM = [[_req("W", PREFIX + _suffix(9, 8), {"vtoken_budget": 256}, max_tokens=4)]]
PROTECT = dict(VT, protect_cached_prefix=True)
# the default rule with a budget below the shared prefix: without the hit, eviction would cut into it
VT_DEFAULT = dict(VT, budget=96)


@pytest.fixture(scope="module")
def default_run(tiny):
    return _run(tiny, VT_DEFAULT, WARM + SEQUENCE + CONCURRENT, "v1-sync", digests=True)


@pytest.fixture(scope="module")
def protect_run(tiny):
    return _run(tiny, PROTECT, SEQUENCE + CONCURRENT, "v1-sync", digests=True)


_oracle: dict = {}


def _oracle_tokens(tiny, prompt, extra, vt, protected, lag=0, new=NEW):
    import torch

    from vtoken.oracle import load_oracle_model, oracle_generate

    cfg = parse_request_overrides(extra).apply(parse_config(vt))
    key = (tuple(prompt), cfg.model_dump_json(), protected, lag, new)
    if key not in _oracle:
        if "model" not in _oracle:
            torch.set_num_threads(2)
            _oracle["model"] = load_oracle_model(tiny)
        res = oracle_generate(_oracle["model"], prompt, new, cfg, protected_prefix=protected, score_lag=lag)
        _oracle[key] = (list(res.token_ids), res.evicted_positions)
    return _oracle[key]


def _check_against_oracle(tiny, out, phases, vt, lag=0):
    mismatches = []
    for phase in phases:
        for r in phase:
            fin = out["finished"][r["id"]]
            toks, _ = _oracle_tokens(tiny, r["prompt_token_ids"], r["extra_args"], vt, fin["protected"], lag,
                                     r["max_tokens"])
            if out["tokens"][r["id"]] != toks:
                mismatches.append((r["id"], fin["protected"], out["tokens"][r["id"]][:12], toks[:12]))
    assert mismatches == []


def _check_sharers(out):
    # C0..C3 hit the same four prefix blocks and decode together: ref_cnt 4 while they evict
    assert out["max_ref_cnt"] >= 4 and out["shared_steps"] > 0
    assert all(out["num_cached_tokens"][f"C{i}"] == 128 for i in range(4))
    assert all(out["finished"][f"C{i}"]["protected"] >= 128 for i in range(4))
    assert all(out["finished"][f"C{i}"]["evicted"] > 0 for i in range(4))
    assert out["stats"]["request_faults"] == 0 and out["stats"]["freed_blocks"] > 0
    # blocks go back through BlockPool.free_blocks: the pool returns to its start after each
    # phase (cached blocks count as free)
    assert out["free_after_phase"] == [out["free_start"]] * len(out["free_after_phase"])


def test_default_protects_the_hit_and_evicts_own_prompt_blocks(tiny, default_run):
    out = default_run
    assert out["paths"] == EXPECTED["v1-sync"]
    hits = out["num_cached_tokens"]
    assert hits["W"] == 0 and out["finished"]["W"]["evicted"] == 0
    # W cached the 4 prefix blocks (it never evicted: all its full blocks are clean); A, B, A
    # again and B-tova hit them. Each evicts inside its own prompt blocks (positions 128 ..
    # prompt end), so nothing past the prefix is clean when it ends: the hits stay 128.
    assert {rid: hits[rid] for rid in ("A", "B", "A2", "B-tova")} == dict.fromkeys(("A", "B", "A2", "B-tova"), 128)
    for rid, prompt in (("A", A), ("B", B), ("A2", A), ("B-tova", B)):
        fin = out["finished"][rid]
        assert fin["protected"] == fin["cached_tokens"] == 128  # only the hit
        assert fin["evicted"] > 0
    _check_against_oracle(tiny, out, WARM + SEQUENCE + CONCURRENT, VT_DEFAULT)
    # the rule binds: A evicted inside its own prompt blocks past the hit
    _, evicted = _oracle_tokens(tiny, A, None, VT_DEFAULT, 128)
    assert any(((e >= 128) & (e < len(A))).any() for e in evicted)
    # and the hit is what kept the prefix: without it the oracle evicts inside [0, 128)
    _, evicted0 = _oracle_tokens(tiny, A, None, VT_DEFAULT, 0)
    assert min(int(e.min()) for e in evicted0 if len(e)) < 128


def test_default_concurrent_sharers_keep_shared_blocks(default_run):
    _check_sharers(default_run)
    # every held hashed block was checked after every step (the driver fails on a change)
    assert default_run["digest_checks"] > 0


def test_protect_cached_prefix_sequence_is_cache_independent(tiny, protect_run):
    out = protect_run
    hits = out["num_cached_tokens"]
    # A computed and cached its full prompt blocks (160 tokens, protected); B shares the
    # 128-token prefix; A again and B-tova hit their whole full prompt blocks (a hit stops
    # one token short of the prompt: (prompt - 1) // 32 blocks).
    assert (hits["A"], hits["B"], hits["A2"], hits["B-tova"]) == (0, 128, 160, 160)
    for rid, prompt in (("A", A), ("B", B), ("A2", A), ("B-tova", B)):
        fin = out["finished"][rid]
        assert fin["protected"] == len(prompt) // BLOCK * BLOCK  # the rule, independent of the hit
        assert fin["cached_tokens"] == hits[rid]
        assert fin["evicted"] > 0, rid
    # the same tokens as alone on a fresh engine: A ran first on a fresh engine
    assert out["tokens"]["A2"] == out["tokens"]["A"]
    _check_against_oracle(tiny, out, SEQUENCE + CONCURRENT, PROTECT)
    # the rule is binding: without the protection the oracle evicts inside A's prompt blocks
    _, evicted = _oracle_tokens(tiny, A, None, PROTECT, 0)
    assert min(int(e.min()) for e in evicted if len(e)) < 160
    _check_sharers(out)
    assert out["digest_checks"] > 0


def test_default_on_mrv2_async(tiny, default_run):
    """The default rule's sequence and sharers on Model Runner V2 with async scheduling (score lag 1)."""
    out = _run(tiny, VT_DEFAULT, WARM + SEQUENCE + CONCURRENT, "mrv2-async", digests=False)
    assert out["paths"] == EXPECTED["mrv2-async"]
    assert out["num_cached_tokens"] == default_run["num_cached_tokens"]
    _check_sharers(out)
    _check_against_oracle(tiny, out, WARM + SEQUENCE + CONCURRENT, VT_DEFAULT, lag=SCORE_LAG["mrv2-async"])


def test_worker_decisions_on_mrv2_async(tiny, default_run):
    """``decide_on: worker`` (the worker picks the victims, no score lag): the same hits, sharers and
    hashed-block contents (checked after every step), tokens equal the oracle with no lag."""
    vt = dict(VT_DEFAULT, decide_on="worker")
    out = _run(tiny, vt, WARM + SEQUENCE + CONCURRENT, "mrv2-async", digests=True)
    assert out["paths"] == EXPECTED["mrv2-async"]
    assert out["num_cached_tokens"] == default_run["num_cached_tokens"]
    _check_sharers(out)
    assert out["digest_checks"] > 0
    _check_against_oracle(tiny, out, WARM + SEQUENCE + CONCURRENT, vt, lag=0)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
