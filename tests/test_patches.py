"""patches/ manifest: the check passes on the tree, catches drift and unlisted symbols; rebase; index.

Everything runs in this process (vLLM is imported once) except the rebase test, which
starts one interpreter (the rebase command's subprocess).
"""

from __future__ import annotations

import re
import shutil
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vtoken.patches import check as chk  # noqa: E402
from vtoken.patches import fingerprint as fp  # noqa: E402
from vtoken.patches.cli import main  # noqa: E402
from vtoken.patches.manifest import DEFAULT_ENTRIES, load_entries  # noqa: E402

SCHED = "vllm.v1.core.sched.scheduler.Scheduler"


@pytest.fixture(scope="module")
def other_interpreter_result():
    """The rebase command's subprocess, started first so it overlaps the in-process import."""
    pool = ThreadPoolExecutor(1)
    fut = pool.submit(chk.fingerprints_via, sys.executable, list(load_entries().values()))
    yield fut
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def report(other_interpreter_result):
    return chk.run_check()


@pytest.fixture()
def entries_copy(tmp_path) -> Path:
    d = tmp_path / "entries"
    shutil.copytree(DEFAULT_ENTRIES, d)
    return d


def _scan_only(entries: Path, files) -> list[str]:
    return chk.run_check(entries, scan=files, include_default=False).problems


def test_check_passes_on_current_tree(report):
    assert report.ok, "\n".join(report.problems)
    assert report.checked >= 50 and report.required >= 20


def test_cli_check_passes_on_current_tree(capsys):
    # the same as CI's `python -m vtoken.patches check`, minus the interpreter start
    assert main(["check"]) == 0, capsys.readouterr().out
    assert ": ok" in capsys.readouterr().out


def test_one_character_fingerprint_edit_fails_naming_the_symbol(entries_copy, capsys):
    p = entries_copy / f"{SCHED}.schedule.toml"
    text = p.read_text()
    i = text.index('fingerprint = "sha256:') + len('fingerprint = "sha256:')
    p.write_text(text[:i] + ("0" if text[i] != "0" else "1") + text[i + 1 :])
    rc = main(["check", "--entries", str(entries_copy), "--no-default-scan"])
    out = capsys.readouterr().out
    assert rc == 1
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 1 and f"FAIL {SCHED}.schedule: CHANGED" in fails[0], out


def test_gone_symbol_fails_naming_it(entries_copy):
    src = entries_copy / "vllm.v1.core.block_pool.BlockPool.free_blocks.toml"
    dst = entries_copy / "vllm.v1.core.block_pool.BlockPool.no_such_member.toml"
    dst.write_text(src.read_text().replace("free_blocks", "no_such_member"))
    problems = _scan_only(entries_copy, [])
    assert len(problems) == 1 and problems[0].startswith("vllm.v1.core.block_pool.BlockPool.no_such_member: GONE")


def test_instance_attribute_gone_is_detected():
    r = fp.fingerprint_symbol("vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager.req_to_blockz",
                              "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager.__init__")
    assert r["status"] == "gone" and "req_to_blockz" in r["error"]


def test_new_subclass_without_entry_fails(tmp_path):
    mod = tmp_path / "vt_tmp_subclass.py"
    mod.write_text(textwrap.dedent("""
        import vllm.v1.core.sched.scheduler

        class X(vllm.v1.core.sched.scheduler.Scheduler):
            def schedule(self):
                ...
    """))
    problems = _scan_only(DEFAULT_ENTRIES, [mod])
    text = "\n".join(problems)
    assert f"{SCHED}: entry's used_by does not list vt_tmp_subclass.X" in text, text
    assert f"{SCHED}.schedule: entry's used_by does not list vt_tmp_subclass.X.schedule" in text, text


def test_subclass_of_unlisted_class_and_unlisted_override(tmp_path):
    mod = tmp_path / "vt_tmp_unlisted.py"
    mod.write_text(textwrap.dedent("""
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.sched.scheduler import Scheduler

        class Y(BlockPool):
            pass

        class Z(Scheduler):
            def _update_after_schedule(self, *a, **k):
                return super()._update_after_schedule(*a, **k)
    """))
    text = "\n".join(_scan_only(DEFAULT_ENTRIES, [mod]))
    assert "vllm.v1.core.block_pool.BlockPool: NO ENTRY" in text, text
    assert f"{SCHED}._update_after_schedule: NO ENTRY" in text, text


def test_runtime_overrides_are_detected(tmp_path):
    mod = tmp_path / "vt_tmp_override.py"
    mod.write_text(textwrap.dedent("""
        def install():
            import vllm.v1.core.block_pool as bp
            from vllm.sampling_params import SamplingParams

            SamplingParams.clone = lambda self: self
            bp.BlockPool.free_blocks = lambda self, blocks: None
    """))
    text = "\n".join(_scan_only(DEFAULT_ENTRIES, [mod]))
    assert "vllm.sampling_params.SamplingParams.clone: NO ENTRY" in text, text
    assert "vllm.v1.core.block_pool.BlockPool.free_blocks: assigned to by vToken, so the entry's kind must be " \
           "runtime-override" in text, text


