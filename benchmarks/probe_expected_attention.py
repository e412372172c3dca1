"""Why does Expected Attention answer no needle prompt? The method itself against vToken's version.

In the task benchmark (``bench_tasks.py``) the Expected Attention policy
(``vtoken/policies/expected_attention.py``; Devoto et al., arXiv 2510.00636; kvpress's
``ExpectedAttentionPress`` is the public reference) scores 0 % on RULER ``niah_single_1`` at about
1k tokens with SmolLM2-135M at every budget, while SnapKV reaches 100 % at 50 %. vToken departs
from the paper in a few places (per-RoPE-pair covariance, the sinks inside the softmax, eviction
while decoding). This probe asks whether those departures cause the 0 %, outside vLLM: Hugging
Face ``transformers``, fp32, eager attention, 1 torch thread.

How: ``--prompts`` needle prompts of about ``--length`` filler tokens
(``bench_same_tokens.needle_prompts``; the chat template applied and the answer's start
appended, as ``bench_same_tokens`` and lm-eval's task do). Per prompt one full-cache forward
gives every layer's pre-RoPE queries (``q_proj`` of the attention input), post-RoPE keys and
values. Each method scores every prompt token per (layer, KV head); per fraction ``f`` each
(layer, KV head) keeps its top ``ceil(f * L)`` prompt tokens, the first ``SINK`` = 4 always
(:func:`keep_mask`). Then greedy decoding of ``GEN_TOKENS`` = 12 tokens: the first from the
full-cache prefill logits (as vLLM evicts after the prefill), the next 11 with the evicted prompt
keys masked (``-inf``) for every query head of their KV head. Eviction happens once; generated
tokens are never evicted. A prompt is correct when its 7-digit value appears in the answer
(spaces removed).

Methods (``METHODS``):

* ``kvpress_full``: Expected Attention as the paper and kvpress define it
  (:func:`expected_attention_scores`): per query head the mean and full ``D x D`` covariance of
  the pre-RoPE prompt queries ``4 .. L-1``, rotated by RoPE's rotation averaged over the next
  ``N_FUTURE`` = 512 positions; ``exp(mu'.k/sqrt(D) + k'S'k/(2D))`` normalized over the non-sink
  keys (sinks outside the softmax), averaged over the KV head's query heads, times ``|v|``.
* ``pair_blocks``: the same with only the covariance's 2x2 RoPE-pair blocks (vToken's storage).
* ``vtoken``: vToken's own ``expected_attention`` (with ``future_rotation``, ``pair_terms``,
  ``rope_pairs``) on the same queries, keys and values: pair blocks, sinks inside the softmax.
* ``question_stats``: ``kvpress_full`` with the statistics of the last ``QUESTION_QUERIES`` = 40
  prompt queries only (the question and the answer's start).
* ``question_kept``: kvpress's protocol: only the context (the prompt before the question) is
  compressed; its statistics and scores from the context alone (rotation from the context's end),
  the question's tokens never evicted, the same total budget ``ceil(f * L)``.
* ``snapkv_window32``: SnapKV-like: the softmax attention of the last ``WINDOW`` = 32 prompt
  queries (post-RoPE, causal), summed over them and the KV head's query heads; no pooling.
* ``vtoken_plus_needle``: ``vtoken``'s kept set plus the needle's value tokens (up to 7 more
  tokens per (layer, KV head) than the budget): shows whether the needle is what is missing.

Recorded per method and fraction: correct count of ``n``, the mean share of the needle's value
tokens and of the question's tokens kept (over layers, KV heads and prompts), and each answer.
Also the full cache's answers and the largest relative difference between ``vtoken``'s scores
and :func:`expected_attention_scores` with pair blocks and the sinks inside the softmax (the same
math written independently: it should be float rounding, about 1e-5).

Writes ``benchmarks/results/<name>.json`` (default ``ea_probe``).

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/probe_expected_attention.py   # 8 prompts, ~5-10 min on 2 cores
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (ROOT, HERE):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from common import RESULTS, machine_info  # noqa: E402

from vtoken.policies.expected_attention import (  # noqa: E402
    expected_attention, future_rotation, pair_terms, rope_pairs)

#: the first prompt tokens, always kept; their queries are left out of the statistics
SINK = 4
#: future positions RoPE's rotation is averaged over (the paper's default)
N_FUTURE = 512
#: SnapKV-like observation window (last prompt queries)
WINDOW = 32
#: ``question_stats``: statistics from this many last prompt queries
QUESTION_QUERIES = 40
#: greedy tokens per answer (the first from the full-cache prefill)
GEN_TOKENS = 12

METHODS = {
    "kvpress_full": "full DxD covariance per query head, stats from prompt queries 4..L-1, rotation averaged over "
                    "L..L+511, |v|, sinks outside the softmax",
    "pair_blocks": "kvpress_full with only the covariance's 2x2 RoPE-pair blocks",
    "vtoken": "vToken's expected_attention/future_rotation/pair_terms/rope_pairs (pair blocks, sinks in the softmax)",
    "question_stats": "kvpress_full with stats from the last 40 prompt queries only",
    "question_kept": "kvpress protocol: context-only stats and scores (rotation from the context's end), "
                     "question tokens never evicted, same total budget",
    "snapkv_window32": "attention of the last 32 prompt queries (post-RoPE, causal), summed over them and the "
                       "KV head's query heads, no pooling",
    "vtoken_plus_needle": "vtoken's kept set plus the needle's value tokens (budget + up to 7 tokens)",
}


# ------------------------------------------------------------------ scoring (no model needed)
def rope_table(head_size: int, theta: float, n_pos: int) -> torch.Tensor:
    """float64 ``[n_pos, head_size]``: per position RoPE's cosines of the ``head_size / 2`` pairs,
    then their sines (vLLM's ``cos_sin_cache`` layout, what ``future_rotation`` reads)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size))
    ang = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv_freq
    return torch.cat([torch.cos(ang), torch.sin(ang)], dim=1)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[M, H, D]``, token ``m`` at position ``m``) by RoPE: pair ``(a, b)`` turns by
    its angle, ``x_a' = x_a cos - x_b sin``, ``x_b' = x_b cos + x_a sin``. Returns ``x``'s dtype."""
    h = a.numel()
    c = cos_sin[:x.shape[0], :h][:, None, :].to(x.dtype)
    s = cos_sin[:x.shape[0], h:][:, None, :].to(x.dtype)
    out = torch.empty_like(x)
    out[..., a] = x[..., a] * c - x[..., b] * s
    out[..., b] = x[..., b] * c + x[..., a] * s
    return out


