"""``python -m vtoken.patches``: see the package docstring."""

import sys

from vtoken.patches.cli import main

sys.exit(main())
