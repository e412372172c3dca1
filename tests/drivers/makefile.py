"""The Makefile's recipes, read the way ``make`` runs them (tests that check a result file's
command against the target that made it)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def recipe(target: str) -> list[str]:
    """The words of ``make TARGET``'s recipe, whatever its prerequisites: its tab-indented lines
    with ``\\``-continuations joined, split as the shell splits them (quotes removed), the
    interpreter first (``$(VPY)``).

    Raises:
        KeyError: the Makefile has no rule for ``target``.
    """
    text = (ROOT / "Makefile").read_text()
    m = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t.*\n)+)", text, re.M)
    if not m:
        raise KeyError(f"Makefile has no recipe for target {target!r}")
    return shlex.split(m.group(1).replace("\\\n", " "))
