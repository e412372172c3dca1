"""``benchmarks/bench_tasks.py`` (RULER accuracy under eviction): its scorer, the parsing of
lm-eval's logged samples and results, the arm list and budgets, the KV-kept arithmetic from
``/metrics`` deltas, the plot, and the committed smoke result's schema. Pure functions on hand-made
inputs: no server, no network, no lm-eval (the one check against lm-eval's own task files is
skipped without it)."""

from __future__ import annotations

import json
import math
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_tasks as bt  # noqa: E402
from drivers.launcher import parse_metrics  # noqa: E402
from drivers.makefile import recipe  # noqa: E402


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
    assert arms[0] == dict(name="stock", policy=None, budget_ratio=None, server="stock", fields={})
    assert arms[1]["fields"] == {"policy": "h2o", "budget_ratio": 0.125}
    # every vToken arm shares one server: its fields travel per request
    assert {a["server"] for a in arms[1:]} == {"vtoken-after"}
    assert bt.arm_list(["h2o"], [0.25], granularity="layer", prefill_eviction="chunks")[1] == dict(
        name="h2o-25pct", policy="h2o", budget_ratio=0.25, server="vtoken-chunks",
        fields={"policy": "h2o", "budget_ratio": 0.25, "granularity": "layer"})


def test_server_configs_one_stock_and_one_vtoken_server_per_engine_only_setting():
    arms = bt.arm_list(bt.POLICIES, bt.RATIOS)
    assert bt.server_configs(arms) == {"stock": None, "vtoken-after": {
        "vtoken": {"policy": "expected_attention", "prefill_eviction": "after"}}}  # (the first arm's policy)
    chunks = bt.arm_list(["snapkv"], [0.5], prefill_eviction="chunks")
    assert bt.server_configs(chunks, "chunks")["vtoken-chunks"] == {"vtoken": {"policy": "snapkv",
                                                                               "prefill_eviction": "chunks"}}


def test_request_xargs_turns_the_ratio_into_each_prompts_budget():
    assert bt.request_xargs(list(range(868)), policy="h2o", budget_ratio=0.125) == {"vtoken_policy": "h2o",
                                                                                  "vtoken_budget": 109}
    assert bt.request_xargs(list(range(1893)), policy="snapkv", budget_ratio=0.5,
                            granularity="layer") == {"vtoken_policy": "snapkv", "vtoken_budget": 947,
                                                     "vtoken_granularity": "layer"}
    assert bt.request_xargs("text", policy="tova", budget=64) == {"vtoken_policy": "tova", "vtoken_budget": 64}
    assert bt.request_xargs([1, 2, 3]) == {}  # stock: nothing added
    assert bt.request_xargs([1], enable=False) == {"vtoken_enable": False}
    with pytest.raises(ValueError):
        bt.request_xargs("a string prompt", policy="h2o", budget_ratio=0.25)  # a ratio needs token ids
    with pytest.raises(ValueError):
        bt.request_xargs([1, 2], budget=4, budget_ratio=0.5)


