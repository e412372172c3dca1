"""Tiny deterministic random models, one per model family vLLM serves, for the model-family tests.

Each family is built from its ``transformers`` config class (no download), 2 layers, vocab 512,
fp32, seeded, with the byte-level tokenizer of :mod:`vtoken.assets.tiny` (two of them, Gemma 2 and
Mistral with a sliding window, are families vToken refuses at start-up). The shapes cover GQA
ratios 1, 2, 4 and 8 and head_dim 64, 128 and 256 (:data:`FAMILIES`). Init scales are per
parameter role (:func:`_role`); the query/key projections (or, with QK-norm, the norm gains) are
set per family so attention is peaked: :func:`attention_check` measures it on the transformers
model itself (``output_attentions``: the family's own scale, multipliers and norms) and
:func:`build` records the numbers in the manifest; ``tests/assets/test_families.py`` checks
that every family's mean max attention probability and logit spread stay clear of near-ties.

``vtoken assets --only families`` builds what is missing; each model's ``vtoken_manifest.json`` holds its check.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from vtoken.assets._common import dir_is_complete, finalize_dir, make_tmp_dir
from vtoken.assets.tiny import BOS_ID, EOS_ID, MAX_POS, PAD_ID, VOCAB, make_tokenizer

BUILD_VERSION = 1
SEED = 4321


@dataclass(frozen=True)
class Family:
    """One tiny model family.

    Attributes:
        name: asset name suffix (``tiny-<name>``).
        label: the family's name in the docs.
        config_cls: the ``transformers`` config class name.
        kwargs: config arguments besides the common ones (:func:`make_config`).
        qk_std: init std of the query/key projections (peaked attention).
        norm_gain: value of the QK-norm gains (``q_norm``/``k_norm`` weights), families with QK-norm.
        std: init std overrides per role (:func:`_role`).
        what: the feature(s) the family adds, for the docs table.
    """

    name: str
    label: str
    config_cls: str
    kwargs: dict
    qk_std: float
    what: str
    norm_gain: float = 1.0
    std: dict = field(default_factory=dict)


def _gqa(hq: int, hkv: int, hd: int, hidden: int = 128) -> dict:
    return dict(hidden_size=hidden, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=hd)


#: the families, each 2 layers; shapes (query heads / KV heads / head_dim) vary on purpose
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen3", "Qwen3", "Qwen3Config", dict(_gqa(8, 2, 128), sliding_window=None, use_sliding_window=False),
           0.16, "QK-norm (per head), GQA 4, head_dim 128", norm_gain=2.2),
    Family("qwen2", "Qwen2", "Qwen2Config", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
                                        sliding_window=None, use_sliding_window=False),
           0.12, "q/k/v biases, GQA 4, head_dim 64"),
    Family("mistral", "Mistral", "MistralConfig", dict(_gqa(8, 1, 64), sliding_window=None),
           0.16, "GQA 8, head_dim 64, no sliding window"),
    Family("phi3", "Phi-3", "Phi3Config", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                                      sliding_window=None, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attention_dropout=0.0),
           0.12, "fused qkv / gate_up projections, MHA (GQA 1), head_dim 64"),
    Family("granite", "Granite", "GraniteConfig", dict(_gqa(4, 2, 64), attention_multiplier=0.25,
                                            embedding_multiplier=2.0, residual_multiplier=0.5,
                                            logits_scaling=0.5),
           0.12, "attention/embedding/residual/logit multipliers (scale 0.25, not 1/sqrt(64)), GQA 2"),
    Family("olmo2", "OLMo 2", "Olmo2Config", dict(_gqa(4, 4, 64)),
           0.16, "QK-norm over all heads, post-norms, MHA, head_dim 64", norm_gain=2.2),
    Family("gemma", "Gemma", "GemmaConfig", dict(_gqa(4, 1, 256), hidden_activation="gelu_pytorch_tanh",
                                        tie_word_embeddings=True),
           0.16, "head_dim 256, embedding scale sqrt(hidden), (1 + w) norms, tied head, GQA 4",
           # larger attention/MLP outputs: with the tied head a small one predicts the current token
           # whatever the context, so eviction would change nothing
           std={"embed": 0.2, "vo": 0.3, "other": 0.15}),
    Family("llama3", "Llama 3 RoPE", "LlamaConfig", dict(_gqa(4, 1, 64), rope_scaling={
               "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}),
           0.16, "Llama 3 RoPE scaling (factor 8, original 256 positions), GQA 4"),
    Family("qwen3_moe", "Qwen3-MoE", "Qwen3MoeConfig", dict(_gqa(4, 1, 64), num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=64, decoder_sparse_step=1,
                                               norm_topk_prob=True, mlp_only_layers=[],
                                               sliding_window=None, use_sliding_window=False),
           0.16, "mixture of experts (4 experts, top 2), QK-norm, GQA 4", norm_gain=2.2),
    Family("gpt_neox", "GPT-NeoX", "GPTNeoXConfig", dict(hidden_size=256, num_attention_heads=4, rotary_pct=0.25,
                                             use_parallel_residual=True, attention_bias=True,
                                             hidden_dropout=0.0, attention_dropout=0.0),
           0.12, "partial rotary (25 % of head_dim 64), parallel residual, LayerNorm, MHA"),
    Family("gptj", "GPT-J", "GPTJConfig", dict(n_embd=256, n_head=4, rotary_dim=16, n_inner=256, resid_pdrop=0.0,
                                               embd_pdrop=0.0, attn_pdrop=0.0),
           0.12, "interleaved (GPT-J style) partial rotary, 16 of head_dim 64, parallel residual, MHA"),
    Family("phi", "Phi", "PhiConfig", dict(hidden_size=256, num_attention_heads=4, partial_rotary_factor=0.5,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
           0.12, "partial rotary (half of head_dim 64), dense biases, parallel residual, MHA"),
    Family("gpt2", "GPT-2", "GPT2Config", dict(n_embd=256, n_head=4, n_inner=256, resid_pdrop=0.0, embd_pdrop=0.0,
                                               attn_pdrop=0.0, tie_word_embeddings=True),
           0.12, "learned absolute position embeddings (no RoPE), fused Conv1D qkv, tied head, MHA",
           std={"embed": 0.3}),
    # families vToken refuses at start-up (tests/drivers/model_families.py REFUSED names the words)
    Family("gemma2", "Gemma 2", "Gemma2Config", dict(_gqa(4, 1, 256), hidden_activation="gelu_pytorch_tanh",
                                                     tie_word_embeddings=True, query_pre_attn_scalar=256,
                                                     sliding_window=64),
           0.16, "attention logit soft-capping 50, sliding window 64 on alternate layers", std={"embed": 0.2}),
    Family("mistral_swa", "Mistral (sliding window)", "MistralConfig", dict(_gqa(8, 1, 64), sliding_window=64),
           0.16, "sliding window 64 (Mistral 7B v0.1 style)"),
)}


def make_config(fam: Family):
    """The family's ``transformers`` config (2 layers, vocab 512, fp32, the tiny tokenizer's ids)."""
    import torch
    import transformers

    cls = getattr(transformers, fam.config_cls)
    kw = dict(vocab_size=VOCAB, intermediate_size=256, num_hidden_layers=2, max_position_embeddings=MAX_POS,
              bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, dtype=torch.float32)
    if "tie_word_embeddings" not in fam.kwargs:
        kw["tie_word_embeddings"] = False
    kw.update(fam.kwargs)
    cfg = cls(**kw)
    if fam.name == "phi3":  # Phi3Config's defaults name bos 1 / eos 32000 / pad 32000; make sure ours stand
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = BOS_ID, EOS_ID, PAD_ID
    return cfg


def _role(name: str) -> str:
    """The init role of a parameter name (suffix rules over every family's module names)."""
    n = name.lower()
    if n.endswith(("q_norm.weight", "k_norm.weight")):
        return "qk_norm"
    if "norm" in n or "layernorm" in n or n.startswith("gpt_neox.final") or ".ln" in n:
        return "norm_bias" if n.endswith(".bias") else "norm"
    if n.endswith(("embed_tokens.weight", "embed_in.weight", "wte.weight")):
        return "embed"
    if n.endswith("wpe.weight"):
        return "pos"
    if n.endswith(("lm_head.weight", "embed_out.weight")):
        return "head"
    if n.endswith((".bias",)):
        return "bias"
    if n.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight", "query_key_value.weight", "c_attn.weight")):
        return "qk"
    if n.endswith(("mlp.gate.weight", "router.weight", "block_sparse_moe.gate.weight")):
        return "router"
    if n.endswith(("v_proj.weight", "o_proj.weight", "attention.dense.weight")):
        return "vo"
    return "other"


_ROLE_STD = {"embed": 1.0, "pos": 0.3, "head": 0.35, "bias": 0.05, "vo": 0.1, "router": 0.5, "other": 0.05}


def make_model(fam: Family):
    """Return the family's deterministic fp32 model (same weights on every call)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    cfg = make_config(fam)
    torch.manual_seed(SEED)  # any init the loop below leaves alone (none expected)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(torch.float32)
    gen = torch.Generator().manual_seed(SEED)
    std = dict(_ROLE_STD, qk=fam.qk_std, **fam.std)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            role = _role(name)
            if role == "norm":
                # Gemma's RMSNorm scales by (1 + w): w = 0 is its identity; others w = 1
                p.fill_(0.0 if fam.config_cls in ("GemmaConfig", "Gemma2Config") else 1.0)
            elif role == "norm_bias":
                p.zero_()
            elif role == "qk_norm":
                p.fill_(fam.norm_gain)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std[role])
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.eval()
    return model


def attention_check(model, n: int = 200, seed: int = 7) -> dict[str, float]:
    """How peaked the model's attention and logits are on a random ``n``-token byte prompt, from
    the model's own eager attention (``output_attentions``): ``max_attn_prob`` (mean over layers,
    heads and query rows past 16 of the largest probability), ``attn_entropy_frac`` (mean entropy
    over the uniform one's) and ``logit_std`` / ``logit_gap`` (std of the last row's logits and the
    gap between its two largest)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 255, (1, n), generator=g)
    impl = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.inference_mode():
            out = model(input_ids=ids, output_attentions=True)
    finally:
        model.config._attn_implementation = impl
    maxp, ent = [], []
    for a in out.attentions:  # [1, H, n, n]
        a = a[0, :, 16:].double()
        maxp.append(a.max(dim=-1).values.mean().item())
        rows = torch.arange(16, n, dtype=torch.float64) + 1
        e = -(a * torch.log(a.clamp_min(1e-30))).sum(-1) / torch.log(rows)
        ent.append(e.mean().item())
    last = out.logits[0, -1].double()
    top2 = last.topk(2).values
    return {"max_attn_prob": round(sum(maxp) / len(maxp), 4), "attn_entropy_frac": round(sum(ent) / len(ent), 4),
            "logit_std": round(last.std().item(), 3), "logit_gap": round((top2[0] - top2[1]).item(), 3)}


def build(fam: Family, final: Path, *, force: bool = False) -> Path:
    """Write the family's tiny model + tokenizer to ``final`` unless a complete build exists."""
    if not force and dir_is_complete(final, BUILD_VERSION):
        return final
    tmp = make_tmp_dir(final)
    try:
        model = make_model(fam)
        check = attention_check(model)
        model.save_pretrained(tmp)
        make_tokenizer().save_pretrained(tmp)
        finalize_dir(tmp, final, {"asset": f"tiny-{fam.name}", "build_version": BUILD_VERSION, "seed": SEED,
                                  "family": fam.name, "config_cls": fam.config_cls, "qk_std": fam.qk_std,
                                  "norm_gain": fam.norm_gain, "check": check, "dtype": "float32"})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final

