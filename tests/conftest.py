"""Makes ``tests/`` (``execution_paths``, ``drivers``, ``reference``) and the repository root importable
from every test directory, however pytest is started."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
_ROOT = str(Path(__file__).resolve().parents[1])
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)
