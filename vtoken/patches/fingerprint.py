"""Fingerprint upstream symbols of the installed vLLM (self-contained: standard library only).

This file is both a module (imported by ``vtoken.patches``) and a script that the
rebase command runs under *another* interpreter, where vToken may not be installed::

    /other/venv/bin/python fingerprint.py OUT.json < request.json

``request.json`` is a list of ``{"symbol": dotted name, "source_of": dotted name or null}``;
``OUT.json`` receives ``{"vllm_version", "python", "symbols": {symbol: result}}`` where
``result`` is ``{"status": "ok", "fingerprint", "source", "source_of", "how"}`` or
``{"status": "gone", "error"}``.

Fingerprint rules (the manifest's contract; see docs/patches.md):

* the *source* of a symbol is, by the first rule that applies:

  1. ``source_of`` is given: the source of that other symbol (rules 2-3 applied to it).
     Used for instance attributes (``SingleTypeKVCacheManager.req_to_blocks`` is
     fingerprinted by the ``__init__`` that assigns it) and module globals whose meaning
     lives in the function that reads them.
  2. a function, method, class, property, classmethod or staticmethod:
     ``inspect.getsource`` of the object, after ``inspect.unwrap`` (so a vToken wrapper
     installed with ``functools.wraps`` is looked through to the upstream function).
  3. any other member of a module or class (constants, dataclass fields, class
     attributes): the top-level statements of the owner's body (descending into
     ``if``/``try`` blocks, e.g. ``if TYPE_CHECKING:`` declarations) that bind the name,
     plus the ``"name": value`` item of any top-level dict literal keyed by the name
     (``vllm.envs.environment_variables``); for classes, of the first class in the MRO
     whose body binds it.

* the symbol *exists* when it resolves by import + ``getattr``, or a statement binds it
  (rule 3), or, with ``source_of``, the ``source_of`` code reads or writes an attribute of
  that name (``self.req_to_blocks``).
* normalisation: ``textwrap.dedent``, trailing whitespace stripped from every line,
  leading and trailing blank lines dropped, ``\\n`` line ends; the fingerprint is
  ``"sha256:" + sha256(utf-8 text).hexdigest()``.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import json
import os
import sys
import textwrap
import types

__all__ = ["normalise", "digest", "resolve", "source_of_symbol", "fingerprint_symbol", "fingerprint_all", "vllm_version"]


class SymbolGone(LookupError):
    """The symbol does not resolve in the installed vLLM (message says which part failed)."""


def normalise(src: str) -> str:
    """Dedent, strip trailing whitespace per line and surrounding blank lines; ``\\n`` ends."""
    lines = [ln.rstrip() for ln in textwrap.dedent(src.expandtabs(8)).splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


def digest(src: str) -> str:
    """``sha256:<hex>`` of the normalised source."""
    return "sha256:" + hashlib.sha256(normalise(src).encode("utf-8")).hexdigest()


def resolve(dotted: str):
    """Resolve a dotted name to ``(owner, name, obj, found)``.

    The longest importable module prefix is imported, the rest is walked with ``getattr``.
    ``found`` is False when only the last component is missing (``obj`` is then None).

    Raises:
        SymbolGone: no module prefix imports, or a component before the last is missing.
    """
    parts = dotted.split(".")
    mod = None
    i = len(parts)
    err = None
    while i > 0:
        try:
            mod = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError as e:  # ModuleNotFoundError included
            err = e
            i -= 1
        except Exception as e:  # an import that crashes is as good as gone for us
            raise SymbolGone(f"importing {'.'.join(parts[:i])} failed: {type(e).__name__}: {e}") from None
    if mod is None:
        raise SymbolGone(f"no importable module prefix ({err})")
    if i == len(parts):
        return None, parts[-1], mod, True
    obj = mod
    for j in range(i, len(parts) - 1):
        try:
            obj = getattr(obj, parts[j])
        except AttributeError:
            raise SymbolGone(f"{'.'.join(parts[: j + 1])} does not exist") from None
    owner, name = obj, parts[-1]
    try:
        return owner, name, getattr(owner, name), True
    except AttributeError:
        return owner, name, None, False


def _is_code(obj) -> bool:
    return isinstance(obj, (types.FunctionType, types.MethodType, type, property, classmethod, staticmethod,
                            types.ModuleType)) or inspect.isroutine(obj)


def _code_source(obj) -> str:
    if isinstance(obj, property):
        obj = obj.fget
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    obj = inspect.unwrap(obj)
    return inspect.getsource(obj)


@functools.lru_cache(maxsize=None)
def _parsed_source(o) -> tuple[str, ast.AST]:
    text = textwrap.dedent(inspect.getsource(o))
    return text, ast.parse(text)


def _body_binding(owner, name: str):
    """Source of the statements in ``owner``'s body (module or class, via MRO) that bind ``name``."""
    owners = list(owner.__mro__) if isinstance(owner, type) else [owner]
    for o in owners:
        if o is object:
            continue
        try:
            text, tree = _parsed_source(o)
        except (OSError, TypeError):
            continue
        body = tree.body
        if isinstance(o, type) and body and isinstance(body[0], ast.ClassDef):
            body = body[0].body
        segs = []
        stmts = list(body)
        k = 0
        while k < len(stmts):  # top-level statements, including those inside if/try blocks
            st = stmts[k]
            k += 1
            if isinstance(st, (ast.If, ast.Try)):
                stmts[k:k] = [*st.body, *getattr(st, "orelse", []), *getattr(st, "finalbody", [])]
                continue
            targets = []
            if isinstance(st, ast.Assign):
                targets = st.targets
            elif isinstance(st, (ast.AnnAssign, ast.AugAssign)):
                targets = [st.target]
            names = set()
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
            if name in names:
                segs.append(ast.get_source_segment(text, st))
            value = getattr(st, "value", None)
            if isinstance(value, ast.Dict):  # a registry dict keyed by the name (vllm.envs)
                for key, val in zip(value.keys, value.values):
                    if isinstance(key, ast.Constant) and key.value == name:
                        segs.append(f"{ast.get_source_segment(text, key)}: {ast.get_source_segment(text, val)}")
        if segs:
            return "\n".join(segs), f"{getattr(o, '__module__', '')}.{getattr(o, '__qualname__', o.__name__)}".lstrip(".")
    return None, None


