"""``benchmarks/bench_ray_serve.py`` (vToken behind Ray Serve LLM): its pure parts (the LLMConfig it
builds, the loopback and pass checks, the network-namespace command) and the committed CPU result.
No Ray needed: CI does not install it; the one check against Ray's own ``LLMConfig`` is skipped
without it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_ray_serve as br  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "ray_serve_cpu.json"


def test_cpu_config_carries_vtoken_in_additional_config():
    cfg = br.llm_config("/m", "cpu", 2, br.VT)
    assert cfg["engine_kwargs"]["additional_config"] == {"vtoken": br.VT}
    assert cfg["accelerator_config"] == {"kind": "cpu"}
    assert cfg["deployment_config"] == {"num_replicas": 2}
    env = cfg["runtime_env"]["env_vars"]
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    # Ray Serve LLM refuses these in engine_kwargs (model_loading_config names the model)
    assert "model" not in cfg["engine_kwargs"] and "served_model_name" not in cfg["engine_kwargs"]
    assert cfg["engine_kwargs"]["block_size"] % 32 == 0  # vLLM's CPU attention


def test_gpu_config_defaults_to_ray_serve_gpu_bundles_or_a_share():
    cfg = br.llm_config("/m", "gpu", 2, br.VT)
    assert "accelerator_config" not in cfg and "placement_group_config" not in cfg
    assert "gpu_memory_utilization" not in cfg["engine_kwargs"]
    assert "OMP_NUM_THREADS" not in cfg["runtime_env"]["env_vars"]
    half = br.llm_config("/m", "gpu", 2, br.VT, 0.5)
    assert half["placement_group_config"] == {"bundles": [{"GPU": 0.5}]}
    assert half["engine_kwargs"]["gpu_memory_utilization"] == 0.4


def test_config_validates_against_ray_serve_llm():
    llm = pytest.importorskip("ray.serve.llm")
    c = llm.LLMConfig(**br.llm_config("/m", "cpu", 2, br.VT))
    assert type(c.accelerator_config).__name__ == "CPUConfig"
    assert c.engine_kwargs["additional_config"] == {"vtoken": br.VT}


def test_cli_args_match_engine_kwargs():
    e = br.engine_kwargs("cpu", br.VT)
    args = br.cli_args(e)
    assert "--additional-config" not in args
    assert args[args.index("--block-size") + 1] == "32"
    assert "--enforce-eager" in args and "--no-enable-prefix-caching" in args
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.2"


def test_completion_body_is_greedy_with_overrides():
    b = br.completion_body("hi", 16, {"vtoken_budget": 56})
    assert b["temperature"] == 0.0 and b["ignore_eos"] and b["return_token_ids"]
    assert b["vllm_xargs"] == {"vtoken_budget": 56} and b["model"] == br.MODEL_ID
    assert "vllm_xargs" not in br.completion_body("hi", 16, None)
    assert br.request_xargs(10)[8:] == br.XARGS[:2]


@pytest.mark.parametrize("listening, ips, off", [
    ([("127.0.0.1", 1, "a"), ("::1", 2, "b"), ("::ffff:127.0.0.1", 3, "c")], ["127.0.0.1", "10.0.0.2"], []),
    # a wildcard socket is on every interface: loopback only when there is no other address
    ([("0.0.0.0", 1, "a"), ("::", 2, "b")], ["127.0.0.1", "::1"], []),
    ([("0.0.0.0", 1, "a"), ("::", 2, "b")], ["127.0.0.1", "10.0.0.2"], [("0.0.0.0", 1, "a"), ("::", 2, "b")]),
    ([("192.0.2.2", 4, "agent")], ["127.0.0.1", "::1"], [("192.0.2.2", 4, "agent")]),
])
def test_off_loopback(listening, ips, off):
    assert br.off_loopback(listening, ips) == off


def test_netns_command_brings_lo_up_and_reruns_the_script():
    argv = br.netns_argv("/py", "/s.py", ["--replicas", "2"], root=True)
    assert argv[:3] == ["unshare", "--net", "--"]
    assert "ip link set lo up" in argv[argv.index("-c") + 1]
    assert argv[-4:] == ["/py", "/s.py", "--replicas", "2"]
    assert "--map-root-user" in br.netns_argv("/py", "/s.py", [], root=False)


def test_started_pids():
    lines = ["worker-1.out: (MainProcess pid=23702) INFO 12-06 [plugin.py:119] vToken on: mode=vtoken", "x: no pid"]
    assert br.started_pids(lines) == {23702}


def test_check_requires_every_replica_to_evict_and_the_oracle_totals():
    want = {"evicted_tokens": 10, "evictions": 2, "freed_blocks": 1}
    a = {"vtoken:evicted_tokens_total": 6.0, "vtoken:evictions_total": 1.0, "vtoken:freed_blocks_total": 1.0}
    b = {"vtoken:evicted_tokens_total": 4.0, "vtoken:evictions_total": 1.0, "vtoken:freed_blocks_total": 0.0}
    assert br.check({"r1": a, "r2": b}, want, 2, [True, True], {"r1": 1, "r2": 2}, {1, 2}) == []
    idle = {k: 0.0 for k in a}
    fails = br.check({"r1": {k: a[k] + b[k] for k in a}, "r2": idle}, want, 2, [True])
    assert fails == ["replica r2 evicted nothing"]
    assert br.check({"r1": a}, want, 2, [False], {"r1": 1}, set()) == [
        "1 replicas answered, 2 expected", "replica r1 (pid 1) did not log 'vToken on:'",
        "sum over replicas of vtoken:evicted_tokens_total = 6, oracle 10",
        "sum over replicas of vtoken:evictions_total = 1, oracle 2", "requests [0]: tokens differ from the oracle's"]


def test_committed_cpu_result():
    """The numbers docs/scaling.md quotes: two replicas, both evicted, totals and tokens equal the
    oracle's and the single server's, every Ray socket on loopback."""
    r = json.loads(RESULT.read_text())
    assert r["passed"] and r["failures"] == []
    assert r["meta"]["device"] == "cpu" and r["meta"]["replicas"] == 2
    assert r["meta"]["llm_config"]["engine_kwargs"]["additional_config"] == {"vtoken": br.VT}
    reps = r["replicas"]
    assert len(reps) == 2
    for rep in reps.values():
        assert rep["vtoken"]["vtoken:evicted_tokens_total"] > 0
    assert br.started_pids(r["vtoken_on_lines"]) >= {rep["pid"] for rep in reps.values()}
    for k, v in r["oracle"].items():
        assert sum(rep["vtoken"][f"vtoken:{k}_total"] for rep in reps.values()) == v
    assert sum(rep["vtoken"]["vtoken:request_peak_blocks_count"] for rep in reps.values()) == len(r["requests"])
    assert all(q["tokens_equal_oracle"] for q in r["requests"])
    assert all(r["single_server"]["tokens_equal_ray_serve"])
    assert r["off_loopback"] == [] and r["listening"]
    assert all(br._is_loopback(ip) for ip in r["interface_ips"])
