"""Fixtures of the reliability tests (bad configs, bad requests, faults, isolation, soak).

Every engine or server runs in its own process (group), on 127.0.0.1, with small shapes
(tiny model, fp32, block size 32, a small KV pool); one at a time.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# tests/e2e's server helper (run_server, Server) is reused as is.
for p in (HERE, HERE.parent / "e2e", HERE.parent.parent / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


@pytest.fixture(scope="session")
def tiny_path() -> str:
    from vtoken.assets.paths import ensure_tiny_model

    return str(ensure_tiny_model())
