"""Eviction policies, discoverable through the ``vtoken.policies`` entry-point group.

A third-party package adds a policy by subclassing
:class:`vtoken.policies.base.EvictionPolicy` and declaring, in its pyproject::

    [project.entry-points."vtoken.policies"]
    mypolicy = "mypkg.policy:MyPolicy"
"""

from __future__ import annotations

from functools import lru_cache
from importlib.metadata import entry_points

from vtoken.policies.base import AttentionNeed, AttentionStats, EvictionPolicy, SlotState, TokenView

__all__ = [
    "AttentionNeed",
    "AttentionStats",
    "EvictionPolicy",
    "SlotState",
    "TokenView",
    "available_policies",
    "get_policy_class",
]

# Built-ins are listed here too, so the core works from a source tree that was not pip-installed.
_BUILTIN = {
    "h2o": "vtoken.policies.h2o:H2OPolicy",
    "scissorhands": "vtoken.policies.scissorhands:ScissorhandsPolicy",
    "random": "vtoken.policies.random:RandomPolicy",
    "streaming": "vtoken.policies.streaming:StreamingLLMPolicy",
    "tova": "vtoken.policies.tova:TOVAPolicy",
    "knorm": "vtoken.policies.knorm:KNormPolicy",
    "keydiff": "vtoken.policies.keydiff:KeyDiffPolicy",
    "snapkv": "vtoken.policies.snapkv:SnapKVPolicy",
    "expected_attention": "vtoken.policies.expected_attention:ExpectedAttentionPolicy",
}


@lru_cache(maxsize=1)
def available_policies() -> dict[str, str]:
    """Policy name -> ``module:Class`` for every registered policy."""
    found = dict(_BUILTIN)
    for ep in entry_points(group="vtoken.policies"):
        found.setdefault(ep.name, ep.value)
    return found


@lru_cache(maxsize=None)
def get_policy_class(name: str) -> type[EvictionPolicy]:
    """The policy class registered under ``name``.

    Raises:
        ValueError: unknown name (lists the allowed ones).
    """
    table = available_policies()
    if name not in table:
        raise ValueError(f"unknown eviction policy {name!r}; allowed: {sorted(table)}")
    import importlib

    mod, _, attr = table[name].partition(":")
    cls = getattr(importlib.import_module(mod), attr)
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise TypeError(f"vtoken.policies entry {name!r} -> {table[name]} is not an EvictionPolicy subclass")
    return cls
