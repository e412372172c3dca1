"""SmolLM2-135M (fp32) inside vLLM with vToken on: greedy tokens equal the dense oracle.

Real model, real ShareGPT prompts. Kept small for CI (one engine, 4 prompts, 48 tokens).
"""

from __future__ import annotations

import json

import pytest

from vtoken.assets.paths import ensure_sharegpt, ensure_smollm2
from vtoken.config import parse_config, parse_request_overrides
from drivers.harness import run_in_subprocess

pytestmark = [pytest.mark.engine, pytest.mark.smollm2]

NEW_TOKENS = 48
CASES = [("h2o", 96), ("tova", 80), ("scissorhands", 100), ("random", 90), ("streaming", 64)]


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ensure_smollm2()))
    data = json.loads(ensure_sharegpt().read_text())
    out = []
    for conv in data:
        turns = conv["conversations"]
        if len(turns) < 2 or turns[0]["from"] != "human":
            continue
        text = tok.apply_chat_template([{"role": "user", "content": turns[0]["value"]}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if 120 <= len(ids) <= 200:
            out.append(ids)
        if len(out) == len(CASES):
            break
    assert len(out) == len(CASES)
    return out


@pytest.fixture(scope="module")
def run(prompts):
    reqs = [dict(id=f"{pol}-{b}", prompt_token_ids=p, max_tokens=NEW_TOKENS,
                 extra_args={"vtoken_policy": pol, "vtoken_budget": b}) for (pol, b), p in zip(CASES, prompts)]
    spec = dict(engine=dict(model=str(ensure_smollm2()), dtype="float32", max_model_len=512, block_size=32,
                            enforce_eager=True, gpu_memory_utilization=0.3, num_gpu_blocks_override=128),
                vtoken={"policy": "h2o", "budget": 96}, requests=reqs)
    return reqs, run_in_subprocess(spec)


def test_smollm2_matches_dense_oracle(run):
    import torch

    from reference.oracle import load_oracle_model, oracle_generate

    reqs, out = run
    assert out["vtoken"]["stats"]["evicted_tokens"] > 0
    assert out["free_blocks_end"] == out["free_blocks_start"]
    torch.set_num_threads(2)
    model = load_oracle_model(str(ensure_smollm2()), dtype=torch.float32)
    base = parse_config({"policy": "h2o", "budget": 96})
    diffs = []
    for r in reqs:
        cfg = parse_request_overrides(r["extra_args"]).apply(base)
        ref = oracle_generate(model, r["prompt_token_ids"], NEW_TOKENS, cfg)
        got = out["tokens"][r["id"]]
        if got != list(ref.token_ids):
            first = next((i for i, (a, b) in enumerate(zip(got, ref.token_ids)) if a != b), None)
            diffs.append(f"{r['id']}: first difference at token {first}")
    assert not diffs, diffs
