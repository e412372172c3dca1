"""Which vLLM platforms and attention backends vToken runs on, and which worker it installs.

Called by the plugin's ``create_engine_config`` wrapper on the built ``VllmConfig``
(front-end process, before any weights load) and, for the attention backend vLLM picked
automatically, by the CUDA worker after the model is loaded (:func:`check_layer_backends`).
Every refusal goes through :func:`vtoken.integrations.vllm.frontend.refusals.refuse` (one table, one
error format, README block generated from it).

Support matrix (README "GPU support"):

=================  ==========================  =============================================
platform           attention backend           worker
=================  ==========================  =============================================
CPU                CPU_ATTN                    ``worker.VTokenCPUWorker``
NVIDIA CUDA        FLASH_ATTN                  ``gpu_worker.VTokenGPUWorker``
NVIDIA CUDA        anything else (FLASHINFER,  refused by name (``--attention-backend``)
                   TRITON_ATTN, FLEX_ATTENTION,
                   TURBOQUANT, MLA backends...)
ROCm, TPU, XPU,    --                          refused by name (``platform``)
out-of-tree
=================  ==========================  =============================================
"""

from __future__ import annotations

from typing import Any, Optional

from vtoken.integrations.vllm.frontend import refusals

__all__ = ["CPU_WORKER_CLS", "CUDA_WORKER_CLS", "CUDA_BACKENDS", "platform_name", "check_platform",
           "backend_name", "check_cuda_backend", "check_block_size", "check_layer_backends"]

CPU_WORKER_CLS = "vtoken.integrations.vllm.worker.cpu_worker.VTokenCPUWorker"
CUDA_WORKER_CLS = "vtoken.integrations.vllm.worker.gpu_worker.VTokenGPUWorker"
#: GPU attention backends vToken's CUDA worker implements (``AttentionBackend.get_name()``).
CUDA_BACKENDS = ("FLASH_ATTN",)


def platform_name(platform) -> str:
    """A readable name of a vLLM ``Platform`` (``current_platform``): ``"CUDA"``, ``"ROCm"``, ``"TPU"``,
    ``"XPU"``, ``"CPU"``, or the platform's ``device_name`` / class name otherwise (out-of-tree)."""
    for meth, name in (("is_cuda", "CUDA"), ("is_rocm", "ROCm"), ("is_tpu", "TPU"), ("is_xpu", "XPU"),
                       ("is_cpu", "CPU")):
        f = getattr(platform, meth, None)
        if f is not None and f():
            return name
    return str(getattr(platform, "device_name", None) or type(platform).__name__)


def backend_name(backend: Any) -> Optional[str]:
    """``AttentionBackendEnum`` member, backend class or string -> its name (``"FLASH_ATTN"``); None for auto."""
    if backend is None:
        return None
    if isinstance(backend, str):
        return None if backend.lower() == "auto" else backend.upper()
    get_name = getattr(backend, "get_name", None)  # an AttentionBackend class
    if callable(get_name):
        return str(get_name())
    return str(getattr(backend, "name", backend))


def check_block_size(block_size: int, backend_cls) -> None:
    """Refuse a KV block size ``backend_cls`` (a vLLM ``AttentionBackend`` class) cannot use, naming
    ``--block-size``. Stock vLLM accepts the value at config time and fails later inside the worker.

    Raises:
        VTokenConfigError: ``--block-size = <n>: ... allowed: a multiple of <k>, ...``.
    """
    from vllm.v1.attention.backend import MultipleOf

    sizes = backend_cls.get_supported_kernel_block_sizes()
    ok = any((isinstance(s, MultipleOf) and block_size % s.base == 0) or (isinstance(s, int) and block_size == s)
             for s in sizes)
    if not ok:
        allowed = ", ".join(f"a multiple of {s.base}" if isinstance(s, MultipleOf) else str(s) for s in sizes)
        example = next((s.base for s in sizes if isinstance(s, MultipleOf)), None) or next(iter(sizes), None)
        refusals.refuse("block_size", block_size, f"the attention backend ({backend_cls.get_name()}) cannot use it "
                        f"without splitting blocks; allowed: {allowed}, e.g. --block-size {example}")


