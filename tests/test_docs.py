"""The docs agree with the code and with the committed result files (no engine; a few seconds).

- README.md is a short front page: at most 12 KB, it starts with the two set-up commands, and its
  configuration examples are valid; docs/*.md and benchmarks/README*.md come to at most 100 KB.
- Generated tables (between ``<!-- generated: ... -->`` and ``<!-- end generated -->``) equal
  what their generator prints now: the config and metrics tables of docs/configuration.md
  (``vtoken config --format markdown``, ``metrics_table_markdown``) and the result tables of
  README.md, docs/models.md and benchmarks/README.md (``benchmarks/doc_tables.py``). docs/configuration.md's refusals block
  is checked by ``tests/integration/test_refusals.py``.
- Every file path cited in README.md, docs/*.md and benchmarks/*.md exists, and every relative
  markdown link (and its ``#anchor``) resolves from the page that holds it.
- docs/layout.md names every module of ``vtoken/`` and every module that imports vllm.
- The result figures (benchmarks/README.md, the README's) equal the values in the result file
  each one names.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from drivers.makefile import recipe

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]
#: where each part of the former long README lives now
CONFIG_DOC = ROOT / "docs" / "configuration.md"
BENCH_DOC = ROOT / "benchmarks" / "README.md"
LAYOUT_DOC = ROOT / "docs" / "layout.md"
README_MAX_BYTES = 12 * 1024


def _generated(text: str, marker: str) -> str:
    """The block after the ``<!-- generated: MARKER ... -->`` line, up to ``<!-- end generated -->``."""
    m = re.search(r"<!-- generated: " + re.escape(marker) + r"[^\n]*-->\n(.*?)<!-- end generated -->", text, re.S)
    assert m, f"no generated block for {marker!r}"
    return m.group(1)


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _config_doc() -> str:
    return CONFIG_DOC.read_text()


def _bench() -> str:
    """benchmarks/README.md: every result, with the command that made it (moved from README.md)."""
    return BENCH_DOC.read_text()


# ----------------------------------------------------------------------------- README: a short front page
def test_readme_is_at_most_12_kb():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES}): move detail into docs/"


#: docs/*.md and the benchmark READMEs together (issue 44: one subject per doc, results as tables)
DOCS_MAX_BYTES = 100_000


def _size_limited_docs(root: Path = ROOT) -> list[Path]:
    return [*sorted((root / "docs").glob("*.md")), *sorted((root / "benchmarks").glob("README*.md"))]


def test_docs_and_benchmark_readmes_are_at_most_100_kb():
    sizes = {str(p.relative_to(ROOT)): len(p.read_bytes()) for p in _size_limited_docs()}
    total = sum(sizes.values())
    assert total <= DOCS_MAX_BYTES, (f"docs/*.md + benchmarks/README*.md are {total} bytes (at most {DOCS_MAX_BYTES}): "
                                     f"cut history and repetition, or make repeated figures a generated table; {sizes}")


def test_docs_size_check_can_fail(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "docs" / "a.md").write_text("x" * 60_000)
    (tmp_path / "benchmarks" / "README_x.md").write_text("y" * 50_000)
    (tmp_path / "benchmarks" / "notes.md").write_text("z" * 10)  # not a README: not counted
    assert sum(len(p.read_bytes()) for p in _size_limited_docs(tmp_path)) == 110_000 > DOCS_MAX_BYTES


def test_readme_starts_with_the_two_commands():
    lines = _readme().splitlines()
    assert lines[0].startswith("# vToken") and lines[1] == "" and lines[2] == "```bash", lines[:3]
    first, second = lines[3], lines[4]
    assert lines[5] == "```", lines[5]
    assert first.split("#", 1)[0].split() == ["make", "serve"] and "vllm serve" in first and "vToken" in first
    assert second.split("#", 1)[0].split() == ["make", "test"] and "test suite" in second
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^serve:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def _makefile_var(name: str) -> str:
    m = re.search(rf"^{name}\s*\?=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, name
    return m.group(1).strip()


def test_readme_config_examples_are_valid_and_the_demo_is_make_serve():
    from vtoken.config import parse_config

    readme = _readme()
    configs = re.findall(r"--additional-config '([^']+)'", readme)
    assert len(configs) >= 2, configs  # the demo and the configuration example
    configs = [c for c in configs if "..." not in c]  # the syntax line `{"vtoken": {...}}`
    for raw in configs:
        parse_config(json.loads(raw)["vtoken"])
    # "`make serve` runs this": the demo command is the Makefile's
    assert json.loads(configs[0]) == json.loads(_makefile_var("VTOKEN_CONFIG"))
    demo = " ".join(readme[readme.index(".venv/bin/vllm serve"):readme.index("--additional-config")].replace("\\", " ").split())
    assert " ".join(_makefile_var("SERVE_ARGS").split()) in demo
    assert "--served-model-name smollm2" in demo and "--block-size 32" in demo


def test_configuration_error_example_is_what_the_code_says():
    from vtoken.config import VTokenConfigError, parse_config

    flat = " ".join(_config_doc().split())
    m = re.search(r"`vtoken: error: (vtoken\.bugdet = 64: [^`]*)`", flat)
    assert m, "docs/configuration.md: no start-up error example"
    with pytest.raises(VTokenConfigError) as e:
        parse_config({"bugdet": 64})
    assert m.group(1) == str(e.value)


# ----------------------------------------------------------------------------- generated tables
def test_config_table_is_generated_from_the_model():
    from vtoken.cli import config_table_markdown

    assert _generated(_config_doc(), "vtoken config --format markdown") == config_table_markdown()


def test_config_table_lists_every_field_and_no_removed_one():
    from vtoken.cli import config_schema
    from vtoken.config import VTokenConfig

    keys = [r["key"] for r in config_schema()]
    assert keys == list(VTokenConfig.model_fields)
    assert "log_stats" not in keys and "score_every" in keys
    assert all(r["meaning"] for r in config_schema())


def test_vtoken_config_command_prints_every_key():
    p = subprocess.run([sys.executable, "-m", "vtoken.cli", "config"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr
    from vtoken.cli import config_schema

    lines = p.stdout.splitlines()
    for r in config_schema():
        assert any(ln.split()[:1] == [r["key"]] and r["default"] in ln and r["meaning"] in ln for ln in lines), r
    p = subprocess.run([sys.executable, "-m", "vtoken.cli", "config", "--format", "json"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert json.loads(p.stdout) == config_schema()


def test_policy_tables_are_generated_from_the_policies():
    """README's and docs/configuration.md's policy tables come from the registered policies'
    declarations (a policy added as a file needs no doc edit), one row per policy."""
    from vtoken.policies import available_policies, policies_markdown, policy_classes_markdown

    readme = _generated(_readme(), "vtoken.policies.policies_markdown()")
    assert readme == policies_markdown()
    config = _generated(_config_doc(), "vtoken.policies.policy_classes_markdown()")
    assert config == policy_classes_markdown()
    assert re.findall(r"^\| `(\w+)` \|", readme, re.M) == sorted(available_policies())
    assert re.findall(r"`(\w+)`: `", config) == sorted(available_policies())
    assert "| `h2o` | H2O, arXiv 2306.14048 | accumulated attention (heavy hitters) + recent window | column sums, " \
           "every step | `head` |" in readme
    assert "; `tova`: `TOVAPolicy`." in config and config.startswith("Classes (in `vtoken.policies.<name>`): ")


def test_metrics_table_is_generated_from_metrics_py():
    from vtoken.integrations.vllm.sched.metrics import COUNTERS, GAUGES, HISTOGRAMS, metrics_table_markdown

    table = _generated(_config_doc(), "vtoken.integrations.vllm.sched.metrics.metrics_table_markdown()")
    assert table == metrics_table_markdown()
    assert len(table.strip().splitlines()) == 2 + len(GAUGES) + len(COUNTERS) + len(HISTOGRAMS)


def test_model_family_tables_are_generated_from_the_matrix():
    """docs/models.md's table and README's families table come from benchmarks/results/model_families.json
    (``PYTHONPATH=tests python -m drivers.model_families``; tests/integration/test_model_families.py checks its rows)."""
    doc_tables = _doc_tables()
    assert _generated((ROOT / "docs" / "models.md").read_text(), "benchmarks/doc_tables.py model_families_table") == \
        doc_tables.model_families_table()
    assert _generated(_readme(), "benchmarks/doc_tables.py model_families_readme_table") == \
        doc_tables.model_families_readme_table()


# ----------------------------------------------------------------------------- cited paths
_EXT = r"(?:py|json|jsonl|png|md|txt|toml|cfg|yaml|yml)"
# a token in backticks or a markdown link target
_CITED = re.compile(r"`([^`\s]+)`|\]\(([^)\s]+)\)")
_PATHLIKE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_./-]*(?:\." + _EXT + r"|/)$")


def _cited_paths(doc: Path) -> list[str]:
    out = []
    for m in _CITED.finditer(doc.read_text()):
        tok = (m.group(1) or m.group(2)).rstrip(".,;:")
        tok = tok.split("#")[0]
        if not tok or tok.startswith(("http:", "https:", "/", "~", "$")) or "..." in tok or "*" in tok:
            continue
        if "/" not in tok and not tok.endswith(tuple(f".{e}" for e in ("py", "json", "jsonl", "png", "md", "txt"))):
            continue
        if _PATHLIKE.match(tok) and not re.search(r"[<>{}]|NAME", tok):
            out.append(tok)
    return out


def _tracked() -> set[str]:
    p = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT)
    files = set(p.stdout.split()) if p.returncode == 0 else set()
    # untracked files too (new docs before their commit), but not the venvs (.venv, .cache/ side venvs)
    files |= {str(f.relative_to(ROOT)) for f in ROOT.rglob("*")
              if ".venv" not in f.parts and ".git" not in f.parts and ".cache" not in f.parts}
    return files


def _exists(tok: str, doc: Path, tracked: set[str]) -> bool:
    tok = tok.rstrip("/")
    if "/" in tok:
        return (doc.parent / tok).exists() or (ROOT / tok).exists() or (ROOT / "benchmarks" / tok).exists()
    # a bare file name: some file of the repository has it
    return any(t == tok or t.endswith("/" + tok) for t in tracked)


# Paths a doc names on purpose although they are not in the repository: the venv `make` creates.
ALLOWED_MISSING: set[str] = {".venv/"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_path_exists(doc):
    tracked = _tracked()
    cited = _cited_paths(doc)
    missing = [t for t in cited if t not in ALLOWED_MISSING and not _exists(t, doc, tracked)]
    assert not missing, f"{doc.relative_to(ROOT)} cites files that do not exist: {missing}"


def test_path_check_can_fail(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("see `benchmarks/results/nope.json` and [plot](benchmarks/results/sla.png)")
    assert _cited_paths(doc) == ["benchmarks/results/nope.json", "benchmarks/results/sla.png"]
    assert not _exists("benchmarks/results/nope.json", doc, set())
    assert _exists("benchmarks/results/sla.png", doc, set())


# ----------------------------------------------------------------------------- relative links
LINK_DOCS = [*DOCS, ROOT / "patches" / "README.md"]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces -> '-'."""
    s = re.sub(r"[`*_]", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # no headings inside code blocks
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def _broken_links(doc: Path) -> list[str]:
    """Relative markdown links of ``doc`` whose file (from ``doc``'s folder, as GitHub resolves
    them) or ``#anchor`` does not exist."""
    bad = []
    for m in _LINK.finditer(doc.read_text()):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        f = (doc.parent / path).resolve() if path else doc
        if not f.exists():
            bad.append(target)
        elif anchor and f.suffix == ".md" and anchor not in _anchors(f):
            bad.append(target)
    return bad


@pytest.mark.parametrize("doc", LINK_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    bad = _broken_links(doc)
    assert not bad, f"{doc.relative_to(ROOT)}: links that do not resolve from {doc.parent.relative_to(ROOT) or '.'}/: {bad}"


def test_readme_links_into_docs():
    links = {m.group(1).partition("#")[0] for m in _LINK.finditer(_readme())}
    for page in ("docs/configuration.md", "benchmarks/README.md", "docs/layout.md"):
        assert page in links, page
    # the README's docs table lists every page of docs/
    assert {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} <= links


def test_link_check_can_fail(tmp_path):
    (tmp_path / "a.md").write_text("# Top part\n\n[ok](b.md#the-b-page) [self](#top-part)\n"
                                   "[gone](nope.md) [bad anchor](b.md#nope) [web](https://example.com)\n")
    (tmp_path / "b.md").write_text("# The `b` page\n")
    assert _broken_links(tmp_path / "a.md") == ["nope.md", "b.md#nope"]


# ----------------------------------------------------------------------------- code layout
def _imports_vllm(path: Path) -> bool:
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
            return True
    return False


def _layout_block() -> str:
    text = LAYOUT_DOC.read_text()
    i = text.index("## Layout")
    m = re.search(r"```\n(.*?)```", text[i:], re.S)
    assert m, "docs/layout.md: no layout block"
    return m.group(1)


def test_layout_names_every_module():
    block = _layout_block()
    pkg = ROOT / "vtoken"
    names = {p.name for p in pkg.glob("*.py") if p.name != "__init__.py"}
    names |= {f"{p.name}/" for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    # the package's entries: lines indented by two spaces under `vtoken/`, first word = the module
    entries = [ln.split()[0] for ln in block.splitlines() if re.match(r"^  \S", ln)]
    missing = sorted(n for n in names if not any(e == n or (n.endswith("/") and e.startswith(n)) for e in entries))
    assert not missing, f"docs/layout.md's layout leaves out {missing}"
    assert "tests/drivers/" in block and "not shipped" in block
    # kernels/ holds the token-move and the scoring kernels
    line = next(ln for ln in block.splitlines() if ln.strip().startswith("kernels/"))
    assert "token-move" in line and "scoring" in line
    assert {p.name for p in (pkg / "kernels").glob("*.py")} >= {"move.py", "score.py"}


def test_layout_names_every_module_that_imports_vllm():
    """The layout says the core imports no vllm: only integrations/, cli.py and patches/fingerprint.py."""
    pkg = ROOT / "vtoken"
    importers = {str(p.relative_to(pkg)) for p in pkg.rglob("*.py") if _imports_vllm(p)}
    assert importers, "no module imports vllm?"
    outside = {m for m in importers if not m.startswith("integrations/")}
    assert outside == {"cli.py", "patches/fingerprint.py"}, outside
    assert any(m.startswith("integrations/") for m in importers)
    lines = _layout_block().splitlines()
    assert lines[0].startswith("vtoken/")
    end = next(i for i, ln in enumerate(lines) if re.match(r"^  \S", ln))
    first = " ".join(" ".join(lines[:end]).split())  # the vtoken/ line and its continuation
    for name in ("integrations/", "cli.py", "patches/fingerprint.py"):
        assert name in first, name


# ----------------------------------------------------------------------------- result figures (benchmarks/README.md)
def _doc_tables():
    """``benchmarks/doc_tables.py`` (the generator of the benchmark tables), imported."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import doc_tables
    finally:
        sys.path.pop(0)
    return doc_tables


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _heading(text: str, start: str, flat: bool = True) -> str:
    """The part of ``text`` from the ``## `` heading that starts with ``start`` to the next ``## ``
    heading; with ``flat``, whitespace runs (line wraps) become single spaces."""
    i = text.index("\n## " + start)
    j = text.find("\n## ", i + 1)
    sec = text[i: j if j > 0 else len(text)]
    return " ".join(sec.split()) if flat else sec


def _lead(text: str, start: str) -> str:
    """The paragraphs from the bold lead-in ``start`` to the next bold lead-in or heading, flat."""
    i = text.index(start)
    ends = [k for k in (text.find("\n\n**", i + len(start)), text.find("\n## ", i)) if k > 0]
    return " ".join(text[i: min(ends) if ends else len(text)].split())


def _makefile_cmd(target: str) -> str:
    return " ".join(recipe(target))


def test_benchmarks_readme_tables_are_generated():
    """Every ``doc_tables.py`` block of benchmarks/README.md equals what its generator prints now,
    and the benchmarks' main tables are there."""
    doc_tables = _doc_tables()
    text = _bench()
    names = re.findall(r"<!-- generated: benchmarks/doc_tables\.py (\w+) -->", text)
    assert {"retained_blocks_table", "concurrency_chunks_table", "quality_scale_table", "sla_at_quality_table",
            "sla_512_snapkv_table", "step_cost_table", "scheduler_table", "preempt_table",
            "soak_rss_table", "tasks_full_table", "tasks_dense_table"} <= set(names)
    for name in names:
        assert _generated(text, f"benchmarks/doc_tables.py {name}") == doc_tables.TABLES[name](), name


def test_generated_block_check_can_fail():
    doc_tables = _doc_tables()
    stale = doc_tables.TABLES["preempt_table"]().replace("| 1 |", "| 2 |", 1)
    text = f"<!-- generated: benchmarks/doc_tables.py preempt_table -->\n{stale}<!-- end generated -->\n"
    assert _generated(text, "benchmarks/doc_tables.py preempt_table") != doc_tables.preempt_table()


def test_results_first_start_matches_result():
    d = _load("first_start.json")
    t, a = d["seconds_from_make_serve"], d["asset_steps_s"]
    sec = _heading(_bench(), "First start")
    assert f"answered `/health` after {t['health_ok']:.0f} s" in sec
    assert f"installing `.venv/` {t['venv_installed']:.1f} s" in sec
    assert f"SmolLM2 {a['smollm2']:.1f} s" in sec and f"ShareGPT JSON {a['sharegpt']:.1f} s" in sec
    assert f"(about {5 * round((t['health_ok'] - t['assets_built']) / 5):.0f} s)" in sec
    assert d["demo_usage"]["prompt_tokens"] == 1037
    # the README's "Try it" quotes the total, with the command and the result file
    try_it = " ".join(_readme()[_readme().index("## Try it"):].split())
    assert f"answered `/health` after {t['health_ok']:.0f} s" in try_it
    assert "(`bash benchmarks/first_start.sh` -> `benchmarks/results/first_start.json`" in try_it


def test_retained_blocks_figures_match_result():
    d = _load("retained_blocks_full.json")
    sec = _heading(_bench(), "Retained KV blocks")
    assert d["naive_mode_check"]["all_equal"] and d["naive_mode_check"]["all_tokens_equal"]
    red = {(s["policy"], s["budget"]): s["reduction_avg"] for s in d["summary"]
           if s["model"] == "smollm2" and s["block_size"] == 32}
    # "beats the paper's range (27.2-72.3 %) at tight budgets"; StreamingLLM "gains little"
    assert "27.2-72.3 %" in sec and max(red[(p, 128)] for p in ("h2o", "random")) > 0.723
    assert max(v for (p, _), v in red.items() if p == "streaming") < 0.15


def test_concurrency_figures_match_results():
    full, ch = _load("concurrency_full.json"), _load("concurrency_chunks.json")
    sec = _heading(_bench(), "Maximum feasible concurrency")
    n = {(r["mode"], r["policy"], r["budget"]): r["max_feasible_n"] for r in full["results"]}
    assert f"a fixed pool of {full['meta']['pool_blocks']} blocks" in sec
    assert f"gets {n[('vtoken', 'h2o', 128)] / n[('naive', 'h2o', 128)]:.2f}x at budget 128" in sec
    assert f"`(N-1) x 5 + 16 <= 192` gives {n[('vtoken', 'h2o', 128)]}" in sec
    assert ch["meta"]["command"] == "python benchmarks/bench_concurrency.py --chunks"
    assert ch["meta"]["reused_results_from"] == "benchmarks/results/concurrency_full.json"
    assert [r for r in ch["results"] if not r["arm"].startswith("vtoken_chunks/")] == full["results"]
    fails = [x for x in ch["probes"] if x["arm"] == "vtoken_chunks/h2o/128" and not x["feasible"]]
    assert fails and all(x["preemptions"] == 0 for x in fails)  # not memory: admission
    assert f"at most {max(x['max_running'] for x in fails)} requests ran together" in sec


def test_quality_scale_figures_match_result():
    d = _load("quality_scale.json")
    rows = {(r["policy"], r["budget"], r["pacing"]): r for r in d["oracle"]["summary"]}
    sec = _lead(_bench(), "**Pacing**")
    assert d["oracle"]["config"]["n_conv"] == 40
    assert f"full cache {rows[('full', None, None)]['nll']:.3f} nats/token" in sec
    # "at budget 128 pressure pacing halves or better every policy's cost"
    assert all(rows[(p, 128, "pressure")]["delta_nll"] <= rows[(p, 128, "fixed")]["delta_nll"] / 2
               for p in d["oracle"]["config"]["policies"])
    assert round(rows[("h2o", 128, "pressure")]["mean_final_live"], -1) == 590 and "about 590" in sec
    best = min(d["oracle"]["config"]["policies"], key=lambda p: rows[(p, 512, "fixed")]["delta_nll"])
    assert best == "tova" and "at budget 512 with fixed pacing TOVA does best" in sec


def test_quality_prefill_figures_match_result():
    """The largest ΔNLL increase of chunks over after (and which policy), the largest for H2O and
    SnapKV, the largest agreement drop, all within the 0.03 nats/token the config's description
    states; peak held tokens the whole prompt against budget + chunk."""
    d = _load("quality_prefill.json")
    assert d["meta"]["command"] == "python benchmarks/bench_quality.py --prefill"
    sec = _lead(_bench(), "**Eviction between prefill chunks**")
    summ = [s for s in d["oracle"]["summary"] if s["policy"] != "full"]
    n = max(s["n"] for s in summ)
    assert not d["meta"].get("partial") and n == d["oracle"]["config"]["n_conv"] == 40 and f"{n} conversations" in sec
    c = d["oracle"]["config"]
    by = {(s["policy"], s["budget"], s["prefill_eviction"]): s for s in summ}
    dnll, drop = {}, 0.0
    for pol in c["policies"]:
        for b in c["budgets"]:
            a, ch = by[(pol, b, "after")], by[(pol, b, "chunks")]
            dnll[pol] = max(dnll.get(pol, -1.0), ch["delta_nll"] - a["delta_nll"])
            drop = max(drop, a["agree_full"] - ch["agree_full"])
            assert a["mean_peak_live"] == c["prompt_len"] and ch["mean_peak_live"] == b + c["prefill_chunk"]
    worst = max(dnll, key=dnll.get)
    assert worst == "tova" and f"at most +{dnll[worst]:.3f} ΔNLL over after (TOVA;" in sec
    assert f"H2O and SnapKV within +{max(dnll['h2o'], dnll['snapkv']):.3f})" in sec
    assert f"at most {drop:.3f} agreement" in sec
    assert dnll[worst] <= 0.03 and "within 0.03" in " ".join(_config_doc().split())
    assert f"({c['prompt_len'] / (min(c['budgets']) + c['prefill_chunk']):.1f}x fewer at budget {min(c['budgets'])})" in sec


def test_quality_granularity_and_keyonly_figures_match_results():
    d = _load("quality_granularity.json")
    sec = _lead(_bench(), "**Token sets** (`make")
    part = d["meta"]["partial"]
    assert f"the first {part['done_convs']} of the {part['n_conv']} conversations" in sec
    by = {(r["policy"], r["budget"], r["pacing"], r["granularity"]): r for r in d["oracle"]["summary"]
          if r["policy"] != "full"}
    req, head = by[("h2o", 128, "fixed", "request")], by[("h2o", 128, "fixed", "head")]
    # "Per-head sets nearly halve H2O's cost at budget 128 and leave Naive-Evict holding every block"
    assert "Per-head sets nearly halve H2O's cost at budget 128" in sec and 0.5 <= head["delta_nll"] / req["delta_nll"] < 0.6
    assert head["naive_blocks"] == -(-(1024 + 32) // 32) and head["vtoken_blocks"] < head["naive_blocks"] / 5
    ko = {(r["policy"], r["budget"]): r for r in _load("quality_keyonly.json")["oracle"]["summary"]}
    sec = _lead(_bench(), "**Key-only policies** (`python")
    h2o = {b: by[("h2o", b, "fixed", "head")]["delta_nll"] for b in (128, 512)}
    assert "None comes near H2O at budget 128; at 512 Expected Attention comes close" in sec
    assert all(ko[(p, 128)]["delta_nll"] > 3 * h2o[128] for p in ("knorm", "keydiff", "expected_attention"))
    assert ko[("expected_attention", 512)]["delta_nll"] - h2o[512] < 0.1


# ----------------------------------------------------------------------------- SLA (benchmarks/README.md, "SLA")
def test_readme_results_lead_with_the_task_table_then_the_sla_pick():
    """README "Results" opens with the task-accuracy table (``tasks_lead_table``, tied to its result
    file by tests/test_bench_tasks.py), then the serving pick table rendered from
    ``results/sla_at_quality.json`` and the quality files (the per-policy SLA table is
    benchmarks/README.md's); it names the command and quotes the run's time and load averages
    from the file."""
    doc_tables = _doc_tables()
    readme = _readme()
    sec = readme[readme.index("\n## Results\n"):]
    sec = sec[: sec.index("\n## ", 5)]
    blocks = re.findall(r"<!-- generated: benchmarks/doc_tables\.py (\w+) -->", sec)
    assert blocks == ["tasks_lead_table", "sla_pick_table"], blocks
    assert _generated(sec, "benchmarks/doc_tables.py sla_pick_table") == doc_tables.sla_pick_table()
    assert "benchmarks/doc_tables.py sla_at_quality_table" in _bench()
    d = _load("sla_at_quality.json")
    assert d["command"].startswith("python benchmarks/bench_sla.py --policies h2o@worker")
    assert d["config"]["search"] == "bisect" and d["config"]["num_prompts"] >= 40 and d["config"]["budget"] == 128
    flat = " ".join(sec.split())
    assert "`make bench-sla-at-quality`" in flat
    assert f"{d['total_wall_s'] / 60:.0f} min" in flat
    loads = [x["load_average_1m"] for a in d["arms"].values() for x in a["runs"]]
    assert f"load average {min(loads):.1f}-{max(loads):.1f}" in flat
    # "every fixed-pacing arm's unloaded TPOT is 1.2-1.5x stock's"; "vToken holds about half
    # Naive-Evict's KV cache at the same load" (mean KV use at the rate every arm measured)
    stock_tpot = d["arms"]["stock"]["unloaded"]["p50_tpot_ms"]
    fixed = [a for n, a in d["arms"].items() if n != "stock" and not n.endswith("-pressure")]
    ratios = [a["unloaded"]["p50_tpot_ms"] / stock_tpot for a in fixed]
    assert f"unloaded TPOT is {min(ratios):.1f}-{max(ratios):.1f}x stock's" in flat
    rc = doc_tables.sla_common_rate(d)
    for r in doc_tables.sla_at_quality_rows():
        kv = [next(x["kv_cache_usage_perc_mean"] for x in a["runs"] if x["rate"] == rc)
              for a in (r["vtoken"]["fixed"], r["naive"])]
        assert 0.4 <= kv[0] / kv[1] <= 0.6, (r["policy"], kv)
    assert "holds about half Naive-Evict's KV cache at the same load" in flat
    make = (ROOT / "Makefile").read_text()
    cmd = make[make.index("\nbench-sla-at-quality:"):].split("\n\n")[0]
    assert " ".join(cmd.replace("\\\n", " ").split()[3:]) == d["command"].removeprefix("python ")


def test_sla_pick_configs_start_and_no_generated_block_names_decide_on():
    """The configs the pick table prints are configs vToken starts with, without the deprecated
    ``decide_on`` the result files record; no generated block of the docs names it."""
    from vtoken.config import parse_config

    configs = re.findall(r"`(\{[^`]*\})`", _doc_tables().sla_pick_table())
    assert configs
    for raw in configs:
        assert "decide_on" not in raw
        parse_config(json.loads(raw))
    for doc in DOCS:
        for block in re.findall(r"<!-- generated: [^\n]*-->\n(.*?)<!-- end generated -->", doc.read_text(), re.S):
            assert "decide_on" not in block, doc.name


def test_sla_at_quality_quality_cells_are_the_matching_quality_runs():
    """Each policy's quality cell is its fixed-pacing row at the SLA run's budget, at the token sets
    and prefill eviction the SLA arms ran with (the policy's default)."""
    doc_tables = _doc_tables()
    from vtoken.config import VTokenConfig
    from vtoken.policies import get_policy_class

    d = _load("sla_at_quality.json")
    for r in doc_tables.sla_at_quality_rows():
        vt = r["vtoken"]["fixed"]["vtoken"]
        # the arms ran on the worker (recorded as decide_on: worker, the one path now; the key is deprecated)
        assert vt.get("decide_on") == "worker"
        cfg = VTokenConfig(**{k: v for k, v in vt.items() if k != "decide_on"})
        assert cfg.budget == d["config"]["budget"] == r["quality"]["budget"]
        assert cfg.granularity is None and cfg.pacing == r["quality"]["pacing"] == "fixed"  # defaults on both sides
        if r["quality_file"] == "quality_prefill.json":
            assert r["quality"]["prefill_eviction"] == "chunks"
            assert cfg.resolved_prefill_eviction() == "chunks"
        else:
            assert r["quality_file"] == "quality_keyonly.json" and r["quality"]["granularity"] == "head"
            assert get_policy_class(r["policy"]).default_granularity() == "head"
        full = next(s for s in _load(r["quality_file"])["oracle"]["summary"] if s["policy"] == "full")
        assert abs(r["quality"]["nll"] - full["nll"] - r["quality"]["delta_nll"]) < 1e-9


def _span(vals, fmt: str) -> str:
    return f"{fmt.format(min(vals))}-{fmt.format(max(vals))}"


def test_sla_at_quality_findings_quote_the_result_file():
    doc_tables = _doc_tables()
    sec = _lead(_bench(), "**At a quality, budget 128**")
    d = _load("sla_at_quality.json")
    A, rc = d["arms"], doc_tables.sla_common_rate(d)
    assert rc == 0.75 and A["stock"]["sla_rate"] == 0.75 and "stock meets the SLOs up to 0.75 req/s" in sec
    assert all(a["sla_rate"] is None or a["sla_rate"] < 0.75 for n, a in A.items() if n != "stock")
    # "one request at a time every evicting arm is already slower than stock"
    un = {n: a["unloaded"]["p50_tpot_ms"] for n, a in A.items()}
    assert all(v > un["stock"] for n, v in un.items() if n != "stock")
    assert "vToken holds about half Naive-Evict's KV cache and never preempts" in sec
    assert all(sum(x["preemptions"] for x in A[n]["runs"]) == 0 for n in A if n.startswith("vtoken-"))
    rows = doc_tables.sla_at_quality_rows()
    assert "No policy is within ΔNLL +0.3 here" in sec and min(r["quality"]["delta_nll"] for r in rows) > 0.3


def test_sla_keyonly_run_is_the_makefiles():
    d = _load("sla_at_quality_keyonly.json")
    assert "`make bench-sla-keyonly` -> `results/sla_at_quality_keyonly.json`" in " ".join(_bench().split())
    assert _makefile_cmd("bench-sla-keyonly").endswith(" ".join(d["command"].split()[1:]))


def test_sla_512_snapkv_findings_quote_the_result_file():
    sec = _lead(_bench(), "**SnapKV compressing the prompt at budget 512**")
    d = _load("sla_at_quality_512_snapkv.json")
    A, cfg, h = d["arms"], d["config"], d["headline"]
    assert (cfg["budget"], cfg["prompt_len"], cfg["num_prompts"], cfg["output_len"]) == (512, 1024, 40, 128)
    assert _makefile_cmd("bench-sla-512-snapkv").endswith(" ".join(d["command"].split()[1:]))
    assert cfg["pool_blocks"] == 65 and -(-(cfg["prompt_len"] + cfg["output_len"]) // 32) == 36
    assert "one request needs 36 of the 64 blocks" in sec
    vt, nv = "vtoken-snapkv-sl128-se1000-worker", "naive-snapkv-sl128-se1000-worker"
    assert A[nv]["sla_rate"] == A["stock"]["sla_rate"]
    q = _doc_tables().sla_at_quality_rows("sla_at_quality_512_snapkv.json")[0]["quality"]
    assert q["delta_nll"] <= 0.3 and h["ratios"][vt]["vtoken_over_naive"] >= 1.5
    assert h["ratios"][vt]["vtoken_over_naive"] == A[vt]["sla_rate"] / A["stock"]["sla_rate"] == 3.0
    assert "Within ΔNLL +0.3, 3x Naive-Evict's SLA rate" in sec
    assert max(x["num_requests_running_max"] for x in A[nv]["runs"]) == 2 and "runs at most 2 requests at a time" in sec
    assert A[vt]["unloaded"]["p50_tpot_ms"] <= A["stock"]["unloaded"]["p50_tpot_ms"]


def test_sla_512_findings_quote_the_result_file():
    sec = _lead(_bench(), "**TOVA at budget 512**")
    d = _load("sla_at_quality_512.json")
    A = d["arms"]
    assert _makefile_cmd("bench-sla-512").endswith(" ".join(d["command"].split()[1:]))
    # "no vToken arm keeps 90 % even at the lowest rate"; "every token slower than stock's"
    assert "no vToken arm keeps 90 % even at the lowest rate" in sec
    assert all(A[n]["sla_rate"] is None for n in A if n.startswith("vtoken"))
    assert all(a["unloaded"]["p50_tpot_ms"] > A["stock"]["unloaded"]["p50_tpot_ms"] for n, a in A.items() if n != "stock")
    # the Naive-Evict arm is the rerun (make bench-sla-512-naive)
    rr, rerun = A["naive-tova-worker"]["rerun"], _load("sla_at_quality_512_naive.json")
    assert rr["command"] == rerun["command"] and A["naive-tova-worker"]["runs"] == rerun["arms"]["naive-tova-worker"]["runs"]
    assert rerun["slo"]["from_file"] == "benchmarks/results/sla_at_quality_512.json"
    assert " ".join(rerun["command"].split()[1:]) in _makefile_cmd("bench-sla-512-naive")
    assert "`make bench-sla-512`" in " ".join(_readme().split())


def test_sla_budget_64_figures_match_results():
    doc_tables = _doc_tables()
    sec = _lead(_bench(), "**Budget 64, Random and H2O**")
    d = _load("sla.json")
    assert d["config"]["num_prompts"] == 24 and d["config"]["budget"] == 64 and "24 prompts a rate" in sec
    assert d["headline"]["ratios"]["vtoken-random-pressure"]["vtoken_over_naive"] == 2.0
    flat = " ".join(_bench().split())
    assert "the 2x of the coarse grid is not a precise ratio" in flat
    assert all(a["sla_rate"] is None for n, a in d["arms"].items() if "h2o" in n)
    assert "H2O misses the TPOT SLO in every arm" in flat
    fine = doc_tables.sla_merged_runs()
    assert fine["vtoken-random"]["sla_rate"] == fine["vtoken-random-pressure"]["sla_rate"] == 0.75
    assert fine["naive-random"]["sla_rate"] is None
    assert next(x for x in fine["naive-random"]["runs"] if x["rate"] == 0.5)["attainment"] < 0.9
    assert "both vToken arms hold 90 % up to 0.75 req/s, Naive-Evict not even at 0.5" in flat
    assert all(x["preemptions"] == 0 for a in ("vtoken-random", "vtoken-random-pressure") for x in fine[a]["runs"])


# ----------------------------------------------------------------------------- step cost
def test_step_cost_figures_match_results():
    """The three bench_overhead.py runs of the step-cost table: their commands, the arms' configs,
    and what the prose says of them."""
    sec = " ".join(_heading(_bench(), "Step cost").split("**Where a decode step")[0].split())
    d = {n: _load(f"{n}.json") for n in ("overhead_policies", "overhead_keyonly_b32", "overhead_keyonly_slack")}
    for n, x in d.items():
        assert f"`{x['command']}` -> `results/{n}.json`" in sec, n
    r8, r32, rs = (x["results"]["smollm2"] for x in d.values())
    assert d["overhead_keyonly_b32"]["config"]["batch"] == 32 and d["overhead_policies"]["config"]["batch"] == 8
    # "K-norm costs the least of the scored policies"; "(within 1.05x at batch 32)"
    scored = [a for a in r8 if a not in ("stock", "evict-random@worker")]
    assert min(scored, key=lambda a: r8[a]["ratio_median"]) == "evict-knorm@worker"
    assert "K-norm costs the least of the scored policies" in sec
    assert r32["evict-knorm@worker"]["ratio_median"] <= 1.05 and "(within 1.05x at batch 32)" in sec
    # a slack of 16 amortizes the eviction-time read, at 64-80 live tokens instead of 64
    arms = d["overhead_keyonly_slack"]["config"]["arms"]
    assert arms["evict-keydiff:sl16@worker"]["slack"] == 16 and arms["evict-keydiff@worker"]["slack"] == 0
    for p in ("keydiff", "expected_attention"):
        assert rs[f"evict-{p}:sl16@worker"]["ratio_median"] < rs[f"evict-{p}@worker"]["ratio_median"]
    st = {x["arm"]: x["vtoken_stats"] for x in d["overhead_keyonly_slack"]["runs"] if x["rep"] == 0}
    assert st["evict-keydiff:sl16@worker"]["evictions"] == 8 * (128 // 16)
    assert "64-80 live tokens instead of 64" in sec
    small = _load("overhead_small.json")["results"]["smollm2"]["noevict"]
    assert abs(small["ratio_median"] - 1) <= 0.02 and "With nothing to evict vToken costs nothing measurable" in sec


def test_step_split_figures_match_result():
    d = _load("step_split.json")
    assert d["command"] == "python benchmarks/bench_step_split.py"
    sec = _lead(_bench(), "**Where a decode step's time goes**")
    assert "`python benchmarks/bench_step_split.py`" in sec
    res = d["results"]
    assert res["vtoken-h2o-pressure"]["median_ms"]["scoring"] > res["vtoken-h2o"]["median_ms"]["scoring"] > 0
    assert "eviction makes the forward cheaper" in sec
    assert all(res[a]["median_ms"]["forward"] < res["stock"]["median_ms"]["forward"]
               for a in ("vtoken-h2o", "vtoken-random"))


def test_scheduler_host_time_matches_result():
    """The figures quoted for results/bench_scheduler.json (stock, h2o and random with vToken's
    default config), and the README's."""
    d = _load("bench_scheduler.json")
    assert d["config"]["arms"] == ["stock", "h2o", "random"]
    flat = _lead(_bench(), "**Scheduler host time**")
    assert f"`{d['command'].split(' ', 1)[1]}`" in flat
    ratio = {(c["num_requests"], c["live"], a): c["arms"][a]["total"]["median_ms"] / c["arms"]["stock"]["total"]["median_ms"]
             for c in d["cells"] for a in ("h2o", "random")}
    assert {(r, L) for r, L, _ in ratio} == {(r, L) for r in (256, 512) for L in (1024, 4096)}
    assert "within the 1.2x target at every cell" in flat and max(ratio.values()) <= 1.2
    readme = " ".join(_readme().split())
    assert f"host time per step is {min(ratio.values()):.2f}-{max(ratio.values()):.2f}x stock's at 256-512 requests" in readme
    for c in d["cells"]:
        for a in ("h2o", "random"):
            rec = c["arms"][a]
            assert rec["checks_ok"] and rec["mean_evicted_per_step"] == c["num_requests"]
            assert rec["vtoken_config"] == {"policy": a, "budget": c["live"], "slack": 0}  # the default config
    assert f"load average {d['load_average_before'][0]:.2f} before and {d['load_average_after'][0]:.2f} after" in flat
    assert f"{d['config']['steps']:,} timed steps per arm and cell" in flat


def test_worker_step_and_granularity_cost_match_results():
    """What the worker step dispatches is the same at every request count; the load averages quoted
    for the granularity cost are the run's."""
    d = _load("bench_worker_step.json")
    assert [r["R"] for r in d["rows"]] == [8, 64, 256]
    for key in ("ops", "host_syncs", "uploads", "py_lines"):
        assert len({r["counts"]["step"][key] for r in d["rows"]}) == 1, key
    g = _load("granularity_cost.json")
    meta, t = g["meta"], {(r["policy"], r["num_requests"], r["granularity"]): r for r in g["time"]}
    flat = " ".join((ROOT / "docs" / "granularity.md").read_text().split())
    assert (f"H2O's `head` takes {t[('h2o', 8, 'head')]['ratio_to_request']:.1f}x `request`'s at 8 requests and "
            f"{t[('h2o', 32, 'head')]['ratio_to_request']:.1f}x at 32 (`{meta['command']}` -> "
            f"`benchmarks/results/granularity_cost.json`, plot `granularity_cost.png`, load {meta['load_average_before'][0]:.2f} before, "
            f"{meta['load_average_after'][0]:.2f} after)") in flat


def test_tpot_matches_result():
    """The TPOT ratio is results/tpot_tiny.json's, and the file says whether it meets 1.5x."""
    r = _load("tpot_tiny.json")["results"]["threads_1"]
    flat = " ".join(_bench().split())
    assert f"stock {r['median_tpot_ms']['stock']:.2f} ms, vToken {r['median_tpot_ms']['vtoken']:.2f} ms, **{r['ratio']:.2f}x**" in flat
    assert f"({min(r['ratio_per_rep']):.2f}-{max(r['ratio_per_rep']):.2f}x by repetition" in flat
    assert f"the code before this change {r['median_tpot_ms']['vtoken_base']:.2f} ms" in flat  # (--baseline)
    assert r["meets_criterion"] == (r["ratio"] <= 1.5) and "not the 1.5x target" in flat


# ----------------------------------------------------------------------------- other benchmarks
def test_prefix_cache_figures_match_result():
    doc_tables = _doc_tables()
    d = _load("prefix_cache_sharegpt.json")
    arms = {a["arm"]: a for a in d["arms"]}
    assert {a for a, _ in doc_tables.PREFIX_ARMS} <= set(arms)
    assert d["meta"]["command"] == "python benchmarks/bench_prefix_cache.py"
    sec = _heading(_bench(), "Prefix caching")
    assert f"{d['args']['conversations']} ShareGPT chats x {d['args']['turns']} turns" in sec
    assert f"{d['args']['max_tokens']} output tokens, budget {d['args']['budget']}" in sec
    assert f"load average {d['load_average_1m']:.1f}" in sec
    c = d["copy_cost"]
    assert f"({c['ms_per_block']:.2f} ms, {c['bytes_per_block'] / 2**20:.2f} MB)" in sec
    s, tv, sk = arms["stock"], arms["vtoken_tova"], arms["vtoken_skip"]
    readme = " ".join(_readme().split())
    assert (f"`python benchmarks/bench_prefix_cache.py`): {tv['prefix_cache_hit_rate'] * 100:.0f} % of prompt tokens "
            f"hit against stock's {s['prefix_cache_hit_rate'] * 100:.0f} %, with "
            f"{(1 - tv['blocks_mean'] / s['blocks_mean']) * 100:.0f} % fewer blocks held on average") in readme
    assert "with `prefix_hits: skip` H2O reads no cache" in sec
    assert sk["prefix_cache_hits"] == 0 and sk["prefix_reads_skipped"] == sk["requests"]
    assert all(a["prefix_cache_hit_rate"] > 0.5 for n, a in arms.items() if n != "vtoken_skip")


def test_longest_prompt_figures_match_result():
    d = _load("longest_prompt.json")
    assert d["meta"]["command"] == "python benchmarks/bench_longest_prompt.py"
    sec = _heading(_bench(), "Longest prompt")
    arms = {a["arm"]: a for a in d["arms"]}
    assert f"a pool of {d['args']['blocks']} blocks of 32 ({d['pool_tokens']:,} usable tokens)" in sec
    ch = arms["vtoken_chunks"]
    assert round(ch["longest_served"] / d["pool_tokens"]) == 4 and "serves a prompt about 4x the pool" in sec
    assert all(arms[a]["longest_served"] < d["pool_tokens"] for a in ("stock", "naive", "vtoken_after"))
    assert max(r["peak_blocks"] for r in ch["runs"]) <= -(-(d["args"]["budget"] + d["args"]["chunk"] + 1) // 32)


def test_preemption_result_recomputes_one_token():
    d = _load("preempt_recompute.json")
    assert d["meta"]["command"] == "python benchmarks/bench_preempt.py"
    assert "`python benchmarks/bench_preempt.py` -> `results/preempt_recompute.json`" in _bench()
    for gran, v in d["granularity"].items():
        r, = v["resumes"]
        assert r["scheduled"] == 1 and r["live"] < r["logical"] and v["request_faults"] == 0, (gran, r)


def test_soak_figures_match_results():
    d = _load("soak_2026-11-30.json")
    f = d["figures"]
    sec = _heading(_bench(), "Soak")
    for key, label in (("requests_served", "requests served"), ("aborts", "aborts"), ("rejected_400", "bad requests"),
                       ("preemptions", "preemptions"), ("evicted_tokens", "tokens evicted"),
                       ("moved_tokens", "moved"), ("freed_blocks", "blocks freed"), ("blocks_leaked", "blocks leaked")):
        num = f"{int(f[key]):,}"
        assert re.search(re.escape(num) + r"\**\s+" + re.escape(label), sec), (key, num)
    assert f"{d['clients']} clients" in sec and f"--minutes {d['minutes']:g}" in sec
    rss = _load("soak_rss.json")
    assert rss["passed"] and rss["verdict"]["vtoken_growth_within_stock"]
    assert f"`{rss['command']}`" in sec and "vToken's EngineCore grows no more than stock's" in sec