def test_per_request_fields_on_the_shared_server_give_each_arms_own_engine_config():
    """What one server per arm applied (``--additional-config`` with the arm's policy and budget_ratio)
    equals what the shared server applies to the arm's request (the engine config + the request's
    vllm_xargs): budget, policy, token sets, slack and prefill_eviction, for every policy and ratio."""
    from vtoken.config import RequestOverrides, effective_budget, parse_config

    arms = bt.arm_list(bt.POLICIES, bt.RATIOS)
    shared = parse_config(bt.server_configs(arms)["vtoken-after"]["vtoken"])
    for arm in arms[1:]:
        own = parse_config({"policy": arm["policy"], "budget_ratio": arm["budget_ratio"], "prefill_eviction": "after"})
        for prompt in (868, 1024, 1893, 30):
            ov = RequestOverrides(**bt.request_xargs(list(range(prompt)), **arm["fields"]))
            eff = ov.apply(shared)
            assert eff.policy == own.policy and eff.policy_args == own.policy_args == {}
            assert eff.resolved_granularity() == own.resolved_granularity()
            assert eff.prefill_eviction == own.prefill_eviction == "after"
            b = effective_budget(eff, prompt)
            assert eff.plan(prompt).slack == own.plan(prompt).slack
            assert eff.plan(prompt).slack == (b // 2 if arm["policy"] == "scissorhands" else 0)
            if b != effective_budget(own, prompt):
                # only where the policy's sinks + recent tokens raise a tiny budget
                assert prompt == 30, (arm, prompt)
        assert bt.effective_settings(bt.server_configs(arms)["vtoken-after"], arm["policy"]) == dict(
            granularity=own.resolved_granularity(), prefill_eviction="after",
            slack=bt.SLACK_PER_REQUEST if arm["policy"] == "scissorhands" else 0)
    assert bt.effective_settings(None, None) == {}


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
    assert argv[0] == "py" and argv[1].endswith("benchmarks/lm_eval_vtoken.py") and argv[2] == "run"
    assert argv[argv.index("--model") + 1] == "vtoken-completions"
    args = dict(kv.split("=", 1) for kv in argv[argv.index("--model_args") + 1].split(","))
    assert args["base_url"] == "http://127.0.0.1:8000/v1/completions" and args["tokenizer"] == "/m"
    assert args["tokenized_requests"] == "True" and args["max_length"] == "2560"
    assert not any(k.startswith("vtoken_") for k in args)  # stock: local-completions' payload
    assert json.loads(argv[argv.index("--metadata") + 1]) == {"max_seq_lengths": [2048]}
    assert "--apply_chat_template" in argv and argv[argv.index("--limit") + 1] == "20"
    argv = bt.lm_eval_argv("py", "ruler_vt", 2048, 8000, "/m", 20, "/o", 2560, 4,
                           fields={"policy": "snapkv", "budget_ratio": 0.125}, xargs_log="/x.jsonl")
    args = dict(kv.split("=", 1) for kv in argv[argv.index("--model_args") + 1].split(","))
    assert args["vtoken_policy"] == "snapkv" and args["vtoken_budget_ratio"] == "0.125"
    assert args["xargs_log"] == "/x.jsonl"


def test_xargs_summary_same_answers_and_the_server_kv_check():
    lines = [json.dumps(dict(prompt_tokens=868, vllm_xargs={"vtoken_policy": "h2o", "vtoken_budget": 109})),
             json.dumps(dict(prompt_tokens=880, vllm_xargs={"vtoken_policy": "h2o", "vtoken_budget": 110})), ""]
    sent = bt.xargs_summary(lines)
    assert sent == dict(requests=2, mean_prompt_tokens=874.0, mean_budget_tokens=109.5, policies=["h2o"])
    assert bt.xargs_summary([json.dumps(dict(prompt_tokens=5, vllm_xargs={}))])["mean_budget_tokens"] is None
    new = [(" 1.", ["1"]), (" 2.", ["2"]), (" 3.", ["3"])]
    assert bt.same_answers(new, [(" 1.", ["1"]), (" 9.", ["2"])]) == dict(compared=2, equal=1, same_refs=2)
    cells = [dict(xargs_sent=sent), dict(xargs_sent=dict(requests=1, mean_budget_tokens=None))]
    before = {"vllm:request_prompt_tokens_sum": 10.0, "vllm:request_prompt_tokens_count": 1.0}
    after = {"vllm:request_prompt_tokens_sum": 10.0 + 868 + 880 + 5, "vllm:request_prompt_tokens_count": 4.0,
             "vllm:request_generation_tokens_sum": 30.0, "vtoken:evicted_tokens_total": 868 + 880 + 30 - 219.0}
    chk = bt.server_kv_check(before, after, cells)
    assert chk == dict(requests=3, requests_sent=3, measured_kept_tokens_sum=224.0, budget_tokens_sum=219.0,
                       measured_over_budget=224.0 / 219.0)


def test_server_use_tells_which_cells_ran_alone():
    use = bt._ServerUse()
    a = use.enter("s")
    assert use.leave("s", *a) is True  # nothing else on "s" meanwhile
    a, b = use.enter("s"), use.enter("s")  # overlapping
    c = use.enter("stock")
    assert use.leave("s", *a) is False and use.leave("s", *b) is False and use.leave("stock", *c) is True
    a = use.enter("s")
    b = use.enter("s")
    assert use.leave("s", *b) is False
    assert use.leave("s", *a) is False  # another cell started while it ran


def test_vtoken_completions_payload_carries_the_requests_xargs(tmp_path):
    """lm-eval's generation payload of ``vtoken-completions`` (lm_eval_vtoken.py) gets vllm_xargs, with
    the budget from this request's own prompt tokens; log-likelihood payloads are left alone."""
    pytest.importorskip("lm_eval", reason="lm-eval not installed (pip install -e '.[tasks]')")
    import lm_eval_vtoken as lv
    from lm_eval.api.registry import get_model

    assert get_model("vtoken-completions") is lv.VTokenCompletions
    m = object.__new__(lv.VTokenCompletions)  # no tokenizer, no server: only the payload
    m.model, m._max_gen_toks = "smollm2", 256
    m.vtoken_fields = dict(policy="snapkv", budget_ratio=0.25, budget=None, granularity=None, enable=None)
    m.xargs_log = str(tmp_path / "x.jsonl")
    gk = {"do_sample": False, "temperature": 0.0, "max_gen_toks": 128, "until": []}
    p = m._create_payload([list(range(868))], generate=True, gen_kwargs=dict(gk), seed=0)
    assert p["vllm_xargs"] == {"vtoken_policy": "snapkv", "vtoken_budget": 217}
    assert p["prompt"] == [list(range(868))] and p["max_tokens"] == 128 and p["temperature"] == 0.0
    p = m._create_payload([list(range(100))], generate=True, gen_kwargs=dict(gk), seed=0)
    assert p["vllm_xargs"]["vtoken_budget"] == 25
    assert "vllm_xargs" not in m._create_payload([list(range(10))], generate=False)
    assert bt.xargs_summary((tmp_path / "x.jsonl").read_text().splitlines()) == dict(
        requests=2, mean_prompt_tokens=484.0, mean_budget_tokens=121.0, policies=["snapkv"])
    m.vtoken_fields = dict(policy=None, budget_ratio=None, budget=None, granularity=None, enable=None)
    m.xargs_log = None
    assert "vllm_xargs" not in m._create_payload([list(range(10))], generate=True, gen_kwargs=dict(gk))


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


def test_benchmarks_readme_one_server_smoke_equals_the_per_arm_servers():
    """The smoke with every vToken arm sent per request to one server scores as the smoke with one
    server per arm (same accuracy, same logged answers), as benchmarks/README.md says."""
    p, q = (ROOT / "benchmarks" / "results" / f"{n}.json" for n in ("tasks_smoke_oneserver", "tasks_smoke"))
    if not (p.exists() and q.exists()):
        pytest.skip("the two smoke results are not committed")
    new, old = json.loads(p.read_text()), json.loads(q.read_text())
    assert [(c["arm"], c["correct"], c["n"], c["examples"]) for c in new["cells"]] == \
        [(c["arm"], c["correct"], c["n"], c["examples"]) for c in old["cells"]]
    assert {c["server"] for c in new["cells"] if c["policy"]} == {"vtoken-after"} and all(x["ok"] for x in new["probes"])
    chk = new["servers"]["vtoken-after"]["kv_check"]
    sent = {c["kv"]["mean_kept_tokens"] for c in new["cells"] if c["policy"]}
    # every arm was sent one budget per request, and the server kept what the arms were sent
    per_request = chk["measured_kept_tokens_sum"] / chk["requests"]
    assert len(sent) == 1 and chk["requests"] == chk["requests_sent"] and 0 <= per_request - sent.pop() <= 2, chk
    assert "`results/tasks_smoke_oneserver.json`, same answers)" in " ".join(
        (ROOT / "benchmarks" / "README.md").read_text().split())


def test_benchmarks_readme_every_policy_table_is_the_result():
    """The every-policy table and its recommendation are generated from results/tasks.json, its run
    line is the file's, and the pick is what the rule gives when worked out here by hand: the
    smallest KV cache kept whose accuracy is within 5 points of stock's; the dense table is
    tasks_dense.json's, and only niah_single_1 passes its 60 % gate."""
    import doc_tables

    d = json.loads((ROOT / "benchmarks" / "results" / "tasks.json").read_text())
    text = (ROOT / "benchmarks" / "README.md").read_text()
    m = re.search(r"<!-- generated: benchmarks/doc_tables.py tasks_full_table -->\n(.*?)<!-- end generated -->",
                  text, re.S)
    assert m and m.group(1) == doc_tables.tasks_table(doc_tables.TASKS_FULL)
    flat = " ".join(text.split())
    loads = [x for c in d["cells"] for x in (c["load_before"][0], c["load_after"][0])]
    # the make target's run: the defaults, end to end within its 90 minutes
    assert d["command"] == "python benchmarks/bench_tasks.py" and d["total_wall_s"] <= 90 * 60
    assert (f"(`make bench-tasks`: `{d['command']}` -> `results/tasks.json`, plot `results/tasks.png`; "
            f"{len(d['cells'])} cells on two servers, {d['total_wall_s']:,.0f} s, load "
            f"{min(loads):.1f}-{max(loads):.1f}") in flat
    assert len(d["cells"]) == 36 and sorted(c["task"] for c in d["cells"] if c["arm"] == "stock") == sorted(bt.TASKS)
    (stock,) = [c for c in d["cells"] if c["arm"] == "stock" and c["task"] == "niah_single_1"]
    assert stock["accuracy"] == 1.0 and stock["n"] == 50
    assert {c["task"] for c in d["cells"] if c["policy"]} == {"niah_single_1"}  # the others under the 60 % gate
    assert sorted(c["policy"] for c in d["cells"] if c["policy"] and c["budget_ratio"] == 0.5) == bt.POLICIES
    ok = [c for c in d["cells"] if c["policy"] and c["accuracy"] >= stock["accuracy"] - 0.05]
    smallest = min(round(c["kv_kept_fraction"] * 100) for c in ok)
    best = max(c["accuracy"] for c in ok if round(c["kv_kept_fraction"] * 100) == smallest)
    picks = sorted(c["policy"] for c in ok if round(c["kv_kept_fraction"] * 100) == smallest and c["accuracy"] == best)
    assert picks == ["snapkv", "tova"] and smallest == 50
    r = doc_tables.recommend_task_config(d["cells"])
    assert sorted(p for p, _ in r["picks"]) == picks and {q for _, q in r["picks"]} == {0.5} and r["accuracy"] == 1.0
    assert doc_tables.tasks_pick_text("tasks.json").startswith(
        '**Recommended: `{"policy":"snapkv","budget_ratio":0.5,"prefill_eviction":"after"}`** (or `tova`)')
    dense = json.loads((ROOT / "benchmarks" / "results" / "tasks_dense.json").read_text())
    m = re.search(r"<!-- generated: benchmarks/doc_tables.py tasks_dense_table -->\n(.*?)<!-- end generated -->",
                  text, re.S)
    assert m and m.group(1) == doc_tables.tasks_dense_table()
    assert f"`{dense['command']}` -> `results/tasks_dense.json`, {dense['total_wall_s']:,.0f} s" in flat
    keep, dropped = bt.dense_gate([c for c in dense["cells"] if c["arm"] == "stock"], 0.6)
    assert keep == {("niah_single_1", 1024), ("niah_single_1", 2048)} and len(dropped) == 10
    assert dense["dense_gate"]["kept"] == [["niah_single_1", 1024], ["niah_single_1", 2048]]
    p4 = ROOT / "benchmarks" / "results" / "tasks_dense_4k.json"  # (4,096 tokens, a run of its own)
    if p4.exists():
        d4 = json.loads(p4.read_text())
        assert {c["length"] for c in d4["cells"]} == {4096} and sorted(c["task"] for c in d4["cells"]) == sorted(bt.TASKS)
        assert all(c["n"] == 50 and c["arm"] == "stock" for c in d4["cells"])
        assert make_recipe(MAKE_TARGETS["tasks_dense_4k.json"]) == shlex.split(d4["command"])[1:]
        assert f"`make bench-tasks-dense-4k` -> `results/tasks_dense_4k.json`, {d4['total_wall_s']:,.0f} s" in flat


# ----------------------------------------------------------------------------- the recommendation rule
def _cell(policy, ratio, task, acc, kv=None, length=1024):
    return dict(arm="stock" if policy is None else f"{policy}-{ratio}", policy=policy, budget_ratio=ratio,
                task=task, length=length, accuracy=acc, kv_kept_fraction=kv)


#: dense 0.9 on "a", 0.5 on "b" (dropped: under 60 %)
RULE_CELLS = [_cell(None, None, "a", 0.9, 1.0), _cell(None, None, "b", 0.5, 1.0),
              _cell("h2o", 0.125, "a", 0.84, 0.126), _cell("h2o", 0.125, "b", 0.0, 0.126),  # 6 points off
              _cell("h2o", 0.25, "a", 0.85, 0.251), _cell("h2o", 0.25, "b", 0.0, 0.251),  # 5 points: in
              _cell("tova", 0.25, "a", 0.9, 0.254), _cell("tova", 0.25, "b", 0.4, 0.254),  # same %, better
              _cell("snapkv", 0.25, "a", 0.9, 0.249),  # tied with tova
              _cell("streaming", 0.125, "b", 0.5, 0.125),  # no cell on "a": not a candidate
              _cell("knorm", 0.5, "a", 1.0, None)]  # KV not measured: its ratio


def test_recommend_task_config_picks_the_smallest_kv_within_5_points():
    import doc_tables

    r = doc_tables.recommend_task_config(RULE_CELLS)
    assert r["kept"] == [("a", 1024, 0.9)] and r["dropped"] == [("b", 1024, 0.5)]
    # h2o 12.5 % misses by 6 points; at 25 %, h2o (0.85), tova (0.9) and snapkv (0.9) keep 25 % of the KV
    # cache: the better accuracy wins, and tova and snapkv tie on both
    assert r["picks"] == [("tova", 0.25), ("snapkv", 0.25)]
    assert r["kv"] == 0.254 and r["accuracy"] == 0.9
    # a tighter bar: nothing at 12.5 or 25 % is within 0 points but knorm at 50 % (its ratio as its KV)
    r = doc_tables.recommend_task_config(RULE_CELLS, tol=0.0)
    assert r["picks"] == [("tova", 0.25), ("snapkv", 0.25)]
    r = doc_tables.recommend_task_config([c for c in RULE_CELLS if c["policy"] not in ("tova", "snapkv")], tol=0.0)
    assert r["picks"] == [("knorm", 0.5)] and r["kv"] == 0.5 and r["accuracy"] == 1.0
    # none within the bar
    r = doc_tables.recommend_task_config([c for c in RULE_CELLS if c["policy"] in (None, "h2o")], tol=0.04)
    assert r["picks"] == [] and r["kv"] is None and r["accuracy"] is None
    # a bar that drops every task: nothing to recommend
    r = doc_tables.recommend_task_config(RULE_CELLS, floor=0.95)
    assert r["kept"] == [] and r["picks"] == [] and len(r["dropped"]) == 2


def test_tasks_pick_text_and_lead_table_on_a_hand_made_run(tmp_path, monkeypatch):
    import doc_tables

    doc = dict(command="python benchmarks/bench_tasks.py --limit 2", cells=[dict(c, n=10) for c in RULE_CELLS],
               settings=dict(model="/m/smollm2-135m-instruct", prefix_caching=False, prefill_eviction="after",
                             granularity="policy default"))
    (tmp_path / "t.json").write_text(json.dumps(doc))
    monkeypatch.setattr(doc_tables, "RESULTS", tmp_path)
    assert doc_tables.tasks_pick_text("t.json") == (
        '**Recommended: `{"policy":"tova","budget_ratio":0.25,"prefill_eviction":"after"}`** (or `snapkv`): '
        "the smallest KV cache kept (25 % of dense's) with accuracy within 5 points of dense (90 %); dropped, "
        "dense under 60 %: b at 1,024 tokens.\n")
    only_h2o = [c for c in doc["cells"] if c["policy"] in (None, "h2o")]
    (tmp_path / "h2o.json").write_text(json.dumps(dict(doc, cells=only_h2o)))
    assert doc_tables.tasks_pick_text("h2o.json", tol=0.04) == (
        "**No config recommended**: none has accuracy within 4 points of dense (90 %); dropped, dense under "
        "60 %: b at 1,024 tokens.\n")
    # more than two dropped at a length: a count (the dense table names them); one task at two lengths
    more = doc["cells"] + [dict(_cell(None, None, t, 0.1, 1.0), n=10) for t in ("c", "d")] + [
        dict(_cell(None, None, "a", 0.9, 1.0, length=2048), n=10), dict(_cell("tova", 0.25, "a", 0.9, 0.25, length=2048), n=10)]
    (tmp_path / "more.json").write_text(json.dumps(dict(doc, cells=more)))
    assert doc_tables.tasks_pick_text("more.json") == (
        '**Recommended: `{"policy":"tova","budget_ratio":0.25,"prefill_eviction":"after"}`**: the smallest KV cache '
        "kept (25 % of dense's) with accuracy within 5 points of dense (90 % at 1,024 and 2,048 tokens); dropped, "
        "dense under 60 %: 3 tasks at 1,024 tokens.\n")
    lead = doc_tables.tasks_lead_table("t.json")
    assert lead.startswith("RULER a at 1,024 tokens, 10 samples a cell, smollm2-135m-instruct, prefix caching off "
                           "(`python benchmarks/bench_tasks.py --limit 2`):\n\n")
    rows = lead.split("\n\n")[1].splitlines()
    assert rows[0] == "| accuracy, % of the prompt kept: | 12.5 % | 25 % | 50 % | 100 % |"
    assert rows[2] == "| stock vLLM (dense) | | | | 90 % |"
    assert rows[3:] == ["| `h2o` | 84 % | 85 % | - | |", "| `tova` | - | **90 %** | - | |",
                        "| `snapkv` | - | **90 %** | - | |", "| `knorm` | - | - | 100 % | |"]
    # top 2 by mean accuracy (knorm 100 %, tova 90 %: snapkv ties tova and comes later), then the
    # default policy (h2o), the rest in one line
    rows2 = doc_tables.tasks_lead_table("t.json", top=2).split("\n\n")[1].splitlines()
    assert rows2[3:] == ["| `knorm` | - | - | 100 % | |", "| `tova` | - | **90 %** | - | |",
                         "| `h2o` | 84 % | 85 % | - | |",
                         "| 1 more | [below](benchmarks/README.md#task-accuracy-ruler) | | | |"]


def test_readme_leads_with_the_task_table_and_its_recommendation():
    """README's "Results" opens with ``tasks_lead_table`` of ``doc_tables.TASKS_LEAD``: the table and
    the recommendation sentence as the generator prints them; the recommended config starts."""
    import doc_tables
    from vtoken.config import parse_config

    readme = (ROOT / "README.md").read_text()
    sec = readme[readme.index("\n## Results\n"):]
    m = re.search(r"<!-- generated: benchmarks/doc_tables.py tasks_lead_table -->\n(.*?)<!-- end generated -->",
                  sec, re.S)
    assert m and sec.index("<!-- generated:") == m.start()
    assert m.group(1) == doc_tables.tasks_lead_table(doc_tables.TASKS_LEAD, top=doc_tables.TASKS_LEAD_TOP,
                                                     extra=doc_tables.TASKS_EXTRA) == doc_tables.TABLES["tasks_lead_table"]()
    pick = doc_tables.tasks_pick_text(doc_tables.TASKS_LEAD, extra=doc_tables.TASKS_EXTRA)
    assert m.group(1).endswith("\n\n" + pick)
    for raw in re.findall(r"`(\{[^`]*\})`", pick):
        parse_config(json.loads(raw))
    # every run the table and the pick draw on is named, with prefix caching off, and its command
    # is in benchmarks/README.md beside its own table
    bench = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())
    names = (doc_tables.TASKS_LEAD,) + doc_tables.TASKS_EXTRA
    assert f"({len(names)} runs, commands in benchmarks/README.md)" in m.group(1)
    for name in names:
        d = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
        assert d["settings"]["prefix_caching"] is False and "prefix caching off" in m.group(1)
        run = f"make {MAKE_TARGETS[name]}" if name in MAKE_TARGETS else d["command"]  # (checked against the file below)
        assert f"`{run}` -> `results/{name}`" in bench, name
        if name in MAKE_TARGETS:
            assert make_recipe(MAKE_TARGETS[name]) == shlex.split(d["command"])[1:], name


