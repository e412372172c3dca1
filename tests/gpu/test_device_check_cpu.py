"""``benchmarks/device_check.py``'s engine settings, without a GPU (the script itself runs on one).

The engines it starts must be ones the CUDA worker accepts (FlashAttention: bf16, a block size
that is a multiple of 16), the eager run must differ from the graph run only in
``cudagraph_mode``, and the oracle matrix must be the integration tests' one. Its plumbing was run
end to end on CPU engines with ``--dry-run-cpu`` (too slow for CI: about 3 minutes).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "benchmarks" / "device_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_engines_are_ones_the_cuda_worker_accepts():
    from types import SimpleNamespace

    import torch
    from vllm.config.attention import AttentionConfig

    from vtoken.integrations.vllm.frontend import platforms

    dc = _load()
    eager, graphs = dc.engine_kw("m", eager=True), dc.engine_kw("m", eager=False)
    assert eager.pop("compilation_config") == {"cudagraph_mode": "NONE"}
    assert eager == graphs and "enforce_eager" not in graphs  # same compilation, graphs differ only
    assert graphs["dtype"] == "bfloat16" and graphs["block_size"] == 16
    cfg = SimpleNamespace(attention_config=AttentionConfig(), cache_config=SimpleNamespace(block_size=16),
                          model_config=SimpleNamespace(dtype=torch.bfloat16))
    assert platforms.check_platform(cfg, SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: True)) == \
        platforms.CUDA_WORKER_CLS


def test_oracle_matrix_is_the_integration_tests_matrix():
    dc = _load()
    reqs = dc.oracle_requests()
    assert len(reqs) == 30 == len({r["id"] for r in reqs})
    assert {r["extra_args"]["vtoken_policy"] for r in reqs} == {"h2o", "tova", "scissorhands", "random", "streaming"}
    assert sorted({r["extra_args"]["vtoken_budget"] for r in reqs}) == [29, 45, 64]
    assert sorted({len(r["prompt_token_ids"]) for r in reqs}) == [20, 100]
    assert all(r["max_tokens"] == 64 for r in reqs)
    assert dc.PART_S["kernel_tests"] + dc.PART_S["bench"] + dc.PART_S["oracle_matrix"] + dc.PART_S["step_time"] <= 450
