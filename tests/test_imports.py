"""The package's import graph, read from the source (``ast``; nothing is imported): no circles,
counting the imports inside functions too, and the engine-independent core (everything outside
``vtoken/integrations/``, the patch-set checker ``vtoken/patches/`` and the ``vtoken`` command) never imports the vLLM integration or vllm
itself, so it never imports a module above it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted((ROOT / "vtoken").rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(name: str, path: Path, mods: dict[str, Path]) -> tuple[set[str], set[str]]:
    """``(vtoken modules, other top-level packages)`` that module ``name`` imports anywhere in it."""
    inside, outside = set(), set()
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def add(target: str) -> None:
        t = target
        while t and t not in mods:
            t = t.rpartition(".")[0]
        if t and t != name:
            inside.add(t)
        elif not target.startswith("vtoken"):
            outside.add(target.split(".")[0])

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:  # a submodule by name (``from pkg import mod``) or a name of ``base``
                add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
    return inside, outside


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    mods = _modules()
    got = {m: _imports(m, p, mods) for m, p in mods.items()}
    return {m: g[0] for m, g in got.items()}, {m: g[1] for m, g in got.items()}


def _circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_graph_is_read():
    inside, outside = _graph()
    # (known edges: the reader would miss them if it were broken)
    assert "vtoken.side_cache" in inside["vtoken.integrations.vllm.worker.eviction"]
    assert "vtoken.select" in inside["vtoken.side_cache"]
    assert "vtoken.assets.tiny" in inside["vtoken.assets.paths"]  # a function-level import
    assert "vllm" in outside["vtoken.integrations.vllm.plugin"]


def test_no_import_circles():
    assert _circles(_graph()[0]) == []


def test_circle_finder_finds_one():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_core_imports_neither_the_integration_nor_vllm():
    inside, outside = _graph()
    for m in inside:
        if m.startswith(("vtoken.integrations", "vtoken.patches")) or m == "vtoken.cli":
            continue  # (the integration; the patch-set checker, which reads vLLM's source; the command)
        assert not {t for t in inside[m] if t.startswith("vtoken.integrations")}, m
        assert "vllm" not in outside[m], m
