"""vToken configuration: what `--additional-config '{"vtoken": {...}}'` accepts.

The same model validates the engine-wide config (at start-up) and the per-request
overrides (`SamplingParams.extra_args` / OpenAI `vllm_xargs`). Errors name the
field, the value and what is allowed, so the integration can turn them into a
start-up error or an HTTP 400 without a traceback from deep inside vLLM.

This module never imports vllm.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "VTokenConfig",
    "RequestPlan",
    "RequestOverrides",
    "VTokenConfigError",
    "parse_config",
    "parse_request_overrides",
    "effective_budget",
    "num_to_evict",
]


def _deprecation(msg: str) -> None:
    """Log a deprecation once per message (vLLM's logger family; the core never imports vllm)."""
    import logging

    if msg not in _DEPRECATIONS_SEEN:
        _DEPRECATIONS_SEEN.add(msg)
        logging.getLogger("vllm.vtoken").warning(msg)


_DEPRECATIONS_SEEN: set[str] = set()


class VTokenConfigError(ValueError):
    """A vToken option has a bad value. The message names the field, the value and what is allowed."""


def _format_validation_error(prefix: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        if not e["loc"] and e["type"] == "value_error":
            # A model_validator's ValueError: its message already names the field(s),
            # the value and what is allowed; print just that.
            ctx_err = (e.get("ctx") or {}).get("error")
            msg = str(ctx_err) if ctx_err is not None else e["msg"].removeprefix("Value error, ")
            lines.append(msg)
            continue
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        val = e.get("input")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = _unknown_key_msg(str(e["loc"][-1]) if e["loc"] else "")
        elif e["type"] in _INT_ERRORS:
            msg += "; allowed: a JSON integer (not a string, a float or a boolean)"
        lines.append(f"{prefix}.{loc} = {val!r}: {msg}")
    return "; ".join(lines)


#: pydantic's error types for a value that is not an integer (strict int fields)
_INT_ERRORS = ("int_type", "int_parsing", "int_from_float")

#: options that existed once and were removed: key -> why (a config naming one gets this in its error)
_REMOVED_KEYS = {"log_stats": "it never did anything; vToken's counters are on /metrics"}


def _unknown_key_msg(key: str) -> str:
    what = f"removed option ({_REMOVED_KEYS[key]})" if key in _REMOVED_KEYS else "unknown key"
    return f"{what}; allowed: {sorted(VTokenConfig.model_fields)}"


def get_policy_needs(name: str):
    """The :class:`~vtoken.policies.base.AttentionNeed` of the registered policy ``name``."""
    return _policy_class(name).needs


def _policy_class(name: str):
    from vtoken.policies import get_policy_class

    return get_policy_class(name)


def _known_policies() -> list[str]:
    from vtoken.policies import available_policies

    return sorted(available_policies())


class VTokenConfig(BaseModel):
    """Engine-wide vToken settings (the `vtoken` key of vLLM's `additional_config`).

    Budget semantics: a request whose live (physical) token count exceeds
    ``budget + slack`` after a step is evicted down to ``budget`` before the next
    step (``slack = 0``: evict every step once full). With ``budget_ratio`` set the
    budget is ``ceil(budget_ratio * prompt_len)`` per request, clamped from below to
    ``sink_tokens + recent_tokens``.

    Protections (tokens): the first ``sink_tokens`` logical positions (attention
    sinks) and the ``recent_tokens`` most recent live tokens are never evicted.
    ``None`` means the policy's own default (see each policy's docstring); a
    defaulted ``recent_tokens`` is clamped to ``budget - sink_tokens``.
    ``sink_tokens + recent_tokens`` must not exceed ``budget``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["vtoken", "naive"] = Field(
        "vtoken",
        description="vtoken: repack and free emptied blocks; naive: Naive-Evict baseline "
        "(same decisions; a block is freed only when every token ever placed in it is dead).",
    )
    policy: str = Field("h2o", description="eviction policy: a module of vtoken/policies/ or an entry point of the vtoken.policies group")
    budget: int = Field(256, ge=1, strict=True, description="KV budget per request, in tokens (live tokens kept after an eviction)")
    budget_ratio: Optional[float] = Field(
        None, gt=0.0, le=1.0,
        description="budget as a fraction of the prompt length, ceil(ratio * prompt tokens) (overrides budget)",
    )
    slack: Optional[int] = Field(
        None, ge=0, strict=True, description="tokens over budget tolerated before evicting (0: evict every step once full); "
        "null: the policy's default")
    sink_tokens: Optional[int] = Field(
        None, ge=0, strict=True, description="first logical positions never evicted (attention sinks), in tokens; "
        "null: the policy's default; sink_tokens + recent_tokens <= budget")
    recent_tokens: Optional[int] = Field(
        None, ge=0, strict=True, description="most recent tokens never evicted, in tokens; null: the policy's default")
    seed: int = Field(0, strict=True, description="seed of the random policy")
    policy_args: dict[str, Any] = Field(
        default_factory=dict, description="policy-specific parameters, e.g. {\"window\": 64} for scissorhands; "
        "unknown names are refused")
    score_every: int = Field(
        1, ge=1, strict=True, description="score attention on every prefill chunk and every k-th decode step (1: every step)"
    )
    pacing: Literal["fixed", "pressure"] = Field(
        "fixed",
        description="fixed: evict once live tokens exceed budget + slack; pressure: the budget is a floor applied "
        "only when the block pool is short (a step's block demand plus the watermark exceeds the free blocks), "
        "evicting just enough, most reclaimable requests first",
    )
    watermark_blocks: int = Field(
        0, ge=0, strict=True, description="pressure pacing: free blocks to keep in reserve, in blocks"
    )
    watermark_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="pressure pacing: free blocks to keep in reserve, as a fraction of the "
        "pool (the larger of the two watermarks applies)"
    )
    granularity: Optional[Literal["request", "layer", "head", "head_shared"]] = Field(
        None,
        description="token sets per request. request: one for every layer and KV head; layer: one per layer; head: "
        "one per (layer, KV head); head_shared: one per KV head across layers. Every set keeps the same number of "
        "live tokens, so block tables and slot mappings stay shared. null: the policy's default (README's policy "
        "table)",
    )
    prefill_eviction: Optional[Literal["after", "chunks"]] = Field(
        None,
        description="when a long prompt is cut to the budget. after: at the first decode step (the whole prompt held "
        "until then); chunks: also at the prompt's eviction points (every prefill_eviction_every tokens), so a "
        "request holds at most budget + slack + prefill_eviction_every + 1 tokens and a prompt longer than the KV "
        "cache is served; under pressure pacing, only when the pool is short. null: chunks (within 0.03 nats/token "
        "of after: docs/eviction.md)",
    )
    prefill_eviction_every: int = Field(
        2048, ge=1, strict=True,
        description="with prefill_eviction chunks: the prompt's eviction points, in tokens: a request evicts during "
        "its prefill only at multiples of this, and no prefill chunk crosses one, so the same greedy request gives "
        "the same tokens at any load. Smaller: less KV cache held during a long prefill, more prefill steps",
    )
    protect_cached_prefix: bool = Field(
        False,
        description="with vLLM prefix caching on: true: never evict a request's full prompt blocks, so they are "
        "never copied out of the cache and stay shared with every request that hits them"
        "; false: a request's first eviction copies the cached blocks it may "
        "write (the cache keeps them for others). No effect with prefix caching off",
    )

    prefix_hits: Literal["protect", "skip"] = Field(
        "skip",
        description="with vLLM prefix caching on, a request that may evict and whose policy needs statistics of the "
        "prompt tokens a hit skips (h2o, snapkv, knorm, expected_attention): protect: it reads its hit and never "
        "evicts the hit's tokens (its tokens may then depend on the cache); skip: it computes its whole prompt, so "
        "its tokens never depend on the cache (its blocks are still cached for others). Other requests read their "
        "hits either way. No effect with prefix caching off",
    )

    @model_validator(mode="before")
    @classmethod
    def _decide_on(cls, data: Any) -> Any:
        # decide_on left the options (one eviction path: the scheduler counts, the worker decides).
        # "worker" names that path: accepted with one deprecation line; "scheduler" is refused.
        if isinstance(data, dict) and "decide_on" in data:
            data = dict(data)
            v = data.pop("decide_on")
            if v != "worker":
                what = ("the scheduler-side eviction path was removed" if v == "scheduler"
                        else "not a value decide_on ever had; the option was removed")
                raise ValueError(
                    f"vtoken.decide_on = {v!r}: {what}; vToken has one eviction path (the scheduler counts how "
                    "many tokens each request evicts, the worker picks which: docs/eviction.md); "
                    "allowed: leave decide_on out (or 'worker', deprecated)")
            _deprecation("vtoken.decide_on = 'worker' is deprecated and has no effect: it is the only eviction "
                         "path now; remove the key")
        return data

    @field_validator("budget", "budget_ratio", "slack", "sink_tokens", "recent_tokens", "seed", "score_every",
                     "prefill_eviction_every", "watermark_blocks", "watermark_fraction", mode="before")
    @classmethod
    def _no_bool(cls, v: Any) -> Any:
        # JSON true/false would otherwise pass as 1/0 (pydantic's lax int/float).
        if isinstance(v, bool):
            raise ValueError("expected a number, not a boolean")
        if not isinstance(v, (int, float, str)) and hasattr(v, "__index__"):
            return int(v.__index__())  # an in-process caller's numpy integer: an integer, not a coercion
        return v

    @model_validator(mode="after")
    def _check(self) -> "VTokenConfig":
        known = _known_policies()
        if self.policy not in known:
            raise ValueError(f"vtoken.policy = {self.policy!r}: unknown policy; allowed: {known}")
        # Build the policy once so that its own checks (policy_args, protections) run now.
        try:
            self.make_policy()
        except ValueError as e:
            msg = str(e)
            if not msg.startswith("vtoken."):  # a policy's own check names only its argument
                rest = msg.removeprefix(f"{self.policy}: ")
                sep = "." if re.match(r"\w+ = ", rest) else ": "
                msg = f"vtoken.policy_args{sep}{rest} (policy {self.policy!r})"
            raise ValueError(msg) from None
        from vtoken.policies.base import AttentionNeed

        if get_policy_needs(self.policy) & (AttentionNeed.KEY_NORM | AttentionNeed.QUERY_MOMENTS) and self.score_every != 1:
            raise ValueError(
                f"vtoken.score_every = {self.score_every} with vtoken.policy = {self.policy!r}: the policy "
                "records each key's norm (knorm) or each query (expected_attention) in the step that computes "
                "it, so every step is scored; allowed: 1")
        sinks, recent = self.protections()
        if self.budget_ratio is None and sinks + recent > self.budget:
            raise ValueError(
                f"vtoken.sink_tokens + vtoken.recent_tokens = {sinks} + {recent} = {sinks + recent} "
                f"exceeds vtoken.budget = {self.budget}; allowed: sink_tokens + recent_tokens <= budget"
            )
        return self

    def make_policy(self, budget: Optional[int] = None):
        """Instantiate the configured :class:`~vtoken.policies.base.EvictionPolicy` for ``budget``
        (tokens; ``None``: ``self.budget``), with the policy's defaults for the protections
        (:meth:`protections`) and for any ``policy_args`` left unset (``default_args``).

        Raises:
            ValueError: an unknown or bad entry in ``policy_args`` (names the argument and
                what is allowed).
        """
        from vtoken.policies import get_policy_class

        cls = get_policy_class(self.policy)
        b = self.budget if budget is None else budget
        allowed = cls.arg_names()
        for k in self.policy_args:
            if k not in allowed:
                raise ValueError(
                    f"vtoken.policy_args.{k} = {self.policy_args[k]!r}: unknown argument for policy "
                    f"{cls.name!r}; allowed: {sorted(allowed)}"
                )
        sinks, recent = self.protections(b)
        return cls(sink_tokens=sinks, recent_tokens=recent, seed=self.seed,
                   **{**cls.default_args(b), **self.policy_args})

    def plan(self, prompt_len: Optional[int] = None) -> "RequestPlan":
        """Resolve this config once for a request of ``prompt_len`` prompt tokens (None: the budget
        as given, ``budget_ratio`` not applied): the policy built, every default applied.

        Raises:
            ValueError: an unknown or bad entry in ``policy_args`` (:meth:`make_policy`).
        """
        budget = self.budget if prompt_len is None else effective_budget(self, prompt_len)
        prefill = self.resolved_prefill_eviction()
        return RequestPlan(
            policy=self.make_policy(budget), budget=budget, slack=self.resolved_slack(budget),
            granularity=self.resolved_granularity(), prefill_eviction=prefill,
            point_every=self.prefill_eviction_every if prefill == "chunks" else 0, score_every=self.score_every,
            mode=self.mode, pacing=self.pacing, protect_cached_prefix=self.protect_cached_prefix,
            prefix_hits=self.prefix_hits)

    def protections(self, budget: Optional[int] = None) -> tuple[int, int]:
        """(sink_tokens, recent_tokens) after applying the policy defaults, in tokens."""
        from vtoken.policies import get_policy_class

        cls = get_policy_class(self.policy)
        b = self.budget if budget is None else budget
        sinks = cls.default_sink_tokens(b) if self.sink_tokens is None else self.sink_tokens
        if self.recent_tokens is None:
            # A defaulted recent window yields to explicitly set sinks (never below 0).
            recent = min(cls.default_recent_tokens(b), max(0, b - sinks))
        else:
            recent = self.recent_tokens
        return sinks, recent

    def resolved_granularity(self) -> str:
        """The token-set granularity in effect: ``granularity`` when set; else the policy's
        default (:meth:`~vtoken.policies.base.EvictionPolicy.default_granularity`)."""
        from vtoken.policies import get_policy_class

        if self.granularity is not None:
            return self.granularity
        return get_policy_class(self.policy).default_granularity()

    def resolved_prefill_eviction(self) -> str:
        """The prefill eviction in effect: ``prefill_eviction`` when set; else ``"chunks"``
        (bounded prefill, ΔNLL within 0.03 nats/token of ``after``:
        ``benchmarks/results/quality_prefill.json``)."""
        if self.prefill_eviction is not None:
            return self.prefill_eviction
        return "chunks"

    def resolved_slack(self, budget: Optional[int] = None) -> int:
        """Pacing slack in tokens after applying the policy default, which depends on the budget:
        ``budget`` (a request's, after ``budget_ratio``: :meth:`plan`), else the configured one."""
        from vtoken.policies import get_policy_class

        if self.slack is not None:
            return self.slack
        return get_policy_class(self.policy).default_slack(self.budget if budget is None else budget)


class RequestOverrides(BaseModel):
    """Per-request overrides, read from ``SamplingParams.extra_args`` (OpenAI: ``vllm_xargs``).

    Keys: ``vtoken_enable`` (bool, or 0/1, or "true"/"false": ``vllm_xargs`` turns JSON
    booleans into ints; false turns eviction off for this request),
    ``vtoken_budget`` (int tokens >= 1), ``vtoken_policy`` (a registered policy name),
    ``vtoken_granularity`` (``request``, ``layer``, ``head`` or ``head_shared``; anything but
    ``request``).
    Other ``extra_args`` keys are ignored (they may belong to someone else).

    Coercions (the same on both paths, so the engine's ``budget`` and a request's
    ``vtoken_budget`` accept exactly the same values): integer fields take JSON integers
    only: no strings (``"64"``), no floats (``64.0``, ``1e30``), no booleans; an explicit
    ``null`` is refused (leave the key out instead). The one coercion is ``vtoken_enable``'s
    (0/1 and "true"/"false"), because vLLM's request model turns JSON booleans into ints.
    A budget above ``max_model_len`` is refused by the front end
    (:func:`vtoken.integrations.vllm.frontend.requests.check_request`): no request can hold more.

    One rule for both paths: ``vtoken_budget`` and ``vtoken_policy`` are validated exactly
    as the engine's ``budget`` and ``policy`` (same coercions, same refusals, same message
    after the field name: ``vllm_xargs.vtoken_budget = True: ...`` where start-up says
    ``vtoken.budget = True: ...``). A boolean budget is refused on both paths.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    vtoken_enable: bool = Field(True, strict=True)
    vtoken_budget: Optional[int] = Field(None, ge=1, strict=True)
    vtoken_policy: Optional[str] = None
    vtoken_granularity: Optional[Literal["request", "layer", "head", "head_shared"]] = None

    @field_validator("vtoken_budget", mode="before")
    @classmethod
    def _no_bool(cls, v: Any) -> Any:
        if v is None:  # an explicit JSON null: the key was sent without a value
            raise ValueError("expected an integer >= 1; leave the key out to use the engine's budget")
        return VTokenConfig._no_bool(v)  # the engine's rule for ``budget``, verbatim

    @field_validator("vtoken_policy", mode="before")
    @classmethod
    def _no_null_policy(cls, v: Any) -> Any:
        if v is None:
            raise ValueError(f"expected a policy name; allowed: {_known_policies()}; leave the key out to use "
                             "the engine's policy")
        return v

    @field_validator("vtoken_granularity", mode="before")
    @classmethod
    def _no_null_granularity(cls, v: Any) -> Any:
        if v is None:
            raise ValueError("expected one of 'request', 'layer', 'head', 'head_shared'; leave the key out to use "
                             "the engine's granularity")
        return v

    @field_validator("vtoken_enable", mode="before")
    @classmethod
    def _enable_from_xargs(cls, v: Any) -> Any:
        # OpenAI ``vllm_xargs`` values are str | int | float: JSON ``false`` arrives as 0.
        # Accept 0/1 and "true"/"false"/"0"/"1" (any case); anything else stays strict.
        if type(v) is int and v in (0, 1):
            return bool(v)
        if isinstance(v, str) and v.strip().lower() in ("true", "false", "0", "1"):
            return v.strip().lower() in ("true", "1")
        return v

    @model_validator(mode="after")
    def _check(self) -> "RequestOverrides":
        if self.vtoken_policy is not None:
            known = _known_policies()
            if self.vtoken_policy not in known:
                raise ValueError(
                    f"vllm_xargs.vtoken_policy = {self.vtoken_policy!r}: unknown policy; allowed: {known}")
        return self

    def apply(self, base: VTokenConfig) -> VTokenConfig:
        """The engine config with this request's overrides applied (the request's effective config).

        Raises:
            VTokenConfigError: the combination is invalid (e.g. ``vtoken_budget`` below the
                engine's ``sink_tokens + recent_tokens``); the message names the request's
                override field(s) and value(s), then the engine rule they break.
        """
        upd: dict[str, Any] = {}
        if self.vtoken_budget is not None:
            upd["budget"] = self.vtoken_budget
            upd["budget_ratio"] = None
        if self.vtoken_policy is not None and self.vtoken_policy != base.policy:
            upd["policy"] = self.vtoken_policy
            upd["policy_args"] = {}
        if self.vtoken_granularity is not None and self.vtoken_granularity != base.granularity:
            upd["granularity"] = self.vtoken_granularity
        if not upd:
            return base
        data = base.model_dump()
        data.update(upd)
        try:
            return VTokenConfig(**data)
        except ValidationError as e:
            fields = ", ".join(f"vllm_xargs.{k} = {getattr(self, k)!r}"
                               for k in ("vtoken_budget", "vtoken_policy", "vtoken_granularity")
                               if getattr(self, k) is not None)
            raise VTokenConfigError(
                f"{fields}: contradicts the engine's vtoken config: {_format_validation_error('vtoken', e)}"
            ) from None


def parse_config(raw: Any) -> VTokenConfig:
    """Validate the ``vtoken`` value of ``additional_config``.

    Args:
        raw: a dict (or a JSON string of one).

    Raises:
        VTokenConfigError: names each bad field, its value and what is allowed.
    """
    if isinstance(raw, str):
        import json

        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise VTokenConfigError(f"additional_config.vtoken = {raw!r}: not valid JSON ({e})") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise VTokenConfigError(
            f"additional_config.vtoken = {raw!r}: expected an object such as {{\"policy\": \"h2o\", \"budget\": 256}}"
        )
    try:
        return VTokenConfig(**raw)
    except ValidationError as e:
        raise VTokenConfigError(_format_validation_error("vtoken", e)) from None


def parse_request_overrides(extra_args: Optional[dict]) -> RequestOverrides:
    """Validate the vToken keys of a request's ``extra_args``.

    Raises:
        VTokenConfigError: names the field (``vllm_xargs.vtoken_budget`` ...) and what is allowed.
    """
    try:
        return RequestOverrides(**(extra_args or {}))
    except ValidationError as e:
        raise VTokenConfigError(_format_validation_error("vllm_xargs", e)) from None


def effective_budget(cfg: VTokenConfig, prompt_len: int) -> int:
    """The budget in tokens for a request with ``prompt_len`` prompt tokens.

    ``budget`` when ``budget_ratio`` is None; otherwise ``ceil(budget_ratio * prompt_len)``
    clamped from below to ``sink_tokens + recent_tokens`` (and to 1).
    """
    if cfg.budget_ratio is None:
        return cfg.budget
    b = max(1, math.ceil(cfg.budget_ratio * prompt_len))
    sinks, recent = cfg.protections(b)
    return max(b, sinks + recent)


@dataclass(frozen=True)
class RequestPlan:
    """One request's eviction settings, resolved once from its config when it arrives
    (:meth:`VTokenConfig.plan`). The scheduler, the worker and the dense oracle read the plan, never
    the config, so a request's policy flows one way: config -> plan -> scheduler / worker.

    Attributes:
        policy: the request's :class:`~vtoken.policies.base.EvictionPolicy`, built with its
            protections and ``policy_args`` (its class: ``type(policy)``).
        budget: live tokens kept after an eviction (``budget_ratio`` applied to the prompt).
        slack: tokens over the budget tolerated before evicting (fixed pacing).
        granularity: the token sets (``request``, ``layer``, ``head``, ``head_shared``).
        prefill_eviction: ``after`` or ``chunks``.
        point_every: the prompt's eviction points under ``chunks``, in tokens; 0 under ``after``.
        score_every, mode, pacing, protect_cached_prefix, prefix_hits: the config's fields.
    """

    policy: Any
    budget: int
    slack: int
    granularity: str
    prefill_eviction: str
    point_every: int
    score_every: int
    mode: str
    pacing: str
    protect_cached_prefix: bool
    prefix_hits: str

    @property
    def sink_tokens(self) -> int:
        return self.policy.sink_tokens

    @property
    def recent_tokens(self) -> int:
        return self.policy.recent_tokens

    @property
    def chunks(self) -> bool:
        """``prefill_eviction: chunks``: it may evict between its prefill chunks."""
        return self.prefill_eviction == "chunks"

    def may_evict(self, prompt_len: int, max_tokens: Optional[int]) -> bool:
        """False when ``prompt_len + max_tokens`` never exceeds what the pacing keeps: budget + slack
        (fixed), or the budget (pressure pacing cuts a request down to its budget)."""
        if max_tokens is None:
            return True
        return prompt_len + max_tokens > self.budget + (self.slack if self.pacing == "fixed" else 0)

    def bound(self) -> int:
        """Tokens a ``chunks`` request may hold at most: the budget, the slack, the prompt tokens
        between two eviction points (it evicts only at the points) and the token sampled last."""
        return self.budget + self.slack + self.point_every + 1

    def known_weaknesses(self) -> list[str]:
        """Measured weaknesses of this plan's combination of settings, one sentence each (the
        plugin logs them at start-up; the policy's :meth:`~vtoken.policies.base.EvictionPolicy.known_weaknesses`);
        empty when none is known."""
        return type(self.policy).known_weaknesses(self.granularity, self.prefill_eviction)

def num_to_evict(num_live: int, budget: int, slack: int) -> int:
    """Pacing: how many tokens to evict now.

    Evict when ``num_live > budget + slack``, down to ``budget``; otherwise 0.

    >>> num_to_evict(10, 8, 0), num_to_evict(10, 8, 2), num_to_evict(11, 8, 2)
    (2, 0, 3)
    """
    if num_live > budget + slack:
        return num_live - budget
    return 0
