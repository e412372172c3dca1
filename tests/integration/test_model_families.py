"""Every model family vLLM 0.32's CPU build serves (issue 43): exact eviction on each, or a
start-up refusal that names what is missing.

Per family (a tiny random model, ``vtoken/assets/families.py``) one engine per execution path
runs four requests in one batch: H2O and K-norm, each under ``head`` and ``request`` token sets
(per-request ``vtoken_policy`` / ``vtoken_granularity``), 160-token prompts, budget 48, 24
greedy tokens; two more with Expected Attention where the family has a plain or Llama 3 RoPE in a
vLLM rotary layer (elsewhere Expected Attention must be refused at start-up, by name). Each request's tokens must equal the dense oracle's (``reference.oracle``, which runs
the family's own transformers attention with the same eviction decisions). The matrix and its
helpers are ``tests/drivers/model_families.py``; every observed row must equal the committed
``benchmarks/results/model_families.json`` (what the docs' "Models" tables show).

Families vToken refuses (``drivers.model_families.REFUSED``: Gemma 2's attention soft-capping,
a Mistral with a sliding window) must stop at start-up with the refusal naming the feature and
the config field; a refusal happens before any weights load and does not depend on the path, so
they run on V1 sync only.

Paths: V1 sync and Model Runner V2 with async scheduling for every family, in the default suite
(:data:`FAST_ASYNC`; about 20-40 s per row on 2 cores), so a fresh clone's CI tests every row.
"""

from __future__ import annotations

import json
import os

import pytest

from drivers import model_families as mf
from vtoken.assets.families import FAMILIES

from execution_paths import EXPECTED

pytestmark = pytest.mark.engine

#: families whose MRV2-async arm runs in the default suite (the rest need VTOKEN_SLOW=1): all of them
FAST_ASYNC = tuple(FAMILIES)
SLOW = os.environ.get("VTOKEN_SLOW") == "1"


def _cases():
    for fam in FAMILIES:
        yield pytest.param(fam, "v1-sync", id=f"{fam}-v1-sync")
    for fam in FAMILIES:
        if "mrv2-async" not in mf.paths_of(fam):
            continue
        marks = [] if fam in FAST_ASYNC else [pytest.mark.slow, pytest.mark.skipif(
            not SLOW, reason="MRV2-async arm of this family: set VTOKEN_SLOW=1 (see FAST_ASYNC)")]
        yield pytest.param(fam, "mrv2-async", id=f"{fam}-mrv2-async", marks=marks)


_committed = json.loads(mf.RESULTS.read_text())


@pytest.mark.parametrize("family, path", list(_cases()))
def test_family_exact_or_refused(family, path):
    out = mf.run_engine(family, path)
    if family in mf.REFUSED:
        assert "refused" in out, f"{family}: expected a start-up refusal naming {mf.REFUSED[family]!r}"
        assert mf.REFUSED[family] in out["refused"], out["refused"]
        assert out["refused"].startswith(f"--model = 'tiny-{family}': vToken does not support it yet (")
    else:
        assert "refused" not in out, out.get("refused")
        assert out["paths"] == EXPECTED[path]
        stats = out["vtoken"]["stats"]
        assert stats["evicted_tokens"] > 0 and stats["freed_blocks"] > 0 and stats["request_faults"] == 0
        assert out["free_blocks_end"] == out["free_blocks_start"]
    ref = None if "refused" in out else mf.oracle_tokens(family)
    got = mf.row(family, path, out, ref)
    if got["status"] != "refused":
        assert got["status"] == "exact", f"{family} on {path}: first differing token per request {got['first_diff']}"
    if ref is not None and path == "v1-sync":  # eviction matters: the full cache's tokens differ
        changes = mf.eviction_changes(family, ref)
        assert changes == _committed["families"][family]["eviction_changes_tokens"]
        assert sum(changes.values()) >= 2, (family, changes)
    want = _committed["families"][family]["paths"][path]
    drop = ("engine_s",)
    assert {k: v for k, v in got.items() if k not in drop} == {k: v for k, v in want.items() if k not in drop}, (
        f"{family} on {path}: the committed row differs; rerun `PYTHONPATH=tests python -m drivers.model_families {family}`")


@pytest.mark.parametrize("family", list(mf.EA_REFUSED))
def test_expected_attention_refused_by_name(family):
    """Families without a full, plain or Llama 3 RoPE in a vLLM rotary layer (no RoPE, partial
    rotary, or vLLM's Transformers modeling backend) refuse Expected Attention at start-up, before
    any weights load (a request's vtoken_policy gets the same reason as a 400, tests/integration/
    test_expected_attention_refusals.py)."""
    out = mf.run_engine(family, "v1-sync", {"policy": "expected_attention", "budget": mf.BASE_VTOKEN["budget"]})
    assert "refused" in out, f"{family}: expected_attention was not refused"
    assert out["refused"].startswith("vtoken.policy = 'expected_attention': vToken does not support it yet (")
    assert mf.EA_REFUSED[family] in out["refused"], out["refused"]
    assert out["refused"] == _committed["families"][family]["expected_attention_refusal"]


def test_committed_matrix_covers_every_family():
    fams = _committed["families"]
    assert list(fams) == list(FAMILIES)
    for name, entry in fams.items():
        assert list(entry["paths"]) == mf.paths_of(name), name
        for path, r in entry["paths"].items():
            assert r["status"] == ("refused" if name in mf.REFUSED else "exact"), (name, path, r)
            if name not in mf.REFUSED:
                assert list(r["first_diff"]) == [f"{p}-{g}" for p, g in mf.arms_of(name)], (name, path)
        assert ("expected_attention_refusal" in entry) == (name in mf.EA_REFUSED), name
        assert entry == dict(entry, **mf.family_info(name)), name
