"""vLLM general plugin: turns vToken on when ``additional_config`` has a ``vtoken`` key.

Registered as the ``vllm.general_plugins`` entry point ``vtoken``; vLLM calls
:func:`register` once in every process (front end, EngineCore, each worker).
Without a ``vtoken`` key the plugin changes nothing: the only things it installs are a
wrapper around ``EngineArgs.create_engine_config`` that returns the stock result
untouched (patches/ entry ``vllm.engine.arg_utils.EngineArgs.create_engine_config``),
a validation of the ``vtoken_*`` keys of ``SamplingParams.extra_args``, which only
acts on requests that carry such keys, and the start-up KV-capacity check's wrapper
(``sched/admission.py``), which only acts on a vToken engine with ``prefill_eviction: chunks``.

With ``vtoken`` set, the wrapper first refuses a vLLM release other than the tested one
(``refusals.check_vllm_version``; ``VTOKEN_ALLOW_UNTESTED_VLLM=1`` starts anyway, with one
warning), then validates the config (pydantic; errors name the field,
the value and what is allowed), refuses what vToken cannot support yet (naming the
option), and sets the scheduler and worker classes; prefix caching stays as the user set
it (the scheduler never repacks shared or cached blocks: docs/integration.md, "Prefix
caching"). It follows vLLM's own choice of model runner (V1 or Model Runner V2) and of
scheduling (sync or async): the scheduler class is :class:`VTokenAsyncScheduler` exactly
when vLLM resolved ``async_scheduling`` to True, and the worker builds the adapter of the
runner vLLM picked. Nothing about either is changed.
"""

from __future__ import annotations

import functools
import logging
import os

from vtoken.config import RequestOverrides, VTokenConfigError, parse_config
from vtoken.integrations.vllm.frontend import requests as frontend
from vtoken.integrations.vllm.frontend import platforms
from vtoken.integrations.vllm.frontend import refusals

logger = logging.getLogger("vllm.vtoken")  # a child of vLLM's logger: same handlers and format

SCHEDULER_CLS = "vtoken.integrations.vllm.sched.scheduler.VTokenScheduler"
ASYNC_SCHEDULER_CLS = "vtoken.integrations.vllm.sched.scheduler.VTokenAsyncScheduler"
CPU_WORKER_CLS = platforms.CPU_WORKER_CLS
CUDA_WORKER_CLS = platforms.CUDA_WORKER_CLS
#: opt-in to a platform vToken's eviction path has not been validated on (CUDA, until
#: ``make device-check`` passes on a GPU)
UNVALIDATED_ENV = "VTOKEN_UNVALIDATED_PLATFORM"