def test_shared_kv_and_rederive():
    """A cell that shared its server: KV kept is the budget sent, or stock's whole prompt."""
    sent = dict(requests=2, mean_prompt_tokens=874.0, mean_budget_tokens=109.5, policies=["h2o"])
    assert bt.shared_kv(sent, 32)["mean_kept_tokens"] == 109.5 and bt.shared_kv(sent, 32)["mean_kept_blocks"] == 109.5 / 32
    stock = dict(requests=2, mean_prompt_tokens=874.0, mean_budget_tokens=None, policies=[])
    assert bt.shared_kv(stock, 32)["mean_kept_tokens"] == 874.0
    cells = [dict(arm="stock", task="t", length=1, alone_on_server=False, xargs_sent=stock, kv={}),
             dict(arm="h2o-12.5pct", task="t", length=1, alone_on_server=False, xargs_sent=sent, kv={}),
             dict(arm="tova-12.5pct", task="t", length=1, alone_on_server=True, xargs_sent=sent,
                  kv=dict(mean_kept_tokens=111.0))]
    bt.rederive(dict(cells=cells), 32)
    assert [c["kv_kept_fraction"] for c in cells] == [1.0, 109.5 / 874.0, 111.0 / 874.0]
    # pacing slack: held over the budget until the next eviction (an upper bound), never past the prompt
    assert bt.shared_kv(sent, 32, slack=128)["mean_kept_tokens"] == 237.5
    assert bt.shared_kv(sent, 32, slack=10_000)["mean_kept_tokens"] == 874.0
    slack = [dict(arm="snapkv-12.5pct-p", policy="snapkv", task="t", length=1, alone_on_server=False,
                  xargs_sent=sent, kv={}, slack=128),
             dict(arm="scissorhands-12.5pct", policy="scissorhands", task="t", length=1, alone_on_server=False,
                  xargs_sent=sent, kv={}, slack=bt.SLACK_PER_REQUEST)]  # its default: half its budget, 110 // 2
    bt.rederive(dict(cells=cells[:1] + slack), 32)
    assert [c["kv"]["mean_kept_tokens"] for c in slack] == [237.5, 109.5 + 55]


