"""``benchmarks/bench_worker_step.py`` at tiny sizes, no engine: its counters count a known op
sequence exactly (and file each event under the right call site), its steps really evict (one
token per set and request, live counts kept), its checks fail on a step that does not evict, and
its JSON has the fields the report reads. Whether the counts are flat in R is not asserted here
(today they are not: the worker's step still loops over requests in Python). A few seconds."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_worker_step as bw  # noqa: E402
from vtoken.config import VTokenConfig  # noqa: E402
from vtoken.side_cache import DeviceDecider  # noqa: E402
from vtoken.counts import evictable  # noqa: E402

LAYERS, KV_HEADS = 2, 1  # 2 token sets per request at granularity "head"
S = LAYERS * KV_HEADS
LIVE = 64


def _line_of(func, startswith: str) -> int:
    """The file line number of the first line of ``func`` whose code starts with ``startswith``."""
    lines, first = inspect.getsourcelines(func)
    return first + next(i for i, ln in enumerate(lines) if ln.strip().startswith(startswith))


def test_the_counters_count_a_known_sequence():
    inst = bw.Instrument()
    with inst:
        a = torch.arange(8)  # arange
        b = a[a > 3]  # gt, index with a boolean index: data-dependent
        int(b.sum())  # sum, _local_scalar_dense
        torch.tensor([1, 2])  # lift_fresh; an upload
        h = torch.from_numpy(np.zeros(2))  # lift_fresh; an upload; np.zeros: a numpy call
        h.numpy()  # detach; made on the host: no read to the host
        a.tolist()  # a read to the host (no op on CPU)
        a.cpu().numpy()  # one read to the host (cpu dispatches nothing on CPU; numpy: detach)
        a[1].item()  # select, _local_scalar_dense
        np.full(2, 1.0)  # a numpy call (its own np.empty/copyto are not counted again)
    c = bw._split_py(inst.counts["all"])
    assert dict(c.ops_by_name) == {"aten::arange": 1, "aten::gt": 1, "aten::index": 1, "aten::sum": 1,
                                   "aten::_local_scalar_dense": 2, "aten::lift_fresh": 2, "aten::detach": 2,
                                   "aten::select": 1}
    # uploads: 2 int64 + 2 float64; reads: a's 8 int64 by tolist and by cpu
    assert c.summary() == dict(ops=11, local_scalar_dense=2, to_host=2, data_dependent=1, host_syncs=5, uploads=2,
                               numpy_calls=2, py_lines=0, py_funcs=0, upload_bytes=32, to_host_bytes=128)
    assert dict(c.py_calls) == dict(item=1, tolist=1, numpy=2, cpu=1, from_numpy=1, tensor=1, as_tensor=0)
    # everything was called from here, outside vtoken/
    assert set(c.focus) == set(c.inner) == {bw.OUTSIDE}
    # the wrappers are gone again
    assert "numpy" not in torch.Tensor.__dict__ and "item" not in torch.Tensor.__dict__
    assert torch.tensor is torch._C._VariableFunctions.tensor and type(np.zeros).__name__ == "builtin_function_or_method"
    assert sys.gettrace() is None or sys.gettrace() != inst._trace_call


def test_events_are_filed_under_their_vtoken_call_site():
    pol = VTokenConfig(policy="h2o", budget=32).make_policy()
    dec = DeviceDecider(pol, num_slots=64, block_size=32, max_requests=2, num_sets=S)
    rows = torch.tensor([0, 1])
    inst = bw.Instrument()
    with inst:
        dec.naive_freed_blocks(rows)  # dead_blocks: index (integer rows), eq; then sum
        evictable(10, 30, 2, 3, 0)  # two lines of Python, no op
    c = bw._split_py(inst.counts["all"])
    dead_line = _line_of(DeviceDecider.dead_blocks, "return")
    freed_line = _line_of(DeviceDecider.naive_freed_blocks, "return")
    assert dict(c.ops_by_name) == {"aten::index": 1, "aten::eq": 1, "aten::sum": 1}
    assert {k: v["ops"] for k, v in c.focus.items()} == {
        f"vtoken/side_cache.py:dead_blocks:{dead_line}": 2, f"vtoken/side_cache.py:naive_freed_blocks:{freed_line}": 1}
    assert {k: v["ops"] for k, v in c.chain.items()} == {  # the callers too, innermost first
        f"vtoken/side_cache.py:dead_blocks:{dead_line} < vtoken/side_cache.py:naive_freed_blocks:{freed_line}": 2,
        f"vtoken/side_cache.py:naive_freed_blocks:{freed_line}": 1}
    assert c.summary()["data_dependent"] == 0  # an integer index is not a boolean one
    ev = [f"vtoken/counts.py:evictable:{_line_of(evictable, s)}" for s in ("p =", "return")]
    assert c.lines[ev[0]] == c.lines[ev[1]] == 1
    assert c.summary()["py_funcs"] == 3 and c.summary()["py_lines"] == sum(c.lines.values()) == 4


def test_growth():
    g = bw.growth({2: 10, 4: 14, 8: 22})
    assert g == dict(per_R={"2": 10, "4": 14, "8": 22}, slope_per_request=2.0, flat=False, linear=True)
    assert bw.growth({2: 5, 8: 5})["flat"] is True and bw.growth({2: 5, 8: 5})["slope_per_request"] == 0
    assert bw.growth({2: 10, 4: 11, 8: 22})["linear"] is False


def test_a_step_evicts_one_token_per_set_and_keeps_the_live_count():
    b = bw.WorkerStepBench(3, LIVE, layers=LAYERS, kv_heads=KV_HEADS)
    assert b.S == S and b.spec.plan.granularity == "head" and b.policy.name == "h2o"
    rows = b.rows
    dead0 = b.dec.dead[rows].sum(1).tolist() if b.dec.dead.shape[1] else [0] * 3
    ms = b.step()
    assert set(ms) == {"begin", "fold", "naive"} and all(v >= 0 for v in ms.values())
    assert b.dec.live[rows].tolist() == [LIVE] * 3 and b.dec.logical[rows].tolist() == [LIVE + 1] * 3
    assert [x - y for x, y in zip(b.dec.dead[rows].sum(1).tolist(), dead0)] == [S] * 3
    b.step()
    assert b.final_check() == dict(sets_checked=S * 3, distinct_live=LIVE, logical=LIVE + 2, sinks=0,
                                   recent=b.spec.plan.recent_tokens)
    assert b.spec.plan.recent_tokens > 0


def test_the_step_check_fails_when_nothing_is_evicted():
    b = bw.WorkerStepBench(2, LIVE, layers=LAYERS, kv_heads=KV_HEADS)
    inputs = b.inputs

    def no_eviction():
        so, payload, scores = inputs()
        payload.evict = {}
        return so, payload, scores

    b.inputs = no_eviction
    with pytest.raises(AssertionError, match="live counts"):
        b.step()


def test_the_json(tmp_path):
    out = tmp_path / "bench_worker_step.json"
    args = bw.parse_args(["--requests", "4", "2", "--live", str(LIVE), "--steps", "2", "--warmup", "1",
                          "--count-steps", "2", "--layers", str(LAYERS), "--kv-heads", str(KV_HEADS), "--out", str(out)])
    doc = bw.run(args, progress=False)
    got = json.loads(out.read_text())
    # (compared as text: a NaN figure, e.g. a spread over too few steps, is never equal to itself)
    assert json.dumps(got, sort_keys=True) == json.dumps(json.loads(json.dumps(doc)), sort_keys=True)
    assert got["bench"] == "bench_worker_step" and "bench_worker_step" in got["command"]
    assert got["versions"]["torch"] == torch.__version__
    assert len(got["loadavg_before"]) == len(got["loadavg_after"]) == 3
    assert got["settings"]["requests"] == [2, 4] and got["settings"]["live"] == LIVE and got["settings"]["policy"] == "h2o"
    assert "TorchDispatchMode" in got["counter"]
    assert [r["R"] for r in got["rows"]] == [2, 4]
    for r in got["rows"]:
        R = r["R"]
        assert r["num_sets"] == S
        assert r["checks"]["evictions_per_step"] == R * S and r["checks"]["live_every_step"] == LIVE
        assert r["checks"]["steps"] == 1 + 2 + 2 and r["checks"]["logical"] == LIVE + 5
        assert set(r["ms"]) == {"step", "begin", "fold", "naive"} and r["ms"]["step"]["n"] == 2
        assert set(r["counts"]) == {"step", "begin", "fold", "naive"}
        for ph, c in r["counts"].items():
            assert list(c) == list(bw.CATEGORIES)
            assert c["host_syncs"] == c["local_scalar_dense"] + c["to_host"] + c["data_dependent"]
        assert all(r["counts"]["step"][k] == r["counts"]["begin"][k] + r["counts"]["fold"][k] for k in bw.CATEGORIES)
        assert r["counts"]["step"]["ops"] > 0 and r["counts"]["step"]["py_lines"] > 0
        assert len(r["counts_per_counted_step"]) == 2 and isinstance(r["counts_stable"], bool)
        step = r["detail"]["step"]
        # every event is filed under exactly one call site
        assert sum(v.get("ops", 0) for v in step["focus_sites"].values()) == r["counts"]["step"]["ops"]
        assert sum(v.get("ops", 0) for v in step["inner_sites"].values()) == r["counts"]["step"]["ops"]
        assert sum(step["lines"].values()) == r["counts"]["step"]["py_lines"]
    for c in bw.CATEGORIES:
        g = got["growth"][c]
        assert set(g["per_R"]) == {"2", "4"} and isinstance(g["flat"], bool) and isinstance(g["linear"], bool)
        assert g["flat"] == (g["per_R"]["2"] == g["per_R"]["4"])
        assert g["slope_per_request"] == (g["per_R"]["4"] - g["per_R"]["2"]) / 2
    assert set(got["growth_by_phase"]) == {"step", "begin", "fold", "naive"}
    assert {"ops_focus", "host_syncs_focus", "uploads_focus", "ops_inner", "py_lines"} <= set(got["sites"])
    for x in got["sites"]["py_lines"]:
        assert x["per_request"] != 0 and set(x["per_R"]) == {"2", "4"}
        path, func, line = x["site"].rsplit(":", 2)
        assert (ROOT / path).is_file() and int(line) > 0
    assert set(got["sources"]["files"]) == {"vtoken/integrations/vllm/worker/eviction.py", "vtoken/side_cache.py",
                                            "vtoken/select.py"}
