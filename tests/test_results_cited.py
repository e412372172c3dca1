"""Every committed result file is cited by a doc, every cited result exists, and results/ stays small
(no engine; about a second).

The result files are those git tracks under ``benchmarks/results`` (the index, so a file counts
from its ``git add`` on; every file on disk when git is not there): what a benchmark writes
and nobody commits is not checked. The docs are README.md, docs/*.md, benchmarks/README*.md and
patches/*.md. A file ``benchmarks/results/R`` (``R`` its path below ``results/``) is **cited** when
one of these holds:

1. a doc cites the path ``results/R`` or ``benchmarks/results/R`` (the whole path, parsed as
   below: ``results/sla.json.gz`` does not cite ``sla.json``);
2. ``R`` is a top-level file and a doc contains its bare name ``R`` as a whole word (not inside a
   longer name: no letter, digit, ``_``, ``-`` or ``.`` right before it, none of the first three
   right after it, and no ``.x`` extension after it). A bare name does not cite a file in a
   subdirectory: names such as ``stock_unloaded.json`` recur in many run directories;
3. a doc cites ``results/D/`` (or ``results/D``) for a directory ``D`` that holds ``R`` at any
   depth: the directory is cited as a whole (e.g. a sweep's per-rate JSONs and server logs);
4. ``benchmarks/doc_tables.py`` loads it while rendering a table that some doc holds, that is a
   ``<!-- generated: benchmarks/doc_tables.py NAME -->`` block; the test renders every such
   ``NAME`` with ``doc_tables._load`` wrapped to record the names it opens.

A cited result is a ``benchmarks/results/...`` or ``results/...`` path in a doc (the latter as the
benchmark READMEs write it, relative to ``benchmarks/``), matched up to the first character that
cannot be part of a path; it must exist (as a directory when it ends in ``/``). A path
with a wildcard or a placeholder (``*``, ``{``, ``<``) is not a citation. ``NOT_YET`` lists the
cited results no one has committed (a command writes them; the doc says so), ``PENDING`` the
committed ones whose citation is on its way; each entry fails once it is no longer needed.

The result files together must stay under ``MAX_BYTES`` (10 MB). Superseded runs are deleted with
``git rm``; git keeps them.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC_TABLES = ROOT / "benchmarks" / "doc_tables.py"
MAX_BYTES = 10 * 1000 * 1000

#: ``results/...`` paths a doc names although no file is committed: the full task table
#: (benchmarks/README.md, "Not produced yet") and the wall times ``make bench`` writes.
NOT_YET: set[str] = {"bench_all_small.json"}
#: committed results whose citation comes with another branch: the worker-step table of issue 40
#: (benchmarks/README.md and ``doc_tables.worker_step_table`` there).
PENDING: set[str] = set()


def docs(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md")),
            *sorted((root / "benchmarks").glob("README*.md")), *sorted((root / "patches").glob("*.md"))]


def result_files(results: Path = RESULTS, git: bool = True) -> list[str]:
    """The files below ``results`` that git tracks (every file there without git or with
    ``git=False``), as paths relative to it, ``/``-separated."""
    if git:
        p = subprocess.run(["git", "ls-files", "-z", "--", "."], capture_output=True, text=True, cwd=results)
        if p.returncode == 0:
            return sorted(f for f in p.stdout.split("\0") if f and (results / f).is_file())
    return sorted(p.relative_to(results).as_posix() for p in results.rglob("*") if p.is_file())


_NAME = r"[A-Za-z0-9_-]"
# ``results/`` not preceded by a name character (``benchmarks/results/`` and ``](results/`` match)
_CITE = re.compile(r"(?<![A-Za-z0-9_.-])results/([A-Za-z0-9_./*{}<>-]*)")


def cited_paths(text: str) -> list[str]:
    """The ``results/...`` paths ``text`` names, relative to ``results/`` (a directory keeps its
    trailing ``/``); sentence punctuation after a path is not part of it."""
    out = []
    for m in _CITE.finditer(text):
        rel = m.group(1)
        while rel and rel[-1] in ".,;:":
            rel = rel[:-1]
        if rel and not re.search(r"[*{}<>]", rel):
            out.append(rel)
    return out


def _name_cited(name: str, text: str) -> bool:
    pattern = r"(?<![A-Za-z0-9_.-])" + re.escape(name) + r"(?!" + _NAME + r"|\.[A-Za-z0-9])"
    return re.search(pattern, text) is not None


def uncited(files: list[str], texts: list[str], loaded: set[str] = frozenset()) -> list[str]:
    """The files (paths relative to ``results/``) that rules 1-4 of the module docstring leave
    uncited; ``loaded`` holds the ones rule 4 cites."""
    paths = {p for t in texts for p in cited_paths(t)}
    dirs = {p.rstrip("/") + "/" for p in paths}
    out = []
    for f in files:
        if f in paths or f in loaded:
            continue
        if "/" not in f and any(_name_cited(f, t) for t in texts):
            continue
        parts = f.split("/")
        if any("/".join(parts[:i]) + "/" in dirs for i in range(1, len(parts))):
            continue
        out.append(f)
    return out


def missing(texts: list[str], results: Path = RESULTS, not_yet: set[str] = frozenset()) -> list[str]:
    """The ``results/...`` paths the texts cite that do not exist under ``results``."""
    out = []
    for rel in sorted({p for t in texts for p in cited_paths(t)}):
        if rel in not_yet:
            continue
        p = results / rel
        if not (p.is_dir() if rel.endswith("/") else p.exists()):
            out.append(rel)
    return out


def total_bytes(results: Path = RESULTS, git: bool = True) -> int:
    return sum((results / f).stat().st_size for f in result_files(results, git))


def loaded_by_doc_tables(texts: list[str]) -> set[str]:
    """The result files ``benchmarks/doc_tables.py`` opens to render the tables the docs hold."""
    spec = importlib.util.spec_from_file_location("_doc_tables_cited", DOC_TABLES)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    names = sorted({n for t in texts for n in re.findall(r"<!-- generated: benchmarks/doc_tables\.py (\w+)", t)})
    seen: set[str] = set()
    load = mod._load

    def recording(name: str) -> dict:
        seen.add(name)
        return load(name)

    mod._load = recording
    for n in names:
        assert n in mod.TABLES, f"a doc holds a generated block for {n!r}, which doc_tables.TABLES lacks"
        mod.TABLES[n]()
    return seen


def _texts() -> list[str]:
    return [d.read_text() for d in docs()]


# ----------------------------------------------------------------------------- the repository


def test_every_result_file_is_cited():
    texts = _texts()
    bad = [f for f in uncited(result_files(), texts, loaded_by_doc_tables(texts)) if f not in PENDING]
    assert not bad, ("benchmarks/results files that no doc cites (cite them or `git rm` them): "
                     + ", ".join(bad))


def test_every_cited_result_exists():
    bad = missing(_texts(), not_yet=NOT_YET)
    assert not bad, "docs cite benchmarks/results paths that do not exist: " + ", ".join(bad)


def test_not_yet_and_pending_are_still_needed():
    texts = _texts()
    cited = {p for t in texts for p in cited_paths(t)}
    for rel in NOT_YET:
        assert not (RESULTS / rel).exists(), f"results/{rel} exists now: drop it from NOT_YET"
        assert rel in cited, f"no doc cites results/{rel} any more: drop it from NOT_YET"
    left = uncited(result_files(), texts, loaded_by_doc_tables(texts))
    for rel in PENDING:
        assert rel in result_files(), f"results/{rel} is gone: drop it from PENDING"
        assert rel in left, f"results/{rel} is cited now: drop it from PENDING"


def test_results_are_under_10_mb():
    n = total_bytes()
    assert n < MAX_BYTES, f"benchmarks/results holds {n / 1e6:.1f} MB, more than {MAX_BYTES / 1e6:.0f} MB"


# ----------------------------------------------------------------------------- the helpers can fail


def test_cited_paths_parses_links_code_and_prose():
    text = ("File `results/sla.json` (plot [`results/sla.png`](results/sla.png); logs in `results/sla/`).\n"
            "`bash x.sh` -> `benchmarks/results/first_start.json`. Wrote results/a_b-1.json.\n"
            "Not: `results/*.json`, results/{name}.json, myresults/x.json, results/<n>.png")
    assert cited_paths(text) == ["sla.json", "sla.png", "sla.png", "sla/", "first_start.json", "a_b-1.json"]


def test_uncited_applies_each_rule():
    files = ["sla.json", "sla_small.json", "old.json", "sla/stock_rate1.json", "other/stock_rate1.json",
             "other/deep/x.json", "quality.json", "table.json", "killed/run.log"]
    texts = ["see results/sla.json and sla/ runs in `results/other/`",
             "the bare name sla_small.json, a longer name quality.json.gz, stock_rate1.json, run.log"]
    assert uncited(files, texts) == ["old.json", "sla/stock_rate1.json", "quality.json", "table.json",
                                     "killed/run.log"]
    assert uncited(files, texts, {"table.json"}) == ["old.json", "sla/stock_rate1.json", "quality.json",
                                                     "killed/run.log"]
    # a bare name inside a longer one does not cite
    assert uncited(["sla.json"], ["quality_sla.json", "x.sla.json", "sla.jsonl"]) == ["sla.json"]
    assert uncited(["sla.json"], ["(sla.json)."]) == []


def test_missing_and_size_on_a_synthetic_dir(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "runs" / "r.json").write_text("x" * 100)
    texts = ["`results/a.json`, `results/runs/`, `results/gone.json`, `results/gone/`, results/runs/r.json, "
             "results/later.json, `results/runs`, `results/a.json/`"]
    assert missing(texts, tmp_path) == ["a.json/", "gone.json", "gone/", "later.json"]
    assert missing(texts, tmp_path, {"later.json"}) == ["a.json/", "gone.json", "gone/"]
    assert result_files(tmp_path, git=False) == ["a.json", "runs/r.json"]
    assert total_bytes(tmp_path, git=False) == 102
    assert uncited(result_files(tmp_path, git=False), ["results/runs/r.json"]) == ["a.json"]


def test_result_files_are_the_tracked_ones(tmp_path):
    if subprocess.run(["git", "init", "-q", str(tmp_path)], capture_output=True).returncode != 0:
        pytest.skip("no git")
    results = tmp_path / "results"
    results.mkdir()
    (results / "a.json").write_text("{}")
    (results / "new.json").write_text("x" * 50)
    subprocess.run(["git", "add", "results/a.json"], cwd=tmp_path, check=True)
    assert result_files(results) == ["a.json"]
    assert result_files(results, git=False) == ["a.json", "new.json"]
    assert total_bytes(results) == 2


def test_loaded_by_doc_tables_records_only_the_tables_docs_hold():
    seen = loaded_by_doc_tables(["<!-- generated: benchmarks/doc_tables.py overhead_table -->"])
    assert seen == {"overhead_small.json"}
    assert loaded_by_doc_tables(["no generated block here"]) == set()