def test_needle_depth_is_where_the_answer_sits_in_the_prompt():
    """The heatmap's depth: the offset of the first reference in ``doc["input"]`` over its length,
    binned in fifths; a sample whose answer is not in its prompt has no depth."""
    def line(text, refs, answer):
        return json.dumps({"doc": {"input": text, "outputs": refs}, "resps": [[answer]], "filtered_resps": [answer]})

    lines = [line("x" * 10 + "1234567" + "y" * 83, ["1234567"], "1234567"),  # 10 / 100
             line("x" * 50 + "7654321" + "y" * 43, ["7654321"], "no"),  # 50 / 100
             line("x" * 99 + "5", ["5"], "5"),  # 99 / 100
             line("nothing here", ["42"], "42")]
    depths = bt.sample_depths(lines)
    assert depths == [0.1, 0.5, 0.99, None]
    cells = bt.by_depth(bt.samples_from_jsonl(lines), depths)
    assert [(c["n"], c["correct"], c["accuracy"]) for c in cells] == [
        (1, 1, 1.0), (0, 0, None), (1, 0, 0.0), (0, 0, None), (1, 1, 1.0)]
    assert cells[2]["lo"] == 0.4 and cells[2]["hi"] == 0.6


def test_needle_heatmap_figures_equal_the_result():
    """benchmarks/README.md's heatmap sentence: correct answers per arm at 1k / 2k / 4k, from
    results/tasks_needle.json, and H2O's only in the last depth bin."""
    doc = json.loads((ROOT / "benchmarks" / "results" / "tasks_needle.json").read_text())
    got = {}
    for c in doc["cells"]:
        got.setdefault(c["arm"], {})[c["length"]] = c
        assert sum(b["n"] for b in c["by_depth"]) == c["n"] == 40
    text = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())

    def row(arm):
        return " / ".join(str(got[arm][n]["correct"]) for n in (1024, 2048, 4096))

    assert f"stock {row('stock')}, TOVA {row('tova-25pct')}, H2O (the default) {row('h2o-25pct')} of 40" in text
    assert all(sum(b["correct"] for b in c["by_depth"][:-1]) == 0 for c in got["h2o-25pct"].values())
    assert "only with the needle in the last fifth" in text


