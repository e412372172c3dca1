"""``benchmarks/bench_tasks.py`` (RULER accuracy under eviction): its scorer, the parsing of
lm-eval's logged samples and results, the arm list and budgets, the KV-kept arithmetic from
``/metrics`` deltas, the plot, and the committed smoke result's schema. Pure functions on hand-made
inputs: no server, no network, no lm-eval (the one check against lm-eval's own task files is
skipped without it)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_tasks as bt  # noqa: E402
from drivers.launcher import parse_metrics  # noqa: E402


# ----------------------------------------------------------------------------- scorer
@pytest.mark.parametrize("pred, refs, want", [
    (" 9002896.", ["9002896"], 1.0),
    ("The special magic number is 9002897.", ["9002896"], 0.0),
    ("QFHHI, wmqwh and STQFP", ["QFHHI", "WMQWH", "STQFP", "SKYRX"], 0.75),  # case-insensitive
    ("deficit\x01fire", ["deficit", "fire", "folk", "mall"], 0.5),
    ("", ["a"], 0.0),
])
def test_score_sample_known_answers(pred, refs, want):
    assert bt.score_sample(pred, refs) == want


def test_score_sample_control_characters_become_newlines():
    # a reference spanning a control character is not found once it is a newline
    assert bt.score_sample("ab\x02cd", ["ab\ncd"]) == 1.0
    assert bt.score_sample("ab\x02cd", ["abcd"]) == 0.0
    with pytest.raises(ValueError):
        bt.score_sample("x", [])


def _fake_sample(doc_id: int, answer: str, outputs: list[str]) -> str:
    """One line of lm-eval's --log_samples file, the shape lm-eval 0.4.13 writes for a RULER task."""
    return json.dumps({"doc_id": doc_id, "doc": {"index": doc_id, "input": "...", "outputs": outputs,
                                                 "max_length": 1024},
                       "target": outputs, "arguments": {}, "resps": [[answer]], "filtered_resps": [answer],
                       "filter": "none", "metrics": ["4096", "1024"], "4096": -1.0, "1024": 1.0})


def test_samples_and_accuracy_from_a_fake_lm_eval_file():
    lines = [_fake_sample(0, " 8284194.", ["8284194"]),
             _fake_sample(1, " 1111111.", ["8284195"]),
             "",
             _fake_sample(2, "QFHHI, WMQWH", ["QFHHI", "WMQWH", "STQFP", "SKYRX"])]
    samples = bt.samples_from_jsonl(lines)
    assert samples == [(" 8284194.", ["8284194"]), (" 1111111.", ["8284195"]),
                       ("QFHHI, WMQWH", ["QFHHI", "WMQWH", "STQFP", "SKYRX"])]
    assert bt.accuracy(samples) == dict(accuracy=0.5, n=3, correct=1)
    assert math.isnan(bt.accuracy([])["accuracy"])


def test_lm_eval_reported_figure():
    res = {"results": {"niah_single_1": {"4096,none": -1, "1024,none": 0.85, "1024_stderr,none": 0.08}}}
    assert bt.lm_eval_reported(res, "niah_single_1", 1024) == 0.85
    assert bt.lm_eval_reported(res, "niah_single_1", 4096) is None  # lm-eval's -1: no sample at that length
    assert bt.lm_eval_reported(res, "ruler_vt", 1024) is None


# ----------------------------------------------------------------------------- arms and budgets
def test_arm_list_is_stock_then_every_policy_at_every_ratio():
    arms = bt.arm_list(["h2o", "tova"], bt.RATIOS)
    assert [a["name"] for a in arms] == ["stock", "h2o-12.5pct", "h2o-25pct", "h2o-50pct",
                                         "tova-12.5pct", "tova-25pct", "tova-50pct"]
    assert arms[0] == dict(name="stock", policy=None, budget_ratio=None, vtoken=None)
    assert arms[1]["vtoken"] == {"policy": "h2o", "budget_ratio": 0.125, "prefill_eviction": "after"}
    assert bt.arm_list(["h2o"], [0.25], granularity="layer", prefill_eviction=None)[1]["vtoken"] == \
        {"policy": "h2o", "budget_ratio": 0.25, "granularity": "layer"}


def test_every_arm_config_is_accepted_by_vtoken_and_budgets_match_its_arithmetic():
    from vtoken.config import effective_budget, parse_config

    for arm in bt.arm_list(bt.POLICIES, bt.RATIOS)[1:]:
        cfg = parse_config(arm["vtoken"])
        for prompt in (868, 1024, 1893, 30):
            if effective_budget(cfg, prompt) == bt.budget_tokens(arm["budget_ratio"], prompt):
                continue
            # only where the policy's sinks + recent tokens raise a tiny budget
            assert prompt == 30, (arm, prompt)