def test_malformed_entry_is_reported(entries_copy):
    p = entries_copy / f"{SCHED}.schedule.toml"
    p.write_text(p.read_text().replace('kind = "subclass-internal"', 'kind = "monkeypatch"'))
    problems = _scan_only(entries_copy, [])
    assert len(problems) == 1 and "monkeypatch" in problems[0] and p.name in problems[0]


def test_normalisation():
    a = "    def f(self):\n        return 1   \n\n"
    assert fp.digest(a) == fp.digest("def f(self):\n    return 1\n")
    assert fp.digest(a) != fp.digest("def f(self):\n    return 2\n")


def test_rebase_against_current_interpreter_is_all_unchanged(other_interpreter_result, monkeypatch, capsys):
    # The real subprocess ran in the fixture (same call the command makes); reuse its answer.
    there = other_interpreter_result.result(timeout=300)
    assert there["python"] == sys.executable and all(v["status"] == "ok" for v in there["symbols"].values())
    real = chk.fingerprints_via
    monkeypatch.setattr(chk, "fingerprints_via", lambda py, ents: there if py == sys.executable else real(py, ents))
    assert main(["rebase", "--python", sys.executable]) == 0
    out = capsys.readouterr().out
    n = len(load_entries())
    assert f"{n} unchanged, 0 changed, 0 gone" in out, out[-2000:]


def test_rebase_reports_changed_with_diff_and_gone(monkeypatch):
    real = chk.fingerprints_via
    entries = load_entries()
    here = real(None, entries.values())

    def fake(python, ents):
        if python is None:
            return here
        there = {"vllm_version": "9.9.9", "python": python, "symbols": {k: dict(v) for k, v in here["symbols"].items()}}
        s = there["symbols"][f"{SCHED}.schedule"]
        s["source"] = s["source"].replace("def schedule(", "def schedule(  # upstream edit\n    ", 1)
        s["fingerprint"] = fp.digest(s["source"])
        there["symbols"]["vllm.v1.core.block_pool.BlockPool.free_blocks"] = {"status": "gone", "error": "x does not exist"}
        return there

    monkeypatch.setattr(chk, "fingerprints_via", fake)
    text, status = chk.rebase_report("other-python")
    assert status[f"{SCHED}.schedule"] == "changed"
    assert status["vllm.v1.core.block_pool.BlockPool.free_blocks"] == "gone"
    assert sum(v == "unchanged" for v in status.values()) == len(entries) - 2
    diff = [ln.strip() for ln in text.splitlines()]
    assert any(ln.startswith("+") and ln.endswith("# upstream edit") for ln in diff), text[-3000:]
    assert f"--- {SCHED}.schedule (vLLM 0.32.0)" in diff and f"+++ {SCHED}.schedule (vLLM 9.9.9)" in diff


def test_update_rewrites_fingerprints_and_index(entries_copy, tmp_path):
    p = entries_copy / f"{SCHED}.schedule.toml"
    orig = p.read_text()
    p.write_text(orig.replace('upstream_version = "', 'upstream_version = "0.0.1-').replace("sha256:", "sha256:0", 1))
    readme = tmp_path / "README.md"
    updated, gone = chk.update_entries(None, entries_copy, readme)
    assert updated == [f"{SCHED}.schedule"] and gone == []
    assert p.read_text() == orig
    assert chk.index_is_current(entries_copy, readme)


def test_readme_index_is_up_to_date():
    assert chk.index_is_current(), "patches/README.md is stale: run `python -m vtoken.patches index`"


# --- the rebase report (make rebase-check): generator on a fake comparison, committed 0.33.0 report ---

from vtoken.patches import report as rpt  # noqa: E402

_OLD_FN = 'def f(self, x: int) -> int:\n    """Old doc."""\n    return x + 1\n'
_DOC_ONLY = 'def f(self, x: "int | None") -> int:\n    """New doc,\n    two lines."""\n    # a comment\n    return (x +\n            1)\n'
_CODE_CHANGE = 'def f(self, x: int) -> int:\n    """Old doc."""\n    return x + 2\n'


def _fake_result() -> "rpt.RebaseResult":
    mk = lambda sym, new, status="changed": rpt.SymbolResult(  # noqa: E731
        f"vllm.fake.{sym}", status, kind="subclass-internal", used_by=[f"vtoken.integrations.vllm.x.{sym}"],
        change="c", old=_OLD_FN, new=new)
    return rpt.RebaseResult("0.32.0", "9.9.9", [mk("Doc", _DOC_ONLY), mk("Judged", _CODE_CHANGE),
                                                mk("Unjudged", _CODE_CHANGE), mk("Same", _OLD_FN, "unchanged")])