def test_dense_gate_drops_the_pairs_stock_does_not_solve():
    stock = [dict(task="niah_single_1", length=1024, accuracy=1.0, n=50),
             dict(task="niah_single_1", length=2048, accuracy=0.6, n=50),  # exactly the floor: kept
             dict(task="niah_multikey_2", length=1024, accuracy=0.2, n=25),
             dict(task="ruler_vt", length=2048, accuracy=0.58, n=50)]
    keep, dropped = bt.dense_gate(stock, 0.6)
    assert keep == {("niah_single_1", 1024), ("niah_single_1", 2048)}
    assert dropped == [dict(task="niah_multikey_2", length=1024, accuracy=0.2, n=25),
                       dict(task="ruler_vt", length=2048, accuracy=0.58, n=50)]
    keep0, dropped0 = bt.dense_gate(stock, 0.0)
    assert len(keep0) == 4 and dropped0 == []


def test_full_run_defaults_cover_every_registered_policy_at_50_samples():
    from vtoken.policies import available_policies

    assert bt.POLICIES == sorted(available_policies())
    assert bt.FULL_LIMIT == 50 and bt.RATIOS == [0.125, 0.25, 0.5] and bt.LENGTHS == [1024]


def test_variants_get_a_server_each_with_their_config_over_the_shared_settings():
    v = bt.parse_variant('chunks256:h2o,tova:{"prefill_eviction": "chunks", "prefill_eviction_every": 256}')
    assert v == ("chunks256", ["h2o", "tova"], {"prefill_eviction": "chunks", "prefill_eviction_every": 256})
    arms = bt.arm_list([], [0.25], variants=[v])
    assert [(x["name"], x["server"], x.get("variant")) for x in arms] == [
        ("stock", "stock", None), ("h2o-25pct-chunks256", "vtoken-chunks256", "chunks256"),
        ("tova-25pct-chunks256", "vtoken-chunks256", "chunks256")]
    cfgs = bt.server_configs(arms, "after", [v])
    assert cfgs == {"stock": None, "vtoken-chunks256": {"vtoken": {
        "policy": "h2o", "prefill_eviction": "chunks", "prefill_eviction_every": 256}}}
    assert bt.effective_settings(cfgs["vtoken-chunks256"], "tova")["prefill_eviction"] == "chunks"
    for bad in ("x:h2o", "X:h2o:{}", "x::{}", "x:h2o:[1]"):
        with pytest.raises(ValueError):
            bt.parse_variant(bad)


