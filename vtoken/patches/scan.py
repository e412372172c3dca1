"""Find the upstream (vLLM) symbols that vToken's code touches.

Two passes over every scanned file (by default: each ``vtoken/**/*.py`` outside
``vtoken/patches`` whose syntax tree imports vllm, i.e. the integration package):

* **ast**: ``from vllm.x import Y`` (symbol ``vllm.x.Y``), ``import vllm.x [as m]``, and
  attribute chains on such names (``m.Y.z``, ``EngineArgs.create_engine_config``). A
  chain is resolved against the installed vLLM and named canonically (a class by its
  defining module and qualname; a method as ``<class>.<name>``); it stops at the first
  object that is neither a module nor a class. A chain that resolves to a module needs
  no entry. An attribute chain on the left of an assignment (``X.attr = ...``,
  ``mod.GLOBAL = ...``) is a **runtime override**: its entry must have that kind.
* **MRO**: the module is imported; every class it defines with a vLLM class in its
  MRO needs an entry for its first upstream base, and every name the class defines
  that an upstream class in its MRO also defines (an override, e.g. ``schedule``) needs
  an entry for ``<upstream owner>.<name>``. Both must list the vToken class or method
  in the entry's ``used_by``.

Runtime overrides that no syntax shows (per-instance rebinds such as the attention
``impl.forward`` wrapper) and internals reached through instances
(``self.kv_cache_manager.block_pool.free_blocks``) cannot be found this way: they are
declared as entries by hand (kinds ``runtime-override`` / ``internal-used``), and the
check still verifies that they exist and fingerprints them.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from vtoken.patches.manifest import REPO_ROOT

__all__ = ["Requirement", "default_scan_files", "scan_files"]

_NOISE = {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__",
          "__firstlineno__", "__static_attributes__", "__orig_bases__", "__parameters__", "__slots__",
          "__abstractmethods__", "_abc_impl", "__dataclass_fields__", "__dataclass_params__",
          "__match_args__", "__hash__"}


@dataclass
class Requirement:
    """One upstream symbol the code needs an entry for.

    Attributes:
        symbol: canonical dotted name (``None`` while unresolved is never returned).
        how: ``import`` / ``attribute`` / ``runtime-override`` / ``subclass`` / ``override``.
        where: ``file:line`` or the vToken class/method.
        user: vToken object that must appear in the entry's ``used_by`` (subclass/override only).
        error: set when the symbol does not resolve in the installed vLLM.
    """

    symbol: str
    how: str
    where: str
    user: Optional[str] = None
    error: Optional[str] = None


def _is_upstream(obj) -> bool:
    return str(getattr(obj, "__module__", "") or "").split(".")[0] == "vllm"


def _canonical_class(cls: type, fallback: str) -> str:
    name = f"{cls.__module__}.{cls.__qualname__}"
    mod = sys.modules.get(cls.__module__)
    obj = mod
    for part in cls.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return name if obj is cls else fallback


def _imports_vllm(tree: ast.AST) -> bool:
    for n in ast.walk(tree):
        if isinstance(n, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in n.names):
            return True
        if isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] == "vllm":
            return True
    return False


def default_scan_files(root: Path = REPO_ROOT) -> list[Path]:
    """``vtoken/**/*.py`` outside ``vtoken/patches`` that import vllm (sorted)."""
    out = []
    pkg = Path(root) / "vtoken"
    for p in sorted(pkg.rglob("*.py")):
        if (pkg / "patches") in p.parents:
            continue
        try:
            tree = ast.parse(p.read_text(encoding="utf-8"), str(p))
        except SyntaxError:
            continue
        if _imports_vllm(tree):
            out.append(p)
    return out


def _resolve_chain(parts: list[str], store: bool) -> tuple[Optional[str], Optional[str]]:
    """Canonical symbol of a dotted chain ``vllm.a.b...`` -> ``(symbol or None, error)``."""
    i = len(parts)
    mod = None
    while i > 0:
        try:
            mod = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            i -= 1
    if mod is None:
        return ".".join(parts), "no importable module prefix"
    obj, canon = mod, mod.__name__
    for j in range(i, len(parts)):
        name = parts[j]
        last = j == len(parts) - 1
        if store and last:
            return f"{canon}.{name}", None
        try:
            nxt = getattr(obj, name)
        except AttributeError:
            return f"{canon}.{name}", f"{canon}.{name} does not exist in the installed vLLM"
        if isinstance(nxt, types.ModuleType):
            obj, canon = nxt, nxt.__name__
            continue
        if isinstance(nxt, type):
            canon = _canonical_class(nxt, f"{canon}.{name}") if _is_upstream(nxt) else f"{canon}.{name}"
            obj = nxt
            if last:
                return canon, None
            continue
        # a function or value: the chain stops here
        if isinstance(obj, types.ModuleType) and inspect.isfunction(nxt) and _is_upstream(nxt) \
                and getattr(sys.modules.get(nxt.__module__), nxt.__qualname__, None) is nxt:
            return f"{nxt.__module__}.{nxt.__qualname__}", None
        return f"{canon}.{name}", None
    return None, None  # a module: needs no entry


class _AstScan(ast.NodeVisitor):
    def __init__(self, path: Path):
        self.path = path
        self.names: dict[str, str] = {}  # local name -> dotted vllm path
        self.found: list[tuple[list[str], bool, int, str]] = []  # (chain, store, line, how)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.split(".")[0] != "vllm":
                continue
            if a.asname:
                self.names[a.asname] = a.name
            else:
                self.names["vllm"] = "vllm"

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or (node.module or "").split(".")[0] != "vllm":
            return
        for a in node.names:
            if a.name == "*":
                continue
            dotted = f"{node.module}.{a.name}"
            self.names[a.asname or a.name] = dotted
            self.found.append((dotted.split("."), False, node.lineno, "import"))


def _chains(tree: ast.AST, scan: _AstScan) -> None:
    parents: dict[int, ast.AST] = {}
    for p in ast.walk(tree):
        for c in ast.iter_child_nodes(p):
            parents[id(c)] = p
    for n in ast.walk(tree):
        if not isinstance(n, ast.Attribute):
            continue
        par = parents.get(id(n))
        if isinstance(par, ast.Attribute) and par.value is n:
            continue  # not the outermost attribute of its chain
        attrs = []
        cur: ast.AST = n
        while isinstance(cur, ast.Attribute):
            attrs.append(cur.attr)
            cur = cur.value
        if not isinstance(cur, ast.Name) or cur.id not in scan.names:
            continue
        chain = scan.names[cur.id].split(".") + attrs[::-1]
        store = isinstance(n.ctx, (ast.Store, ast.Del))
        scan.found.append((chain, store, n.lineno, "runtime-override" if store else "attribute"))


def _rel(p: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(p)


def _import_file(p: Path):
    p = Path(p).resolve()
    try:
        rel = p.relative_to(REPO_ROOT)
        if rel.parts[0] == "vtoken":
            return importlib.import_module(".".join(rel.with_suffix("").parts))
    except ValueError:
        pass
    name = p.stem
    spec = importlib.util.spec_from_file_location(name, p)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _mro_requirements(mod) -> list[Requirement]:
    out = []
    for cls in list(vars(mod).values()):
        if not isinstance(cls, type) or cls.__module__ != mod.__name__ or _is_upstream(cls):
            continue
        mro = cls.__mro__[1:]
        ups = [b for b in mro if _is_upstream(b)]
        if not ups:
            continue
        user = f"{cls.__module__}.{cls.__qualname__}"
        base = ups[0]
        out.append(Requirement(_canonical_class(base, f"{base.__module__}.{base.__qualname__}"), "subclass", user, user))
        for name in vars(cls):
            if name in _NOISE:
                continue
            holder = next((b for b in mro if name in vars(b)), None)
            if holder is None or not _is_upstream(holder):
                continue
            owner = _canonical_class(holder, f"{holder.__module__}.{holder.__qualname__}")
            out.append(Requirement(f"{owner}.{name}", "override", f"{user}.{name}", f"{user}.{name}"))
    return out


def scan_files(files: Iterable[Path]) -> list[Requirement]:
    """Requirements found in ``files`` (ast pass, then import + MRO pass).

    Raises:
        SyntaxError / ImportError: a scanned file does not parse or import (the check
        reports it: broken code cannot be checked).
    """
    reqs: list[Requirement] = []
    for p in files:
        p = Path(p)
        tree = ast.parse(p.read_text(encoding="utf-8"), str(p))
        s = _AstScan(p)
        s.visit(tree)
        _chains(tree, s)
        for chain, store, line, how in s.found:
            sym, err = _resolve_chain(chain, store)
            if sym is None:
                continue
            reqs.append(Requirement(sym, how, f"{_rel(p)}:{line}", None, err))
        reqs.extend(_mro_requirements(_import_file(p)))
    return reqs
