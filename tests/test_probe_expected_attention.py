"""``benchmarks/probe_expected_attention.py``: its scorers and keep mask on small tensors, and its
committed result (no model load; about a second)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import probe_expected_attention as pea  # noqa: E402

from vtoken.policies.expected_attention import rope_pairs  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "ea_probe.json"


def _random_case(seed: int = 0, n: int = 48, hq: int = 6, hkv: int = 2, d: int = 16):
    """Pre-RoPE queries with a shared direction (so that the covariance has cross-pair terms),
    post-RoPE keys, values, a RoPE table and the pairs."""
    gen = torch.Generator().manual_seed(seed)
    a, b = rope_pairs(d, True)
    cos_sin = pea.rope_table(d, 10000.0, n + pea.N_FUTURE)
    base = torch.randn(n, hq, d, generator=gen)
    shared = torch.randn(n, hq, 1, generator=gen) * torch.randn(1, hq, d, generator=gen)
    q = base + 1.5 * shared + 0.5
    keys = pea.apply_rope(torch.randn(n, hkv, d, generator=gen), cos_sin, a, b).permute(1, 0, 2).contiguous()
    vals = torch.randn(hkv, n, d, generator=gen)
    return q, keys, vals, cos_sin, a, b


def test_pair_block_scorer_with_sinks_in_softmax_equals_vtoken():
    q, keys, vals, cos_sin, a, b = _random_case()
    n = keys.shape[1]
    ref = pea.vtoken_scores(q, keys, vals, cos_sin, a, b)
    mine = pea.expected_attention_scores(q, keys, vals, torch.arange(pea.SINK, n), cos_sin, n, a, b,
                                         blocks="pair", sinks_in_softmax=True)
    assert mine.shape == ref.shape == (2, n)
    assert torch.isinf(mine[:, :pea.SINK]).all() and torch.isinf(ref[:, :pea.SINK]).all()
    assert pea.rel_diff(mine, ref) < 1e-5
    # the comparison can tell the variants apart: the full covariance and the sinks outside the
    # softmax each move the scores by far more than the tolerance
    full = pea.expected_attention_scores(q, keys, vals, torch.arange(pea.SINK, n), cos_sin, n, a, b,
                                         blocks="full", sinks_in_softmax=True)
    out = pea.expected_attention_scores(q, keys, vals, torch.arange(pea.SINK, n), cos_sin, n, a, b,
                                        blocks="pair", sinks_in_softmax=False)
    assert pea.rel_diff(full, ref) > 1e-3 and pea.rel_diff(out, ref) > 1e-3


def test_full_scorer_matches_a_direct_gaussian_formula():
    """One query head per KV head, no sinks: the logit is the log-MGF of the rotated Gaussian."""
    q, keys, vals, cos_sin, a, b = _random_case(seed=1, hq=2, hkv=2)
    n, d = keys.shape[1], keys.shape[2]
    got = pea.expected_attention_scores(q, keys, vals, torch.arange(n), cos_sin, n, a, b, sink=0)
    for h in range(2):
        x = q[:, h].double()
        mu, cov = x.mean(0), torch.cov(x.T, correction=0)
        rot = torch.zeros(d, d, dtype=torch.float64)
        for p in range(n, n + pea.N_FUTURE):  # the mean of the rotation matrices, position by position
            c, s = cos_sin[p, :d // 2], cos_sin[p, d // 2:]
            r = torch.zeros(d, d, dtype=torch.float64)
            r[a, a], r[b, b], r[a, b], r[b, a] = c, c, -s, s
            rot += r / pea.N_FUTURE
        m2, s2 = rot @ mu, rot @ cov @ rot.T
        k = keys[h].double()
        logit = torch.stack([m2 @ kk / math.sqrt(d) + kk @ s2 @ kk / (2 * d) for kk in k])
        want = torch.softmax(logit, 0) * vals[h].double().norm(dim=-1)
        torch.testing.assert_close(got[h], want, rtol=1e-9, atol=0)


def test_keep_mask_keeps_sinks_top_scores_and_the_later_of_ties():
    nan = float("nan")
    s = torch.tensor([[0.0, 0.0, 5, 1, 3, 3, 3, 2, 9, 3],
                      [nan, 1, nan, 4, 4, 0, -1, 2, 2, 7]])
    kept = lambda m: [torch.nonzero(r).flatten().tolist() for r in m]  # noqa: E731
    # 5 of 10 per row, the 2 sinks among them whatever their scores; the four 3s tie for the last
    # place in row 0: the latest (position 9) is kept; a NaN counts as -inf
    assert kept(pea.keep_mask(s, 0.5, sink=2)) == [[0, 1, 2, 8, 9], [0, 1, 3, 4, 9]]
    # 6 of 10: two of the four tied 3s (the later ones, 6 and 9); the later of row 1's tied 2s
    assert kept(pea.keep_mask(s, 0.6, sink=2)) == [[0, 1, 2, 6, 8, 9], [0, 1, 3, 4, 8, 9]]
    assert kept(pea.keep_mask(s, 0.1, sink=2)) == [[0, 1], [0, 1]]  # never fewer than the sinks
    assert pea.keep_mask(s, 1.0, sink=2).all()
    batched = pea.keep_mask(s.expand(3, 2, 10), 0.5, sink=2)  # [layers, KV heads, L]: row by row
    assert batched.shape == (3, 2, 10) and (batched == pea.keep_mask(s, 0.5, sink=2)).all()
    assert not torch.isnan(s[0]).any() and torch.isnan(s[1, 0])  # the input is left alone


@pytest.mark.skipif(not RESULT.exists(), reason="benchmarks/results/ea_probe.json not written yet")
def test_committed_result():
    d = json.loads(RESULT.read_text())
    assert d["command"].startswith("python benchmarks/probe_expected_attention.py")
    r, n = d["results"], d["settings"]["prompts"]
    assert r["vtoken_vs_reimpl_max_rel_diff"] < 1e-4
    assert r["full_cache"]["correct"] == r["full_cache"]["n"] == n
    m = r["methods"]
    assert set(m) == set(pea.METHODS)
    for method in ("kvpress_full", "vtoken"):
        for f in ("0.125", "0.25", "0.5"):
            assert m[method][f]["n"] == n and m[method][f]["correct"] == 0, (method, f)
    assert m["snapkv_window32"]["0.5"]["correct"] == m["snapkv_window32"]["0.5"]["n"] == n
    for method in m.values():
        for cell in method.values():
            assert cell["correct"] == sum(p["correct"] for p in cell["per_prompt"]) and len(cell["per_prompt"]) == n
    assert all(cell["question_kept"] == 1.0 for cell in m["question_kept"].values())
    assert all(cell["needle_kept"] == 1.0 for cell in m["vtoken_plus_needle"].values())


@pytest.mark.skipif(not RESULT.exists(), reason="benchmarks/results/ea_probe.json not written yet")
def test_benchmarks_readme_quotes_the_result():
    """benchmarks/README.md's paragraph on Expected Attention states the file's figures."""
    d = json.loads(RESULT.read_text())
    r, n = d["results"], d["settings"]["prompts"]
    m = r["methods"]
    fr = d["settings"]["fractions"]
    lens = [p["tokens"] for p in d["prompts"]]
    flat = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())
    assert (f"(`{d['command']}` -> `results/ea_probe.json`; Hugging Face fp32, {n} needle prompts of about "
            f"{round(sum(lens) / len(lens), -1):,.0f} tokens,") in flat
    zero = all(m[k][str(f)]["correct"] == 0 for k in ("kvpress_full", "vtoken", "question_kept") for f in fr)
    assert zero and f"answers 0 of {n} at {min(fr) * 100:g} to {max(fr) * 100:g} %" in flat
    assert f"(within {r['vtoken_vs_reimpl_max_rel_diff']:.0e} of it)" in flat
    assert m["snapkv_window32"]["0.5"]["correct"] == n and f"window answers {n} of {n} at 50 %" in flat
    assert all(c["correct"] == n for c in m["vtoken_plus_needle"].values())
    assert f"plus the needle's {d['prompts'][0]['needle_tokens']} tokens {n} of {n} at every budget" in flat
