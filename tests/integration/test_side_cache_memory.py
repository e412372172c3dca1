"""vToken counts the side cache against the KV cache's memory.

The side cache shadows every KV slot, so with ``--kv-cache-memory-bytes X`` the K/V and the side
cache share ``X``: the tiny model (2 layers, 1 KV head of 64 dims, float32) has 1,024 K/V bytes
per token, and H2O's per-head side cache adds 16 bytes (a logical position and an accumulator,
int64 and float64) per (layer, KV head) set, 32 per token. ``X`` = 200 blocks of 32 tokens of K/V
then holds 193 blocks with their side cache; stock vLLM (no ``vtoken`` key) keeps 200.
"""

from __future__ import annotations

import pytest

from vtoken.assets.paths import ensure_tiny_model
from drivers.harness import run_in_subprocess

pytestmark = pytest.mark.engine

BLOCK = 32
KV_PER_TOKEN = 2 * 2 * 1 * 64 * 4  # layers x (K, V) x KV heads x head dim x float32
SIDE_PER_TOKEN = (8 + 8) * 2 * 1  # (position, accumulator) x (layers x KV heads) sets
X = 200 * BLOCK * KV_PER_TOKEN


@pytest.mark.parametrize("vtoken_on,blocks", [(True, X * KV_PER_TOKEN // (KV_PER_TOKEN + SIDE_PER_TOKEN)
                                                 // (BLOCK * KV_PER_TOKEN)), (False, 200)])
def test_side_cache_is_counted_against_the_kv_cache(vtoken_on, blocks):
    assert blocks == (193 if vtoken_on else 200)
    engine = dict(model=str(ensure_tiny_model()), dtype="float32", max_model_len=256, block_size=BLOCK,
                  enforce_eager=True, kv_cache_memory_bytes=X, skip_tokenizer_init=True)
    vt = {"policy": "h2o", "budget": 40, "granularity": "head"} if vtoken_on else None
    out = run_in_subprocess(dict(engine=engine, vtoken=vt, check=vtoken_on, requests=[
        dict(id="r", prompt_token_ids=list(range(1, 80)), max_tokens=8)]))
    assert out["num_blocks"] == blocks
    assert out["free_blocks_end"] == blocks - 1