def averaged_rotation(cos_sin: torch.Tensor, start: int, n_future: int, a: torch.Tensor,
                      b: torch.Tensor) -> torch.Tensor:
    """float64 ``[D, D]``: the mean of RoPE's rotation matrices over positions
    ``start .. start + n_future - 1`` (those past the table left out): block-diagonal in the pairs,
    each block ``[[c, -s], [s, c]]`` with ``c``, ``s`` the pair's mean cosine and sine."""
    d = cos_sin.shape[1]
    rows = cos_sin[start:start + n_future].to(torch.float64)
    c, s = rows[:, :d // 2].mean(0), rows[:, d // 2:].mean(0)
    rot = torch.zeros(d, d, dtype=torch.float64)
    rot[a, a], rot[b, b], rot[a, b], rot[b, a] = c, c, -s, s
    return rot


def pair_block_mask(d: int, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bool ``[D, D]``: the entries of a ``D x D`` matrix inside RoPE's 2x2 pair blocks."""
    m = torch.zeros(d, d, dtype=torch.bool)
    m[a, a] = m[b, b] = m[a, b] = m[b, a] = True
    return m


def expected_attention_scores(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, q_sel: torch.Tensor,
                              cos_sin: torch.Tensor, start: int, a: torch.Tensor, b: torch.Tensor, *,
                              blocks: str = "full", sinks_in_softmax: bool = False, sink: int = SINK,
                              n_future: int = N_FUTURE) -> torch.Tensor:
    """Expected Attention (arXiv 2510.00636, Sec. 3), written out with a ``D x D`` covariance.

    The future query of each query head is modelled as Gaussian with the mean ``mu`` and the
    (biased) covariance ``S`` of the head's pre-RoPE queries ``q[q_sel]``, moved to the positions to
    come by the rotation ``R`` averaged over ``start .. start + n_future - 1``
    (:func:`averaged_rotation`): ``mu' = R mu``, ``S' = R S R^T``. A key ``k``'s logit is the log of
    the Gaussian's moment-generating function, ``mu'.k / sqrt(D) + k^T S' k / (2 D)``; the logits
    are normalized over the keys (a softmax per query head), averaged over the KV head's query
    heads and multiplied by the value's L2 norm.

    Args:
        q: ``[L, Hq, D]`` pre-RoPE queries.
        keys, vals: ``[Hkv, N, D]`` post-RoPE keys and the values (``N`` <= ``L``).
        q_sel: int64 indices into ``q``'s first dimension: the queries in the statistics.
        cos_sin: :func:`rope_table`; ``start``: the first future position.
        a, b: RoPE's pairs (``rope_pairs``).
        blocks: ``"full"``: the whole covariance; ``"pair"``: only its 2x2 pair blocks.
        sinks_in_softmax: the first ``sink`` keys take part in the softmax (vToken) or not (kvpress).

    Returns:
        float64 ``[Hkv, N]``; the first ``sink`` entries ``+inf`` (always kept).
    """
    if blocks not in ("full", "pair"):
        raise ValueError(f"blocks = {blocks!r}; allowed: 'full', 'pair'")
    hkv, n, d = keys.shape
    hq = q.shape[1]
    g = hq // hkv
    sel = q[q_sel].to(torch.float64)  # [M, Hq, D]
    mu = sel.mean(0)  # [Hq, D]
    dev = sel - mu
    cov = torch.einsum("mhi,mhj->hij", dev, dev) / sel.shape[0]  # [Hq, D, D]
    if blocks == "pair":
        cov = cov * pair_block_mask(d, a, b)
    rot = averaged_rotation(cos_sin, start, n_future, a, b)
    mu_f = mu @ rot.T
    cov_f = rot @ cov @ rot.T
    first = 0 if sinks_in_softmax else sink
    k = keys[:, first:].to(torch.float64).repeat_interleave(g, 0)  # [Hq, N', D]
    logits = torch.einsum("hnd,hd->hn", k, mu_f) / math.sqrt(d) + ((k @ cov_f) * k).sum(-1) / (2 * d)
    p = torch.softmax(logits, dim=-1).view(hkv, g, -1).mean(1)  # [Hkv, N']
    p = p * vals[:, first:].to(torch.float64).norm(dim=-1)
    if sinks_in_softmax:
        p = p[:, sink:]
    return torch.cat([torch.full((hkv, sink), float("inf"), dtype=torch.float64), p], dim=1)


def vtoken_scores(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, cos_sin: torch.Tensor,
                  a: torch.Tensor, b: torch.Tensor, *, sink: int = SINK, n_future: int = N_FUTURE) -> torch.Tensor:
    """vToken's own Expected Attention on one request's prompt, as its policy computes it after the
    prompt: the moment sums of the queries ``sink .. L-1`` (``pair_terms``), the rotation from
    ``future_rotation`` at position ``L``, every key live (the sinks in the softmax).

    Args and returns as :func:`expected_attention_scores` (``N`` = ``L``)."""
    n = keys.shape[1]
    sel = q[sink:].to(torch.float64)
    qsum = sel.sum(0)[None]
    qpair = pair_terms(sel, a, b).sum(0)[None]
    cos_bar, sin_bar = future_rotation(cos_sin, torch.tensor([n]), n_future)
    sc = expected_attention(keys[None].to(torch.float32), torch.tensor([n]), qsum, qpair, torch.tensor([n - sink]),
                            cos_bar, sin_bar, a, b, vnorm=vals.norm(dim=-1)[None])[0]
    sc[:, :sink] = float("inf")
    return sc


def snapkv_scores(q_rot: torch.Tensor, keys: torch.Tensor, window: int = WINDOW, sink: int = SINK) -> torch.Tensor:
    """SnapKV-like: each key's softmax attention from the last ``window`` queries (post-RoPE
    ``q_rot`` ``[L, Hq, D]``, causal), summed over those queries and the KV head's query heads (no
    pooling). float64 ``[Hkv, L]``; the first ``sink`` ``+inf``."""
    hkv, n, d = keys.shape
    hq = q_rot.shape[1]
    qw = q_rot[n - window:].permute(1, 0, 2).to(torch.float64)  # [Hq, W, D]
    k = keys.to(torch.float64).repeat_interleave(hq // hkv, 0)  # [Hq, L, D]
    logits = qw @ k.transpose(1, 2) / math.sqrt(d)
    future = torch.arange(n)[None, :] > torch.arange(n - window, n)[:, None]  # [W, L]
    att = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
    sc = att.sum(1).view(hkv, hq // hkv, n).sum(1)
    sc[:, :sink] = float("inf")
    return sc


def keep_mask(score: torch.Tensor, fraction: float, sink: int = SINK) -> torch.Tensor:
    """bool mask, ``score``'s shape ``[..., L]``: per row the ``max(ceil(fraction * L), sink)``
    highest-scoring tokens (at most ``L``), the first ``sink`` always among them.

    Ties: among equal scores the later position is kept (the earlier one is evicted first, as
    vToken breaks ties); a NaN score counts as ``-inf``. The sinks count in the budget."""
    n_tok = score.shape[-1]
    n_keep = min(n_tok, max(math.ceil(fraction * n_tok), sink))
    s = score.to(torch.float64).clone()
    s[torch.isnan(s)] = float("-inf")
    s[..., :sink] = float("inf")
    # a stable descending sort of the reversed row puts the later of equal scores first
    order = torch.sort(s.flip(-1), dim=-1, descending=True, stable=True).indices[..., :n_keep]
    mask = torch.zeros(s.shape, dtype=torch.bool)
    mask.scatter_(-1, n_tok - 1 - order, True)
    return mask


def rel_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |x - ref| / max |ref|`` over finite ``ref`` entries."""
    ok = torch.isfinite(ref)
    return ((x[ok] - ref[ok]).abs().max() / ref[ok].abs().max()).item()


# ------------------------------------------------------------------ model (main only)
def _spans(prompt: str, offsets: list[tuple[int, int]], doc: dict[str, Any]) -> tuple[list[int], list[int]]:
    """Token indices of the needle's value and of the question (from its first word to the end)."""
    vs = prompt.index(doc["value"])
    ve = vs + len(doc["value"])
    needle = [i for i, (s, e) in enumerate(offsets) if s < ve and e > vs]
    qs = prompt.index("What is the special magic number")
    question = [i for i, (s, e) in enumerate(offsets) if e > qs]
    return needle, question


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--length", type=int, default=1000, help="filler tokens per prompt (about)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.125, 0.25, 0.5, 0.75],
                    help="kept share of each prompt per (layer, KV head)")
    ap.add_argument("--name", default="ea_probe")
    a = ap.parse_args(argv)

    torch.set_num_threads(1)
    import transformers.models.llama.modeling_llama as llama
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench_same_tokens import needle_chat_prompt, needle_prompts
    from vtoken.assets.paths import smollm2_dir

    doc: dict[str, Any] = dict(
        bench="probe_expected_attention",
        command="python " + shlex.join(["benchmarks/probe_expected_attention.py"] + argv),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        machine=machine_info(), loadavg_before=list(os.getloadavg()),
        settings=dict(prompts=a.prompts, length=a.length, seed=a.seed, fractions=a.fractions, model="SmolLM2-135M",
                      backend="transformers, fp32, eager attention, 1 torch thread", sink=SINK, n_future=N_FUTURE,
                      window=WINDOW, question_queries=QUESTION_QUERIES, gen_tokens=GEN_TOKENS, greedy=True,
                      eviction="once after the prefill, per (layer, KV head); the first token from the full cache"),
        methods=METHODS)
    t0 = time.time()

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    cfg = model.config
    n_layers, hq, hkv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    g = hq // hkv
    rp = getattr(cfg, "rope_parameters", None)
    theta = rp["rope_theta"] if rp else cfg.rope_theta
    cos_sin = rope_table(d, theta, cfg.max_position_embeddings)
    pa, pb = rope_pairs(d, True)  # Llama rotates halves

    # evicted prompt keys: per layer an additive [Hq, L] bias (-inf where evicted) on the first L keys
    bias_by_layer: dict[int, torch.Tensor] = {}
    plain_eager = llama.eager_attention_forward

    def masked_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        bias = bias_by_layer.get(module.layer_idx)
        if bias is None:
            return plain_eager(module, query, key, value, attention_mask, scaling, dropout, **kw)
        n_k = key.shape[2]
        full = torch.zeros(1, hq, query.shape[2], n_k, dtype=query.dtype)
        full[..., :bias.shape[1]] = bias[None, :, None, :]
        if attention_mask is not None:
            full = full + attention_mask[..., :n_k]
        return plain_eager(module, query, key, value, full, scaling, dropout, **kw)

    llama.eager_attention_forward = masked_eager

    # each layer's attention input (after input_layernorm) during the prefill
    attn_in: dict[int, torch.Tensor] = {}

    def grab(i):
        def hook(mod, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            if h.shape[1] > 1:
                attn_in[i] = h.detach()
        return hook

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(grab(i), with_kwargs=True)

    def decode(cache, first: int, mask: Optional[torch.Tensor]) -> str:
        """``GEN_TOKENS`` greedy tokens after ``first``; ``mask`` ``[layers, Hkv, L]`` of the prompt
        keys kept (None: the full cache)."""
        bias_by_layer.clear()
        if mask is not None:
            for li in range(n_layers):
                bias = torch.zeros(hq, mask.shape[-1])
                bias[~mask[li].repeat_interleave(g, 0)] = float("-inf")
                bias_by_layer[li] = bias
        toks = [first]
        with torch.no_grad():
            for _ in range(GEN_TOKENS - 1):
                out = model(torch.tensor([[toks[-1]]]), past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                toks.append(int(out.logits[0, -1].argmax()))
        bias_by_layer.clear()
        return tok.decode(toks)

    docs = needle_prompts(a.prompts, a.length, a.seed)
    fkeys = [str(f) for f in a.fractions]
    per = {m: {f: [] for f in fkeys} for m in METHODS}  # per-prompt rows
    full_rows, prompts_info = [], []
    max_rel = 0.0
    bar = tqdm(docs, desc="prompts", unit="prompt")
    for doc_i in bar:
        prompt = needle_chat_prompt(tok, doc_i)
        enc = tok(prompt, return_offsets_mapping=True, return_tensors="pt")
        ids, offsets = enc.input_ids, [tuple(x) for x in enc.offset_mapping[0].tolist()]
        L = ids.shape[1]
        needle, question = _spans(prompt, offsets, doc_i)
        nc = question[0]  # context length (question_kept)
        attn_in.clear()
        bias_by_layer.clear()
        with torch.no_grad():
            out = model(ids, use_cache=True)
        pkv = out.past_key_values
        first = int(out.logits[0, -1].argmax())

        scores: dict[str, list[torch.Tensor]] = {m: [] for m in METHODS if m != "vtoken_plus_needle"}
        for li in range(n_layers):
            with torch.no_grad():
                q = model.model.layers[li].self_attn.q_proj(attn_in[li][0]).view(L, hq, d)
            keys, vals = pkv.layers[li].keys[0], pkv.layers[li].values[0]  # [Hkv, L, D]
            prompt_q = torch.arange(SINK, L)
            scores["kvpress_full"].append(expected_attention_scores(q, keys, vals, prompt_q, cos_sin, L, pa, pb))
            scores["pair_blocks"].append(
                expected_attention_scores(q, keys, vals, prompt_q, cos_sin, L, pa, pb, blocks="pair"))
            vt = vtoken_scores(q, keys, vals, cos_sin, pa, pb)
            scores["vtoken"].append(vt)
            ref = expected_attention_scores(q, keys, vals, prompt_q, cos_sin, L, pa, pb, blocks="pair",
                                            sinks_in_softmax=True)
            max_rel = max(max_rel, rel_diff(vt, ref))
            scores["question_stats"].append(expected_attention_scores(
                q, keys, vals, torch.arange(L - QUESTION_QUERIES, L), cos_sin, L, pa, pb))
            ctx = expected_attention_scores(q[:nc], keys[:, :nc], vals[:, :nc], torch.arange(SINK, nc),
                                            cos_sin, nc, pa, pb)
            scores["question_kept"].append(
                torch.cat([ctx, torch.full((hkv, L - nc), float("inf"), dtype=torch.float64)], dim=1))
            scores["snapkv_window32"].append(snapkv_scores(apply_rope(q, cos_sin, pa, pb), keys))
        stacked = {m: torch.stack(v) for m, v in scores.items()}  # [layers, Hkv, L]

        for f, fk in zip(a.fractions, fkeys):
            masks = {m: keep_mask(s, f) for m, s in stacked.items()}
            plus = masks["vtoken"].clone()
            plus[..., needle] = True
            masks["vtoken_plus_needle"] = plus
            for m in METHODS:
                mk = masks[m]
                answer = decode(copy.deepcopy(pkv), first, mk)
                per[m][fk].append(dict(correct=doc_i["value"] in answer.replace(" ", ""),
                                       needle_kept=mk[..., needle].float().mean().item(),
                                       question_kept=mk[..., question].float().mean().item(),
                                       kept_tokens=int(mk.sum().item()), answer=answer))
        answer = decode(pkv, first, None)
        full_rows.append(dict(correct=doc_i["value"] in answer.replace(" ", ""), answer=answer))
        prompts_info.append(dict(tokens=L, value=doc_i["value"], depth=doc_i["depth"], needle_tokens=len(needle),
                                 question_tokens=len(question), context_tokens=nc))
        bar.set_postfix(vtoken_rel_diff=f"{max_rel:.1e}",
                        kvpress_half=sum(r["correct"] for r in per["kvpress_full"].get("0.5", [])),
                        snapkv_half=sum(r["correct"] for r in per["snapkv_window32"].get("0.5", [])))
    llama.eager_attention_forward = plain_eager

    def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
        n = len(rows)
        return dict(correct=sum(r["correct"] for r in rows), n=n,
                    needle_kept=round(sum(r["needle_kept"] for r in rows) / n, 4),
                    question_kept=round(sum(r["question_kept"] for r in rows) / n, 4),
                    per_prompt=[dict(r, needle_kept=round(r["needle_kept"], 4),
                                     question_kept=round(r["question_kept"], 4)) for r in rows])

    doc["prompts"] = prompts_info
    doc["results"] = dict(
        full_cache=dict(correct=sum(r["correct"] for r in full_rows), n=len(full_rows), per_prompt=full_rows),
        vtoken_vs_reimpl_max_rel_diff=max_rel,
        methods={m: {fk: summary(per[m][fk]) for fk in fkeys} for m in METHODS})
    doc["loadavg_after"] = list(os.getloadavg())
    doc["total_wall_s"] = round(time.time() - t0, 1)
    out_path = RESULTS / f"{a.name}.json"
    out_path.write_text(json.dumps(doc, indent=1) + "\n")

    print(f"full cache {doc['results']['full_cache']['correct']}/{len(full_rows)}; "
          f"vtoken vs reimplementation max rel diff {max_rel:.2e}")
    print(f"{'method':20s} " + " ".join(f"{fk:>18s}" for fk in fkeys) + "   (correct/n needle% question%)")
    for m in METHODS:
        cells = [doc["results"]["methods"][m][fk] for fk in fkeys]
        print(f"{m:20s} " + " ".join(f"{c['correct']}/{c['n']} {100 * c['needle_kept']:5.1f} {100 * c['question_kept']:5.1f}"
                                     .rjust(18) for c in cells))
    print(f"wrote {out_path} ({doc['total_wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
