"""Request-time checks in the front-end process (the OpenAI server, or the ``LLM`` process).

The front end builds the engine config (``EngineArgs.create_engine_config`` runs in the
process that serves requests: the API server's process 0, or the ``LLM`` user's process),
so the plugin hands the parsed :class:`~vtoken.config.VTokenConfig` to
:func:`set_engine_config` there. With it:

* :func:`check_request` validates a request's ``vtoken_*`` overrides *applied to the
  engine config* (the request's effective config), so an override that contradicts the
  engine config (``vtoken_budget`` below the engine's ``sink_tokens + recent_tokens``) is
  a ``ValueError`` (HTTP 400 naming the field), not a request that silently evicts nothing.
  Without a stored config (a process that never built one, e.g. the EngineCore) each field
  is checked alone; the scheduler checks the combination again and never crashes on it.
* :class:`XargsGuard`, an ASGI middleware added to the OpenAI app, applies the same parser
  (:func:`vtoken.config.parse_request_overrides`) to the raw JSON ``vllm_xargs`` before
  vLLM's request model narrows JSON booleans to 0/1: ``"vtoken_budget": true`` is refused
  exactly as ``budget: true`` is at start-up (patches/ entry
  ``vllm.entrypoints.launchers.app.init_entrypoints_middleware``).
* beam search is refused by name (:data:`BEAM_SEARCH_REFUSAL`): vLLM's front end runs it as
  one-token requests, which never evict. Online, :class:`XargsGuard` answers HTTP 400 for a
  body with ``use_beam_search: true`` unless ``vllm_xargs.vtoken_enable`` is false; offline,
  ``LLM.beam_search`` raises ``ValueError`` (patches/ entry
  ``vllm.entrypoints.generate.beam_search.offline.BeamSearchOfflineMixin.beam_search``).
  Parallel sampling (``n > 1``) is not split that way: vLLM fans it out into ``n`` whole
  requests, each of which evicts as any other.
* a ``vtoken_budget`` above ``max_model_len`` is refused (no request can hold more tokens,
  so it would never evict; ``vtoken_enable: false`` says that explicitly).
* streaming-input (resumable) requests are refused by name (patches/ entry
  ``vllm.v1.engine.async_llm.AsyncLLM._validate_streaming_input_sampling_params``):
  a resumable request keeps its blocks across input chunks, while vToken's per-request
  state (prompt length, decode phase) is built for one prompt.

Limitation: with ``--api-server-count > 1`` the extra API-server processes do not build the
engine config; there each field is checked alone and the scheduler checks the combination.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from typing import Any, Optional

from vtoken.config import VTokenConfig, VTokenConfigError, parse_request_overrides
from vtoken.integrations.vllm.frontend.refusals import REFUSALS

_REFUSAL = next(r for r in REFUSALS if r.key == "streaming_input")
_BEAM = next(r for r in REFUSALS if r.key == "beam_search")

logger = logging.getLogger("vllm.vtoken")

__all__ = ["set_engine_config", "set_max_model_len", "engine_config", "check_request", "XargsGuard",
           "STREAMING_INPUT_REFUSAL", "BEAM_SEARCH_REFUSAL", "OFFLINE_BEAM_SEARCH_REFUSAL"]

_engine_cfg: Optional[VTokenConfig] = None
_max_model_len: Optional[int] = None
_per_head_ok = True
_rope_problem: Optional[str] = None  # why Expected Attention cannot run on the model (None: it can)

#: The message of the beam-search refusal through the OpenAI server (its row of refusals.REFUSALS).
BEAM_SEARCH_REFUSAL = (
    f"use_beam_search = True: vToken does not support beam search yet: {_BEAM.reason}; leave use_beam_search "
    "out, or set vllm_xargs.vtoken_enable = false for this request (beam search then runs as in stock vLLM)"
)
#: The same refusal for the offline ``LLM.beam_search`` (BeamSearchParams carries no extra_args).
OFFLINE_BEAM_SEARCH_REFUSAL = (
    f"LLM.beam_search: vToken does not support beam search yet: {_BEAM.reason}; build this LLM without the "
    "vtoken key of additional_config to run beam search"
)

#: The message of the streaming-input refusal (its row of refusals.REFUSALS, plus what to do instead).
STREAMING_INPUT_REFUSAL = (
    f"vToken does not support {_REFUSAL.option} yet: {_REFUSAL.reason}; send each turn as its own request, "
    "or set vllm_xargs.vtoken_enable = false for this request"
)


def set_engine_config(cfg: Optional[VTokenConfig]) -> None:
    """Record the engine's vToken config in this process (None: vToken off) and install the
    request-time guards (idempotent). Called by the plugin's ``create_engine_config`` wrapper."""
    global _engine_cfg, _max_model_len, _per_head_ok, _rope_problem
    _engine_cfg = cfg
    _max_model_len = None
    _per_head_ok = True
    _rope_problem = None
    if cfg is not None:
        _install_middleware_hook()
        _install_streaming_input_refusal()
        _install_offline_beam_search_refusal()


