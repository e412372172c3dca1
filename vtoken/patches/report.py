"""The upstream rebase report: ``patches/rebase-<version>.md``, one verdict per changed symbol.

``python -m vtoken.patches report --python OTHER`` (what ``make rebase-check VLLM=x.y.z``
runs) compares every ``patches/entries/`` symbol with the vLLM installed under ``OTHER``
(the same comparison as ``rebase``: :func:`vtoken.patches.check.rebase_compare`) and writes
a Markdown report:

* a summary line, ``**Summary:** U unchanged, C changed, G gone (N symbols)``, a verdict
  count line and the symbols of each verdict at a glance;
* per changed (or gone) symbol: its kind and ``used_by`` (from the entry; the entry's
  ``change`` text when it lists no user), a diff summary (lines added / removed and a
  unified-diff excerpt of at most :data:`EXCERPT_LINES` lines, one line of context), and
  a **verdict**, one of :data:`VERDICTS`:

  - ``cosmetic``: automatic, and only when :func:`is_cosmetic` proves it: the old and new
    sources parse to the same syntax tree once docstrings (every bare string statement),
    comments, formatting and the annotations of function signatures and of local
    variables are dropped. Annotations of class-body fields are kept: on vLLM's pydantic
    config dataclasses they are validated at run time, so changing one is not cosmetic.
    A reviewer may also write ``cosmetic`` by hand (shown as reviewed, not automatic).
  - ``behaviour``: *behaviour change vToken must follow*: ``what`` changed upstream and
    ``where`` in vToken it matters (file and function).
  - ``new-seam``: *new seam worth using*: ``what`` changed and ``seam`` (which one, why).
  - ``no-impact``: *code change vToken does not depend on*: ``what`` changed and ``why``
    vToken is unaffected (it never takes that path, or it only calls the symbol).

  Every verdict other than the automatic ``cosmetic`` is hand-written after reading the
  diff, in a committed TOML file (``patches/rebase-verdicts-<version>.toml``) keyed by
  symbol::

      ["vllm.v1.core.sched.scheduler.Scheduler.schedule"]
      verdict = "behaviour"
      what = "..."                   # what changed upstream
      where = ["vtoken/integrations/vllm/sched/scheduler.py: VTokenScheduler.schedule"]

  A changed or gone symbol with neither is listed as ``needs review``; so is the command's
  exit status 1 (0 when every changed symbol has a verdict). A verdict whose symbol is not
  changed (or is cosmetic by the AST) is listed as stale.

Only diff excerpts of vLLM's source go into the report, never whole functions; the report
has no timestamps or paths, so regenerating it unchanged gives the same file.
"""

from __future__ import annotations

import ast
import difflib
import re
import textwrap
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

__all__ = ["VERDICTS", "EXCERPT_LINES", "SymbolResult", "RebaseResult", "Verdict", "VerdictError",
           "is_cosmetic", "load_verdicts", "verdict_for", "verdict_line", "render_report", "write_report",
           "summary_counts", "parse_summary"]

#: verdict slug -> the label the report prints
VERDICTS = {
    "cosmetic": "cosmetic",
    "behaviour": "behaviour change vToken must follow",
    "new-seam": "new seam worth using",
    "no-impact": "code change vToken does not depend on",
}
NEEDS_REVIEW = "needs review"
#: most diff lines shown per symbol (the full diff: ``python -m vtoken.patches rebase``)
EXCERPT_LINES = 40

_REQUIRED_FIELDS = {"cosmetic": ("what",), "behaviour": ("what", "where"), "new-seam": ("what", "seam"),
                    "no-impact": ("what", "why")}
_ALLOWED_FIELDS = {"verdict", "what", "where", "seam", "why"}


@dataclass
class SymbolResult:
    """One entry compared with the other vLLM (``old``/``new``: normalised upstream sources)."""

    symbol: str
    status: str  # unchanged | changed | gone
    kind: str = ""
    used_by: list[str] = field(default_factory=list)
    change: str = ""  # the entry's `change` text
    old: str = ""  # source in the vLLM installed here ("" if it does not resolve here)
    new: str = ""  # source in the other vLLM ("" when gone)
    error: str = ""  # why it is gone
    note: str = ""  # e.g. the vLLM here does not match the entry's fingerprint
    fingerprint_old: str = ""  # the entry's
    fingerprint_new: str = ""  # the other vLLM's ("" when gone)