def test_rebase_report_verdict_lines(tmp_path):
    verdicts = tmp_path / "rebase-verdicts-9.9.9.toml"
    verdicts.write_text(textwrap.dedent('''
        ["vllm.fake.Judged"]
        verdict = "behaviour"
        what = "f returns x + 2."
        where = ["vtoken/x.py: Judged.f"]
    '''))
    out = tmp_path / "rebase-9.9.9.md"
    given = rpt.write_report(_fake_result(), verdicts, out)
    text = out.read_text()
    lines = text.splitlines()
    assert rpt.parse_summary(text) == {"unchanged": 1, "changed": 3, "gone": 0}
    assert [v.verdict for v in given.values()] == ["cosmetic", "behaviour", rpt.NEEDS_REVIEW]

    def verdict_after(sym):
        i = lines.index(f"### `vllm.fake.{sym}`")
        return next(ln for ln in lines[i:] if ln.startswith("- **verdict"))

    assert verdict_after("Doc") == ("- **verdict: cosmetic** (automatic: same AST without docstrings, comments and "
                                    "annotations)")
    assert verdict_after("Judged") == ("- **verdict: behaviour change vToken must follow** (reviewed): f returns "
                                       "x + 2. Where in vToken: vtoken/x.py: Judged.f.")
    assert verdict_after("Unjudged") == ("- **verdict: needs review** (no entry in the verdicts file; read the diff "
                                         "and add one)")
    assert "- kind: subclass-internal; used by: `x.Judged`" in lines
    assert "- diff: +1 -1 lines" in lines and lines.count("+    return x + 2") == 1  # one excerpt per diff
    assert "- same upstream source and diff as `vllm.fake.Judged` (shown there)" in lines
    assert "### `vllm.fake.Same`" not in text


def test_rebase_report_cli_exit_status_and_bad_verdicts(tmp_path, capsys):
    saved = tmp_path / "cmp.json"
    saved.write_text(__import__("json").dumps(_fake_result().to_json()))
    out = tmp_path / "r.md"
    assert main(["report", "--from-json", str(saved), "--verdicts", str(tmp_path / "none.toml"),
                 "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "2 changed symbol(s) need review" in printed and "needs review: vllm.fake.Judged" in printed
    bad = tmp_path / "bad.toml"
    bad.write_text('["vllm.fake.Judged"]\nverdict = "behaviour"\nwhat = "no where"\n')
    assert main(["report", "--from-json", str(saved), "--verdicts", str(bad), "--out", str(out)]) == 2
    assert "needs field(s) ['where']" in capsys.readouterr().err


def test_cosmetic_needs_the_ast_to_prove_it():
    assert rpt.is_cosmetic(_OLD_FN, _DOC_ONLY) and not rpt.is_cosmetic(_OLD_FN, _CODE_CHANGE)
    # a class field's annotation is validated at run time on pydantic config classes: not cosmetic
    assert not rpt.is_cosmetic("class A:\n    x: int = 0\n", "class A:\n    x: str = 0\n")
    assert rpt.is_cosmetic("class A:\n    x: int = 0\n", 'class A:\n    x: int = 0\n    """Field doc."""\n')
    assert rpt.is_cosmetic('"K": lambda: 1', '"K": (lambda: 1)  # registry item') and not rpt.is_cosmetic("", "x = 1")


REBASE_VERSIONS = ("0.33.0", "0.34.0")  # committed reports; the last one compared every current entry


@pytest.mark.parametrize("version", REBASE_VERSIONS)
def test_committed_rebase_report_is_fully_reviewed(version):
    root = DEFAULT_ENTRIES.parent
    text = (root / f"rebase-{version}.md").read_text()
    verdicts = rpt.load_verdicts(root / f"rebase-verdicts-{version}.toml")
    assert rpt.NEEDS_REVIEW not in text.replace(f"0 {rpt.NEEDS_REVIEW}.", "")
    assert "## Stale verdicts" not in text
    n = rpt.parse_summary(text)
    changed = re.findall(r"^### `(vllm\.[^`]+)`$", text, flags=re.M)
    auto = text.count("(automatic: same AST")
    assert len(changed) == n["changed"] + n["gone"]
    # every changed symbol is cosmetic by the AST or has a hand-written verdict, and nothing else is in the file
    assert n["changed"] + n["gone"] == len(verdicts) + auto and set(verdicts) <= set(changed)
    # the newest report covers every entry; an older one every entry it knew (entries added since, e.g.
    # vllm.__version__ for the version gate, are in the newer reports only)
    if version == REBASE_VERSIONS[-1]:
        assert sum(n.values()) == len(load_entries())
    else:
        assert sum(n.values()) <= len(load_entries())
