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
    "policies_markdown",
    "policy_classes_markdown",
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


def _needs_text(cls: type[EvictionPolicy]) -> str:
    n = cls.needs
    if n & AttentionNeed.QUERY_MOMENTS:
        return "no (query moments + keys)"
    if cls.eviction_keys or n & AttentionNeed.KEY_NORM:
        return "no (keys only)"
    if n & AttentionNeed.WINDOW:
        return "window column sums"
    if n & AttentionNeed.COL_SUM:
        return "column sums, every step"
    return "last query row" if n & AttentionNeed.LAST_ROW else "no"


def policies_markdown() -> str:
    """The README's policy table, from each registered policy's declarations (``paper``, ``summary``,
    ``needs``, ``default_granularity``): a policy added as a file appears with no doc to edit."""
    rows = ["| name | paper | score | needs attention | default token sets |", "|---|---|---|---|---|"]
    for name in sorted(available_policies()):
        cls = get_policy_class(name)
        rows.append(f"| `{name}` | {cls.paper} | {cls.summary} | {_needs_text(cls)} | `{cls.default_granularity()}` |")
    return "\n".join(rows) + "\n"


def policy_classes_markdown() -> str:
    """docs/configuration.md's list: each registered policy's name and class (``name``: ``class``,
    the module named where it is not ``vtoken.policies.<name>``)."""
    items = []
    for name in sorted(available_policies()):
        cls = get_policy_class(name)
        mod = "" if cls.__module__ == f"vtoken.policies.{name}" else f"{cls.__module__}."
        items.append(f"`{name}`: `{mod}{cls.__qualname__}`")
    return "Classes (in `vtoken.policies.<name>`): " + "; ".join(items) + ".\n"