def set_max_model_len(max_model_len: Optional[int]) -> None:
    """Record the engine's resolved ``max_model_len`` (tokens): the upper bound of ``vtoken_budget``."""
    global _max_model_len
    _max_model_len = max_model_len


def set_per_head_allowed(ok: bool) -> None:
    """Record whether per-head token sets are possible (False: tensor parallelism replicates KV
    heads; refusals ``per_head_replicated_kv``)."""
    global _per_head_ok
    _per_head_ok = ok


def set_rope_problem(problem: Optional[str]) -> None:
    """Record why Expected Attention cannot run on the engine's model, or None (refusals ``ea_rope``)."""
    global _rope_problem
    _rope_problem = problem


def engine_config() -> Optional[VTokenConfig]:
    """The engine config recorded in this process, or None."""
    return _engine_cfg


def check_request(extra_args: Optional[dict]) -> None:
    """Validate a request's ``vtoken_*`` keys, combined with the engine config when known.

    Raises:
        VTokenConfigError: names the ``vllm_xargs`` field, its value and what is allowed.
    """
    ov = parse_request_overrides(extra_args)
    if _max_model_len is not None and ov.vtoken_budget is not None and ov.vtoken_budget > _max_model_len:
        raise VTokenConfigError(
            f"vllm_xargs.vtoken_budget = {ov.vtoken_budget!r}: above max_model_len, so it would never evict; "
            f"allowed: 1..{_max_model_len} (set vllm_xargs.vtoken_enable = false to turn eviction off for this "
            "request)")
    if _engine_cfg is not None and ov.vtoken_enable:
        eff = ov.apply(_engine_cfg)
        if not _per_head_ok and eff.resolved_granularity() in ("head", "head_shared"):
            what = (f"vllm_xargs.vtoken_granularity = {ov.vtoken_granularity!r}" if ov.vtoken_granularity else
                    f"vllm_xargs.vtoken_policy = {ov.vtoken_policy!r} (its default granularity "
                    f"{eff.resolved_granularity()!r})")
            raise VTokenConfigError(
                f"{what}: per-head token sets need every tensor-parallel rank to own its KV heads, and this engine "
                "replicates them (more ranks than KV heads); allowed here: vtoken_granularity 'request' or 'layer'")
        if _rope_problem is not None and eff.policy == "expected_attention":
            raise VTokenConfigError(
                f"vllm_xargs.vtoken_policy = {eff.policy!r}: Expected Attention needs one full, plain or Llama 3 rotary "
                f"position embedding, and this model has {_rope_problem}; allowed here: another policy (e.g. keydiff, "
                "knorm)")


