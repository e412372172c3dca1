"""Fixtures of the end-to-end tests: the tiny model, ShareGPT prompts, the oracle's model.

Servers are started per test module with :func:`e2e_server.run_server`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


# ---------------------------------------------------------------------- assets
@pytest.fixture(scope="session")
def tiny_model() -> str:
    from vtoken.assets.paths import ensure_tiny_model

    return str(ensure_tiny_model())


@pytest.fixture(scope="session")
def sharegpt_prompts() -> list[str]:
    """Six real ShareGPT first human turns (ASCII, >= 120 chars), truncated to 200 chars.

    The tiny model's tokenizer is byte-level, so each prompt is 120..200 tokens
    (plus the chat template for chat requests): above the test budget, so vToken evicts.
    """
    from vtoken.assets.paths import ensure_sharegpt

    data = json.loads(Path(ensure_sharegpt()).read_text())
    out: list[str] = []
    for conv in data:
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        text = " ".join(turns[0].get("value", "").split())
        if len(text) >= 120 and text.isascii():
            out.append(text[:200])
        if len(out) == 6:
            break
    assert len(out) == 6
    return out


@pytest.fixture(scope="session")
def oracle_model(tiny_model):
    """The tiny model in Hugging Face eager fp32: the dense oracle's reference."""
    from reference.oracle import load_oracle_model

    return load_oracle_model(tiny_model)
