"""Prompts longer than the KV pool (issue 25, item 2; ``prefill_eviction: chunks``).

With ``prefill_eviction: chunks`` a request never holds more than ``budget + slack +
prefill_eviction_every + 1`` tokens (:meth:`vtoken.config.RequestPlan.bound`: it evicts at its eviction points,
and vLLM's chunks never cross one), whatever its prompt. Two
of vLLM's checks assume a request holds its whole sequence, and vToken bounds both by that:

* **At start-up** ``vllm.v1.core.kv_cache_utils._check_enough_kv_cache_memory`` refuses an engine
  whose pool cannot hold one ``max_model_len`` sequence. :func:`install` wraps it: when the stock
  check fails and the engine's vToken config has ``prefill_eviction: chunks`` with a fixed
  ``budget``, the engine starts if the pool holds :func:`engine_bound` tokens (logged); otherwise
  the stock error is raised with what vToken would need. It reads the engine's config from a
  wrapper around ``get_kv_cache_configs`` as imported by ``vllm.v1.engine.core`` (a context
  variable while it runs). Without a ``vtoken`` key both wrappers pass everything through.
* **At admission** vLLM reserves the full prompt (``scheduler_reserve_full_isl``): the KV
  manager's ``get_num_blocks_to_allocate(apply_admission_cap=True)``, overridden in
  ``accounting.py``, caps the tokens to reserve at the request's own bound
  (``BlockAccounting.admission_cap``, set by the scheduler when the request is added).

``max_model_len`` still applies as in vLLM (a longer prompt is rejected by vLLM's own checks).
Naive-Evict (``mode: naive``) frees a block only once every token in it is dead, so its requests
have no such bound: both checks stay stock for it.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from typing import Any, Optional

from vtoken.config import VTokenConfig

__all__ = ["install", "engine_bound"]

logger = logging.getLogger("vllm.vtoken")

_VLLM_CONFIG: contextvars.ContextVar = contextvars.ContextVar("vtoken_kv_cache_vllm_config", default=None)


def engine_bound(vllm_config: Any) -> Optional[int]:
    """:meth:`vtoken.config.RequestPlan.bound` for the engine's own config, or None: no ``vtoken`` key, ``mode`` is
    ``naive``, ``prefill_eviction`` is not ``chunks``, or the budget is a ratio of the prompt (then
    no bound holds for every prompt)."""
    ac = getattr(vllm_config, "additional_config", None) or {}
    raw = ac.get("vtoken") if isinstance(ac, dict) else None
    if not raw:
        return None
    cfg = VTokenConfig.model_validate(raw)
    plan = cfg.plan()
    if plan.mode != "vtoken" or not plan.chunks or cfg.budget_ratio is not None:
        return None
    return plan.bound()


def install() -> None:
    """Wrap vLLM's start-up KV-capacity check (module docstring); idempotent."""
    import vllm.v1.core.kv_cache_utils as kcu
    import vllm.v1.engine.core as core

    orig_get = getattr(core, "get_kv_cache_configs", None)
    orig_check = getattr(kcu, "_check_enough_kv_cache_memory", None)
    if orig_get is None or orig_check is None:  # another vLLM (0.33 moved both into a config builder)
        logger.debug("vToken: vLLM's start-up KV-capacity check is not where vToken looks for it; prompts longer "
                     "than the KV cache are refused by vLLM's own check")
        return
    if getattr(orig_get, "_vtoken_wrapped", False):
        return

    @functools.wraps(orig_get)
    def get_kv_cache_configs(vllm_config, *args, **kwargs):
        token = _VLLM_CONFIG.set(vllm_config)
        try:
            return orig_get(vllm_config, *args, **kwargs)
        finally:
            _VLLM_CONFIG.reset(token)

    @functools.wraps(orig_check)
    def _check_enough_kv_cache_memory(available_memory, get_needed_memory, max_model_len, estimate_max_model_len):
        try:
            return orig_check(available_memory, get_needed_memory, max_model_len, estimate_max_model_len)
        except ValueError as e:
            vcfg = _VLLM_CONFIG.get()
            bound = engine_bound(vcfg) if vcfg is not None else None
            if bound is None or available_memory <= 0:
                raise
            fits = estimate_max_model_len(available_memory)
            if bound >= max_model_len:  # vToken's bound never asks more than stock vLLM needs
                raise
            if fits < bound:
                raise ValueError(
                    f"vToken: the KV cache holds {fits} tokens, below one request's bound of {bound} tokens "
                    f"(prefill_eviction chunks: vtoken.budget + slack + vtoken.prefill_eviction_every + 1); raise the KV "
                    "cache (--kv-cache-memory-bytes, --num-gpu-blocks-override, --gpu-memory-utilization) or lower "
                    f"vtoken.budget or vtoken.prefill_eviction_every (stock vLLM would need --max-model-len = "
                    f"{max_model_len} tokens). vLLM's check: {e}") from None
            logger.info("vToken: max_model_len = %d does not fit the KV cache (%d tokens), but with "
                        "prefill_eviction: chunks a request holds at most budget + slack + prefill_eviction_every + 1 "
                        "= %d tokens, which fits: prompts longer than the KV cache are admitted", max_model_len,
                        fits, bound)

    get_kv_cache_configs._vtoken_wrapped = True
    core.get_kv_cache_configs = get_kv_cache_configs
    kcu._check_enough_kv_cache_memory = _check_enough_kv_cache_memory