@dataclass
class RebaseResult:
    old_version: str
    new_version: str
    symbols: list[SymbolResult]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "RebaseResult":
        return cls(data["old_version"], data["new_version"], [SymbolResult(**s) for s in data["symbols"]])


@dataclass
class Verdict:
    verdict: str  # a VERDICTS key, or NEEDS_REVIEW
    automatic: bool = False
    what: str = ""
    where: list[str] = field(default_factory=list)
    seam: str = ""
    why: str = ""


class VerdictError(ValueError):
    """The verdicts file is malformed (message names the symbol and the field)."""


# --- the AST comparison -------------------------------------------------------------------


def _parse(src: str) -> Optional[ast.AST]:
    src = textwrap.dedent(src)
    for text in (src, "{\n" + src + "\n}"):  # a registry-dict item ("name": value) parses inside braces
        try:
            return ast.parse(text)
        except SyntaxError:
            continue
    return None


def _is_string_statement(st: ast.stmt) -> bool:
    return isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant) and isinstance(st.value.value, str)


class _Cosmetics(ast.NodeTransformer):
    """Drops docstrings (any bare string statement) and signature / local annotations."""

    def __init__(self):
        self.depth = 0  # > 0 inside a function body

    def _body(self, node):
        for name in ("body", "orelse", "finalbody"):
            stmts = getattr(node, name, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                kept = [s for s in stmts if not _is_string_statement(s)]
                if not kept and name == "body":
                    kept = [ast.Pass()]
                setattr(node, name, kept)

    def generic_visit(self, node):
        self._body(node)
        return super().generic_visit(node)

    def _function(self, node):
        node.returns = None
        if hasattr(node, "type_params"):
            node.type_params = []
        self.depth += 1
        try:
            return self.generic_visit(node)
        finally:
            self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Lambda(self, node):
        self.depth += 1
        try:
            return self.generic_visit(node)
        finally:
            self.depth -= 1

    def visit_arg(self, node):
        node.annotation = None
        return node

    def visit_AnnAssign(self, node):
        if self.depth:  # an annotation inside a function body (local, self.x): no run-time effect
            if node.value is None:
                return None
            return ast.copy_location(ast.Assign(targets=[node.target], value=node.value), node)
        return self.generic_visit(node)


def _canonical(src: str) -> Optional[str]:
    tree = _parse(src)
    if tree is None:
        return None
    tree = _Cosmetics().visit(tree)
    return ast.dump(tree, annotate_fields=True, include_attributes=False)


def is_cosmetic(old: str, new: str) -> bool:
    """True only when ``old`` and ``new`` provably differ in docstrings, comments, formatting
    or signature/local annotations alone (same AST after dropping those); False when not, or
    when either side does not parse."""
    if not old or not new:
        return False
    a, b = _canonical(old), _canonical(new)
    return a is not None and a == b


# --- verdicts -----------------------------------------------------------------------------


def load_verdicts(path: Optional[Path]) -> dict[str, Verdict]:
    """The hand-written verdicts of ``path`` (TOML, one table per symbol); {} if it does not exist.

    Raises:
        VerdictError: not TOML, an unknown verdict or field, a missing field.
    """
    if path is None or not Path(path).exists():
        return {}
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise VerdictError(f"{path}: not valid TOML: {e}") from None
    out: dict[str, Verdict] = {}
    for sym, t in data.items():
        if not isinstance(t, dict):
            raise VerdictError(f"{path}: {sym} must be a table ([\"{sym}\"])")
        unknown = sorted(set(t) - _ALLOWED_FIELDS)
        if unknown:
            raise VerdictError(f"{path}: {sym}: unknown field(s) {unknown}; allowed: {sorted(_ALLOWED_FIELDS)}")
        v = t.get("verdict")
        if v not in VERDICTS:
            raise VerdictError(f"{path}: {sym}: verdict {v!r} is not one of {sorted(VERDICTS)}")
        missing = [k for k in _REQUIRED_FIELDS[v] if not t.get(k)]
        if missing:
            raise VerdictError(f"{path}: {sym}: verdict {v!r} needs field(s) {missing}")
        where = t.get("where", [])
        if isinstance(where, str):
            where = [where]
        if not isinstance(where, list) or not all(isinstance(w, str) for w in where):
            raise VerdictError(f"{path}: {sym}: where must be a string or a list of strings")
        for k in ("what", "seam", "why"):
            if k in t and not isinstance(t[k], str):
                raise VerdictError(f"{path}: {sym}: {k} must be a string")
        out[sym] = Verdict(verdict=v, what=t.get("what", ""), where=list(where), seam=t.get("seam", ""),
                           why=t.get("why", ""))
    return out


def verdict_for(s: SymbolResult, verdicts: dict[str, Verdict]) -> Verdict:
    """The automatic ``cosmetic`` when the AST proves it, else the hand-written one, else needs review."""
    if s.status == "changed" and is_cosmetic(s.old, s.new):
        return Verdict("cosmetic", automatic=True)
    return verdicts.get(s.symbol, Verdict(NEEDS_REVIEW))


def verdict_line(v: Verdict) -> str:
    """The report's verdict bullet (one line)."""
    if v.verdict == NEEDS_REVIEW:
        return f"- **verdict: {NEEDS_REVIEW}** (no entry in the verdicts file; read the diff and add one)"
    label = VERDICTS[v.verdict]
    if v.automatic:
        return f"- **verdict: {label}** (automatic: same AST without docstrings, comments and annotations)"
    text = f"- **verdict: {label}** (reviewed): {v.what}"
    if v.verdict == "behaviour":
        text += f" Where in vToken: {'; '.join(v.where)}."
    elif v.verdict == "new-seam":
        text += f" Seam: {v.seam}"
    elif v.verdict == "no-impact":
        text += f" Why vToken is unaffected: {v.why}"
    if v.verdict != "behaviour" and v.where:
        text += f" ({'; '.join(v.where)})"
    return text


# --- rendering ----------------------------------------------------------------------------


def _diff_stats(old: str, new: str) -> tuple[int, int]:
    added = removed = 0
    for d in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0):
        if d.startswith("+") and not d.startswith("+++"):
            added += 1
        elif d.startswith("-") and not d.startswith("---"):
            removed += 1
    return added, removed


