"""The manifest check, the upstream-rebase comparison, ``update`` and the generated index."""

from __future__ import annotations

import difflib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from vtoken.patches import fingerprint as fp
from vtoken.patches.manifest import (
    DEFAULT_ENTRIES,
    DEFAULT_README,
    KINDS,
    Entry,
    EntryError,
    load_entries,
    write_entry,
)
from vtoken.patches.scan import Requirement, default_scan_files, scan_files

__all__ = ["CheckReport", "run_check", "fingerprints_via", "rebase_compare", "rebase_report", "update_entries",
           "render_index", "write_index", "index_is_current", "add_entry"]


@dataclass
class CheckReport:
    problems: list[str] = field(default_factory=list)
    checked: int = 0
    required: int = 0
    vllm_version: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems


def _request(entries: Iterable[Entry]) -> list[dict]:
    return [{"symbol": e.symbol, "source_of": e.source_of} for e in entries]


def _resolves(dotted: str) -> bool:
    try:
        owner, name, obj, found = fp.resolve(dotted)
        return found
    except fp.SymbolGone:
        return False


def run_check(entries_dir: Path = DEFAULT_ENTRIES, scan: Optional[Iterable[Path]] = None,
              include_default: bool = True) -> CheckReport:
    """Check the manifest against the installed vLLM and the code.

    Never raises for a finding: every finding is a line of ``report.problems`` that starts
    with the upstream symbol. Findings: malformed entry; fingerprint differs (CHANGED);
    symbol no longer resolves (GONE); code touches a symbol that has no entry (NO ENTRY);
    a subclass/override not listed in its entry's ``used_by``; an assignment to an upstream
    attribute whose entry is not of kind ``runtime-override``; a ``used_by`` name that no
    longer exists in vToken; a scanned file that fails to import (SCAN); for the default
    entries directory, a stale generated patches/README.md.
    """
    rep = CheckReport(vllm_version=fp.vllm_version())
    try:
        entries = load_entries(entries_dir)
    except EntryError as e:
        rep.problems.append(f"manifest: {e}")
        return rep
    # 1. fingerprints
    for e in entries.values():
        r = fp.fingerprint_symbol(e.symbol, e.source_of)
        rep.checked += 1
        if r["status"] == "gone":
            rep.problems.append(f"{e.symbol}: GONE from installed vLLM {rep.vllm_version}: {r['error']}")
        elif r["fingerprint"] != e.fingerprint:
            rep.problems.append(
                f"{e.symbol}: CHANGED upstream: fingerprint {e.fingerprint[:19]}... (vLLM {e.upstream_version}) != "
                f"{r['fingerprint'][:19]}... (installed {rep.vllm_version}); see `python -m vtoken.patches rebase`"
            )
        for u in e.used_by:
            if u.startswith("vtoken.") and not _resolves(u):
                rep.problems.append(f"{e.symbol}: used_by names {u}, which no longer exists in vToken")
    if Path(entries_dir).resolve() == DEFAULT_ENTRIES.resolve() and not index_is_current(entries_dir, DEFAULT_README):
        rep.problems.append(f"{DEFAULT_README}: STALE (generated index): run `python -m vtoken.patches index`")
    # 2. the code
    files = list(default_scan_files()) if include_default else []
    files += [Path(p) for p in (scan or [])]
    reqs: list[Requirement] = []
    for f in files:
        try:
            reqs.extend(scan_files([f]))
        except Exception as ex:  # noqa: BLE001 - a file we cannot import is a finding
            rep.problems.append(f"SCAN {f}: {type(ex).__name__}: {ex}")
    rep.required = len({r.symbol for r in reqs})
    found: dict[str, list[str]] = {}  # message -> where it was found (merged per message)
    for r in reqs:
        e = entries.get(r.symbol)
        if r.error:
            msg = f"{r.symbol}: GONE from installed vLLM {rep.vllm_version}: {r.error}"
        elif e is None:
            msg = f"{r.symbol}: NO ENTRY in {entries_dir}"
        elif r.user and r.user not in e.used_by:
            msg = f"{r.symbol}: entry's used_by does not list {r.user}"
        elif r.how == "runtime-override" and e.kind != "runtime-override":
            msg = f"{r.symbol}: assigned to by vToken, so the entry's kind must be runtime-override (is {e.kind})"
        else:
            continue
        where = f"{r.how} at {r.where}"
        if where not in found.setdefault(msg, []):
            found[msg].append(where)
    for msg, wheres in found.items():
        rep.problems.append(f"{msg} (found as {'; '.join(wheres)})")
    return rep


