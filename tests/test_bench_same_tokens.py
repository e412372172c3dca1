"""``benchmarks/bench_same_tokens.py``: its needle prompts and its committed result (no engine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_same_tokens as bst  # noqa: E402


def test_needle_prompts_hide_one_value_at_each_stated_depth():
    docs = bst.needle_prompts(5, 520, seed=3)
    depths = [d["depth"] for d in docs]  # (the needle's line over the filler lines: 20 here)
    assert depths == [0.0, 5 / 19, 10 / 19, 14 / 19, 1.0]
    for d in docs:
        lines = d["text"].split("\n")
        body = lines[1:-1]  # between the instruction and the question
        at = [i for i, x in enumerate(body) if d["value"] in x]
        assert len(at) == 1 and body[at[0]] == f"One of the special magic numbers for {d['key']} is: {d['value']}."
        assert at[0] / (len(body) - 2) == d["depth"]  # (the needle line and the trailing filler newline aside)
        assert len(d["value"]) == 7 and lines[-1].endswith(f"number for {d['key']} mentioned in the provided text?")
    assert bst.needle_prompts(5, 520, seed=3) == docs and bst.needle_prompts(5, 520, seed=4) != docs


def test_committed_result_arms_and_counts():
    d = json.loads((ROOT / "benchmarks" / "results" / "same_tokens.json").read_text())
    assert d["command"].startswith("python benchmarks/bench_same_tokens.py")
    arms = {(a["dtype"], a["policy"]): a for a in d["arms"]}
    assert set(arms) == {(t, p) for t in ("bfloat16", "float32") for p in ("stock", d["settings"]["policy"])}
    for a in arms.values():
        assert a["same"] == sum(r["same"] for r in a["rows"]) and a["n"] == len(a["rows"]) == d["settings"]["prompts"]
        for r in a["rows"]:
            assert not r["same"] or r["alone"] == r["batch"]


def test_configuration_doc_quotes_the_result():
    d = json.loads((ROOT / "benchmarks" / "results" / "same_tokens.json").read_text())
    arms = {(a["dtype"], a["policy"]): a for a in d["arms"]}
    n, pol = d["settings"]["prompts"], d["settings"]["policy"]
    text = " ".join((ROOT / "docs" / "configuration.md").read_text().split())
    assert d["command"] == f"python benchmarks/bench_same_tokens.py --prompts {n}" and pol == "snapkv"
    assert d["settings"]["ratio"] == 0.25
    b = arms[("bfloat16", pol)]["same"]
    assert (f"(`python benchmarks/bench_same_tokens.py --prompts {n}` -> `same_tokens.json`: SnapKV at 25 %, {b} of {n} needle prompts "
            f"the same alone and batched; fp32 and stock {n} of {n})") in text
    assert all(arms[k]["same"] == n for k in arms if k != ("bfloat16", pol))
