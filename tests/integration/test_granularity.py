"""Per-layer and per-head token sets inside a real engine (issue 23, ``docs/granularity.md``).

The tiny Llama's 2-KV-head variant (4 query heads over 2 KV heads, 2 layers), so ``head``
(4 sets), ``layer`` (2) and ``head_shared`` (2) all differ from ``request``. One mixed batch per
path: every policy at every granularity, chosen per request (``vtoken_granularity``). The
engine's greedy tokens equal the dense oracle keeping per-set caches (a gather per layer and KV
head), on V1 sync and Model Runner V2 async, and at TP=2 where each rank decides alone for its
own KV head (``head``) or from the all-reduced per-layer statistics (``layer``). Every run has
``VTOKEN_CHECK=1``: the block accounting (``ceil(live/B)`` retained) is checked after every
schedule(), under every granularity.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vtoken.policies import available_policies
from vtoken.assets.paths import ensure_tiny_gqa_model
from vtoken.config import parse_config, parse_request_overrides
from drivers.harness import run_in_subprocess

from execution_paths import EXPECTED, path_env
from test_worker_eviction import _naive_blocks

pytestmark = pytest.mark.engine

POLICIES = sorted(available_policies())  # every registered policy, a new one included
GRANULARITIES = ["layer", "head", "head_shared"]
NEW = 40
BASE = {"policy": "h2o", "budget": 40}
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1"}


def _prompt(i: int, n: int) -> list[int]:
    return [((i + 5) * 41 + j * (13 + i % 7)) % 250 + 1 for j in range(n)]


def _requests(grans=GRANULARITIES, policies=POLICIES) -> list[dict]:
    """Per (policy, granularity): a prompt longer than its budget (cut at the first decode step)
    and, alternately, budget 24 or 40."""
    out = []
    for k, (pol, g) in enumerate((p, g) for p in policies for g in grans):
        b = 24 if k % 2 else 40
        out.append(dict(id=f"{pol}-{g}-{b}", prompt_token_ids=_prompt(k, 60), max_tokens=NEW,
                        extra_args={"vtoken_policy": pol, "vtoken_budget": b, "vtoken_granularity": g}))
    return out


def _engine(model: str, **kw) -> dict:
    e = dict(model=model, dtype="float32", max_model_len=512, block_size=32, enforce_eager=True,
             gpu_memory_utilization=0.1, num_gpu_blocks_override=256, skip_tokenizer_init=True,
             enable_prefix_caching=False)
    e.update(kw)
    return e


@pytest.fixture(scope="module")
def gqa() -> str:
    return str(ensure_tiny_gqa_model())


@pytest.fixture(scope="module")
def oracle(gqa):
    import torch

    from reference.oracle import load_oracle_model, oracle_generate

    torch.set_num_threads(2)
    model = load_oracle_model(gqa)
    cache: dict = {}

    def run(r: dict):
        cfg = parse_request_overrides(r["extra_args"]).apply(parse_config(BASE))
        key = (r["id"], tuple(r["prompt_token_ids"]))
        if key not in cache:
            cache[key] = oracle_generate(model, r["prompt_token_ids"], NEW, cfg)
        return cache[key]

    return run


def _check(out: dict, reqs: list[dict], oracle) -> None:
    s = out["vtoken"]["stats"]
    assert s["evicted_tokens"] > 0 and s["request_faults"] == 0
    assert out["free_blocks_end"] == out["free_blocks_start"]
    bad = [r["id"] for r in reqs if out["tokens"][r["id"]] != list(oracle(r).token_ids)]
    assert not bad, bad
    by_id = {r["id"]: r for r in reqs}
    for f in out["vtoken"]["finished"]:
        assert f["evicted"] + f["num_live"] == f["num_logical"]
        # Naive-Evict's blocks: a logical block is freed once every set (on every TP rank) evicted it
        want = _naive_blocks(oracle(by_id[f["req_id"].rsplit("-", 1)[0]]), f["num_logical"])
        assert f["naive_blocks"] == want, (f["req_id"], f["naive_blocks"], want)


@pytest.mark.parametrize("path", ["v1-sync", "mrv2-async"])
def test_every_granularity_equals_the_per_set_oracle(gqa, oracle, path):
    reqs = _requests()
    out = run_in_subprocess(dict(engine=_engine(gqa), vtoken=BASE, requests=reqs), env=path_env(path))
    assert out["paths"] == EXPECTED[path]
    _check(out, reqs, oracle)


def test_sets_are_not_vacuous(oracle):
    """The oracle's per-set caches differ from one shared set for the scoring policies, and the
    sets of one request differ from each other, so the engine test above could fail."""
    for r in _requests(grans=["head"], policies=["h2o", "tova", "scissorhands"]):
        res = oracle(r)
        sets = [tuple(sorted(p.tolist())) for p in res.live_positions_sets]
        assert len(sets) == 4 and len(set(sets)) > 1, r["id"]


def test_tp2_each_rank_decides_for_its_own_heads(gqa, oracle):
    """TP=2 on 2 KV heads: each rank owns one. ``head`` and ``head_shared`` decide per rank with no
    communication; ``layer`` from the all-reduced per-layer statistics. Tokens equal the oracle."""
    reqs = _requests(policies=["h2o", "tova", "scissorhands"])
    out = run_in_subprocess(dict(engine=_engine(gqa, tensor_parallel_size=2), vtoken=BASE, requests=reqs),
                            env=dict(path_env("v1-sync"), **TP_ENV))
    _check(out, reqs, oracle)


def test_preemption_keeps_every_token_set(gqa):
    """A preempted request keeps every token set: the worker saves its live K/V (every layer and
    KV head) and every set's side-cache state, and restores them at the resume, so per-head sets
    that keep different tokens resume exactly (``docs/granularity.md``, "Preemption"). 6 requests
    that grow to 4 blocks each (budget 100) share 12 blocks: vLLM preempts; each resume schedules
    one token (nothing recomputed) and every request's tokens equal the oracle's without any
    preemption, under head, head_shared and layer sets."""
    hooks = f"{Path(__file__).resolve().parent / '_preempt_hooks.py'}:PreemptProbe"
    reqs = [dict(id=f"pre-{g}-{i}", prompt_token_ids=_prompt(40 + i, 40), max_tokens=90,
                 extra_args={"vtoken_policy": pol, "vtoken_budget": 100, "vtoken_granularity": g})
            for i, (pol, g) in enumerate([("h2o", "head"), ("tova", "layer"), ("scissorhands", "head"),
                                          ("h2o", "head_shared"), ("h2o", "layer"), ("tova", "head")])]
    out = run_in_subprocess(dict(engine=_engine(gqa, num_gpu_blocks_override=13, max_model_len=256), vtoken=BASE, requests=reqs,
                                 hooks=hooks), env=path_env("v1-sync"))
    assert sum(len(v) for v in out["preempted_steps"].values()) >= 2, out["preempted_steps"]
    assert out["free_blocks_end"] == out["free_blocks_start"]
    assert out["vtoken"]["stats"]["evicted_tokens"] > 0 and out["vtoken"]["stats"]["request_faults"] == 0
    assert len(out["resumes"]) >= 2 and all(x["scheduled"] == 1 for x in out["resumes"]), out["resumes"]
    import torch

    from reference.oracle import load_oracle_model, oracle_generate

    torch.set_num_threads(2)
    model = load_oracle_model(gqa)
    for r in reqs:
        cfg = parse_request_overrides(r["extra_args"]).apply(parse_config(BASE))
        assert out["tokens"][r["id"]] == list(oracle_generate(model, r["prompt_token_ids"], 90, cfg).token_ids), r["id"]