def fingerprints_via(python: Optional[str], entries: Iterable[Entry]) -> dict:
    """Fingerprint ``entries`` under interpreter ``python`` (None: this process).

    Raises:
        RuntimeError: the interpreter failed to run the fingerprint script (stderr tail).
    """
    req = _request(entries)
    if python is None:
        return fp.fingerprint_all(req)
    exe = os.path.abspath(python) if os.sep in python else (shutil.which(python) or python)
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "out.json"
        try:
            proc = subprocess.run([exe, fp.__file__, str(out)], input=json.dumps(req), text=True,
                                  capture_output=True, cwd=td, env={**os.environ, "VLLM_PLUGINS": ""})
        except OSError as e:
            raise RuntimeError(f"cannot run {python}: {e}") from None
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{python} {fp.__file__} exited {proc.returncode}: {proc.stderr[-2000:]}")
        return json.loads(out.read_text(encoding="utf-8"))


def rebase_compare(python: str, entries_dir: Path = DEFAULT_ENTRIES) -> "RebaseResult":
    """Compare every entry's upstream source here against the vLLM installed under ``python``.

    A symbol is ``changed``/``gone`` relative to the fingerprint recorded in its entry; the
    ``old``/``new`` sources are those of the vLLM installed here and there (for the diff).
    """
    from vtoken.patches.report import RebaseResult, SymbolResult

    entries = load_entries(entries_dir)
    here = fingerprints_via(None, entries.values())
    there = fingerprints_via(python, entries.values())
    out = []
    for sym, e in sorted(entries.items()):
        t = there["symbols"][sym]
        h = here["symbols"][sym]
        s = SymbolResult(sym, "", kind=e.kind, used_by=list(e.used_by), change=e.change,
                         old=h.get("source", "") if h["status"] == "ok" else "",
                         fingerprint_old=e.fingerprint, fingerprint_new=t.get("fingerprint", ""))
        if t["status"] == "gone":
            s.status, s.error = "gone", t["error"]
        elif t["fingerprint"] == e.fingerprint:
            s.status, s.new = "unchanged", t["source"]
        else:
            s.status, s.new = "changed", t["source"]
            if h["status"] == "ok" and h["fingerprint"] != e.fingerprint:
                s.note = "the vLLM installed here does not match the entry either"
        out.append(s)
    return RebaseResult(here["vllm_version"], there["vllm_version"], out)


def rebase_report(python: str, entries_dir: Path = DEFAULT_ENTRIES) -> tuple[str, dict[str, str]]:
    """Text form of :func:`rebase_compare`: ``(text, {symbol: unchanged|changed|gone})``, with a
    unified diff (old -> new source) under each changed symbol."""
    res = rebase_compare(python, entries_dir)
    lines = [f"upstream rebase check: vLLM {res.old_version} (here) -> {res.new_version} ({python})", ""]
    status: dict[str, str] = {}
    for s in res.symbols:
        status[s.symbol] = s.status
        if s.status == "gone":
            lines.append(f"gone       {s.symbol}  ({s.error})")
            continue
        if s.status == "unchanged":
            lines.append(f"unchanged  {s.symbol}")
            continue
        lines.append(f"changed    {s.symbol}  [{s.kind}] {s.fingerprint_old[:19]}... -> {s.fingerprint_new[:19]}...")
        if s.note:
            lines.append(f"           (note: {s.note})")
        diff = difflib.unified_diff(s.old.splitlines(), s.new.splitlines(),
                                    f"{s.symbol} (vLLM {res.old_version})", f"{s.symbol} (vLLM {res.new_version})",
                                    lineterm="")
        lines += ["    " + d for d in diff]
    n = {k: sum(1 for v in status.values() if v == k) for k in ("unchanged", "changed", "gone")}
    lines += ["", f"{n['unchanged']} unchanged, {n['changed']} changed, {n['gone']} gone"]
    return "\n".join(lines), status