#: the make target of each run the benchmarks README names by its target
MAKE_TARGETS = {"tasks_arms.json": "bench-tasks-arms", "tasks_2k.json": "bench-tasks-2k",
                "tasks_2k_b.json": "bench-tasks-2k-rest", "tasks_2k_request.json": "bench-tasks-2k-request",
                "tasks_dense_4k.json": "bench-tasks-dense-4k", "tasks_4k_a.json": "bench-tasks-4k-a",
                "tasks_4k_pick.json": "bench-tasks-4k-pick"}


def make_recipe(target: str) -> list[str]:
    """The arguments ``make TARGET`` passes to ``benchmarks/bench_tasks.py`` (its script first)."""
    words = recipe(target)
    assert words[0] == "$(VPY)", words[:2]
    return words[1:]


def test_make_recipe_reads_continued_lines():
    assert make_recipe("bench-tasks-2k") == ["benchmarks/bench_tasks.py", "--tasks", "niah_single_1", "--lengths",
                                             "2048", "--parallel", "3", "--name", "tasks_2k"]
    assert make_recipe("bench-tasks-arms")[-2:] == ["--variant", 'recent64:expected_attention:{"recent_tokens": 64}']
    assert recipe("bench-sla-512")[:2] == ["$(VPY)", "benchmarks/bench_sla.py"]  # (another prerequisite)
    with pytest.raises(KeyError, match="no-such-target"):
        recipe("no-such-target")


def test_benchmarks_readme_arms_table_is_the_result():
    """The other settings (``--variant``): the table is generated from its file, the run line is the
    file's, and every cell ran with its variant's settings (as the engine resolves them,
    ``effective_settings``)."""
    import doc_tables

    text = (ROOT / "benchmarks" / "README.md").read_text()
    flat = " ".join(text.split())
    for name, table in (("tasks_arms.json", "tasks_arms_table"),):
        d = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
        m = re.search(rf"<!-- generated: benchmarks/doc_tables.py {table} -->\n(.*?)<!-- end generated -->", text, re.S)
        assert m and m.group(1) == doc_tables.TABLES[table](), table
        wall = d["total_wall_s"] or d["cells_wall_s_sum"]  # (a --salvage'd run records its cells' sum)
        target = MAKE_TARGETS[name]
        assert make_recipe(target) == shlex.split(d["command"])[1:], target  # the file's run is the target's
        assert f"`make {target}` -> `results/{name}`" in flat and f"{wall:,.0f} s" in flat, name
        (stock,) = [c for c in d["cells"] if c["arm"] == "stock"]
        assert stock["n"] == 50 and d["settings"]["prefix_caching"] is False
        for c in d["cells"]:
            if c.get("variant"):
                cfg = d["settings"]["variants"][c["variant"]]["config"]
                assert c["policy"] in d["settings"]["variants"][c["variant"]]["policies"]
                for k in ("granularity", "prefill_eviction", "slack"):
                    if k in cfg:
                        assert c[k] == cfg[k], (c["arm"], k)
    arms = json.loads((ROOT / "benchmarks" / "results" / "tasks_arms.json").read_text())
    assert {c["length"] for c in arms["cells"]} == {1024}
    assert sum(1 for c in arms["cells"] if c.get("variant")) == 3 * sum(
        len(v["policies"]) for v in arms["settings"]["variants"].values())


