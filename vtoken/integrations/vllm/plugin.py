"""vLLM general plugin: turns vToken on when ``additional_config`` has a ``vtoken`` key.

Registered as the ``vllm.general_plugins`` entry point ``vtoken``; vLLM calls
:func:`register` once in every process (front end, EngineCore, each worker).
Without a ``vtoken`` key the plugin changes nothing: the only thing it installs is a
wrapper around ``EngineArgs.create_engine_config`` that returns the stock result
untouched (patches/ entry ``vllm.engine.arg_utils.EngineArgs.create_engine_config``),
and a validation of the ``vtoken_*`` keys of ``SamplingParams.extra_args``, which only
acts on requests that carry such keys.

With ``vtoken`` set, the wrapper validates the config (pydantic; errors name the field,
the value and what is allowed), refuses what vToken cannot support yet (naming the
option), turns prefix caching off with one warning, forces the V1 model runner and
synchronous scheduling, and sets the scheduler and worker classes.
"""

from __future__ import annotations

import functools
import logging
import os

from vtoken.config import VTokenConfigError, parse_config, parse_request_overrides

logger = logging.getLogger("vllm.vtoken")  # a child of vLLM's logger: same handlers and format

SCHEDULER_CLS = "vtoken.integrations.vllm.scheduler.VTokenScheduler"
CPU_WORKER_CLS = "vtoken.integrations.vllm.worker.VTokenCPUWorker"

_registered = False


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent, no arguments)."""
    global _registered
    if _registered:
        return
    _registered = True
    _wrap_create_engine_config()
    _wrap_sampling_params_verify()


def _vtoken_raw(additional_config):
    if not additional_config:
        return None
    if isinstance(additional_config, str):
        import json

        additional_config = json.loads(additional_config)
    if not isinstance(additional_config, dict) or "vtoken" not in additional_config:
        return None
    return additional_config


def _refuse(option: str, value, why: str) -> None:
    # the one error format (vtoken.config): "<where> = <value>: <problem>"
    raise VTokenConfigError(f"{option} = {value!r}: vToken does not support it yet ({why})")


def _wrap_create_engine_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_engine_config
    if getattr(orig, "_vtoken_wrapped", False):
        return

    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        ac = _vtoken_raw(self.additional_config)
        if ac is None:
            return orig(self, *args, **kwargs)
        cfg = parse_config(ac["vtoken"])
        # --- refuse what v1 cannot do, naming the option ---
        if self.speculative_config:
            _refuse("--speculative-config", self.speculative_config, "drafters address the KV cache by logical position")
        if (self.pipeline_parallel_size or 1) > 1:
            _refuse("--pipeline-parallel-size", self.pipeline_parallel_size, "scores would need a cross-stage exchange")
        if self.kv_transfer_config is not None:
            _refuse("--kv-transfer-config", "set", "KV connectors assume positionally stable block tables")
        if getattr(self, "kv_events_config", None) is not None:
            _refuse("--kv-events-config", "set", "KV events describe hashed blocks, which repacking invalidates")
        if str(self.kv_cache_dtype).startswith("fp8"):
            _refuse("--kv-cache-dtype", self.kv_cache_dtype, "the token-move layout probe covers fp32/bf16/fp16 caches")
        if self.enable_prefix_caching is not False:
            logger.warning(
                "vToken: prefix caching turned off (--no-enable-prefix-caching): repacking live tokens "
                "changes block contents, so block hashes would lie"
            )
            self.enable_prefix_caching = False
        self.async_scheduling = False
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        vcfg = orig(self, *args, **kwargs)
        _check_model(vcfg)
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            raise VTokenConfigError(
                "vToken's integration currently runs on the CPU backend only (the GPU path is a later milestone)"
            )
        _check_block_size(vcfg.cache_config.block_size)
        vcfg.scheduler_config.scheduler_cls = SCHEDULER_CLS
        vcfg.parallel_config.worker_cls = CPU_WORKER_CLS
        vcfg.additional_config["vtoken"] = cfg.model_dump()
        # /metrics (front end) must see the EngineCore's vtoken: metrics: Prometheus
        # multiprocess mode, set up here, before the EngineCore and vLLM's stat loggers exist.
        from vtoken.integrations.vllm.metrics import setup_prometheus_bridge

        setup_prometheus_bridge()
        logger.info(
            "vToken on: mode=%s policy=%s budget=%s%s slack=%d sinks/recent=%s block_size=%s",
            cfg.mode, cfg.policy, cfg.budget,
            f" (ratio {cfg.budget_ratio})" if cfg.budget_ratio else "",
            cfg.resolved_slack(), cfg.protections(), vcfg.cache_config.block_size,
        )
        return vcfg

    create_engine_config._vtoken_wrapped = True
    EngineArgs.create_engine_config = create_engine_config


def _check_block_size(block_size) -> None:
    """Refuse a KV block size the CPU attention backend cannot use, naming ``--block-size``.

    Stock vLLM accepts the value here and fails later, inside the worker, with a deep
    traceback ("No common block size for 16 (CPU_ATTN: [MultipleOf(32)])").
    """
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_kernel_block_sizes()
    ok = any((isinstance(s, MultipleOf) and block_size % s.base == 0) or (isinstance(s, int) and block_size == s)
             for s in sizes)
    if not ok:
        allowed = ", ".join(f"a multiple of {s.base}" if isinstance(s, MultipleOf) else str(s) for s in sizes)
        raise VTokenConfigError(
            f"--block-size = {block_size!r}: the CPU attention backend ({CPUAttentionBackend.get_name()}) "
            f"cannot use it; allowed: {allowed} (e.g. --block-size 32)"
        )


def _check_model(vcfg) -> None:
    mc = vcfg.model_config
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    sw = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None) or []
    if sw or any(t != "full_attention" for t in layer_types):
        raise VTokenConfigError(
            f"--model = {mc.model!r}: vToken does not support it yet (sliding-window or hybrid layers: "
            f"sliding_window={sw!r}, layer_types={sorted(set(layer_types)) or None})"
        )
    if getattr(mc, "is_hybrid", False) or getattr(mc, "has_inner_state", False):
        raise VTokenConfigError(f"--model = {mc.model!r}: vToken does not support it yet (hybrid/Mamba layers)")


def _wrap_sampling_params_verify() -> None:
    """Validate ``vtoken_*`` keys of ``extra_args`` where vLLM validates sampling params.

    A bad value raises ``ValueError`` (the OpenAI server answers HTTP 400 naming the
    field); requests without ``vtoken_*`` keys are untouched.
    """
    from vllm.sampling_params import SamplingParams

    orig = SamplingParams._verify_args
    if getattr(orig, "_vtoken_wrapped", False):
        return

    @functools.wraps(orig)
    def _verify_args(self, *args, **kwargs):
        res = orig(self, *args, **kwargs)
        extra = self.extra_args
        if extra and any(isinstance(k, str) and k.startswith("vtoken_") for k in extra):
            known = {"vtoken_enable", "vtoken_budget", "vtoken_policy"}
            unknown = sorted(k for k in extra if isinstance(k, str) and k.startswith("vtoken_") and k not in known)
            if unknown:
                # the start-up format (vtoken.config): "<where>.<key> = <value>: <problem>; allowed: ..."
                raise ValueError(f"vllm_xargs.{unknown[0]} = {extra[unknown[0]]!r}: unknown key; "
                                 f"allowed: {sorted(known)}")
            try:
                parse_request_overrides(extra)
            except VTokenConfigError as e:
                raise ValueError(str(e)) from None
        return res

    _verify_args._vtoken_wrapped = True
    SamplingParams._verify_args = _verify_args