def _excerpt(old: str, new: str, limit: int = EXCERPT_LINES) -> list[str]:
    body = list(difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=1))[2:]
    if len(body) <= limit:
        return body
    return body[:limit] + [f"... ({len(body) - limit} more diff lines: python -m vtoken.patches rebase --python OTHER)"]


def summary_counts(result: RebaseResult) -> dict[str, int]:
    return {k: sum(1 for s in result.symbols if s.status == k) for k in ("unchanged", "changed", "gone")}


def _short(u: str) -> str:
    return u.removeprefix("vtoken.integrations.vllm.")


def render_report(result: RebaseResult, verdicts: dict[str, Verdict],
                  verdicts_name: str = "the verdicts file") -> tuple[str, dict[str, Verdict]]:
    """The Markdown report and ``{symbol: verdict}`` of every changed or gone symbol."""
    n = summary_counts(result)
    todo = sorted((s for s in result.symbols if s.status != "unchanged"), key=lambda s: (s.status != "gone", s.symbol))
    given = {s.symbol: verdict_for(s, verdicts) for s in todo}
    by_kind = {k: sum(1 for v in given.values() if v.verdict == k) for k in [*VERDICTS, NEEDS_REVIEW]}
    auto = sum(1 for v in given.values() if v.automatic)
    stale = sorted(sym for sym in verdicts if sym not in given or given[sym].automatic)
    out = [
        f"# Upstream rebase report: vLLM {result.old_version} -> {result.new_version}",
        "",
        f"<!-- GENERATED by `python -m vtoken.patches report` (make rebase-check VLLM={result.new_version}) from "
        f"patches/entries/ and {verdicts_name}; edit the verdicts file, not this one. -->",
        "",
        f"**Summary:** {n['unchanged']} unchanged, {n['changed']} changed, {n['gone']} gone "
        f"({len(result.symbols)} symbols of patches/entries/).",
        "",
        f"**Verdicts:** {by_kind['cosmetic']} {VERDICTS['cosmetic']} ({auto} automatic), "
        f"{by_kind['behaviour']} {VERDICTS['behaviour']}, {by_kind['new-seam']} {VERDICTS['new-seam']}, "
        f"{by_kind['no-impact']} {VERDICTS['no-impact']}, {by_kind[NEEDS_REVIEW]} {NEEDS_REVIEW}.",
        "",
        f"Diffs are vLLM {result.old_version} (-) -> {result.new_version} (+), excerpts of at most {EXCERPT_LINES} "
        "lines with one line of context; the full diffs: `python -m vtoken.patches rebase --python OTHER`. "
        "Hand-written verdicts come from the verdicts file; `cosmetic` is automatic only when the ASTs "
        "(docstrings, comments, formatting and signature/local annotations dropped) are equal.",
        "",
    ]
    glance = []
    for k in [NEEDS_REVIEW, "behaviour", "new-seam", "cosmetic", "no-impact"]:
        syms = [sym for sym, v in given.items() if v.verdict == k]
        if syms:
            label = VERDICTS.get(k, k)
            glance.append(f"- **{label}** ({len(syms)}): " + ", ".join(f"`{x.removeprefix('vllm.')}`" for x in syms))
    if glance:
        out += ["## At a glance", "", *glance, ""]
    if stale:
        out += ["## Stale verdicts", "",
                "In the verdicts file but not changed here (or cosmetic by the AST): "
                + ", ".join(f"`{s}`" for s in stale), ""]
    shown: dict[tuple[str, str], str] = {}  # (old, new) -> first symbol whose excerpt was shown
    for status in ("gone", "changed"):
        group = [s for s in todo if s.status == status]
        if not group:
            continue
        out += [f"## {status.capitalize()} ({len(group)})", ""]
        for s in group:
            out += [f"### `{s.symbol}`", ""]
            used = ", ".join(f"`{_short(u)}`" for u in s.used_by)
            out.append(f"- kind: {s.kind}; used by: {used or '(no vToken user listed) entry: ' + s.change}")
            if s.status == "gone":
                out.append(f"- gone: {s.error}")
            else:
                a, r = _diff_stats(s.old, s.new)
                out.append(f"- diff: +{a} -{r} lines")
            if s.note:
                out.append(f"- note: {s.note}")
            out.append(verdict_line(given[s.symbol]))
            if s.status == "changed":
                first = shown.setdefault((s.old, s.new), s.symbol)
                if first == s.symbol:
                    out += ["", "```diff", *_excerpt(s.old, s.new), "```"]
                else:
                    out.append(f"- same upstream source and diff as `{first}` (shown there)")
            out.append("")
    return "\n".join(out).rstrip("\n") + "\n", given


def write_report(result: RebaseResult, verdicts_path: Optional[Path], out: Path) -> dict[str, Verdict]:
    """Write the report of ``result`` (verdicts from ``verdicts_path``) to ``out``; returns the verdicts.

    Raises:
        VerdictError: the verdicts file is malformed.
    """
    verdicts = load_verdicts(verdicts_path)
    name = _display(verdicts_path) if verdicts_path else "no verdicts file"
    text, given = render_report(result, verdicts, name)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text, encoding="utf-8")
    return given


def _display(p: Path) -> str:
    from vtoken.patches.manifest import REPO_ROOT

    try:
        return str(Path(p).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return Path(p).name


_SUMMARY_RE = re.compile(r"^\*\*Summary:\*\* (\d+) unchanged, (\d+) changed, (\d+) gone")


def parse_summary(text: str) -> dict[str, int]:
    """The counts of a report's summary line (for tests and tooling)."""
    for ln in text.splitlines():
        m = _SUMMARY_RE.match(ln)
        if m:
            return dict(zip(("unchanged", "changed", "gone"), map(int, m.groups())))
    raise ValueError("no **Summary:** line")