# ---------------------------------------------------------------------- raw JSON guard
def _xargs_error(body: bytes) -> Optional[str]:
    """The refusal for a JSON body (bad raw ``vllm_xargs.vtoken_*``, or beam search with
    eviction on), or None if fine / not ours."""
    if b"vtoken_" not in body and b"use_beam_search" not in body:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None  # vLLM answers malformed JSON itself
    if not isinstance(data, dict):
        return None
    xargs = data.get("vllm_xargs")
    ours = {k: v for k, v in xargs.items() if isinstance(k, str) and k.startswith("vtoken_")} \
        if isinstance(xargs, dict) else {}
    try:
        check_request(ours)
    except VTokenConfigError as e:
        return str(e)
    if data.get("use_beam_search") is True and parse_request_overrides(ours).vtoken_enable:
        return BEAM_SEARCH_REFUSAL
    return None


class XargsGuard:
    """ASGI middleware: a 400 naming the field for bad raw ``vllm_xargs.vtoken_*`` values.

    Only POST bodies that contain ``vtoken_`` are parsed; everything else passes through
    untouched (the body is replayed to the app unchanged). The error body has vLLM's
    OpenAI error shape (``{"error": {"message", "type": "BadRequestError", "param", "code": 400}}``).
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST" or _engine_cfg is None:
            await self.app(scope, receive, send)
            return
        messages: list[dict] = []
        chunks: list[bytes] = []
        while True:
            msg = await receive()
            messages.append(msg)
            if msg.get("type") != "http.request":
                break
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        err = _xargs_error(b"".join(chunks))
        if err is not None:
            param = err.split(" = ", 1)[0] if " = " in err else "vllm_xargs"
            payload = json.dumps({"error": {"message": err, "type": "BadRequestError", "param": param,
                                            "code": 400}}).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return

        async def replay():
            if messages:
                return messages.pop(0)
            return await receive()

        await self.app(scope, replay, send)


def _install_middleware_hook() -> None:
    # Only where the OpenAI app is built in this process (its module is already imported there).
    app_mod = sys.modules.get("vllm.entrypoints.launchers.app")
    if app_mod is None:
        return
    orig = app_mod.init_entrypoints_middleware
    if getattr(orig, "_vtoken_wrapped", False):
        return

    @functools.wraps(orig)
    def init_entrypoints_middleware(args, app, *a, **kw):
        app.add_middleware(XargsGuard)  # added first: innermost, after CORS and authentication
        return orig(args, app, *a, **kw)

    init_entrypoints_middleware._vtoken_wrapped = True
    app_mod.init_entrypoints_middleware = init_entrypoints_middleware


# ---------------------------------------------------------------------- offline beam search
def _install_offline_beam_search_refusal() -> None:
    # Only where the offline LLM class is loaded (its process builds the engine config).
    mod = sys.modules.get("vllm.entrypoints.generate.beam_search.offline")
    if mod is None:
        return
    orig = mod.BeamSearchOfflineMixin.beam_search
    if getattr(orig, "_vtoken_wrapped", False):
        return

    @functools.wraps(orig)
    def beam_search(self, *args, **kwargs):
        if _engine_cfg is not None:
            raise ValueError(OFFLINE_BEAM_SEARCH_REFUSAL)
        return orig(self, *args, **kwargs)

    beam_search._vtoken_wrapped = True
    mod.BeamSearchOfflineMixin.beam_search = beam_search


# ---------------------------------------------------------------------- streaming input
def _install_streaming_input_refusal() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.async_llm import AsyncLLM

    orig = AsyncLLM._validate_streaming_input_sampling_params
    if getattr(orig, "_vtoken_wrapped", False):
        return

    @functools.wraps(orig)
    def _validate_streaming_input_sampling_params(params):
        extra = getattr(params, "extra_args", None) or {}
        if _engine_cfg is not None and parse_request_overrides(extra).vtoken_enable:
            raise VLLMValidationError(STREAMING_INPUT_REFUSAL)
        return orig(params)

    _validate_streaming_input_sampling_params._vtoken_wrapped = True
    AsyncLLM._validate_streaming_input_sampling_params = staticmethod(_validate_streaming_input_sampling_params)
