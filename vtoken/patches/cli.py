"""Command line of ``python -m vtoken.patches``.

Exit status: 0 ok; 1 findings (check: any problem; rebase: any symbol changed or gone;
report: a changed or gone symbol has no verdict;
update: a symbol is gone; index --check: stale); 2 usage or setup error (malformed entry,
an interpreter that cannot run, a symbol ``add`` cannot resolve, a malformed verdicts file).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from vtoken.patches.manifest import DEFAULT_ENTRIES, DEFAULT_README, KINDS, EntryError
from vtoken.patches.report import VerdictError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m vtoken.patches", description="vToken's upstream-divergence manifest")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="fail, naming the symbol, on drift or a missing entry")
    c.add_argument("--entries", type=Path, default=DEFAULT_ENTRIES)
    c.add_argument("--scan", type=Path, nargs="*", default=[], help="extra files to scan (besides vtoken/)")
    c.add_argument("--no-default-scan", action="store_true", help="scan only --scan files")
    r = sub.add_parser("rebase", help="compare against the vLLM installed under another interpreter")
    r.add_argument("--python", required=True)
    r.add_argument("--entries", type=Path, default=DEFAULT_ENTRIES)
    rp = sub.add_parser("report", help="write the Markdown rebase report with verdicts (make rebase-check)")
    src = rp.add_mutually_exclusive_group(required=True)
    src.add_argument("--python", help="interpreter of the other vLLM (as for rebase)")
    src.add_argument("--from-json", type=Path, help="re-render from a comparison saved with --save-json")
    rp.add_argument("--save-json", type=Path, default=None,
                    help="also save the comparison (holds upstream source: keep it out of git, e.g. under .cache/)")
    rp.add_argument("--verdicts", type=Path, default=None,
                    help="hand-written verdicts (default patches/rebase-verdicts-<other version>.toml)")
    rp.add_argument("--out", type=Path, default=None, help="default patches/rebase-<other version>.md")
    rp.add_argument("--entries", type=Path, default=DEFAULT_ENTRIES)
    u = sub.add_parser("update", help="rewrite fingerprints + upstream_version, regenerate the index")
    u.add_argument("--python", default=None, help="interpreter whose vLLM to take (default: this one)")
    u.add_argument("--entries", type=Path, default=DEFAULT_ENTRIES)
    u.add_argument("--readme", type=Path, default=DEFAULT_README)
    i = sub.add_parser("index", help="write patches/README.md from the entries")
    i.add_argument("--check", action="store_true", help="only verify it is up to date")
    i.add_argument("--entries", type=Path, default=DEFAULT_ENTRIES)
    i.add_argument("--readme", type=Path, default=DEFAULT_README)
    a = sub.add_parser("add", help="create an entry fingerprinted against the installed vLLM")
    a.add_argument("symbol")
    a.add_argument("--kind", required=True, choices=sorted(KINDS))
    a.add_argument("--why", required=True)
    a.add_argument("--change", required=True)
    a.add_argument("--source-of", default=None)
    a.add_argument("--used-by", nargs="*", default=[])
    a.add_argument("--entries", type=Path, default=DEFAULT_ENTRIES)
    a.add_argument("--readme", type=Path, default=DEFAULT_README)
    return ap


def _report(args) -> int:
    import json

    from vtoken.patches import report as rpt

    if args.from_json:
        res = rpt.RebaseResult.from_json(json.loads(args.from_json.read_text(encoding="utf-8")))
    else:
        from vtoken.patches.check import rebase_compare

        print(f"comparing {len(list(args.entries.glob('*.toml')))} entries with the vLLM under {args.python} ...",
              flush=True)
        res = rebase_compare(args.python, args.entries)
    if args.save_json:
        args.save_json.parent.mkdir(parents=True, exist_ok=True)
        args.save_json.write_text(json.dumps(res.to_json()), encoding="utf-8")
    root = DEFAULT_ENTRIES.parent
    verdicts = args.verdicts or root / f"rebase-verdicts-{res.new_version}.toml"
    out = args.out or root / f"rebase-{res.new_version}.md"
    given = rpt.write_report(res, verdicts, out)
    n = rpt.summary_counts(res)
    review = sorted(s for s, v in given.items() if v.verdict == rpt.NEEDS_REVIEW)
    kinds = {k: sum(1 for v in given.values() if v.verdict == k) for k in rpt.VERDICTS}
    print(f"vLLM {res.old_version} -> {res.new_version}: {n['unchanged']} unchanged, {n['changed']} changed, "
          f"{n['gone']} gone; verdicts: " + ", ".join(f"{c} {k}" for k, c in kinds.items()))
    print(f"wrote {out}")
    for s in review:
        print(f"needs review: {s}")
    print(f"{len(review)} changed symbol(s) need review" + (f": add verdicts to {verdicts}" if review else ""))
    return 1 if review else 0


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from vtoken.patches import check as chk

    try:
        if args.cmd == "check":
            rep = chk.run_check(args.entries, args.scan, include_default=not args.no_default_scan)
            for p in rep.problems:
                print(f"FAIL {p}")
            print(f"patches check: {rep.checked} entries, {rep.required} symbols used by the code, "
                  f"vLLM {rep.vllm_version}: {'ok' if rep.ok else f'{len(rep.problems)} problem(s)'}")
            return 0 if rep.ok else 1
        if args.cmd == "rebase":
            text, status = chk.rebase_report(args.python, args.entries)
            print(text)
            return 0 if all(v == "unchanged" for v in status.values()) else 1
        if args.cmd == "report":
            return _report(args)
        if args.cmd == "update":
            updated, gone = chk.update_entries(args.python, args.entries, args.readme)
            for s in updated:
                print(f"updated {s}")
            for s in gone:
                print(f"GONE    {s} (entry left as is: adapt the code, then edit or delete the entry)")
            print(f"{len(updated)} updated, {len(gone)} gone; index regenerated")
            return 1 if gone else 0
        if args.cmd == "index":
            if args.check:
                ok = chk.index_is_current(args.entries, args.readme)
                print(f"{args.readme}: {'up to date' if ok else 'STALE: run python -m vtoken.patches index'}")
                return 0 if ok else 1
            print(f"wrote {chk.write_index(args.entries, args.readme)}")
            return 0
        if args.cmd == "add":
            p = chk.add_entry(args.symbol, args.kind, args.why, args.change, args.source_of, args.used_by,
                              args.entries)
            print(f"wrote {p}; index {chk.write_index(args.entries, args.readme)}")
            return 0
    except (EntryError, RuntimeError, VerdictError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 2
