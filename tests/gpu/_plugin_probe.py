"""Run the plugin's real ``create_engine_config`` wrapper with the platform seen as CUDA / ROCm / CPU.

Used by ``test_gpu_path_cpu.py`` in a subprocess (the wrapper sets up process-wide state). vLLM's own
config code keeps the real CPU platform (it binds ``current_platform`` at import); only the plugin's
call-time lookup sees the stand-in, which answers ``is_cpu`` / ``is_cuda`` / ``is_rocm`` and delegates
the rest. FlashAttention's module is imported first, under the real platform (on CPU its import-time
CUDA extension check would fail). Prints one JSON object: case -> worker class or error message.
"""

from __future__ import annotations

import json
import os
import sys

import vllm.platforms as vp
import vllm.v1.attention.backends.flash_attn  # noqa: F401  (under the real platform)
from vllm.engine.arg_utils import EngineArgs

from vtoken.integrations.vllm import plugin


class Seen:
    def __init__(self, real, kind):
        self._real, self._kind = real, kind

    def __getattr__(self, name):
        return getattr(self._real, name)

    def is_cpu(self):
        return self._kind == "cpu"

    def is_cuda(self):
        return self._kind == "cuda"

    def is_rocm(self):
        return self._kind == "rocm"


#: cases opted in to the unvalidated CUDA path (VTOKEN_UNVALIDATED_PLATFORM=1); the others run without it
OPT_IN = {"cuda_bf16", "cuda_flash_attn", "cuda_flashinfer", "cuda_triton_attn", "cuda_float32", "rocm", "cpu"}
CASES = {
    "cuda_not_opted_in": ("cuda", dict(dtype="bfloat16")),
    "cuda_bf16": ("cuda", dict(dtype="bfloat16")),
    "cuda_flash_attn": ("cuda", dict(dtype="bfloat16", attention_backend="FLASH_ATTN")),
    "cuda_flashinfer": ("cuda", dict(dtype="bfloat16", attention_backend="FLASHINFER")),
    "cuda_triton_attn": ("cuda", dict(dtype="bfloat16", attention_backend="TRITON_ATTN")),
    "cuda_float32": ("cuda", dict(dtype="float32")),
    "rocm": ("rocm", dict(dtype="bfloat16")),
    "cpu": ("cpu", dict(dtype="bfloat16")),
}


def main(model: str) -> None:
    plugin.register()
    real = vp.current_platform
    out = {}
    for name, (kind, kw) in CASES.items():
        vp.current_platform = Seen(real, kind)
        os.environ.pop("VTOKEN_UNVALIDATED_PLATFORM", None)
        if name in OPT_IN:
            os.environ["VTOKEN_UNVALIDATED_PLATFORM"] = "1"
        try:
            ea = EngineArgs(model=model, block_size=32, skip_tokenizer_init=True, enable_prefix_caching=False,
                            additional_config={"vtoken": {"policy": "h2o", "budget": 64}}, **kw)
            out[name] = dict(worker=ea.create_engine_config().parallel_config.worker_cls)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[name] = dict(error=f"{type(exc).__name__}: {exc}")
        finally:
            del vp.current_platform
    print("PROBE " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
