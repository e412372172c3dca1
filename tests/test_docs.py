"""The docs agree with the code and with the committed result files (no engine; a few seconds).

- README.md is a short front page: at most 12 KB, it starts with the two set-up commands, and its
  configuration examples are valid.
- Generated tables (between ``<!-- generated: ... -->`` and ``<!-- end generated -->``) equal
  what their generator prints now: the config and metrics tables of docs/configuration.md
  (``vtoken config --format markdown``, ``metrics_table_markdown``) and the benchmark tables of
  benchmarks/README.md and README_sla.md (``benchmarks/doc_tables.py``). docs/configuration.md's refusals block
  is checked by ``tests/integration/test_refusals.py``.
- Every file path cited in README.md, docs/*.md and benchmarks/*.md exists, and every relative
  markdown link (and its ``#anchor``) resolves from the page that holds it.
- docs/layout.md names every module of ``vtoken/`` and every module that imports vllm.
- The result figures (benchmarks/README.md, README_sla.md, the README's first-start time) equal
  the values in the result file each one names.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_policy_classes_are_the_registered_ones():
    from vtoken.policies import get_policy_class

    rows = re.findall(r"^\| `(\w+)` \| `(vtoken\.policies\.[\w.]+)`(?: \([^|]*\))? \|$", _config_doc(), re.M)
    from vtoken.policies import available_policies

    assert sorted(n for n, _ in rows) == sorted(available_policies())  # every built-in policy, once
    for name, path in rows:
        cls = get_policy_class(name)
        assert f"{cls.__module__}.{cls.__qualname__}" == path, name
    readme_names = re.findall(r"^\| `(\w+)` \| [^|]*arXiv|^\| `(\w+)` \| baseline", _readme(), re.M)
    assert {a or b for a, b in readme_names} == {n for n, _ in rows}


def test_metrics_table_is_generated_from_metrics_py():
    from vtoken.integrations.vllm.sched.metrics import COUNTERS, GAUGES, HISTOGRAMS, metrics_table_markdown

    table = _generated(_config_doc(), "vtoken.integrations.vllm.sched.metrics.metrics_table_markdown()")
    assert table == metrics_table_markdown()
    assert len(table.strip().splitlines()) == 2 + len(GAUGES) + len(COUNTERS) + len(HISTOGRAMS)


@pytest.mark.parametrize("name", ["sla_table", "sla_unloaded_table", "overhead_table", "sla_headline_table",
                                  "sla_full_table", "sla_full_unloaded_table", "sla_k_grid_table",
                                  "sla_fine_table", "step_split_table", "step_split_elementwise_table",
                                  "sla_h2o_faster_headline_table", "sla_h2o_faster_table",
                                  "sla_h2o_faster_unloaded_table"])
def test_readme_sla_tables_are_generated_from_results(name):
    doc_tables = _doc_tables()
    text = (ROOT / "benchmarks" / "README_sla.md").read_text()
    assert _generated(text, f"benchmarks/doc_tables.py {name}") == doc_tables.TABLES[name]()


def test_model_family_tables_are_generated_from_the_matrix():
    """docs/models.md's table and README's families table come from benchmarks/results/model_families.json
    (``python -m drivers.model_families``; tests/integration/test_model_families.py checks its rows)."""
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
    doc.write_text("see `benchmarks/results/nope.json` and [plot](benchmarks/results/sla_small.png)")
    assert _cited_paths(doc) == ["benchmarks/results/nope.json", "benchmarks/results/sla_small.png"]
    assert not _exists("benchmarks/results/nope.json", doc, set())
    assert _exists("benchmarks/results/sla_small.png", doc, set())


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
    """``benchmarks/doc_tables.py`` (the generator of the benchmark READMEs' tables), imported."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import doc_tables
    finally:
        sys.path.pop(0)
    return doc_tables


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _section(text: str, start: str, flat: bool = False) -> str:
    """The README paragraph group starting at ``start`` (up to the next bold lead-in); with
    ``flat``, whitespace runs (line wraps) become single spaces."""
    i = text.index(start)
    j = text.find("\n\n**", i + len(start))
    sec = text[i: j if j > 0 else len(text)]
    return " ".join(sec.split()) if flat else sec


def test_results_retained_blocks_table_matches_result():
    d = _load("retained_blocks_full.json")
    red = {(s["policy"], s["budget"], s["block_size"]): s["reduction_avg"] * 100
           for s in d["summary"] if s["model"] == "smollm2"}
    names = {"H2O": "h2o", "Random": "random", "Scissorhands": "scissorhands", "TOVA": "tova",
             "StreamingLLM": "streaming"}
    sec = _section(_bench(), "**Retained KV blocks per request")
    seen = 0
    for line in sec.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not cells or cells[0] not in names:
            continue
        for col, bs in ((1, 32), (2, 64)):
            got = [float(x) for x in re.findall(r"\d+\.\d", cells[col])]
            want = [round(red[(names[cells[0]], b, bs)], 1) for b in (128, 256, 512)]
            assert got == want, (cells[0], bs, got, want)
        seen += 1
    assert seen == 5


def test_results_concurrency_table_matches_result():
    d = _load("concurrency_full.json")
    n = {(r["mode"], r["policy"], r["budget"]): r["max_feasible_n"] for r in d["results"]}
    stock = n[("stock", None, None)]
    sec = _section(_bench(), "**Maximum feasible concurrency")
    seen = 0
    for line in sec.splitlines():
        m = re.match(r"\| (H2O|Random|Scissorhands), (\d+) \| (\d+) \| (\d+) \| (\d+) \| \**([\d.]+)x", line)
        if not m:
            continue
        pol, budget = m.group(1).lower(), int(m.group(2))
        got = tuple(int(m.group(i)) for i in (3, 4, 5))
        assert got == (stock, n[("naive", pol, budget)], n[("vtoken", pol, budget)]), line
        assert m.group(6) == f"{n[('vtoken', pol, budget)] / n[('naive', pol, budget)]:.2f}", line
        seen += 1
    assert seen == 6
    assert f"fixed pool of {d['meta']['pool_blocks']}" in sec


def test_results_overhead_figures_match_result():
    r = _load("overhead_small.json")["results"]["smollm2"]
    sec = _section(_bench(), "**Overhead**", flat=True)
    for arm in ("noevict", "evict"):
        x = r[arm]
        assert f"**{x['ratio_median']:.2f}x**" in sec
        assert f"min-max {x['ratio_min']:.2f}-{x['ratio_max']:.2f}" in sec
    assert f"median of {len(r['evict']['step_ms'])}" in sec


def test_results_step_split_figures_match_results():
    """The README's step-split paragraph quotes both result files (before and after the strided
    key reads); every figure is re-derived here from them."""
    sec = _section(_bench(), "**Where a decode step's time goes**", flat=True)
    old = _load("step_split_elementwise_gather.json")["results"]
    new = _load("step_split.json")["results"]
    for res in (old, new):
        assert set(res) == {"stock", "naive-h2o", "vtoken-h2o", "vtoken-h2o-se4", "vtoken-h2o-pressure",
                            "vtoken-random"}
    o, n = old["vtoken-h2o"]["median_ms"], old["vtoken-h2o-pressure"]["median_ms"]
    assert f"{o['scoring']:.1f} ms of vToken H2O's {o['step']:.1f} ms step" in sec
    assert f"{n['scoring']:.1f} ms of pressure-paced H2O's {n['step']:.1f} ms" in sec
    assert f"({old['vtoken-h2o-pressure']['step_over_stock']:.2f}x stock)" in sec
    assert (f"scoring {new['vtoken-h2o']['median_ms']['scoring']:.1f} ms and "
            f"{new['vtoken-h2o-pressure']['median_ms']['scoring']:.1f} ms") in sec
    assert f"H2O step at {new['vtoken-h2o']['step_over_stock']:.2f}x stock" in sec
    assert f"pressure-paced one at {new['vtoken-h2o-pressure']['step_over_stock']:.2f}x" in sec
    assert f"Random: {new['vtoken-random']['step_over_stock']:.2f}x stock" in sec
    assert f"planning {new['vtoken-h2o']['median_ms']['plan']:.1f} ms" in sec
    assert (f"moves {new['vtoken-random']['median_ms']['moves']:.1f}-"
            f"{new['vtoken-h2o']['median_ms']['moves']:.1f} ms") in sec
    # the new file was made after the change, by the command the README names
    assert _load("step_split.json")["command"] == "python benchmarks/bench_step_split.py"
    assert "`python benchmarks/bench_step_split.py`" in sec


def test_h2o_rerun_figures_match_results():
    """The free-text figures about the H2O rerun (README and README_sla) come from its file."""
    d, old = _load("sla_h2o_faster_scoring.json"), _load("sla.json")
    u = {k: a["unloaded"] for k, a in d["arms"].items()}
    ou = {k: a["unloaded"] for k, a in old["arms"].items()}
    readme = " ".join(_bench().split())
    sla_md = " ".join((ROOT / "benchmarks" / "README_sla.md").read_text().split())
    vt, nv = f"{u['vtoken-h2o']['p50_tpot_ms']:.1f}", f"{u['naive-h2o']['p50_tpot_ms']:.1f}"
    assert f"unloaded P50 {vt} against {nv} ms" in readme
    assert f"unloaded P50 TPOT ({vt} ms, one request at a time) is above Naive-Evict H2O's ({nv} ms)" in sla_md
    assert (f"from {ou['vtoken-h2o']['ttft_fit_b_ms_per_token']:.2f} to {u['naive-h2o']['ttft_fit_b_ms_per_token']:.2f}-"
            f"{u['vtoken-h2o']['ttft_fit_b_ms_per_token']:.2f} ms per prompt token (stock "
            f"{u['stock']['ttft_fit_b_ms_per_token']:.2f})") in readme
    assert (f"against {ou['naive-h2o']['ttft_fit_b_ms_per_token']:.2f} and "
            f"{ou['vtoken-h2o']['ttft_fit_b_ms_per_token']:.2f} in the full sweep") in sla_md
    assert (f"gives {u['naive-h2o']['ttft_fit_b_ms_per_token']:.2f} ms per token for Naive-Evict H2O and "
            f"{u['vtoken-h2o']['ttft_fit_b_ms_per_token']:.2f} for vToken H2O") in sla_md
    assert f"stock's {u['stock']['ttft_fit_b_ms_per_token']:.2f}" in sla_md
    r05 = {k: a["runs"][0] for k, a in d["arms"].items()}
    assert all(r["rate"] == 0.5 for r in r05.values())
    good = {k: round(r["attainment"] * d["config"]["num_prompts"]) for k, r in r05.items()}
    assert f"{r05['naive-h2o']['attainment'] * 100:.0f} % of the requests ({good['naive-h2o']} of 24)" in sla_md
    assert f"{r05['vtoken-h2o']['attainment'] * 100:.0f} % ({good['vtoken-h2o']} of 24)" in sla_md
    assert f"(21.4 against 20.4)" in sla_md and f"{ou['vtoken-h2o']['p50_tpot_ms']:.1f}" == "21.4"
    assert f"{ou['naive-h2o']['p50_tpot_ms']:.1f}" == "20.4"


def test_results_sla_figures_match_result():
    doc_tables = _doc_tables()
    readme = _bench()
    assert _generated(readme, "benchmarks/doc_tables.py sla_headline_table") == doc_tables.sla_headline_table()
    d = _load("sla.json")
    sec = _section(readme, "**SLA-constrained throughput**", flat=True)
    slo, cfg = d["slo"], d["config"]
    assert f"run time {d['total_wall_s']:,.0f} s" in sec
    loads = [r["load_average_1m"] for a in d["arms"].values() for r in a["runs"]]
    assert f"load average {min(loads):.1f}-{max(loads):.1f} per rate" in sec
    assert f"{cfg['num_prompts']} prompts per rate" in sec and f"budget {cfg['budget']}" in sec
    assert f"a pool of {cfg['pool_blocks']} blocks x {cfg['block_size']} tokens" in sec
    assert f"TTFT <= {slo['k_ttft']:g} x {slo['ttft_b_ms_per_token']:.2f} ms per prompt token" in sec
    assert slo["ttft_a_ms"] == 0.0
    assert f"TPOT <= {slo['k_tpot']:g} x {slo['unloaded_p50_tpot_ms']:.1f} ms = {slo['tpot_ms']:.1f} ms" in sec
    arms = d["arms"]

    def run(arm, rate):
        return next(r for r in arms[arm]["runs"] if r["rate"] == rate)

    ratios = d["headline"]["ratios"]
    assert ratios["vtoken-random-pressure"]["vtoken_over_naive"] == 2.0 and "**2.00x** (1 vs 0.5 req/s)" in sec
    assert arms["vtoken-random-pressure"]["sla_rate"] == 1.0 and arms["naive-random"]["sla_rate"] == 0.5
    assert ratios["vtoken-random"]["vtoken_over_naive"] == 1.0 and "1.00x (0.5 vs 0.5 req/s)" in sec
    # "no arm, Naive-Evict included, reaches 90 % at 0.5 req/s" for H2O
    assert all(a["sla_rate"] is None for n, a in arms.items() if "h2o" in n)
    p, nv, st = run("vtoken-random-pressure", 1.0), run("naive-random", 1.0), run("stock", 1.0)
    assert f"{p['attainment'] * 100:.0f} % of requests (Naive-Evict {nv['attainment'] * 100:.0f} %, " \
           f"stock {st['attainment'] * 100:.0f} %)" in sec
    assert p["preemptions"] == 0 and f"(Naive-Evict {nv['preemptions']:.0f}, stock {st['preemptions']:.0f})" in sec
    n = cfg["num_prompts"]
    assert f"{round(p['attainment'] * n)} of {n} requests against {round(nv['attainment'] * n)} of {n}" in sec
    p2, n2 = run("vtoken-random-pressure", 2.0), run("naive-random", 2.0)
    assert f"goodput was {p2['request_goodput']:.3f} req/s against {n2['request_goodput']:.3f}" in sec
    pre = {a: sum(r["preemptions"] for r in arms[a]["runs"]) for a in arms}
    assert pre["vtoken-random"] == 0 and f"(Naive-Evict: {pre['naive-random']:.0f} preemptions" in sec
    v3, n3 = run("vtoken-random", 3.0), run("naive-random", 3.0)
    assert f"({v3['request_throughput']:.3f} req/s at 3 req/s against Naive-Evict's {n3['request_throughput']:.3f})" in sec
    assert f"({v3['num_requests_running_max']:.0f} against {n3['num_requests_running_max']:.0f})" in sec
    v2 = run("vtoken-random", 2.0)
    assert f"P50 TPOT at 2 req/s was {v2['p50_tpot_ms']:.0f} ms against Naive-Evict's {n2['p50_tpot_ms']:.0f} ms" in sec
    assert v2["p50_tpot_ms"] > slo["tpot_ms"] > n2["p50_tpot_ms"]
    un = {a: arms[a]["unloaded"]["p50_tpot_ms"] for a in arms}
    assert f"{un['naive-h2o']:.1f} ms for Naive-Evict H2O and {un['vtoken-h2o']:.1f} ms for vToken H2O " \
           f"against stock's {un['stock']:.1f} ms" in sec
    assert f"rose to {run('vtoken-h2o-pressure', 0.5)['p50_tpot_ms']:.0f} ms" in sec
    assert f"(vToken: {run('vtoken-h2o-se4', 1.0)['attainment']:.2f} attainment at 1 req/s against " \
           f"{run('vtoken-h2o', 1.0)['attainment']:.2f})" in sec


def test_readme_sla_grid_and_counters_match_result():
    d = _load("sla.json")
    text = (ROOT / "benchmarks" / "README_sla.md").read_text()
    sec = text[text.index("## Results: SLA, full sweep"):text.index("## Results: SLA, small")]
    flat = " ".join(sec.split())
    grid = d["k_grid_sla_rate"]
    rank = {None: -1.0}
    cmp = [(rank.get(g["vtoken-random-pressure"], g["vtoken-random-pressure"]),
            rank.get(g["naive-random"], g["naive-random"])) for g in grid.values()]
    ahead = sum(a > b for a, b in cmp)
    assert all(a >= b for a, b in cmp)
    assert f"ahead of Naive-Evict at {ahead} of the {len(grid)} SLO scales and level at the rest" in flat
    g = grid["k_ttft=20,k_tpot=3"]
    assert (g["vtoken-random"], g["naive-random"]) == (2.0, 1.0) and "(k_TPOT 3, k_TTFT 20) it reaches 2 req/s against 1" in flat
    r = next(x for x in d["arms"]["vtoken-h2o"]["runs"] if x["rate"] == 0.5)
    assert f"{r['vtoken_counters']['vtoken:repack_seconds_total']:.1f} s over the whole 0.5 req/s run" in flat
    assert f"{d['total_wall_s']:,.0f} s (`results/sla.json`" in text


def test_sla_fine_replicate_figures_match_results():
    doc_tables = _doc_tables()
    readme = _bench()
    assert _generated(readme, "benchmarks/doc_tables.py sla_fine_table") == doc_tables.sla_fine_table()
    arms = doc_tables.sla_merged_runs()
    flat = " ".join(_section(readme, "**Replicate on a finer grid**", flat=True).split())
    assert arms["vtoken-random"]["sla_rate"] == arms["vtoken-random-pressure"]["sla_rate"] == 0.75
    assert arms["naive-random"]["sla_rate"] is None
    run = {a: {r["rate"]: r for r in rec["runs"]} for a, rec in arms.items()}
    nv, vt, pr = run["naive-random"], run["vtoken-random"], run["vtoken-random-pressure"]
    n = _load("sla_random_fine.json")["config"]["num_prompts"]
    assert f"({round(nv[0.5]['attainment'] * n)} of {n} good requests)" in flat
    assert f"0.90 is {round(vt[0.75]['attainment'] * n)} of {n}" in flat
    for rate in (1.25, 1.5):
        ratio = vt[rate]["request_goodput"] / nv[rate]["request_goodput"]
        assert f"{ratio:.2f}x" in flat and vt[rate]["preemptions"] == 0
    assert f"({vt[1.25]['request_goodput']:.3f} against {nv[1.25]['request_goodput']:.3f})" in flat
    assert f"(Naive-Evict: {nv[1.25]['preemptions']:.0f} and {nv[1.5]['preemptions']:.0f})" in flat
    assert f"(goodput {pr[1.25]['request_goodput']:.3f} against {vt[1.25]['request_goodput']:.3f} at 1.25 req/s)" in flat
    text = " ".join((ROOT / "benchmarks" / "README_sla.md").read_text().split())
    assert f"(mean KV usage {pr[1.25]['kv_cache_usage_perc_mean']:.2f} against {vt[1.25]['kv_cache_usage_perc_mean']:.2f}" in text
    assert f"({pr[1.25]['p50_tpot_ms']:.1f} against {vt[1.25]['p50_tpot_ms']:.1f} ms)" in text
    loads = [r["load_average_1m"] for rec in arms.values() for r in rec["runs"]]
    assert f"load average {min(loads):.1f}-{max(loads):.1f} per rate" in text
    walls = [_load(n)["total_wall_s"] for n in ("sla_random_fine.json", "sla_random_fine_r05.json")]
    assert f"{walls[0]:.0f} s + {walls[1]:.0f} s" in text


def test_results_prefix_cache_figures_match_result():
    doc_tables = _doc_tables()
    d = _load("prefix_cache_sharegpt.json")
    arms = {a["arm"]: a for a in d["arms"]}
    assert {a for a, _ in doc_tables.PREFIX_ARMS} <= set(arms)
    assert _generated(_bench(), "benchmarks/doc_tables.py prefix_cache_table") == doc_tables.prefix_cache_table()
    sec = _section(_bench(), "**Prefix caching with vToken**", flat=True)
    assert d["meta"]["command"] == "python benchmarks/bench_prefix_cache.py"
    assert f"{d['args']['conversations']} ShareGPT chats x {d['args']['turns']} turns" in sec
    assert f"{d['args']['max_tokens']} output tokens, budget {d['args']['budget']}" in sec
    assert f"load average {d['load_average_1m']:.1f}" in sec
    c = d["copy_cost"]
    assert f"({c['ms_per_block']:.2f} ms, {c['bytes_per_block'] / 2**20:.2f} MB)" in sec
    s, tv = arms["stock"], arms["vtoken_tova"]
    assert (f"{tv['prefix_cache_hit_rate'] * 100:.0f} % of the prompt tokens hit against "
            f"{s['prefix_cache_hit_rate'] * 100:.0f} %") in sec
    assert f"TOVA holds {(1 - tv['blocks_mean'] / s['blocks_mean']) * 100:.0f} % fewer blocks" in sec
    assert f"its peak is {tv['blocks_peak']:.0f} blocks against {s['blocks_peak']:.0f}" in sec
    readme = " ".join(_readme().split())
    assert (f"`python benchmarks/bench_prefix_cache.py`): {tv['prefix_cache_hit_rate'] * 100:.0f} % of prompt tokens "
            f"hit against stock's {s['prefix_cache_hit_rate'] * 100:.0f} %, with "
            f"{(1 - tv['blocks_mean'] / s['blocks_mean']) * 100:.0f} % fewer blocks held on average") in readme
    # "well under 1 % of each run's wall time"
    assert all(a["copy_ms_est"] < 0.01 * a["wall_s"] * 1e3 for a in arms.values() if a.get("copy_ms_est") is not None)
    sk, kd, h = arms["vtoken_skip"], arms["vtoken_keydiff"], arms["vtoken"]
    assert (f"({sk['prefix_reads_skipped']:.0f} of {sk['requests']} requests computed their whole prompt: 0 % hits)"
            in sec and sk["prefix_cache_hits"] == 0 and sk["prefix_reads_skipped"] == sk["requests"])
    assert f"it holds the fewest blocks ({sk['blocks_mean']:.1f} on average)" in sec
    assert sk["blocks_mean"] == min(a["blocks_mean"] for a in arms.values())
    assert f"its run took {sk['wall_s'] / h['wall_s']:.2f}x the wall time" in sec
    assert (f"({kd['unshared_blocks']:.0f} blocks copied, TOVA {tv['unshared_blocks']:.0f}) and hits "
            f"{kd['prefix_cache_hit_rate'] * 100:.0f} %") in sec
    # every other arm hit the shared system prompt; none deferred a first eviction (a large pool)
    assert all(a["prefix_cache_hit_rate"] > 0.5 for n, a in arms.items() if n != "vtoken_skip")
    assert all(not a["unshare_deferred"] for a in arms.values())


def test_results_longest_prompt_figures_match_result():
    doc_tables = _doc_tables()
    d = _load("longest_prompt.json")
    assert d["meta"]["command"] == "python benchmarks/bench_longest_prompt.py"
    assert _generated(_bench(), "benchmarks/doc_tables.py longest_prompt_table") == doc_tables.longest_prompt_table()
    sec = _section(_bench(), "**Longest prompt served in a fixed pool**", flat=True)
    arms = {a["arm"]: a for a in d["arms"]}
    assert f"a pool of {d['args']['blocks']} blocks of 32 ({d['pool_tokens']:,} usable tokens)" in sec
    ch = arms["vtoken_chunks"]
    assert f"serves {ch['longest_served']:,} tokens" in sec
    assert ch["longest_served"] > 3 * d["pool_tokens"]
    assert all(arms[a]["longest_served"] < d["pool_tokens"] for a in ("stock", "naive", "vtoken_after"))
    peak = max(r["peak_blocks"] for r in ch["runs"])
    assert f"holding at most {peak} blocks" in sec
    assert peak <= -(-(d["args"]["budget"] + d["args"]["chunk"] + 1) // 32)


def test_results_concurrency_chunks_figures_match_result():
    doc_tables = _doc_tables()
    d = _load("concurrency_chunks.json")
    assert d["meta"]["command"] == "python benchmarks/bench_concurrency.py --chunks"
    assert d["meta"]["reused_results_from"] == "benchmarks/results/concurrency_full.json"
    full = _load("concurrency_full.json")
    assert [r for r in d["results"] if not r["arm"].startswith("vtoken_chunks/")] == full["results"]
    assert _generated(_bench(), "benchmarks/doc_tables.py concurrency_chunks_table") == doc_tables.concurrency_chunks_table()
    sec = " ".join(_bench().split())
    fails = [x for x in d["probes"] if x["arm"] == "vtoken_chunks/h2o/128" and not x["feasible"]]
    assert fails and all(x["preemptions"] == 0 for x in fails)  # not memory: admission
    assert f"at most {max(x['max_running'] for x in fails)} requests ran together" in sec


def test_results_soak_figures_match_result():
    d = _load("soak_2026-11-30.json")
    f = d["figures"]
    sec = _section(_bench(), "**Soak**", flat=True)
    for key, label in (("requests_served", "requests served"), ("aborts", "aborts"), ("rejected_400", "bad requests"),
                       ("preemptions", "preemptions"), ("evicted_tokens", "tokens evicted"),
                       ("moved_tokens", "moved"), ("freed_blocks", "blocks freed"), ("blocks_leaked", "blocks leaked")):
        num = f"{int(f[key]):,}"
        assert re.search(re.escape(num) + r"\**\s+" + re.escape(label), sec), (key, num)
    assert f"{d['clients']} clients" in sec and f"--minutes {d['minutes']:g}" in sec


def test_results_quality_figures_match_result():
    rows = {(r["policy"], r["budget"]): r for r in _load("quality_small.json")["oracle"]["summary"]}
    sec = _section(_bench(), "**Quality**", flat=True)
    att = [rows[(p, b)] for p in ("h2o", "scissorhands") for b in (128, 256)]
    rnd = [rows[("random", b)] for b in (128, 256)]
    lo, hi = min(r["delta_nll"] for r in att), max(r["delta_nll"] for r in att)
    assert f"+{lo:.2f} to +{hi:.2f} nats/token" in sec
    alo, ahi = min(r["agree_full"] for r in att), max(r["agree_full"] for r in att)
    assert f"{alo * 100:.0f}-{ahi * 100:.0f} % next-token agreement" in sec
    assert f"+{min(r['delta_nll'] for r in rnd):.1f} to +{max(r['delta_nll'] for r in rnd):.1f} nats" in sec


def test_results_quality_scale_table_and_figures_match_result():
    doc_tables = _doc_tables()
    readme = _bench()
    assert _generated(readme, "benchmarks/doc_tables.py quality_scale_table") == doc_tables.quality_scale_table()
    d = _load("quality_scale.json")
    rows = {(r["policy"], r["budget"], r["pacing"]): r for r in d["oracle"]["summary"]}
    sec = _section(readme, "**Quality at scale**", flat=True)
    assert f"run time {d['meta']['total_wall_s']:,.0f} s" in sec
    assert f"({rows[('full', None, None)]['nll']:.3f} nats/token)" in sec
    assert d["oracle"]["config"]["n_conv"] == 40 and "40 long ShareGPT" in sec
    for pol, label in (("h2o", "H2O"), ("tova", "TOVA")):
        f, pr = rows[(pol, 128, "fixed")], rows[(pol, 128, "pressure")]
        assert f"{label} +{f['delta_nll']:.3f} -> +{pr['delta_nll']:.3f}" in sec
    # "pressure pacing halves or better the NLL cost of every policy" at budget 128
    assert all(rows[(p, 128, "pressure")]["delta_nll"] <= rows[(p, 128, "fixed")]["delta_nll"] / 2
               for p in d["oracle"]["config"]["policies"])
    order = sorted(("tova", "scissorhands", "streaming", "h2o"), key=lambda p: rows[(p, 512, "fixed")]["delta_nll"])
    assert order == ["tova", "scissorhands", "streaming", "h2o"]


def test_results_first_start_matches_result():
    d = _load("first_start.json")
    t, a = d["seconds_from_make_serve"], d["asset_steps_s"]
    sec = _section(_bench(), "**First start**", flat=True)
    assert f"answered `/health` after {t['health_ok']:.0f} s" in sec
    assert f"installing `.venv/` {t['venv_installed']:.1f} s" in sec
    assert f"SmolLM2 {a['smollm2']:.1f} s" in sec and f"ShareGPT JSON {a['sharegpt']:.1f} s" in sec
    assert f"(about {5 * round((t['health_ok'] - t['assets_built']) / 5):.0f} s)" in sec
    assert d["demo_usage"]["prompt_tokens"] == 1037
    # the README's "Try it" quotes the total, with the command and the result file
    try_it = " ".join(_readme()[_readme().index("## Try it"):].split())
    assert f"answered `/health` after {t['health_ok']:.0f} s" in try_it
    assert "(`bash benchmarks/first_start.sh` -> `benchmarks/results/first_start.json`" in try_it


# ----------------------------------------------------------------------------- benchmarks/README.md tables
def _bench_readme_rows(first_cell: str, section: str) -> list[list[str]]:
    """Table rows of benchmarks/README.md whose first cell matches ``first_cell``, in the ``## ``
    section whose heading starts with ``section`` (the summary above the sections quotes some of
    the same tables in other shapes)."""
    text = _bench()
    i = text.index("\n## " + section)
    j = text.find("\n## ", i + 1)
    text = text[i: j if j > 0 else len(text)]
    rows = []
    for line in text.splitlines():
        if line.startswith("| "):
            cells = [c.strip().strip("*").replace(" %", "").rstrip("x") for c in line.strip("|").split("|")]
            if re.fullmatch(first_cell, cells[0]):
                rows.append(cells)
    return rows


def test_benchmarks_readme_retained_table_matches_result():
    s = {(r["policy"], r["budget"], r["block_size"]): r for r in _load("retained_blocks_full.json")["summary"]
         if r["model"] == "smollm2"}
    rows = _bench_readme_rows("h2o|random|scissorhands|tova|streaming", "1. Retained")
    rows = [r for r in rows if len(r) == 10]
    assert len(rows) == 15
    for pol, b, *cells in rows:
        a, c = s[(pol, int(b), 32)], s[(pol, int(b), 64)]
        want = [f"{a['full_avg']:.1f}", f"{a['naive_avg']:.1f}", f"{a['vtoken_avg']:.1f}", f"{a['ideal_avg']:.1f}",
                f"{100 * a['reduction_avg']:.1f}", f"{c['naive_avg']:.1f}", f"{c['vtoken_avg']:.1f}",
                f"{100 * c['reduction_avg']:.1f}"]
        assert cells == want, (pol, b)


def test_benchmarks_readme_concurrency_tables_match_results():
    for name, first, n_rows in (("concurrency_small.json", r"stock vLLM|Naive-Evict, .*|vToken, .*", 7),
                                ("concurrency_full.json", r"h2o|random|scissorhands", 6)):
        res = {(r["mode"], r["policy"], r["budget"]): r for r in _load(name)["results"]}
        stock = res[("stock", None, None)]["max_feasible_n"]
        rows = [r for r in _bench_readme_rows(first, "2. Maximum feasible concurrency") if r[1].isdigit()]
        if name == "concurrency_small.json":
            rows = [r for r in rows if len(r) == 5]
            assert len(rows) == n_rows
            for arm, n, first_bad, *_ in rows:
                if arm == "stock vLLM":
                    key = ("stock", None, None)
                else:
                    mode, pb = arm.split(", ")
                    pol, b = pb.rsplit(" ", 1)
                    key = ("naive" if mode == "Naive-Evict" else "vtoken", pol.lower(), int(b))
                assert (int(n), int(first_bad)) == (res[key]["max_feasible_n"], res[key]["first_infeasible_n"]), arm
        else:
            rows = [r for r in rows if len(r) == 7 and r[2].isdigit()]
            assert len(rows) == n_rows
            for pol, b, st, nv, vt, ratio, vs_stock in rows:
                key = (pol, int(b))
                assert int(st) == stock
                assert int(nv) == res[("naive", *key)]["max_feasible_n"]
                assert int(vt) == res[("vtoken", *key)]["max_feasible_n"]
                assert ratio == f"{int(vt) / int(nv):.2f}" and vs_stock == f"{int(vt) / stock:.2f}"


def test_benchmarks_readme_quality_table_matches_result():
    d = _load("quality_small.json")
    o = {(r["policy"], r["budget"]): r for r in d["oracle"]["summary"]}
    e = {(r["policy"], r["budget"]): r for r in d["engine"]["summary"]}
    rows = [r for r in _bench_readme_rows("h2o|random|scissorhands", "3. Quality") if len(r) == 7 and "." in r[2]]
    assert len(rows) == 6
    for pol, b, nll, dnll, agree, top1, greedy in rows:
        r, g = o[(pol, int(b))], e[(pol, int(b))]
        assert [nll, dnll, agree, top1, greedy] == [
            f"{r['nll']:.3f}", f"{r['delta_nll']:+.3f}", f"{r['agree_full']:.2f}", f"{r['top1_acc']:.2f}",
            f"{g['prefix_agreement']:.2f}"], (pol, b)


def test_benchmarks_readme_scheduler_host_time_matches_result():
    """Issue 22's host-time table and the figures quoted above it equal results/bench_scheduler.json
    (one eviction path: stock, h2o and random with vToken's default config)."""
    doc_tables = _doc_tables()
    text = BENCH_DOC.read_text()
    assert _generated(text, "benchmarks/doc_tables.py scheduler_table") == doc_tables.scheduler_table()
    d = json.loads((RESULTS / "bench_scheduler.json").read_text())
    assert d["config"]["arms"] == ["stock", "h2o", "random"]
    flat = " ".join(text.split())
    cmd = d["command"].split(" ", 1)[1]  # the interpreter's name left out
    assert f"`{cmd}`" in flat, cmd
    ratio = {(c["num_requests"], c["live"], a): c["arms"][a]["total"]["median_ms"] / c["arms"]["stock"]["total"]["median_ms"]
             for c in d["cells"] for a in ("h2o", "random")}
    assert {(r, L) for r, L, _ in ratio} == {(r, L) for r in (256, 512) for L in (1024, 4096)}  # the criterion's cells
    quoted = f"host time per step is {min(ratio.values()):.2f}-{max(ratio.values()):.2f}x stock's"
    assert quoted in flat, quoted
    # the text says: within the 1.2x target at every cell
    assert "within the 1.2x target at every cell" in flat and max(ratio.values()) <= 1.2
    fastest = [c["arms"][a]["total"]["min_ms"] / c["arms"]["stock"]["total"]["min_ms"]
               for c in d["cells"] for a in ("h2o", "random")]
    assert f"the fastest steps' ratio is {min(fastest):.2f}-{max(fastest):.2f}x" in flat
    pre = [c["arms"][a]["evict"]["median_ms"] for c in d["cells"] for a in ("h2o", "random")]
    assert f"is {min(pre):.2f}-{max(pre):.2f} ms a step" in flat
    for c in d["cells"]:
        for a in ("h2o", "random"):
            rec = c["arms"][a]
            assert rec["checks_ok"] and rec["mean_evicted_per_step"] == c["num_requests"]
            assert rec["vtoken_config"] == {"policy": a, "budget": c["live"], "slack": 0}  # the default config
    la = f"load average {d['load_average_before'][0]:.2f} before and {d['load_average_after'][0]:.2f} after"
    assert la in flat, la
    assert f"{d['config']['steps']:,} timed steps per arm and cell" in flat


@pytest.mark.parametrize("name, result", [("granularity_cost_table", "granularity_cost.json"),
                                          ("overhead_policies_table", "overhead_policies.json"),
                                          ("quality_granularity_table", "quality_granularity.json")])
def test_benchmarks_readme_granularity_tables_match_results(name, result):
    """Issue 23's tables in benchmarks/README.md equal their result files, and the load averages
    quoted above the cost table are the run's."""
    doc_tables = _doc_tables()
    text = BENCH_DOC.read_text()
    assert _generated(text, f"benchmarks/doc_tables.py {name}") == doc_tables.TABLES[name]()
    meta = json.loads((RESULTS / result).read_text()).get("meta", {})
    if "load_average_before" in meta:
        la = (f"load average {meta['load_average_before'][0]:.2f} before, "
              f"{meta['load_average_after'][0]:.2f} after")
        assert la in " ".join(text.split()), la


def test_benchmarks_readme_step_cost_per_policy_figures():
    """The ratios and load averages quoted above the per-policy step-cost table are the result's."""
    d = json.loads((RESULTS / "overhead_policies.json").read_text())
    r = d["results"]["smollm2"]
    text = " ".join(BENCH_DOC.read_text().split())
    assert f"K-norm costs {r['evict-knorm@worker']['ratio_median']:.2f}x" in text
    attn = [r[a]["ratio_median"] for a in ("evict-h2o", "evict-h2o@worker", "evict-tova@worker",
                                            "evict-scissorhands@worker")]
    assert f"any attention-scored policy ({min(attn):.2f}-{max(attn):.2f}x)" in text
    assert f"brings it to {r['evict-keydiff@worker']['ratio_median']:.2f}x here" in text
    assert f"of every step to {r['evict-expected_attention@worker']['ratio_median']:.2f}x" in text
    la = [x["load_average_1m"] for x in d["runs"]]
    assert f"load average {min(la):.1f}-{max(la):.1f} while it ran" in text


def test_benchmarks_readme_granularity_quality_figures():
    """The conversation count and the figures quoted above the granularity quality table are the result's."""
    d = json.loads((RESULTS / "quality_granularity.json").read_text())
    text = " ".join(BENCH_DOC.read_text().split())
    part = d["meta"].get("partial")
    if part:
        assert f"first {part['done_convs']} of the {part['n_conv']} conversations" in text
    by = {(r["policy"], r["budget"], r["pacing"], r["granularity"]): r for r in d["oracle"]["summary"]
          if r["policy"] != "full"}
    req, head = by[("h2o", 128, "fixed", "request")], by[("h2o", 128, "fixed", "head")]
    assert f"({req['delta_nll']:+.3f} -> {head['delta_nll']:+.3f} nats)" in text
    assert f"holding every block it ever held ({head['naive_blocks']:.0f}), against vToken's {head['vtoken_blocks']:.0f}" in text


def test_results_quality_prefill_figures_match_result():
    """``bench_quality.py --prefill``: the table is generated from the result, the section names how
    many conversations it covers (and says so when the result is a running job's partial file),
    and its figures are the result's: the largest ΔNLL increase of chunks over after (and which
    policy), the largest for H2O and SnapKV, the largest agreement drop, all within the 0.03
    nats/token the config's description states, peak held tokens the whole prompt against budget + chunk."""
    doc_tables = _doc_tables()
    d = _load("quality_prefill.json")
    assert d["meta"]["command"] == "python benchmarks/bench_quality.py --prefill"
    assert _generated(_bench(), "benchmarks/doc_tables.py quality_prefill_table") == doc_tables.quality_prefill_table()
    sec = _section(_bench(), "**Quality of eviction between prefill chunks**", flat=True)
    part = d["meta"].get("partial")
    summ = [s for s in d["oracle"]["summary"] if s["policy"] != "full"]
    n = max(s["n"] for s in summ)
    if part:
        assert n == part["done_convs"] and f"the first {n} of the planned {part['n_conv']} conversations" in sec
    else:
        assert n == d["oracle"]["config"]["n_conv"] == 40 and f"; {n} conversations" in sec
    c = d["oracle"]["config"]
    by = {(s["policy"], s["budget"], s["prefill_eviction"]): s for s in summ}
    dnll, drop = {}, 0.0
    for pol in c["policies"]:
        for b in c["budgets"]:
            a, ch = by[(pol, b, "after")], by[(pol, b, "chunks")]
            dnll[pol] = max(dnll.get(pol, -1.0), ch["delta_nll"] - a["delta_nll"])
            drop = max(drop, a["agree_full"] - ch["agree_full"])
            assert a["mean_peak_live"] == c["prompt_len"]
            assert ch["mean_peak_live"] == b + c["prefill_chunk"]
    worst = max(dnll, key=dnll.get)
    assert worst == "tova" and f"at most +{dnll[worst]:.3f} above the after arm's (TOVA;" in sec
    assert f"H2O and SnapKV within +{max(dnll['h2o'], dnll['snapkv']):.3f})" in sec
    assert f"agreement at most {drop:.3f} lower" in sec
    assert dnll[worst] <= 0.03 and "within 0.03" in " ".join(_config_doc().split())
    assert f"({c['prompt_len'] / (min(c['budgets']) + c['prefill_chunk']):.1f}x fewer at budget {min(c['budgets'])})" in sec


def test_benchmarks_readme_key_only_quality_figures():
    """The ΔNLL figures quoted above the key-only quality table are the results' (40
    conversations of --keyonly; H2O's from the --granularity run's head sets)."""
    ko = {(r["policy"], r["budget"]): r for r in json.loads((RESULTS / "quality_keyonly.json").read_text())
          ["oracle"]["summary"]}
    gr = json.loads((RESULTS / "quality_granularity.json").read_text())["oracle"]["summary"]
    h2o = {r["budget"]: r for r in gr if r["policy"] == "h2o" and r.get("granularity") == "head"
           and r["pacing"] == "fixed"}
    text = " ".join(BENCH_DOC.read_text().split())
    assert (f"Expected Attention is the best of them (+{ko[('expected_attention', 128)]['delta_nll']:.3f} nats over "
            f"40 conversations, H2O +{h2o[128]['delta_nll']:.3f} over 21), KeyDiff "
            f"+{ko[('keydiff', 128)]['delta_nll']:.3f}, K-norm +{ko[('knorm', 128)]['delta_nll']:.3f}") in text
    assert (f"Expected Attention is within +{ko[('expected_attention', 512)]['delta_nll']:.3f} of the full cache"
            in text)
    assert f"H2O +{h2o[512]['delta_nll']:.3f}), KeyDiff +{ko[('keydiff', 512)]['delta_nll']:.3f}" in text


# ----------------------------------------------------------------------------- issue 26: SLA at a quality
def test_readme_results_lead_with_the_sla_at_quality_tables():
    """README "Results" opens with the pick table, then the SLA-at-quality table, both rendered
    from ``results/sla_at_quality.json`` and the quality files; it names the command and quotes
    the run's time and load averages from the file."""
    doc_tables = _doc_tables()
    readme = _readme()
    sec = readme[readme.index("\n## Results\n"):]
    sec = sec[: sec.index("\n## ", 5)]
    assert sec.index("sla_pick_table") < sec.index("sla_at_quality_table")
    assert _generated(sec, "benchmarks/doc_tables.py sla_pick_table") == doc_tables.sla_pick_table()
    assert _generated(sec, "benchmarks/doc_tables.py sla_at_quality_table") == doc_tables.sla_at_quality_table()
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


def test_sla_at_quality_section_of_readme_sla_is_generated():
    doc_tables = _doc_tables()
    text = (ROOT / "benchmarks" / "README_sla.md").read_text()
    for name in ("sla_at_quality_table", "sla_at_quality_runs_table", "sla_at_quality_unloaded_table"):
        assert _generated(text, f"benchmarks/doc_tables.py {name}") == doc_tables.TABLES[name]()


def test_sla_at_quality_findings_quote_the_result_file():
    """The figures in README_sla.md's "SLA at a quality" findings equal the run's file."""
    doc_tables = _doc_tables()
    text = (ROOT / "benchmarks" / "README_sla.md").read_text()
    sec = " ".join(text[text.index("## Results: SLA at a quality"):text.index("## Where vToken is ahead")].split())
    d = _load("sla_at_quality.json")
    A, rc = d["arms"], doc_tables.sla_common_rate(d)
    at = {n: next(x for x in a["runs"] if x["rate"] == rc) for n, a in A.items()}
    un = {n: a["unloaded"]["p50_tpot_ms"] for n, a in A.items()}
    assert f"{d['total_wall_s']:,.0f} s;" in sec and rc == 0.75
    assert d["slo"]["tpot_ms"] == 30.0 and f"stock's unloaded {un['stock']:.1f} ms" in sec
    assert f"preempts {sum(x['preemptions'] for x in A['stock']['runs']):.0f} times" in sec
    assert f"uses {at['stock']['kv_cache_usage_perc_mean'] * 100:.0f} % of the pool on average at 0.75" in sec
    assert A["stock"]["sla_rate"] == 0.75 and all(a["sla_rate"] is None or a["sla_rate"] < 0.75
                                                   for n, a in A.items() if n != "stock")

    def span(names, f, fmt):
        v = [f(n) for n in names]
        return f"{fmt.format(min(v))}-{fmt.format(max(v))}"

    fixed = [n for n in A if n != "stock" and not n.endswith("-pressure")]
    attn = [n for n in fixed if any(p in n for p in ("h2o", "tova", "snapkv"))]
    keyonly = [n for n in fixed if n not in attn]
    assert f"take {span(attn, un.get, '{:.1f}')} ms a token" in sec
    assert f"key-only ones {span(keyonly, un.get, '{:.1f}')} ms" in sec
    kv = lambda n: at[n]["kv_cache_usage_perc_mean"] * 100  # noqa: E731
    vt = [n for n in fixed if n.startswith("vtoken-")]
    nv = [n for n in fixed if n.startswith("naive-")]
    assert f"{span(vt, kv, '{:.0f}')} % of the pool against {span(nv, kv, '{:.0f}')} %" in sec
    assert all(sum(x["preemptions"] for x in A[n]["runs"]) == 0 for n in A if n.startswith("vtoken-"))
    assert f"(Naive-Evict H2O: {sum(x['preemptions'] for x in A['naive-h2o-worker']['runs']):.0f})" in sec
    assert (f"{at['vtoken-h2o-worker-pressure']['p50_tpot_ms']:.1f} ms with pressure pacing against "
            f"{at['vtoken-h2o-worker']['p50_tpot_ms']:.1f} ms") in sec
    ev = lambda n: at[n]["vtoken_counters"]["vtoken:evicted_tokens_total"]  # noqa: E731
    assert f"({ev('vtoken-keydiff-worker-pressure'):.0f} tokens at 0.75 req/s, against {ev('vtoken-keydiff-worker'):,.0f}" in sec
    best = max((n for n in A if n != "stock"), key=lambda n: A[n]["sla_rate"] or 0)
    assert best == "vtoken-keydiff-worker-pressure" and f"best evicting arm ({A[best]['sla_rate']:g} req/s)" in sec
    rows = {r["policy"]: r for r in doc_tables.sla_at_quality_rows()}
    assert f"(H2O: {rows['h2o']['quality']['delta_nll']:+.3f})" in sec
    assert min(r["quality"]["delta_nll"] for r in rows.values()) > 0.3


def test_sla_keyonly_section_is_generated_and_quotes_the_result_file():
    """README_sla.md's key-only rerun (``make bench-sla-keyonly``): its tables are generated, and
    every figure its findings quote is the run's file."""
    doc_tables = _doc_tables()
    text = (ROOT / "benchmarks" / "README_sla.md").read_text()
    for name in ("sla_keyonly_table", "sla_keyonly_unloaded_table"):
        assert _generated(text, f"benchmarks/doc_tables.py {name}") == doc_tables.TABLES[name]()
    sec = " ".join(text[text.index("### The key-only policies after the step-cost cuts"):
                        text.index("## Where vToken is ahead")].split())
    d = _load("sla_at_quality_keyonly.json")
    A, rc = d["arms"], doc_tables.sla_common_rate(d)
    rate = {n: a["sla_rate"] for n, a in A.items()}
    un = {n: a["unloaded"]["p50_tpot_ms"] for n, a in A.items()}
    la = [x["load_average_1m"] for a in A.values() for x in a["runs"]]
    assert f"{d['total_wall_s']:,.0f} s; 1-minute load average {min(la):.1f}-{max(la):.1f} per rate" in sec
    assert rc == 0.75 == rate["stock"] == rate["vtoken-knorm-worker-pressure"] == rate["vtoken-keydiff-worker-pressure"]
    assert f"TPOT SLO {d['slo']['tpot_ms']} ms, 2 x stock's unloaded {un['stock']:.1f} ms" in sec
    ratio = rate["vtoken-keydiff-worker-pressure"] / rate["naive-keydiff-worker"]
    assert f"reaches {ratio:.2f}x its Naive-Evict" in sec and ratio >= 1.5
    assert rate["vtoken-expected_attention-worker-pressure"] == 0.5
    assert rate["naive-expected_attention-worker"] is None and rate["vtoken-expected_attention-worker"] is None
    rows = {r["policy"]: r for r in doc_tables.sla_at_quality_rows("sla_at_quality_keyonly.json")}
    best = min(rows.values(), key=lambda r: r["quality"]["delta_nll"])
    assert best["policy"] == "expected_attention" and f"Expected Attention, {best['quality']['delta_nll']:+.3f}" in sec
    assert min(r["quality"]["delta_nll"] for r in rows.values()) > 0.3
    for p, name in (("knorm", "K-norm"), ("keydiff", "KeyDiff")):
        v, n = rate[f"vtoken-{p}-worker"], rate[f"naive-{p}-worker"]
        assert f"{name} {v:g} against {n:g}" in sec and v < n
        assert f"{un[f'vtoken-{p}-worker']:.1f} against {un[f'naive-{p}-worker']:.1f}" in sec
    kv = lambda n: next(x for x in A[n]["runs"] if x["rate"] == rc)["kv_cache_usage_perc_mean"] * 100  # noqa: E731
    vt = [kv(f"vtoken-{p}-worker") for p in rows]
    nv = [kv(f"naive-{p}-worker") for p in rows]
    assert f"hold {min(vt):.0f}-{max(vt):.0f} % of the pool on average, against {min(nv):.0f}-{max(nv):.0f} %" in sec
    old = _load("sla_at_quality.json")
    assert f"stock's unloaded TPOT {old['arms']['stock']['unloaded']['p50_tpot_ms']:.1f} ms there" in sec
    for p, name in (("knorm", "K-norm"), ("keydiff", "KeyDiff")):
        was = old["arms"][f"vtoken-{p}-worker-pressure"]["sla_rate"]
        assert f"{name}'s" in sec and f"from {was:g} to {rate[f'vtoken-{p}-worker-pressure']:g}" in sec


def test_benchmarks_readme_step_cost_at_batch_32():
    """The batch-32 step-cost table is generated and the figures quoted above it are the result's."""
    doc_tables = _doc_tables()
    text = BENCH_DOC.read_text()
    assert _generated(text, "benchmarks/doc_tables.py overhead_keyonly_b32_table") == \
        doc_tables.TABLES["overhead_keyonly_b32_table"]()
    d = json.loads((RESULTS / "overhead_keyonly_b32.json").read_text())
    assert d["config"]["batch"] == 32
    r = d["results"]["smollm2"]
    flat = " ".join(text.split())
    assert f"K-norm's evicting step costs {r['evict-knorm@worker']['ratio_median']:.2f}x stock here" in flat
    assert r["evict-knorm@worker"]["ratio_median"] <= 1.05
    assert f"(Random {r['evict-random@worker']['ratio_median']:.2f}x" in flat
    assert f"KeyDiff ({r['evict-keydiff@worker']['ratio_median']:.2f}x; 2.10x before the one-copy read)" in flat
    assert f"Expected Attention ({r['evict-expected_attention@worker']['ratio_median']:.2f}x)" in flat
    la = [x["load_average_1m"] for x in d["runs"]]
    assert f"{d['total_wall_s']:.0f} s, 1-minute load average {min(la):.1f}-{max(la):.1f}" in flat


def test_sla_512_section_is_generated_and_quotes_the_result_file():
    """README_sla.md's budget-512 run (``make bench-sla-512``): its tables are generated, and every
    figure its findings quote is the run's file (and the quality file it names)."""
    doc_tables = _doc_tables()
    text = (ROOT / "benchmarks" / "README_sla.md").read_text()
    for name in ("sla_512_table", "sla_512_headline_table", "sla_512_runs_table", "sla_512_unloaded_table"):
        assert _generated(text, f"benchmarks/doc_tables.py {name}") == doc_tables.TABLES[name]()
    sec = " ".join(text[text.index("### Budget 512 on 1,024-token prompts"):
                        text.index("### SnapKV compressing the prompt at budget 512")].split())
    d = _load("sla_at_quality_512.json")
    A, cfg, slo = d["arms"], d["config"], d["slo"]
    assert cfg["budget"] == 512 and cfg["prompt_len"] == 1024 and cfg["num_prompts"] == 40
    assert d["command"].endswith(" ".join(text.split("make bench-sla-512` (= `python ")[1].split("`)")[0].split()))
    la = [x["load_average_1m"] for a in A.values() for x in a["runs"]]
    assert f"{d['total_wall_s']:,.0f} s; 1-minute load average {min(la):.1f}-{max(la):.1f} per rate" in sec
    assert f"{cfg['pool_tokens']:,}-token pool ({cfg['pool_blocks']} blocks of {cfg['block_size']})" in sec
    q = next(r for r in doc_tables.sla_at_quality_rows("sla_at_quality_512.json") if r["policy"] == "tova")["quality"]
    assert f"TOVA is ({q['delta_nll']:+.3f}" in sec and q["delta_nll"] <= 0.3
    un = {n: a["unloaded"]["p50_tpot_ms"] for n, a in A.items()}
    assert f"TTFT <= {slo['k_ttft']:g} x {slo['ttft_a_ms']:.0f} ms, TPOT <= {slo['tpot_ms']} ms = 2 x stock's unloaded {un['stock']:.1f} ms" in sec
    lo = cfg["rates"][0]
    run = lambda n: next(x for x in A[n]["runs"] if x["rate"] == lo)  # noqa: E731
    nv = run("naive-tova-worker")
    assert A["stock"]["sla_rate"] == A["naive-tova-worker"]["sla_rate"] == lo
    assert f"rate, {lo:g} req/s, where stock ({run('stock')['attainment']:.2f}) and Naive-Evict ({nv['attainment']:.2f}) do" in sec
    assert all(A[n]["sla_rate"] is None for n in A if n.startswith("vtoken"))
    v = run("vtoken-tova-worker")
    miss_tpot = sum(tp > slo["tpot_ms"] for _, tp, _ in v["per_request_ttft_tpot_ms_prompt"])
    miss_ttft = sum(tt > slo["k_ttft"] * slo["ttft_a_ms"] for tt, _, _ in v["per_request_ttft_tpot_ms_prompt"])
    good = round(v["attainment"] * 40)
    assert f"{v['attainment']:.2f} ({good} of 40; {miss_tpot} miss the TPOT SLO, {miss_ttft} the TTFT SLO)" in sec
    assert f"up to {v['num_requests_running_max']:.0f} requests running where stock runs {run('stock')['num_requests_running_max']:.0f}" in sec
    assert v["preemptions"] == 0
    # the Naive-Evict arm is the rerun (make bench-sla-512-naive), the thrashing first one kept aside
    rr, old = A["naive-tova-worker"]["rerun"], d["superseded_arms"]["naive-tova-worker"]
    rerun = _load("sla_at_quality_512_naive.json")
    assert rr["command"] == rerun["command"] and A["naive-tova-worker"]["runs"] == rerun["arms"]["naive-tova-worker"]["runs"]
    assert rerun["slo"]["from_file"] == "benchmarks/results/sla_at_quality_512.json"
    make = (ROOT / "Makefile").read_text().split("bench-sla-512-naive: assets\n")[1].split("\n\n")[0]
    make = " ".join(make.replace("\\\n", " ").split())
    assert " ".join(rerun["command"].split()[1:]) in make and "--replace-arms benchmarks/results/sla_at_quality_512.json" in make
    assert f"({sum(x['preemptions'] for x in old['runs'][:1]):.0f}\npreemptions at {lo:g} req/s)".replace("\n", " ") in sec
    assert f"with the first run's SLOs ({rr['total_wall_s']:,.0f} s)" in sec
    assert max(x["num_requests_running_max"] for x in A["naive-tova-worker"]["runs"]) == 1 and sum(
        x["preemptions"] for x in A["naive-tova-worker"]["runs"]) == 0
    assert f"vLLM runs 1 at a time (P50 TPOT {nv['p50_tpot_ms']:.0f} ms at {lo:g} req/s, no preemption)" in sec
    h = d["headline"]
    pg = {n: x["peak_goodput"] for n, x in h["per_arm"].items()}
    assert f"peak goodput is {h['ratios']['vtoken-tova-worker']['peak_goodput_over_naive']:.2f}x Naive-Evict's " \
           f"({pg['vtoken-tova-worker']:.3f} against {pg['naive-tova-worker']:.3f} req/s) and below stock's ({pg['stock']:.3f})" in sec
    lo_un, hi_un = sorted([un["naive-tova-worker"], un["vtoken-tova-worker"]])
    assert f"the TOVA arms take {lo_un:.1f}-{hi_un:.1f} ms a token against stock's {un['stock']:.1f} " \
           f"({lo_un / un['stock']:.2f}-{hi_un / un['stock']:.2f}x" in sec
    g = d["k_grid_sla_rate"]["k_ttft=5,k_tpot=3"]
    assert g["vtoken-tova-worker"] == 2 * g["stock"] == 2 * g["naive-tova-worker"]
    assert f"fixed arm serves {g['vtoken-tova-worker']:g} req/s, 2x stock's and Naive-Evict's {g['stock']:g}" in sec
    assert f"({run('vtoken-tova-worker-pressure')['attainment']:.2f} at {lo:g} req/s)" in sec
    assert f"(unloaded TPOT {un['vtoken-tova-worker-pressure']:.1f} ms)" in sec
    make = (ROOT / "Makefile").read_text()
    cmd = make[make.index("\nbench-sla-512:"):].split("\n\n")[0]
    assert " ".join(cmd.replace("\\\n", " ").split()[3:]) == d["command"].removeprefix("python ")
    assert "`make bench-sla-512`" in " ".join(_readme().split())


def test_sla_512_snapkv_section_is_generated_and_quotes_the_result_file():
    """README_sla.md's SnapKV run at budget 512 (``make bench-sla-512-snapkv``): tables generated,
    every figure its findings quote read from the run's file and the quality file, the goal (within
    ΔNLL +0.3, >= 1.5x Naive-Evict's SLA rate) stated only where the file shows it."""
    doc_tables = _doc_tables()
    text = (ROOT / "benchmarks" / "README_sla.md").read_text()
    for name in ("sla_512_snapkv_table", "sla_512_snapkv_headline_table", "sla_512_snapkv_runs_table",
                 "sla_512_snapkv_unloaded_table"):
        assert _generated(text, f"benchmarks/doc_tables.py {name}") == doc_tables.TABLES[name]()
    sec = " ".join(text[text.index("### SnapKV compressing the prompt at budget 512"):
                        text.index("## Where vToken is ahead")].split())
    d = _load("sla_at_quality_512_snapkv.json")
    A, cfg, slo, h = d["arms"], d["config"], d["slo"], d["headline"]
    assert (cfg["budget"], cfg["prompt_len"], cfg["num_prompts"], cfg["output_len"]) == (512, 1024, 40, 128)
    assert d["command"].endswith(sec.split("make bench-sla-512-snapkv` (= `python ")[1].split("`)")[0])
    make = (ROOT / "Makefile").read_text().split("bench-sla-512-snapkv: assets\n")[1].split("\n\n")[0]
    assert " ".join(make.replace("\\\n", " ").split()).endswith(" ".join(d["command"].split()[1:]))
    la = [x["load_average_1m"] for a in A.values() for x in a["runs"]]
    assert f"{d['total_wall_s']:,.0f} s; 1-minute load average {d['load_average_at_start'][0]:.1f} at the start, " \
           f"{min(la):.1f}-{max(la):.1f} per rate" in sec
    rows = doc_tables.sla_at_quality_rows("sla_at_quality_512_snapkv.json")
    q = rows[0]["quality"]
    assert rows[0]["policy"] == "snapkv" and q["delta_nll"] <= 0.3
    assert f"(+{q['delta_nll']:.3f}, agreement {q['agree_full'] * 100:.1f} %)" in sec
    un = {n: a["unloaded"]["p50_tpot_ms"] for n, a in A.items()}
    vt, nv = "vtoken-snapkv-sl128-se1000-worker", "naive-snapkv-sl128-se1000-worker"
    assert f"TTFT <= {slo['k_ttft']:g} x {slo['ttft_a_ms']:.0f} ms, TPOT <= {slo['tpot_ms']} ms = 2 x stock's " \
           f"unloaded {un['stock']:.1f} ms" in sec
    r = lambda n, rate: next(x for x in A[n]["runs"] if x["rate"] == rate)  # noqa: E731
    v = A[vt]["sla_rate"]
    assert f"keeps {r(vt, v)['attainment'] * 100:.0f} % of its requests within the SLOs" in sec and f"at {v:g} req/s" in sec
    assert A[nv]["sla_rate"] == A["stock"]["sla_rate"] == 0.125 and "Naive-Evict and stock do at 0.125" in sec
    ratio = h["ratios"][vt]
    assert ratio["vtoken_over_naive"] >= 1.5 and f"{ratio['vtoken_over_naive']:.2f}x both" in sec
    pg = {n: x["peak_goodput"] for n, x in h["per_arm"].items()}
    assert f"peak goodput is {pg[vt]:.3f} req/s, {ratio['peak_goodput_over_naive']:.2f}x Naive-Evict's " \
           f"{pg[nv]:.3f} and {pg[vt] / pg['stock']:.1f}x stock's {pg['stock']:.3f}" in sec
    assert max(x["num_requests_running_max"] for x in A[nv]["runs"]) == 2 and "at most 2 requests at a time" in sec
    assert sum(x["preemptions"] for x in A[nv]["runs"]) == 2 * r(nv, 0.25)["preemptions"] == 6
    assert f"({r(nv, 0.25)['preemptions']:.0f} preemptions from 0.25 req/s on" in sec
    assert max(x["num_requests_running_max"] for x in A["stock"]["runs"]) == 1
    assert max(x["num_requests_running_max"] for x in A[vt]["runs"]) == 3 and all(x["preemptions"] == 0 for x in A[vt]["runs"])
    assert f"vToken's unloaded TPOT ({un[vt]:.1f} ms) is not above stock's ({un['stock']:.1f})" in sec and un[vt] <= un["stock"]
    p50 = [round(x["p50_tpot_ms"]) for x in A[vt]["runs"]]
    assert f"P50 TPOT rises to {min(p50)}-{max(p50)} ms" in sec


def test_benchmarks_readme_step_cost_with_a_slack():
    """The slack step-cost table is generated; the figures quoted above it are the result's, and
    the arms ran with the slack the text names (16) against slack 0."""
    doc_tables = _doc_tables()
    text = BENCH_DOC.read_text()
    assert _generated(text, "benchmarks/doc_tables.py overhead_keyonly_slack_table") == \
        doc_tables.TABLES["overhead_keyonly_slack_table"]()
    d = json.loads((RESULTS / "overhead_keyonly_slack.json").read_text())
    flat = " ".join(text.split())
    assert f"`{d['command']}`" in flat.replace("` -> `results/overhead_keyonly_slack.json`", "`")
    arms, r = d["config"]["arms"], d["results"]["smollm2"]
    assert arms["evict-keydiff:sl16@worker"]["slack"] == 16 and arms["evict-keydiff@worker"]["slack"] == 0
    assert d["config"]["batch"] == 8
    med = lambda a: r[a]["ratio_median"]  # noqa: E731
    assert f"KeyDiff's mean step then costs {med('evict-keydiff:sl16@worker'):.2f}x stock " \
           f"({med('evict-keydiff@worker'):.2f}x with slack 0 in this run)" in flat
    assert f"Expected Attention's {med('evict-expected_attention:sl16@worker'):.2f}x " \
           f"({med('evict-expected_attention@worker'):.2f}x)" in flat
    la = [x["load_average_1m"] for x in d["runs"]]
    assert f"{d['total_wall_s']:.0f} s, 1-minute load average {min(la):.1f}-{max(la):.1f}" in flat
    st = {x["arm"]: x["vtoken_stats"] for x in d["runs"] if x["rep"] == 0}["evict-keydiff:sl16@worker"]
    assert st["evictions"] == 8 * (128 // 16) and st["retained_blocks"] == 8 * 3
    assert "holds 64-80 live tokens instead of 64 (here still 3 blocks of 32)" in flat


def test_benchmarks_readme_preemption_table_matches_result():
    """``bench_preempt.py``: every row of the README's preemption table is the result file's
    (vLLM's scheduled-token count at the resume, live and logical tokens at the preemption)."""
    import json
    import re

    d = json.loads((ROOT / "benchmarks" / "results" / "preempt_recompute.json").read_text())
    assert d["meta"]["command"] == "python benchmarks/bench_preempt.py"
    text = (ROOT / "benchmarks" / "README.md").read_text()
    assert "`python benchmarks/bench_preempt.py` -> `results/preempt_recompute.json`" in text
    for gran, v in d["granularity"].items():
        r, = v["resumes"]
        row = (f"| {gran} | {v['preemptions']} | {r['live']} | {r['logical']} | {r['scheduled']} | {r['live'] + 1} | "
               f"{r['logical'] + 1} | {r['blocks']} |")
        assert row in text, row
        assert r["scheduled"] == 1 and r["live"] < r["logical"] and v["request_faults"] == 0, (gran, r)
    assert re.search(r"\| head \| 1 \| \d+ \| \d+ \| 1 \|", text)


def test_benchmarks_readme_worker_step_matches_result():
    """Issue 40's worker-step table equals results/bench_worker_step.json, and what the step
    dispatches (torch ops, host syncs, uploads, Python lines) is the same at every request count."""
    doc_tables = _doc_tables()
    text = BENCH_DOC.read_text()
    assert _generated(text, "benchmarks/doc_tables.py worker_step_table") == doc_tables.worker_step_table()
    d = json.loads((RESULTS / "bench_worker_step.json").read_text())
    assert [r["R"] for r in d["rows"]] == [8, 64, 256]
    for key in ("ops", "host_syncs", "uploads", "py_lines"):
        assert len({r["counts"]["step"][key] for r in d["rows"]}) == 1, key


def test_benchmarks_readme_tpot_matches_result():
    """The TPOT ratio quoted for issue 40 is results/tpot_tiny.json's, and the file says whether it
    meets the 1.5x criterion."""
    d = json.loads((RESULTS / "tpot_tiny.json").read_text())
    r = d["results"]["threads_1"]
    flat = " ".join(BENCH_DOC.read_text().split())
    assert f"stock {r['median_tpot_ms']['stock']:.2f} ms, vToken {r['median_tpot_ms']['vtoken']:.2f} ms, **{r['ratio']:.2f}x**" in flat
    lo, hi = min(r["ratio_per_rep"]), max(r["ratio_per_rep"])
    assert f"({lo:.2f}-{hi:.2f}x by repetition" in flat
    assert r["meets_criterion"] == (r["ratio"] <= 1.5)
