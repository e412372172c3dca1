"""A tiny deterministic random Llama for fast plumbing tests (HF and vLLM load it).

2 layers, hidden 128, 2 query heads x head_dim 64, 1 KV head (GQA), vocab 512, fp32. The weights
come from a fixed torch seed with per-tensor init scales chosen so attention is peaked (typical
q.k/sqrt(d) std about 3.2, mean max attention probability about 0.47 on a random 200-token prompt) and next-token logits have clear gaps (std > 3). Tokenizer: byte-level,
256 byte tokens + a few special tokens, built offline with ``tokenizers``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from vtoken.assets._common import dir_is_complete, finalize_dir, make_tmp_dir

BUILD_VERSION = 1
SEED = 1234

NUM_LAYERS = 2
HIDDEN = 128
NUM_HEADS = 2
HEAD_DIM = 64
NUM_KV_HEADS = 1
INTERMEDIATE = 256
VOCAB = 512
MAX_POS = 4096
ROPE_THETA = 10000.0

# Special tokens follow the 256 byte tokens (ids 256..).
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")

# Init std per parameter-name suffix (others: 0.02; norms: 1.0).
INIT_STD = {
    "embed_tokens.weight": 1.0,
    "q_proj.weight": 0.16,
    "k_proj.weight": 0.16,
    "v_proj.weight": 0.1,
    "o_proj.weight": 0.1,
    "gate_proj.weight": 0.05,
    "up_proj.weight": 0.05,
    "down_proj.weight": 0.05,
    "lm_head.weight": 0.35,
}


def _bytes_to_unicode() -> dict[int, str]:
    """Byte -> printable unicode char map used by byte-level BPE (printable bytes map to themselves)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def make_tokenizer():
    """Return a ``PreTrainedTokenizerFast``: byte tokens at ids 0..255 (id == byte), then specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    b2u = _bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", model_max_length=MAX_POS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


#: the GQA variant (``gqa=True``): 4 query heads over 2 KV heads, so per-(layer, KV head) token
#: sets differ from per-layer ones and each of two TP ranks owns one KV head
GQA_NUM_HEADS = 4
GQA_NUM_KV_HEADS = 2


def make_model(gqa: bool = False):
    """Return the deterministic fp32 ``LlamaForCausalLM`` (same weights on every call);
    ``gqa``: the 4-query-head / 2-KV-head variant (same seed and init scales)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=GQA_NUM_HEADS if gqa else NUM_HEADS,
        num_key_value_heads=GQA_NUM_KV_HEADS if gqa else NUM_KV_HEADS,
        head_dim=HEAD_DIM, max_position_embeddings=MAX_POS, rope_theta=ROPE_THETA,
        rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, dtype=torch.float32)
    # rope_theta may live in rope_parameters depending on the transformers version; make sure
    # the value we want is the one stored.
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict):
        rp["rope_theta"] = ROPE_THETA
    model = LlamaForCausalLM(config).to(torch.float32)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = next((s for suf, s in INIT_STD.items() if name.endswith(suf)), 0.02)
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                                               pad_token_id=PAD_ID)
    model.eval()
    return model


def build(final: Path, *, force: bool = False, gqa: bool = False) -> Path:
    """Write the tiny model + tokenizer to ``final`` unless a complete build exists; return
    ``final``. ``gqa``: the 2-KV-head variant (:data:`GQA_NUM_KV_HEADS`)."""
    if not force and dir_is_complete(final, BUILD_VERSION):
        return final
    tmp = make_tmp_dir(final)
    try:
        make_model(gqa).save_pretrained(tmp)
        make_tokenizer().save_pretrained(tmp)
        finalize_dir(tmp, final, {"asset": "tiny-llama-gqa" if gqa else "tiny-llama", "build_version": BUILD_VERSION,
                                  "seed": SEED, "init_std": INIT_STD, "dtype": "float32"})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