_registered = False


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent, no arguments)."""
    global _registered
    if _registered:
        return
    _registered = True
    _wrap_create_engine_config()
    _wrap_sampling_params_verify()
    from vtoken.integrations.vllm.sched import admission

    admission.install()  # (passes everything through without a vtoken key)


def _vtoken_raw(additional_config):
    if not additional_config:
        return None
    if isinstance(additional_config, str):
        import json

        additional_config = json.loads(additional_config)
    if not isinstance(additional_config, dict) or "vtoken" not in additional_config:
        return None
    return additional_config


def _wrap_create_engine_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_engine_config
    if getattr(orig, "_vtoken_wrapped", False):
        return

    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        ac = _vtoken_raw(self.additional_config)
        if ac is None:
            frontend.set_engine_config(None)
            return orig(self, *args, **kwargs)
        # another vLLM release than the tested one: refused unless VTOKEN_ALLOW_UNTESTED_VLLM=1
        untested = refusals.check_vllm_version()
        if untested:
            logger.warning("%s", untested)
        cfg = parse_config(ac["vtoken"])
        refusals.check_engine_args(self)  # refuse, naming the option, what vToken cannot do (refusals.REFUSALS)
        frontend.set_engine_config(cfg)  # request-time checks against this config (front-end process)
        # Prefix caching stays as the user set it: the scheduler keeps shared and cached blocks
        # out of every repack (docs/integration.md, "Prefix caching").
        vcfg = orig(self, *args, **kwargs)
        _check_model(vcfg)
        max_len = vcfg.model_config.max_model_len
        frontend.set_max_model_len(max_len)  # the upper bound of a request's vtoken_budget
        if cfg.budget_ratio is None and cfg.budget >= max_len:
            logger.warning("vToken: budget = %d is not below max_model_len = %d: no request can hold more than "
                           "max_model_len tokens, so none will evict unless it sets a smaller vtoken_budget",
                           cfg.budget, max_len)
        from vllm.platforms import current_platform

        # CPU, or CUDA with FlashAttention; other platforms / GPU backends refused by name (platforms.py)
        worker_cls = platforms.check_platform(vcfg, current_platform)
        if vcfg.scheduler_config.scheduler_cls is not None:
            refusals.refuse("scheduler_cls", vcfg.scheduler_config.scheduler_cls)
        _refuse_unsupported(cfg, vcfg, worker_cls)
        is_async = bool(vcfg.scheduler_config.async_scheduling)
        vcfg.scheduler_config.scheduler_cls = ASYNC_SCHEDULER_CLS if is_async else SCHEDULER_CLS
        vcfg.parallel_config.worker_cls = worker_cls
        vcfg.additional_config["vtoken"] = cfg.model_dump()
        # /metrics (front end) must see the EngineCore's vtoken: metrics: their directory and its
        # collector, set up here, before the EngineCore starts (sched/metrics.py).
        from vtoken.integrations.vllm.sched.metrics import setup_prometheus_bridge

        setup_prometheus_bridge()
        plan = cfg.plan()
        logger.info(
            "vToken on: mode=%s policy=%s budget=%s%s slack=%d sinks/recent=%s block_size=%s "
            "model_runner=%s scheduling=%s granularity=%s prefill_eviction=%s",
            cfg.mode, cfg.policy, cfg.budget,
            f" (ratio {cfg.budget_ratio})" if cfg.budget_ratio else "",
            plan.slack, (plan.sink_tokens, plan.recent_tokens), vcfg.cache_config.block_size,
            "v2" if vcfg.use_v2_model_runner else "v1", "async" if is_async else "sync",
            plan.granularity + ("" if cfg.granularity else " (the policy's default)"),
            plan.prefill_eviction + ("" if cfg.prefill_eviction else " (the default)"),
        )
        for w in plan.known_weaknesses():
            logger.warning("vToken: %s", w)
        return vcfg

    create_engine_config._vtoken_wrapped = True
    EngineArgs.create_engine_config = create_engine_config


def _refuse_unsupported(cfg, vcfg, worker_cls: str) -> None:
    """What vToken cannot do yet on this platform and model is refused, by name (refusals.py). CUDA has
    not been validated on a GPU yet: it starts only with ``VTOKEN_UNVALIDATED_PLATFORM=1``."""
    if worker_cls == platforms.CUDA_WORKER_CLS:
        if os.environ.get(UNVALIDATED_ENV, "0") in ("", "0"):
            refusals.refuse("cuda_unvalidated", "CUDA", f"{UNVALIDATED_ENV} is not set")
        logger.warning("vToken: running on CUDA, which has not been validated on a GPU (%s=1); run "
                       "`make device-check` on this machine first", UNVALIDATED_ENV)
    tp = vcfg.parallel_config.tensor_parallel_size
    replicated = vcfg.model_config.get_total_num_kv_heads() < tp
    frontend.set_per_head_allowed(not replicated)
    gran = cfg.plan().granularity
    if replicated and gran in ("head", "head_shared"):
        refusals.refuse("per_head_replicated_kv", gran,
                        f"the model has {vcfg.model_config.get_total_num_kv_heads()} KV heads, "
                        f"--tensor-parallel-size is {tp}")
    rope = refusals.rope_problem(vcfg.model_config.hf_text_config)
    where = "the model's config"
    if rope is None and vcfg.model_config.using_transformers_backend():
        # e.g. GPT-NeoX, OLMo 2, Phi in vLLM 0.32: the RoPE runs inside the transformers code, so the worker
        # finds no rotary embedding to un-rotate queries with (a request would fail at its first scored step)
        rope = "its RoPE inside vLLM's Transformers modeling backend (transformers code, not a vLLM rotary layer)"
        where = "the model as vLLM serves it"
    frontend.set_rope_problem(rope)
    if rope is not None and cfg.policy == "expected_attention":
        refusals.refuse("ea_rope", cfg.policy, f"{where}: {rope}")


def _check_block_size(block_size) -> None:
    """Refuse a KV block size the CPU attention backend cannot use (see ``platforms.check_block_size``)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    platforms.check_block_size(block_size, CPUAttentionBackend)


def _check_model(vcfg) -> None:
    """Start-up refusals on the built config: model features, resolved KV-cache dtype (refusals.py)."""
    refusals.check_model(vcfg)
    refusals.check_kv_cache_dtype(vcfg)


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
            known = set(RequestOverrides.model_fields)
            unknown = sorted(k for k in extra if isinstance(k, str) and k.startswith("vtoken_") and k not in known)
            if unknown:
                # the start-up format (vtoken.config): "<where>.<key> = <value>: <problem>; allowed: ..."
                raise ValueError(f"vllm_xargs.{unknown[0]} = {extra[unknown[0]]!r}: unknown key; "
                                 f"allowed: {sorted(known)}")
            try:
                frontend.check_request(extra)  # the request's effective config: overrides applied to the engine's
            except VTokenConfigError as e:
                raise ValueError(str(e)) from None
        return res

    _verify_args._vtoken_wrapped = True
    SamplingParams._verify_args = _verify_args