def check_cuda_backend(vcfg) -> None:
    """Refuse, by name, an attention backend other than FlashAttention chosen in the config
    (``--attention-backend`` / ``--attention-config``, including ``backend_per_kind``).

    ``None`` (vLLM's automatic choice) passes here; the worker checks the backend vLLM
    actually picked once the model is loaded (:func:`check_layer_backends`).

    Raises:
        VTokenConfigError: ``--attention-backend = 'FLASHINFER': vToken does not support it yet (...)``.
    """
    ac = getattr(vcfg, "attention_config", None)
    chosen = [backend_name(getattr(ac, "backend", None))]
    chosen += [backend_name(b) for b in (getattr(ac, "backend_per_kind", None) or {}).values()]
    for name in chosen:
        if name is not None and name not in CUDA_BACKENDS:
            refusals.refuse("attention_backend", name)


def check_platform(vcfg, platform) -> str:
    """Start-up check of the platform (and, on CUDA, the attention backend and block size).

    Args:
        vcfg: vLLM's built ``VllmConfig``.
        platform: ``vllm.platforms.current_platform``.

    Returns:
        the dotted path of the worker class to install (:data:`CPU_WORKER_CLS` or
        :data:`CUDA_WORKER_CLS`).

    Raises:
        VTokenConfigError: ``platform = 'ROCm': ...`` for ROCm, TPU, XPU and out-of-tree platforms;
            ``--attention-backend = '<NAME>': ...`` on CUDA for any backend but FLASH_ATTN, and for a
            model dtype FlashAttention cannot run (float32: vLLM would pick another backend);
            ``--block-size = <n>: ...`` for a block size the backend cannot use.
    """
    block_size = vcfg.cache_config.block_size
    if platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        check_block_size(block_size, CPUAttentionBackend)
        return CPU_WORKER_CLS
    if platform.is_cuda():  # NVIDIA only: ROCm answers is_rocm() (is_cuda_alike() covers both)
        check_cuda_backend(vcfg)
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        dtype = getattr(getattr(vcfg, "model_config", None), "dtype", None)
        if dtype is not None and dtype not in FlashAttentionBackend.supported_dtypes:
            name = str(dtype).removeprefix("torch.")
            refusals.refuse("attention_backend", backend_name(vcfg.attention_config.backend) or "auto",
                            f"--dtype {name}: FlashAttention runs float16 and bfloat16 only, so vLLM would pick "
                            "another backend; use --dtype bfloat16 or float16")

        if block_size is not None:
            check_block_size(block_size, FlashAttentionBackend)
        return CUDA_WORKER_CLS
    refusals.refuse("platform", platform_name(platform))
    raise AssertionError("unreachable")  # refuse() always raises


def check_layer_backends(layers: dict[str, Any]) -> str:
    """The attention backend vLLM picked for the loaded layers (the CUDA worker, after ``load_model``).

    Args:
        layers: layer name -> vLLM attention layer (``compilation_config.static_forward_context``);
            layers without ``get_attn_backend`` (non-attention entries) are skipped.

    Returns:
        the backend name (``"FLASH_ATTN"``).

    Raises:
        VTokenConfigError: ``--attention-backend = '<NAME>': ...; layer <name> (picked automatically)``
            for the first layer whose backend is not FlashAttention.
    """
    names: list[str] = []
    for lname, layer in layers.items():
        get = getattr(layer, "get_attn_backend", None)
        if get is None:
            continue
        name = backend_name(get())
        if name not in CUDA_BACKENDS:
            refusals.refuse("attention_backend", name, f"layer {lname}; vLLM picked it for this GPU and model")
        names.append(name)
    return names[0] if names else CUDA_BACKENDS[0]
