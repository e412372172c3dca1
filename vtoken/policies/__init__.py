"""Eviction policies: every module here that defines an
:class:`~vtoken.policies.base.EvictionPolicy` subclass with a ``name`` is a built-in policy, so
adding one is adding a file (``docs/layout.md``). A third-party package adds a policy through the
``vtoken.policies`` entry-point group, in its pyproject::

    [project.entry-points."vtoken.policies"]
    mypolicy = "mypkg.policy:MyPolicy"
"""

from __future__ import annotations

from functools import lru_cache
from importlib.metadata import entry_points

from vtoken.policies.base import AttentionNeed, EvictionPolicy

__all__ = [
    "AttentionNeed",
    "EvictionPolicy",
    "available_policies",
    "get_policy_class",
]

@lru_cache(maxsize=1)
def available_policies() -> dict[str, str]:
    """Policy name -> ``module:Class`` for every built-in (module docstring) and entry-point policy."""
    import importlib
    import pkgutil

    found: dict[str, str] = {}
    for info in pkgutil.iter_modules(__path__):
        mod = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(mod).values():
            if (isinstance(obj, type) and issubclass(obj, EvictionPolicy) and obj.__module__ == mod.__name__
                    and obj.name != EvictionPolicy.name):
                found[obj.name] = f"{mod.__name__}:{obj.__qualname__}"
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