def test_heatmap_only_for_a_run_with_depths_at_several_lengths():
    """``make bench-tasks`` (1k only) draws no heatmap (it once crashed drawing a one-length one
    after writing tasks.json); ``--heatmap`` (1k, 2k, 4k) does."""
    one = dict(cells=[dict(length=1024, by_depth=[]), dict(length=1024)])
    assert not bt.has_heatmap(one)
    assert bt.has_heatmap(dict(cells=[dict(length=1024, by_depth=[]), dict(length=2048, by_depth=[])]))
    for name, want in (("tasks", False), ("tasks_needle", True), ("tasks_arms", False)):
        assert bt.has_heatmap(json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())) is want


def test_tasks_table_stock_is_the_same_task_and_length(tmp_path, monkeypatch):
    """The every-policy table's stock figure is stock's on the row's own task and length (it once
    showed the first stock cell of the run, another task's), across several result files."""
    import doc_tables

    def cell(arm, task, length, correct, policy=None, ratio=None):
        return dict(arm=arm, task=task, length=length, correct=correct, n=50, policy=policy, budget_ratio=ratio)

    one = dict(settings={}, cells=[cell("stock", "niah_multikey_2", 1024, 13), cell("stock", "niah_single_1", 1024, 50),
                                   cell("h2o-25pct", "niah_single_1", 1024, 7, "h2o", 0.25)])
    two = dict(settings={}, cells=[cell("stock", "niah_single_1", 2048, 49),
                                   cell("h2o-25pct", "niah_single_1", 2048, 3, "h2o", 0.25)])
    (tmp_path / "a.json").write_text(json.dumps(one))
    (tmp_path / "b.json").write_text(json.dumps(two))
    monkeypatch.setattr(doc_tables, "RESULTS", tmp_path)
    assert doc_tables.tasks_table("a.json").splitlines()[:3] == [
        "| niah_single_1, 1,024 tokens: policy | 25 % of the prompt (stock, full cache: 50/50) |", "|---|---|",
        "| `h2o` | 7/50 |"]
    # one task at two lengths (a file not committed is skipped): a column per length
    assert doc_tables.tasks_table(("a.json", "b.json", "missing.json")).splitlines() == [
        "| niah_single_1, correct of 50: policy | 1,024 tokens at 25 % | 2,048 tokens at 25 % |",
        "|---|---|---|", "| stock (full cache) | 50/50 | 49/50 |", "| `h2o` | 7 | 3 |"]
    two["cells"].append(cell("tova-25pct", "niah_multikey_2", 2048, 1, "tova", 0.25))  # two tasks: a row per pair
    (tmp_path / "b.json").write_text(json.dumps(two | {"cells": two["cells"] + [cell("stock", "niah_multikey_2", 2048, 4)]}))
    assert doc_tables.tasks_table(("a.json", "b.json")).splitlines()[2:] == [
        "| niah_multikey_2, 2,048 | `tova` | 1/50 | 4/50 |", "| niah_single_1, 1,024 | `h2o` | 7/50 | 50/50 |",
        "| niah_single_1, 2,048 | `h2o` | 3/50 | 49/50 |"]
    # two runs at one length (a run completed by another): stock once where they agree, both where not
    three = dict(settings={}, cells=[cell("stock", "niah_single_1", 2048, 49), cell("tova-25pct", "niah_single_1", 2048, 9,
                                                                                     "tova", 0.25)])
    two = dict(settings={}, cells=[cell("stock", "niah_single_1", 2048, 49), cell("h2o-25pct", "niah_single_1", 2048, 3,
                                                                                   "h2o", 0.25)])
    (tmp_path / "b.json").write_text(json.dumps(two))
    (tmp_path / "c.json").write_text(json.dumps(three))
    assert doc_tables.tasks_table(("b.json", "c.json")).splitlines()[0] == (
        "| niah_single_1, 2,048 tokens: policy | 25 % of the prompt (stock, full cache: 49/50) |")
    three["cells"][0]["correct"] = 48
    (tmp_path / "c.json").write_text(json.dumps(three))
    assert doc_tables.tasks_table(("b.json", "c.json")).splitlines() == [
        "| niah_single_1, 2,048 tokens: policy | 25 % of the prompt (stock, full cache: 49/50, 48/50) |", "|---|---|",
        "| `h2o` | 3/50 |", "| `tova` | 9/50 |"]


def _niah_run(name: str, length: int = 2048) -> tuple[dict, set[str], str]:
    """A niah_single_1 result at ``length`` tokens: (the file, its eviction cells' names, its load
    range); every cell 50 samples, its command the make target's."""
    d = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
    assert make_recipe(MAKE_TARGETS[name]) == shlex.split(d["command"])[1:], name
    cells = d["cells"]
    assert {(c["task"], c["length"]) for c in cells} == {("niah_single_1", length)} and all(c["n"] == 50 for c in cells)
    loads = [x for c in cells for x in (c["load_before"][0], c["load_after"][0]) if x is not None]
    return d, {f"{c['arm']} niah_single_1 {length}" for c in cells if c["policy"]}, f"load {min(loads):.1f}-{max(loads):.1f}"


