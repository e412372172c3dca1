"""``benchmarks/bench_sla.py``'s rate search: the binary search (``--search bisect``) finds the same
SLA rate as the full sweep on every monotone attainment curve, with the knee's two neighbouring
grid rates measured, in at most ``ceil(log2(n + 1))`` loads. Pure functions: no server."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_sla import bisect_rates, sla_rate  # noqa: E402

THR = 0.9


def _sweep_reference(grid: list[float], att: dict[float, float]) -> float | None:
    """The definition, written out: the highest rate that passes with every lower rate passing."""
    best = None
    for r in sorted(grid):
        if att[r] < THR:
            return best
        best = r
    return best


@given(st.lists(st.integers(1, 400), min_size=1, max_size=12, unique=True), st.data())
def test_bisect_finds_the_sweeps_sla_rate(xs, data):
    grid = sorted(x / 100 for x in xs)
    knee = data.draw(st.integers(0, len(grid)))          # the first missing grid index
    att = {r: (0.95 if i < knee else 0.5) for i, r in enumerate(grid)}
    calls: list[float] = []

    def passes(r):
        calls.append(r)
        return att[r] >= THR

    measured = bisect_rates(list(reversed(grid)), passes)   # the grid's order on the command line is free
    assert measured == calls
    assert len(measured) == len(set(measured)) <= math.ceil(math.log2(len(grid) + 1))
    expected = grid[knee - 1] if knee else None
    assert _sweep_reference(grid, att) == expected
    assert sla_rate(measured, [att[r] for r in measured], THR) == expected
    if knee > 0:
        assert grid[knee - 1] in measured                 # the highest passing rate
    if knee < len(grid):
        assert grid[knee] in measured                     # the lowest missing rate


def test_sla_rate_stops_at_the_first_miss_and_treats_no_completions_as_a_miss():
    assert sla_rate([0.5, 1.0, 2.0, 3.0], [0.95, 0.8, 0.95, 0.95], THR) == 0.5
    assert sla_rate([3.0, 0.5, 1.0], [0.0, 0.91, 0.9], THR) == 1.0
    assert sla_rate([0.5, 1.0], [None, 1.0], THR) is None
    assert sla_rate([], [], THR) is None


def test_bisect_on_the_issue_26_grid_measures_three_rates():
    grid = [0.25, 0.375, 0.5, 0.75, 1, 1.25, 1.5]
    assert bisect_rates(grid, lambda r: r <= 0.5) == [0.75, 0.375, 0.5]
    assert bisect_rates(grid, lambda r: False) == [0.75, 0.375, 0.25]
    assert bisect_rates(grid, lambda r: True) == [0.75, 1.25, 1.5]


def test_long_prompts_are_the_quality_benchmarks_conversations_and_refuse_over_1024(tmp_path, monkeypatch):
    """``--prompt-len``: a ShareGPT-format file whose prompts are the first ``prompt_len`` tokens of
    the conversations ``bench_quality.py`` scores (``load_long_conversations(n, prompt_len + 32,
    seed=1)``), each re-tokenizing to at most ``prompt_len`` tokens; over 1,024 (vLLM's ShareGPT
    loader's limit) it is refused by name. ``bench_argv`` loads it as vLLM's ``sharegpt`` dataset."""
    import json

    import pytest

    import bench_sla
    import common

    with pytest.raises(SystemExit, match="--prompt-len 1025"):
        bench_sla.long_prompts(40, 1025)

    class Tok:  # one token per character: decode(ids) re-tokenizes to len(ids) tokens
        def __call__(self, text):
            return {"input_ids": list(text)}

        def decode(self, ids):
            return "".join(chr(97 + i % 26) for i in ids)

    calls = []

    def convs(n, min_tokens, seed):
        calls.append((n, min_tokens, seed))
        return [dict(id=f"c{i}", ids=list(range(i, i + min_tokens))) for i in range(n)]

    import transformers
    import vtoken.assets.paths as paths

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(lambda *_a, **_k: Tok()))
    monkeypatch.setattr(common, "load_long_conversations", convs)
    monkeypatch.setattr(paths, "ensure_sharegpt_long", lambda: tmp_path / "long.jsonl")
    out = bench_sla.long_prompts(3, 10)
    assert calls == [(3, 42, 1)]
    rows = json.loads(out.read_text())
    assert [r["id"] for r in rows] == ["c0", "c1", "c2"]
    assert [r["conversations"][0]["value"] for r in rows] == ["abcdefghij", "bcdefghijk", "cdefghijkl"]
    argv = bench_sla.bench_argv(port=1, model_dir=tmp_path, dataset=out, num_prompts=3, rate=0.5, out_len=128,
                                result_dir=tmp_path, filename="x.json", goodput=None)
    i = argv.index("--dataset-name")
    assert argv[i:i + 6] == ["--dataset-name", "sharegpt", "--dataset-path", str(out), "--sharegpt-output-len", "128"]


def test_policy_specs_set_score_every_and_slack_and_refuse_the_rest():
    """``--policies NAME[:seK][:slK][@worker]``: each option once, in the arm's vToken config and
    name; the Naive-Evict arm gets the same config; anything else is refused by name."""
    import pytest

    from bench_sla import build_arms

    arms = build_arms(["snapkv:sl128:se1000@worker", "h2o:se4"], 512, ["fixed", "pressure"], [None])
    assert [(n, vt) for n, vt, _ in arms] == [
        ("stock", None),
        ("naive-snapkv-sl128-se1000-worker", {"mode": "naive", "policy": "snapkv", "budget": 512,
                                              "slack": 128, "score_every": 1000}),
        ("vtoken-snapkv-sl128-se1000-worker", {"policy": "snapkv", "budget": 512, "pacing": "fixed",
                                               "slack": 128, "score_every": 1000}),
        ("vtoken-snapkv-sl128-se1000-worker-pressure", {"policy": "snapkv", "budget": 512, "pacing": "pressure",
                                                        "slack": 128, "score_every": 1000}),
        ("naive-h2o-se4", {"mode": "naive", "policy": "h2o", "budget": 512, "score_every": 4}),
        ("vtoken-h2o-se4", {"policy": "h2o", "budget": 512, "pacing": "fixed", "score_every": 4}),
        ("vtoken-h2o-se4-pressure", {"policy": "h2o", "budget": 512, "pacing": "pressure", "score_every": 4})]
    for bad in ("h2o:sx4", "h2o:se", "h2o:se4:se8", "h2o@gpu", "h2o:sl-1"):
        with pytest.raises(SystemExit, match="allowed: NAME"):
            build_arms([bad], 64, ["fixed"], [None])


def _summary(arms: dict[str, list[tuple[float, float, int]]], tpot_ms: float = 30.0, rates=(0.125, 0.25)) -> dict:
    """A bench_sla result with one run per rate per arm: each run's requests ``(ttft, tpot, prompt)``."""
    slo = dict(ttft_a_ms=100.0, ttft_b_ms_per_token=0.0, k_ttft=5.0, tpot_ms=tpot_ms, k_tpot=2.0,
               unloaded_p50_tpot_ms=tpot_ms / 2)
    out = dict(date="d", command="python benchmarks/bench_sla.py x", load_average_at_start=[1, 1, 1],
               total_wall_s=1.0, slo=slo, machine=dict(cpu_count=2), arms={},
               config=dict(rates=list(rates), attainment_threshold=THR, pool_blocks=65, block_size=32, budget=512,
                           output_len=128))
    for arm, reqs in arms.items():
        runs = [dict(rate=r, attainment=sum(t <= 500 and p <= tpot_ms for t, p, _ in reqs) / len(reqs),
                     request_goodput=r, request_throughput=r, preemptions=i, per_request_ttft_tpot_ms_prompt=reqs)
                for i, r in enumerate(rates)]
        out["arms"][arm] = dict(runs=runs, sla_rate=sla_rate(list(rates), [x["attainment"] for x in runs], THR),
                                server_cmd="s")
    return out


def test_replace_arms_puts_the_rerun_in_place_keeps_the_old_arm_and_refuses_other_slos(tmp_path):
    import json

    import pytest
    from bench_sla import replace_arms

    good, bad = [(10.0, 10.0, 5)] * 10, [(10.0, 99.0, 5)] * 10
    base = _summary({"stock": good, "naive-tova-worker": bad, "vtoken-tova-worker": good})
    (tmp_path / "b.json").write_text(json.dumps(base))
    (tmp_path / "r.json").write_text(json.dumps(_summary({"naive-tova-worker": good})))
    assert replace_arms([str(tmp_path / "b.json"), str(tmp_path / "r.json")]) == 0
    out = json.loads((tmp_path / "b.json").read_text())
    assert list(out["arms"]) == ["stock", "naive-tova-worker", "vtoken-tova-worker"]
    assert out["arms"]["naive-tova-worker"]["sla_rate"] == 0.25
    assert out["arms"]["naive-tova-worker"]["rerun"]["file"] == str(tmp_path / "r.json")
    assert out["superseded_arms"]["naive-tova-worker"]["sla_rate"] is None
    assert out["headline"]["ratios"]["vtoken-tova-worker"]["vtoken_over_naive"] == 1.0
    assert out["headline"]["per_arm"]["naive-tova-worker"]["preemptions"] == 1
    assert (tmp_path / "b.png").exists()
    (tmp_path / "o.json").write_text(json.dumps(_summary({"naive-tova-worker": good}, tpot_ms=31.0)))
    with pytest.raises(SystemExit, match="other SLOs or rates"):
        replace_arms([str(tmp_path / "b.json"), str(tmp_path / "o.json")])
    (tmp_path / "m.json").write_text(json.dumps(_summary({"naive-h2o-worker": good})))
    with pytest.raises(SystemExit, match=r"arms \['naive-h2o-worker'\]"):
        replace_arms([str(tmp_path / "b.json"), str(tmp_path / "m.json")])
