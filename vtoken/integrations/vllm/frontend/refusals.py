"""What vToken refuses, in one table; the checks that apply it.

:data:`REFUSALS` lists every option, model feature and request kind vToken refuses (each
with the reason). vToken changes no vLLM setting: what it cannot follow it refuses.
The "What vToken refuses" block of ``docs/configuration.md`` (README links to it) is generated
from the table by :func:`readme_block` (``python -m vtoken.integrations.vllm.frontend.refusals`` rewrites
it in place) and ``tests/integration/test_refusals.py`` checks that the page holds exactly that block.
Every start-up refusal is raised through :func:`refuse`, which takes a key of
:data:`REFUSALS`, so the code cannot refuse something the table (and so the README) does
not list.

Start-up checks (called by the plugin's ``create_engine_config`` wrapper, in the front-end
process, before any weights load): :func:`check_vllm_version` first (the installed vLLM
release against the tested one), :func:`check_engine_args` on the ``EngineArgs`` before
vLLM builds its config, :func:`check_model` and :func:`check_kv_cache_dtype` on the built
``VllmConfig``. Errors are :class:`~vtoken.config.VTokenConfigError` (a ``ValueError``):
``<option> = <value>: vToken does not support it yet (<reason>[; allowed: ...])``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from vtoken.config import VTokenConfigError

__all__ = ["Refusal", "REFUSALS", "refuse", "check_engine_args", "check_model", "rope_problem",
           "model_attention_features", "check_attention_layers", "check_kv_cache_dtype", "KV_CACHE_DTYPES", "MODEL_DTYPES", "readme_block",
           "ALLOW_UNTESTED_VLLM_ENV", "installed_vllm_version", "check_vllm_version"]


@dataclass(frozen=True)
class Refusal:
    """One thing vToken refuses.

    Attributes:
        key: stable id used by the code (:func:`refuse`).
        option: what the user set, as named in the error and the README (a CLI option,
            a model feature or a request kind).
        when: ``"start-up"`` or ``"request"`` (HTTP 400 / ``ValueError`` for that request only).
        reason: why vToken cannot do it (yet).
    """

    key: str
    option: str
    when: str
    reason: str


#: Tested KV-cache dtypes: the token-move and key-read paths are bit-exact against vLLM's
#: packing op for these (tests/integration/test_kv_layout.py); ``auto`` means the model dtype.
MODEL_DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")

#: opt-in to start on a vLLM release other than the tested one (:func:`check_vllm_version`)
ALLOW_UNTESTED_VLLM_ENV = "VTOKEN_ALLOW_UNTESTED_VLLM"

_CONTEXT_PARALLEL_REASON = ("context parallelism shards each request's KV cache by token across ranks (interleaved "
                            "slots, different block-size arithmetic), so token moves and scores would need a "
                            "cross-rank exchange")

REFUSALS: tuple[Refusal, ...] = (
    Refusal("vllm_version", f"vllm.__version__ other than the tested release, without {ALLOW_UNTESTED_VLLM_ENV}=1",
            "start-up",
            "vToken subclasses and overrides vLLM internals (patches/entries/) checked against one vLLM release; "
            "another release may have moved or changed them (see patches/rebase-<version>.md where one exists), "
            f"so a mismatch could fail late or evict wrongly; set {ALLOW_UNTESTED_VLLM_ENV}=1 to start anyway"),
    Refusal("speculative", "--speculative-config", "start-up",
            "speculative decoding: drafters address the KV cache by logical position"),
    Refusal("pipeline_parallel", "--pipeline-parallel-size > 1", "start-up",
            "scores would need a cross-stage exchange"),
    Refusal("decode_context_parallel", "--decode-context-parallel-size > 1", "start-up",
            "decode " + _CONTEXT_PARALLEL_REASON),
    Refusal("prefill_context_parallel", "--prefill-context-parallel-size > 1", "start-up",
            "prefill " + _CONTEXT_PARALLEL_REASON),
    Refusal("kv_transfer", "--kv-transfer-config", "start-up",
            "KV connectors assume positionally stable block tables"),
    Refusal("kv_cache_dtype", "--kv-cache-dtype", "start-up",
            "the token-move layout probe covers fp32/bf16/fp16 caches only (fp8 and quantized caches untested); "
            f"allowed: {', '.join(KV_CACHE_DTYPES)} (auto: a model dtype of {', '.join(MODEL_DTYPES)})"),
    Refusal("sliding_window", "sliding-window or mixed layer types (model feature)", "start-up",
            "the block manager of a non-full-attention layer group does not follow the token table"),
    Refusal("mamba", "hybrid / Mamba state-space layers (model feature)", "start-up",
            "their per-request state is not a token-indexed KV cache"),
    Refusal("alibi", "ALiBi (model feature)", "start-up",
            "ALiBi biases attention by key index, so a repack changes outputs, and the scorer ignores the bias"),
    Refusal("softcap", "attention logit soft-capping (model feature)", "start-up",
            "the scorer computes softmax(q K^T * scale) without the cap, so its scores are not the model's"),
    Refusal("sinks", "learned attention sinks (model feature, e.g. gpt-oss)", "start-up",
            "the scorer's softmax has no sink logit, so its scores are not the model's"),
    Refusal("block_size", "--block-size not usable by the attention backend", "start-up",
            "the CPU backend needs a multiple of 32, FlashAttention a multiple of 16 (stock vLLM fails later, "
            "inside the worker, or splits blocks, which vToken's block tables do not follow)"),
    Refusal("platform", "platform other than vLLM's CPU backend or NVIDIA CUDA (e.g. ROCm, TPU, XPU)", "start-up",
            "only the CPU worker and the CUDA worker (FlashAttention) are built; the other platforms' KV layouts, "
            "attention kernels and graph modes are untested"),
    Refusal("attention_backend", "--attention-backend other than FLASH_ATTN (CUDA)", "start-up",
            "the CUDA worker implements FlashAttention's KV layout, block sizes and CUDA graph behaviour only; "
            "FLASHINFER, TRITON_ATTN and the other GPU backends are untested (FlashInfer also treats the seq_lens "
            "upper bound as exact); pass --attention-backend FLASH_ATTN"),
    Refusal("scheduler_cls", "--scheduler-cls", "start-up",
            "vToken installs its own scheduler (a subclass of vLLM's Scheduler, or AsyncScheduler under "
            "async scheduling)"),
    Refusal("cuda_unvalidated", "platform = CUDA without VTOKEN_UNVALIDATED_PLATFORM=1", "start-up",
            "vToken's eviction path (selection, moves and scoring on the worker) has not been validated on a "
            "GPU yet; run `make device-check` on the GPU machine, then start with VTOKEN_UNVALIDATED_PLATFORM=1 "
            "to opt in"),
    Refusal("per_head_replicated_kv", "vtoken.granularity = head or head_shared with --tensor-parallel-size above the "
            "model's KV heads", "start-up",
            "each rank then holds a copy of a KV head but scores it from its own query heads only, so the copies "
            "would keep different tokens; allowed there: granularity request or layer (a request's "
            "vtoken_granularity is refused the same way, HTTP 400)"),
    Refusal("ea_rope", "vtoken.policy = expected_attention on a model without one full, plain or Llama 3 "
            "rotary position embedding", "start-up",
            "Expected Attention un-rotates each query and rotates the query moments to future positions with the "
            "model's own RoPE; other position encodings, partial rotary dimensions and other RoPE scalings are not "
            "modelled; allowed there: another policy (keydiff, knorm); a request's vtoken_policy is refused the "
            "same way, HTTP 400"),
    Refusal("streaming_input", "streaming-input (resumable) requests", "request",
            "the request keeps its blocks across input chunks while vToken's per-request state is built "
            "for one prompt"),
    Refusal("beam_search", "beam search (use_beam_search; LLM.beam_search)", "request",
            "vLLM's front end runs beam search as a series of one-token requests (one per beam and step), so no "
            "request decodes past its prompt and none would ever evict: the answer would be stock vLLM's while "
            "eviction is reported on"),
)

_BY_KEY = {r.key: r for r in REFUSALS}


def refuse(key: str, value: Any, detail: Optional[str] = None) -> None:
    """Raise the refusal ``key`` of :data:`REFUSALS` for ``value``.

    Raises:
        VTokenConfigError: ``<option> = <value>: vToken does not support it yet (<reason>[; <detail>])``
            for an option (``platform = <value>: ...`` for the platform); ``--model = <value>: vToken does not support it yet (<feature>[; <detail>]:
            <reason>)`` for a model feature (the one error format of ``vtoken.config``).
        KeyError: ``key`` is not in the table (a refusal the README would not list).
    """
    r = _BY_KEY[key]
    # the one error format (vtoken.config): "<where> = <value>: <problem>"
    extra = f"; {detail}" if detail else ""
    if r.option.startswith(("--", "vtoken.")) or r.key in ("platform", "cuda_unvalidated", "vllm_version"):
        option = r.option.split(" ", 1)[0]
        raise VTokenConfigError(f"{option} = {value!r}: vToken does not support it yet ({r.reason}{extra})")
    raise VTokenConfigError(f"--model = {value!r}: vToken does not support it yet ({r.option}{extra}: {r.reason})")


def rope_problem(hf_text_config: Any) -> Optional[str]:
    """Why Expected Attention cannot run on a model, from its Hugging Face config, or None.

    Allowed: a rotary position embedding over every head dimension, of RoPE type ``default`` or
    ``llama3`` (``rope_parameters`` / ``rope_scaling``; the worker's
    ``WorkerStep.find_rope`` checks the loaded layers the same way).
    """
    params = _get(hf_text_config, "rope_parameters") or _get(hf_text_config, "rope_scaling")
    theta = _get(hf_text_config, "rope_theta")
    if isinstance(params, dict) and "rope_theta" not in params and any(isinstance(v, dict) for v in params.values()):
        return f"rope_parameters = {params!r} (one RoPE per layer type)"
    if theta is None and not (isinstance(params, dict) and params.get("rope_theta") is not None):
        return "no rotary position embedding (rope_theta)"
    kind = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if kind not in ("default", "llama3"):
        return f"rope_type = {kind!r}"
    partial = _get(hf_text_config, "partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        return f"partial_rotary_factor = {partial!r}"
    return None


# ---------------------------------------------------------------------- start-up checks
def installed_vllm_version() -> str:
    """``vllm.__version__`` of the vLLM this process imports (e.g. ``0.32.0``, ``0.32.0+cpu``)."""
    import vllm

    return str(vllm.__version__)


def _release(version: str) -> str:
    """The version without its local label: ``0.32.0+cpu`` -> ``0.32.0`` (a pre- or post-release
    keeps its suffix: ``0.32.0rc1`` is not the tested release)."""
    return version.split("+", 1)[0].strip()


def check_vllm_version(installed: Optional[str] = None, env: Optional[dict] = None) -> Optional[str]:
    """Refuse a vLLM release other than the tested one unless ``VTOKEN_ALLOW_UNTESTED_VLLM=1``.

    Called by the plugin only when vToken is on (a ``vtoken`` key in ``additional_config``);
    a stock start with the plugin installed is never checked. ``installed`` defaults to
    :func:`installed_vllm_version`, ``env`` to ``os.environ``. The comparison drops the
    local label (``0.32.0+cpu`` is the tested ``0.32.0``).

    Returns:
        None on the tested release; with the opt-in, the one warning line to log (names both
        versions and ``patches/rebase-<version>.md`` when the repository has it).

    Raises:
        VTokenConfigError: ``vllm.__version__ = '<installed>': vToken does not support it yet
            (<reason>; installed vLLM <installed>, tested vLLM <tested>; set VTOKEN_ALLOW_UNTESTED_VLLM=1 ...)``.
    """
    import os

    from vtoken.patches.manifest import REPO_ROOT, TESTED_VLLM_VERSION

    installed = installed_vllm_version() if installed is None else installed
    if _release(installed) == _release(TESTED_VLLM_VERSION):
        return None
    env = os.environ if env is None else env
    release = _release(installed)
    report = f"patches/rebase-{release}.md"
    known = (f"see {report} for what changed" if (REPO_ROOT / report).exists()
             else f"no {report} next to this vToken (make rebase-check VLLM={release} writes one)")
    if env.get(ALLOW_UNTESTED_VLLM_ENV, "0") in ("", "0"):
        refuse("vllm_version", installed, f"installed vLLM {installed}, tested vLLM {TESTED_VLLM_VERSION}; {known}; "
                                          f"{ALLOW_UNTESTED_VLLM_ENV} is not set")
    return (f"vToken: vLLM {installed} is untested (vToken is tested with vLLM {TESTED_VLLM_VERSION}); "
            f"starting anyway because {ALLOW_UNTESTED_VLLM_ENV}=1; {known}")


def check_engine_args(args) -> None:
    """Refuse, naming the option, what vToken cannot do; ``args`` is vLLM's ``EngineArgs``.

    Raises:
        VTokenConfigError: see :func:`refuse`.
    """
    if args.speculative_config:
        refuse("speculative", args.speculative_config)
    if (args.pipeline_parallel_size or 1) > 1:
        refuse("pipeline_parallel", args.pipeline_parallel_size)
    if (getattr(args, "decode_context_parallel_size", 1) or 1) > 1:
        refuse("decode_context_parallel", args.decode_context_parallel_size)
    if (getattr(args, "prefill_context_parallel_size", 1) or 1) > 1:
        refuse("prefill_context_parallel", args.prefill_context_parallel_size)
    if args.kv_transfer_config is not None:
        refuse("kv_transfer", "set")
    if str(args.kv_cache_dtype) not in KV_CACHE_DTYPES:
        refuse("kv_cache_dtype", args.kv_cache_dtype)


def check_kv_cache_dtype(vcfg) -> None:
    """Refuse ``--kv-cache-dtype auto`` when the model dtype it resolves to is untested.

    Raises:
        VTokenConfigError: names ``--kv-cache-dtype``, the resolved dtype and the allowed ones.
    """
    cache_dtype = str(vcfg.cache_config.cache_dtype)
    if cache_dtype not in KV_CACHE_DTYPES:
        refuse("kv_cache_dtype", cache_dtype)
    if cache_dtype == "auto":
        model_dtype = str(vcfg.model_config.dtype).removeprefix("torch.")
        if model_dtype not in MODEL_DTYPES:
            refuse("kv_cache_dtype", "auto", f"resolves to the model dtype {model_dtype}")


def _get(obj, name):
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


#: Architectures whose attention is always ALiBi / always has learned sinks in vLLM 0.32
#: (``vllm/model_executor/models/{bloom,step1,gpt_oss}.py``).
_ALIBI_ARCHS = {"BloomForCausalLM": "bloom", "Step1ForCausalLM": "step1"}
_ALIBI_MODEL_TYPES = {"bloom", "step1"}
_SINK_MODEL_TYPES = {"gpt_oss"}


def model_attention_features(hf_config, hf_text_config=None) -> list[tuple[str, str]]:
    """Attention features of a Hugging Face config that vToken's scorer does not reproduce.

    Reads the config only (no weights): ALiBi (``alibi`` true as in Falcon,
    ``position_embedding_type == "alibi"``, MPT's ``attn_config.alibi``, and architectures
    that always use it: BLOOM, Step1), attention logit soft-capping
    (``attn_logit_softcapping`` set and non-zero, as in Gemma 2; ``final_logit_softcapping``
    caps the LM head, not attention, and is allowed), learned attention sinks (gpt-oss,
    ``attention_sinks`` true, ``add_*_attention_sink_bias`` true).

    Returns:
        ``[(refusal key, evidence)]``, e.g. ``[("alibi", "alibi=True")]``; empty when none.
    """
    text = hf_text_config if hf_text_config is not None else hf_config
    found: list[tuple[str, str]] = []
    archs = list(_get(hf_config, "architectures") or [])
    model_type = _get(text, "model_type") or _get(hf_config, "model_type")
    # ALiBi
    alibi = None
    if _get(text, "alibi") is True:
        alibi = "alibi=True"
    elif _get(text, "position_embedding_type") == "alibi":
        alibi = "position_embedding_type='alibi'"
    elif _get(_get(text, "attn_config") or {}, "alibi") is True:
        alibi = "attn_config.alibi=True"
    elif model_type in _ALIBI_MODEL_TYPES or any(a in _ALIBI_ARCHS for a in archs):
        alibi = f"model_type={model_type!r} (always ALiBi)"
    if alibi:
        found.append(("alibi", alibi))
    # attention logit soft-capping
    cap = _get(text, "attn_logit_softcapping")
    if cap:
        found.append(("softcap", f"attn_logit_softcapping={cap!r}"))
    # learned attention sinks
    sinks = None
    if model_type in _SINK_MODEL_TYPES:
        sinks = f"model_type={model_type!r} (learned per-head sinks)"
    elif _get(text, "attention_sinks") is True:
        sinks = "attention_sinks=True"
    else:
        for name in ("add_full_attention_sink_bias", "add_swa_attention_sink_bias"):
            if _get(text, name) is True:
                sinks = f"{name}=True"
                break
    if sinks:
        found.append(("sinks", sinks))
    return found


def check_model(vcfg) -> None:
    """Refuse models whose attention vToken's scorer or block manager does not reproduce.

    Raises:
        VTokenConfigError: names the model and the feature (with the config field that shows it).
    """
    mc = vcfg.model_config
    hf = getattr(mc, "hf_config", None)
    text = getattr(mc, "hf_text_config", None) or hf
    for key, evidence in model_attention_features(hf, text):
        refuse(key, mc.model, evidence)
    sw = _get(text, "sliding_window")
    layer_types = _get(text, "layer_types") or []
    if sw or any(t != "full_attention" for t in layer_types):
        refuse("sliding_window", mc.model, f"sliding_window={sw!r}, layer_types={sorted(set(layer_types)) or None}")
    if getattr(mc, "is_hybrid", False) or getattr(mc, "has_inner_state", False):
        refuse("mamba", mc.model)


def check_attention_layers(model: str, layers: dict) -> None:
    """The exact form of :func:`check_model`'s feature checks, on the loaded attention layers.

    For the worker to call after ``load_model`` (``layers``: name -> vLLM ``Attention`` layer,
    e.g. ``compilation_config.static_forward_context``): refuses a layer whose attention
    implementation has ``alibi_slopes``, a ``logits_soft_cap`` or learned ``sinks`` (the
    attributes vLLM's attention implementations keep them in), whatever the config says.

    Raises:
        VTokenConfigError: names the model, the feature and the first layer that has it.
    """
    for name, layer in layers.items():
        impl = getattr(layer, "impl", None)
        if impl is None:
            continue
        if getattr(impl, "alibi_slopes", None) is not None:
            refuse("alibi", model, f"layer {name}: alibi_slopes")
        cap = getattr(impl, "logits_soft_cap", None)
        if cap:
            refuse("softcap", model, f"layer {name}: logits_soft_cap={cap!r}")
        if getattr(impl, "sinks", None) is not None:
            refuse("sinks", model, f"layer {name}: sinks")


# ---------------------------------------------------------------------- README
README_BEGIN = "<!-- refusals: generated by `python -m vtoken.integrations.vllm.frontend.refusals`; do not edit -->"
README_END = "<!-- /refusals -->"


def readme_block() -> str:
    """The README's refusals block (markers included), generated from :data:`REFUSALS`."""
    lines = [README_BEGIN, "", "| vToken refuses | when | why |", "|---|---|---|"]
    lines += [f"| {r.option} | {r.when} | {r.reason} |" for r in REFUSALS]
    lines += ["", "vToken changes no vLLM setting.", "", README_END]
    return "\n".join(lines)


#: the page that holds the refusals block (README.md links to it)
REFUSALS_PAGE = "docs/configuration.md"


def write_readme(path: str = REFUSALS_PAGE) -> None:
    """Replace the block between the markers of ``path`` with :func:`readme_block`."""
    with open(path) as f:
        text = f.read()
    i, j = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    with open(path, "w") as f:
        f.write(text[:i] + readme_block() + text[j:])


if __name__ == "__main__":
    import sys

    # ``python -m vtoken.integrations.vllm.frontend.refusals`` rewrites REFUSALS_PAGE's block in place
    # (run from the repository root); ``--print`` prints the block instead.
    if "--print" in sys.argv[1:]:
        print(readme_block())
    else:
        write_readme()