def _correct_by_ratio(cells: list[dict]) -> str:
    """The eviction cells' correct answers at 12.5 / 25 / 50 %, as the README quotes them ("41 / 48 / 49")."""
    return " / ".join(str(c["correct"]) for r in sorted(bt.RATIOS) for c in cells if c["budget_ratio"] == r)


def test_benchmarks_readme_names_the_2k_run():
    """``make bench-tasks-2k``'s result: every policy at 2,048 tokens on the one task dense passes
    there, at the three budgets, 50 samples a cell. A run cut short (``--salvage``'d) names each cell
    it lacks, and ``make bench-tasks-2k-rest`` (``tasks_2k_b.json``), where committed, runs exactly
    those. The README names each run with its cells, time and load, and the policies still lacking
    (the table is the every-policy table's 2,048 column)."""
    if not (ROOT / "benchmarks" / "results" / "tasks_2k.json").exists():
        pytest.skip("results/tasks_2k.json not committed")
    d, have, load = _niah_run("tasks_2k.json")
    cells, missing = d["cells"], d.get("salvaged", {}).get("cells_missing", [])
    want = {f"{pol}-{r * 100:g}pct niah_single_1 2048" for pol in bt.POLICIES for r in bt.RATIOS}
    assert have | set(missing) == want and not have & set(missing)
    flat = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())
    head = f"2,048 tokens: `make bench-tasks-2k` -> `results/tasks_2k.json`, plot `results/tasks_2k.png`, "
    if not missing:
        assert (head + f"{len(cells)} cells, {d['total_wall_s']:,.0f} s, {load})") in flat
        return
    lacking = sorted({m.split("-")[0] for m in missing})
    head += f"{len(cells)} of {len(cells) + len(missing)} cells ({d['cells_wall_s_sum']:,.0f} s of cells, {load}; cut short and salvaged"
    if not (ROOT / "benchmarks" / "results" / "tasks_2k_b.json").exists():
        assert (head + "; not yet: " + ", ".join(lacking) + ")") in flat
        return
    rest, rest_have, rest_load = _niah_run("tasks_2k_b.json")
    assert rest_have == set(missing) and not rest.get("salvaged")
    assert (head + f"); the other {len(lacking)}, " + ", ".join(lacking) + ": `make bench-tasks-2k-rest` -> "
            f"`results/tasks_2k_b.json`, {len(rest['cells'])} cells, {rest['total_wall_s']:,.0f} s, {rest_load})") in flat


def test_benchmarks_readme_names_the_2k_request_run():
    """``make bench-tasks-2k-request``: the recommended SnapKV with request sets at 2,048 tokens, its
    correct answers at 12.5 / 25 / 50 % as the README quotes them, with its cells, time and load;
    the recommendation (README and benchmarks/README.md) weighs both lengths."""
    import doc_tables

    d, have, load = _niah_run("tasks_2k_request.json")
    assert have == {f"snapkv-{r * 100:g}pct-request niah_single_1 2048" for r in bt.RATIOS}
    assert d["settings"]["variants"]["request"]["config"] == {"granularity": "request"}
    got = _correct_by_ratio(d["cells"])
    flat = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())
    assert (f"(2,048 tokens: {got}; `make bench-tasks-2k-request` -> `results/tasks_2k_request.json`, "
            f"{len(d['cells'])} cells, {d['total_wall_s']:,.0f} s, {load})") in flat
    r = doc_tables.recommend_task_config(doc_tables._task_cells(doc_tables.TASKS_LEAD, doc_tables.TASKS_EXTRA)[1])
    assert [(t, n) for t, n, _ in r["kept"]] == [("niah_single_1", n) for n in (1024, 2048, 4096)]
    assert r["picks"] == [("snapkv", 0.25, "request")]


def test_benchmarks_readme_names_the_4k_runs():
    """At 4,096 tokens: KeyDiff at the three budgets (``make bench-tasks-4k-a``, cut short: it names
    the SnapKV cells it lacks, and why) and, where committed, the recommended SnapKV with request
    sets at 25 % (``make bench-tasks-4k-pick``); the README quotes their correct answers, cells,
    time and load."""
    if not (ROOT / "benchmarks" / "results" / "tasks_4k_a.json").exists():
        pytest.skip("results/tasks_4k_a.json not committed")
    a, have, load = _niah_run("tasks_4k_a.json", 4096)
    missing = a["salvaged"]["cells_missing"]
    assert have == {f"keydiff-{r * 100:g}pct niah_single_1 4096" for r in bt.RATIOS} and a["salvaged"]["why"]
    assert set(missing) == {f"snapkv-{r * 100:g}pct-request niah_single_1 4096" for r in bt.RATIOS}
    kd = _correct_by_ratio(a["cells"])
    flat = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())
    text = (f"**4,096 tokens** (`make bench-tasks-4k-a` -> `results/tasks_4k_a.json`, {len(a['cells'])} of "
            f"{len(a['cells']) + len(missing)} cells ({a['cells_wall_s_sum']:,.0f} s of cells, {load}; stopped after KeyDiff)")
    if (ROOT / "benchmarks" / "results" / "tasks_4k_pick.json").exists():
        p, p_have, p_load = _niah_run("tasks_4k_pick.json", 4096)
        assert p_have == {"snapkv-25pct-request niah_single_1 4096"}
        (pick,) = [c for c in p["cells"] if c["policy"]]
        text += (f"; `make bench-tasks-4k-pick` -> `results/tasks_4k_pick.json`, {len(p['cells'])} cells, "
                 f"{p['total_wall_s']:,.0f} s, {p_load}): KeyDiff {kd} of 50 at 12.5 / 25 / 50 %, SnapKV with "
                 f"request sets {pick['correct']} at 25 %.")
    else:
        text += f"): KeyDiff {kd} of 50 at 12.5 / 25 / 50 %."
    assert text in flat