def update_entries(python: Optional[str] = None, entries_dir: Path = DEFAULT_ENTRIES,
                   readme: Path = DEFAULT_README) -> tuple[list[str], list[str]]:
    """Rewrite fingerprints and ``upstream_version`` from the vLLM under ``python`` (None: here).

    Gone symbols are left untouched and returned. Regenerates the index.
    Returns ``(updated symbols, gone symbols)``.
    """
    entries = load_entries(entries_dir)
    res = fingerprints_via(python, entries.values())
    updated, gone = [], []
    for sym, e in sorted(entries.items()):
        r = res["symbols"][sym]
        if r["status"] != "ok":
            gone.append(sym)
            continue
        if r["fingerprint"] != e.fingerprint or e.upstream_version != res["vllm_version"]:
            e.fingerprint, e.upstream_version = r["fingerprint"], res["vllm_version"]
            write_entry(entries_dir, e)
            updated.append(sym)
    write_index(entries_dir, readme)
    return updated, gone


def add_entry(symbol: str, kind: str, why: str, change: str, source_of: Optional[str] = None,
              used_by: Iterable[str] = (), entries_dir: Path = DEFAULT_ENTRIES) -> Path:
    """Create (or overwrite) an entry with the fingerprint of the installed vLLM.

    Raises:
        EntryError: unknown kind, or the symbol does not resolve here (names it).
    """
    if kind not in KINDS:
        raise EntryError(f"kind {kind!r} is not one of {sorted(KINDS)}")
    r = fp.fingerprint_symbol(symbol, source_of)
    if r["status"] != "ok":
        raise EntryError(f"{symbol}: {r['error']}")
    e = Entry(symbol=symbol, kind=kind, upstream_version=fp.vllm_version(), fingerprint=r["fingerprint"],
              why=why, change=change, source_of=source_of, used_by=list(used_by))
    return write_entry(entries_dir, e)


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def render_index(entries_dir: Path = DEFAULT_ENTRIES) -> str:
    """The text of patches/README.md, generated from the entries (deterministic)."""
    entries = load_entries(entries_dir)
    versions = sorted({e.upstream_version for e in entries.values()})
    out = [
        "# patches/: vToken's divergence from upstream vLLM",
        "",
        "<!-- GENERATED by `python -m vtoken.patches index` from patches/entries/*.toml; do not edit. -->",
        "",
        f"{len(entries)} upstream symbols, fingerprinted against vLLM {', '.join(versions) or '-'}. "
        "Check: `python -m vtoken.patches check`; rebase: `python -m vtoken.patches rebase --python OTHER`; "
        "see docs/patches.md.",
        "",
    ]
    for kind, label in KINDS.items():
        group = [e for e in entries.values() if e.kind == kind]
        if not group:
            continue
        out += [f"## {label} ({len(group)})", "", "| Symbol | Why | What changes | Used by | Fingerprint |",
                "|---|---|---|---|---|"]
        for e in sorted(group, key=lambda x: x.symbol):
            fpr = f"`{e.fingerprint[7:19]}`" + (f" of `{e.source_of}`" if e.source_of else "")
            used = ", ".join(f"`{u.removeprefix('vtoken.integrations.vllm.')}`" for u in e.used_by) or "-"
            out.append(f"| `{e.symbol}` | {_cell(e.why)} | {_cell(e.change)} | {used} | {fpr} |")
        out.append("")
    return "\n".join(out)


def write_index(entries_dir: Path = DEFAULT_ENTRIES, readme: Path = DEFAULT_README) -> Path:
    Path(readme).write_text(render_index(entries_dir), encoding="utf-8")
    return Path(readme)


def index_is_current(entries_dir: Path = DEFAULT_ENTRIES, readme: Path = DEFAULT_README) -> bool:
    p = Path(readme)
    return p.exists() and p.read_text(encoding="utf-8") == render_index(entries_dir)