@pytest.mark.parametrize("ratio, prompt, want", [(0.125, 868, 109), (0.25, 868, 217), (0.5, 868, 434),
                                                 (0.25, 1024, 256), (0.125, 1, 1), (0.5, 1893, 947)])
def test_budget_tokens(ratio, prompt, want):
    assert bt.budget_tokens(ratio, prompt) == want


# ----------------------------------------------------------------------------- KV kept from /metrics
_BEFORE = """\
# HELP vllm:request_prompt_tokens Number of prefill tokens processed.
vllm:request_prompt_tokens_sum{engine="0",model_name="smollm2"} 100.0
vllm:request_prompt_tokens_count{engine="0",model_name="smollm2"} 1.0
vllm:request_generation_tokens_sum{engine="0",model_name="smollm2"} 5.0
vtoken:evicted_tokens_total{engine="0",model_name="smollm2"} 60.0
vtoken:request_peak_blocks_sum{engine="0",model_name="smollm2"} 4.0
vtoken:request_peak_blocks_count{engine="0",model_name="smollm2"} 1.0
"""
_AFTER = """\
vllm:request_prompt_tokens_sum{engine="0",model_name="smollm2"} 8780.0
vllm:request_prompt_tokens_count{engine="0",model_name="smollm2"} 11.0
vllm:request_generation_tokens_sum{engine="0",model_name="smollm2"} 105.0
vtoken:evicted_tokens_total{engine="0",model_name="smollm2"} 6570.0
vtoken:request_peak_blocks_sum{engine="0",model_name="smollm2"} 294.0
vtoken:request_peak_blocks_count{engine="0",model_name="smollm2"} 11.0
"""


def test_kv_kept_from_metric_deltas():
    d = bt.metric_delta(parse_metrics(_BEFORE), parse_metrics(_AFTER), bt.KV_METRICS)
    assert d == {"vllm:request_prompt_tokens_sum": 8680.0, "vllm:request_prompt_tokens_count": 10.0,
                 "vllm:request_generation_tokens_sum": 100.0, "vtoken:evicted_tokens_total": 6510.0,
                 "vtoken:request_peak_blocks_sum": 290.0, "vtoken:request_peak_blocks_count": 10.0}
    kv = bt.kv_kept(d, block_size=32)
    # (8680 + 100 - 6510) / 10 = 227 tokens held at the end; 227 / 32 blocks; 290 / 10 peak blocks
    assert kv == dict(requests=10, mean_prompt_tokens=868.0, mean_kept_tokens=227.0, mean_kept_blocks=7.09375,
                      mean_peak_blocks=29.0)


def test_kv_kept_stock_has_no_vtoken_metrics_and_fractions_are_against_stock():
    text = _AFTER.split("vtoken:")[0]  # stock's /metrics: vLLM's metrics only
    stock = bt.kv_kept(bt.metric_delta({}, parse_metrics(text), bt.KV_METRICS), 32)
    assert stock["mean_kept_tokens"] == (8780 + 105) / 11 and stock["mean_peak_blocks"] is None
    assert bt.kv_kept(dict.fromkeys(bt.KV_METRICS, 0.0), 32)["mean_kept_tokens"] is None
    cells = [dict(arm="stock", task="niah_single_1", length=1024, kv=dict(mean_kept_tokens=880.0)),
             dict(arm="h2o-25pct", task="niah_single_1", length=1024, kv=dict(mean_kept_tokens=220.0)),
             dict(arm="h2o-25pct", task="ruler_vt", length=1024, kv=dict(mean_kept_tokens=220.0))]
    bt.add_kv_fractions(cells)
    assert [c["kv_kept_fraction"] for c in cells] == [1.0, 0.25, None]


def test_vtoken_log_line():
    log = ("INFO 12-06 03:40:01 [plugin.py:113] vToken on: mode=vtoken policy=h2o budget=256 (ratio 0.25) "
           "slack=0 sinks/recent=(0, 0) block_size=32 model_runner=v1 scheduling=sync "
           "granularity=head (the policy's default) prefill_eviction=after\n")
    assert bt.vtoken_line(log) == dict(policy="h2o", slack="0", block_size="32",
                                       granularity="head (the policy's default)", prefill_eviction="after",
                                       mode="vtoken")
    assert bt.vtoken_line("no such line") == {}


def test_lm_eval_command():
    argv = bt.lm_eval_argv("py", "ruler_vt", 2048, 8000, "/m", 20, "/o", 2560, 4)
    assert argv[:5] == ["py", "-m", "lm_eval", "run", "--model"] and argv[5] == "local-completions"
    args = dict(kv.split("=", 1) for kv in argv[argv.index("--model_args") + 1].split(","))
    assert args["base_url"] == "http://127.0.0.1:8000/v1/completions" and args["tokenizer"] == "/m"
    assert args["tokenized_requests"] == "True" and args["max_length"] == "2560"
    assert json.loads(argv[argv.index("--metadata") + 1]) == {"max_seq_lengths": [2048]}
    assert "--apply_chat_template" in argv and argv[argv.index("--limit") + 1] == "20"