@functools.lru_cache(maxsize=None)
def _attribute_names(src: str) -> frozenset:
    return frozenset(n.attr for n in ast.walk(ast.parse(textwrap.dedent(src))) if isinstance(n, ast.Attribute))


def _mentions_attribute(src: str, name: str) -> bool:
    return name in _attribute_names(src)


@functools.lru_cache(maxsize=None)
def source_of_symbol(dotted: str) -> tuple[str, str]:
    """``(source, how)`` of a symbol by rules 2-3 (module docstring).

    Raises:
        SymbolGone: it does not resolve, or it has neither code nor a binding statement.
    """
    owner, name, obj, found = resolve(dotted)
    if found and _is_code(obj) and not isinstance(obj, types.ModuleType):
        try:
            return _code_source(obj), "getsource"
        except (OSError, TypeError) as e:
            if owner is None:
                raise SymbolGone(f"{dotted}: no source ({e})") from None
    if owner is not None:
        src, where = _body_binding(owner, name)
        if src is not None:
            return src, f"binding in {where}"
    if not found:
        raise SymbolGone(f"{dotted} does not exist")
    raise SymbolGone(f"{dotted}: not code and no binding statement; give the entry a source_of")


def fingerprint_symbol(symbol: str, source_of: str | None = None) -> dict:
    """Fingerprint one symbol; returns the result dict described in the module docstring."""
    try:
        if source_of:
            src, how = source_of_symbol(source_of)
            owner, name, obj, found = None, None, None, False
            try:
                owner, name, obj, found = resolve(symbol)
            except SymbolGone:
                pass
            if not found and owner is not None:
                found = _body_binding(owner, name)[0] is not None
            if not found and not _mentions_attribute(src, symbol.rsplit(".", 1)[-1]):
                raise SymbolGone(f"{symbol} does not exist and {source_of} does not use .{symbol.rsplit('.', 1)[-1]}")
            how = f"source_of {source_of} ({how})"
        else:
            src, how = source_of_symbol(symbol)
    except SymbolGone as e:
        return {"status": "gone", "error": str(e)}
    return {"status": "ok", "fingerprint": digest(src), "source": normalise(src), "source_of": source_of, "how": how}


def vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return f"unimportable ({type(e).__name__}: {e})"


def fingerprint_all(request: list[dict]) -> dict:
    """Fingerprint every ``{"symbol", "source_of"}`` of ``request``."""
    return {
        "vllm_version": vllm_version(),
        "python": sys.executable,
        "symbols": {r["symbol"]: fingerprint_symbol(r["symbol"], r.get("source_of")) for r in request},
    }


def _main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python fingerprint.py OUT.json < request.json", file=sys.stderr)
        return 2
    request = json.load(sys.stdin)
    result = fingerprint_all(request)
    with open(argv[0], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    # Run as a script: drop this directory from sys.path so sibling modules never shadow anything.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    sys.exit(_main(sys.argv[1:]))