def test_plot_writes_a_png(tmp_path):
    cells = [dict(arm="stock", policy=None, task="niah_single_1", length=1024, accuracy=1.0, n=4,
                  kv_kept_fraction=1.0),
             dict(arm="h2o-25pct", policy="h2o", task="niah_single_1", length=1024, accuracy=0.5, n=4,
                  kv_kept_fraction=0.26)]
    bt.plot(dict(cells=cells, settings=dict(prefill_eviction="after")), tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


# ----------------------------------------------------------------------------- the committed smoke
def test_committed_smoke_result_schema():
    p = ROOT / "benchmarks" / "results" / "tasks_smoke.json"
    if not p.exists():
        pytest.skip("benchmarks/results/tasks_smoke.json not committed")
    d = json.loads(p.read_text())
    assert d["small"] is True and d["settings"]["prefix_caching"] is False
    assert "--no-enable-prefix-caching" in d["server"]["args"]
    keys = {"arm", "policy", "budget_ratio", "budget_tokens", "granularity", "prefill_eviction", "task", "length",
            "accuracy", "n", "kv", "kv_kept_fraction", "wall_s", "load_before", "command"}
    for c in d["cells"]:
        assert keys <= set(c), keys - set(c)
        assert 0.0 <= c["accuracy"] <= 1.0 and 0 <= c["correct"] <= c["n"] and c["n"] > 0
    stock = [c for c in d["cells"] if c["arm"] == "stock"]
    assert stock and all(c["accuracy"] >= 0.9 for c in stock), "stock must find the needle before anything else counts"


# ----------------------------------------------------------------------------- lm-eval itself (optional)
def test_tasks_exist_in_lm_eval():
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval not installed (pip install -e '.[tasks]')")
    ruler = Path(lm_eval.__file__).parent / "tasks" / "ruler"
    names = set()
    for y in ruler.glob("*.yaml"):
        for line in y.read_text().splitlines():
            if line.startswith("task:"):
                names.add(line.split(":", 1)[1].strip())
    assert set(bt.TASKS) <= names, set(bt.TASKS) - names
    assert set(bt.LEFT_OUT) <= names, set(bt.LEFT_OUT) - names


def test_benchmarks_readme_smoke_figures_equal_the_result():
    p = ROOT / "benchmarks" / "results" / "tasks_smoke.json"
    if not p.exists():
        pytest.skip("benchmarks/results/tasks_smoke.json not committed")
    d = json.loads(p.read_text())
    text = (ROOT / "benchmarks" / "README.md").read_text()
    sec = " ".join(text[text.index("**Smoke** (`python benchmarks/bench_tasks.py"):].split("\n\n")[0].split())
    assert f"`{d['command']}` -> `results/tasks_smoke.json`" in sec
    cells = {c["arm"]: c for c in d["cells"]}
    assert f"{cells['stock']['length'] // 1024}k tokens, {cells['stock']['n']} samples" in sec
    assert f"mean prompt {cells['stock']['kv']['mean_prompt_tokens']} tokens, {d['total_wall_s']:.0f} s" in sec
    assert f"stock {cells['stock']['correct']}/{cells['stock']['n']};" in sec
    h2o = cells["h2o-25pct"]
    assert (f"H2O at 25 % ({h2o['kv']['mean_kept_tokens']} tokens kept, {h2o['kv_kept_fraction']:.2f} of stock's) "
            f"{h2o['correct']}/{h2o['n']}") in sec
    snap = cells["snapkv-25pct"]
    assert f"SnapKV at 25 % {snap['correct']}/{snap['n']}" in sec


def test_benchmarks_readme_budget_slice_figures_equal_the_result():
    p = ROOT / "benchmarks" / "results" / "tasks_niah_single_1_1k.json"
    if not p.exists():
        pytest.skip("benchmarks/results/tasks_niah_single_1_1k.json not committed")
    d = json.loads(p.read_text())
    text = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())
    c = {x["arm"]: f"{x['correct']}/{x['n']}" for x in d["cells"]}
    loads = [x["load_before"][0] for x in d["cells"]]
    want = (f"(`{d['command']}` -> `results/tasks_niah_single_1_1k.json` and `.png`, {d['total_wall_s']:,.0f} s, "
            f"load {min(loads):.1f}-{max(loads):.1f}): stock {c['stock']}; at 12.5 % H2O {c['h2o-12.5pct']}, SnapKV {c['snapkv-12.5pct']}; "
            f"at 50 % H2O {c['h2o-50pct']}, SnapKV {c['snapkv-50pct']}.")
    assert want in text
