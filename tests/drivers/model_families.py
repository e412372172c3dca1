"""The model-family matrix (issue 43): one engine per (family, execution path), four requests in
one batch (H2O and K-norm, each under ``head`` and ``request`` token sets, chosen per request
with ``vtoken_policy`` / ``vtoken_granularity``), every request's greedy tokens against the dense
oracle (:func:`reference.oracle.oracle_generate` on the transformers model of the same weights).

Used by ``tests/integration/test_model_families.py`` and by
``PYTHONPATH=tests python -m drivers.model_families [--paths v1-sync,mrv2-async] [FAMILY ...]``, which runs the
matrix and writes :data:`RESULTS` (the docs' "Models" tables are rendered from it by
``benchmarks/doc_tables.py``; ``tests/test_docs.py`` checks they agree, and the engine tests
check every committed row against what they observe).

A family vToken refuses at start-up is listed in :data:`REFUSED` with the refusal's words; its
row then records the refusal instead of tokens.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "model_families.json"

BASE_VTOKEN = {"policy": "h2o", "budget": 48}
#: (policy, token sets) per request
ARMS = [("h2o", "head"), ("h2o", "request"), ("knorm", "head"), ("knorm", "request")]
PROMPT_LEN = 160
NEW_TOKENS = 24
BLOCK = 32

#: family -> words the start-up refusal must contain (vToken refuses these models by name, before
#: any weights load; the refusal does not depend on the execution path, so only V1 sync runs them)
REFUSED: dict[str, str] = {
    "gemma2": "--model = 'tiny-gemma2': vToken does not support it yet (attention logit soft-capping (model feature); "
              "attn_logit_softcapping=50.0",
    "mistral_swa": "--model = 'tiny-mistral_swa': vToken does not support it yet (sliding-window or mixed layer types (model "
                   "feature); sliding_window=64",
}


#: Expected Attention (two more requests in the batch: head and request sets) needs one full, plain
#: or Llama 3 RoPE in a vLLM rotary layer; on these families vToken refuses it (engine policy at
#: start-up, a request's vtoken_policy with a 400) with these words
EA_REFUSED: dict[str, str] = {
    "olmo2": "its RoPE inside vLLM's Transformers modeling backend",
    "gpt_neox": "its RoPE inside vLLM's Transformers modeling backend",
    "phi": "partial_rotary_factor = 0.5",
    "gptj": "no rotary position embedding (rope_theta)",
    "gpt2": "no rotary position embedding (rope_theta)",
}
EA_ARMS = [("expected_attention", "head"), ("expected_attention", "request")]


def arms_of(family: str) -> list[tuple[str, str]]:
    """(policy, token sets) of the family's requests: :data:`ARMS`, plus :data:`EA_ARMS` where
    Expected Attention runs."""
    return ARMS + ([] if family in EA_REFUSED or family in REFUSED else EA_ARMS)


def paths_of(family: str) -> list[str]:
    """The execution paths the matrix runs ``family`` on."""
    return ["v1-sync"] if family in REFUSED else ["v1-sync", "mrv2-async"]


def prompt(i: int, n: int = PROMPT_LEN) -> list[int]:
    """Deterministic byte-range token ids (the tiny byte tokenizer's real tokens)."""
    return [((i + 3) * 37 + j * (11 + i % 5)) % 250 + 1 for j in range(n)]


def requests(family: str) -> list[dict]:
    return [dict(id=f"{p}-{g}", prompt_token_ids=prompt(k), max_tokens=NEW_TOKENS,
                 extra_args={"vtoken_policy": p, "vtoken_granularity": g})
            for k, (p, g) in enumerate(arms_of(family))]


def engine_kwargs(model: str) -> dict:
    return dict(model=model, dtype="float32", max_model_len=512, block_size=BLOCK, enforce_eager=True,
                gpu_memory_utilization=0.1, num_gpu_blocks_override=64, skip_tokenizer_init=True)


def run_engine(family: str, path: str, vtoken: dict | None = None) -> dict[str, Any]:
    """One engine run of ``family`` on execution ``path`` (``vtoken``: the engine's config, default
    :data:`BASE_VTOKEN`): the harness output, or ``{"refused": message}`` when the engine refused
    to start (a ``RuntimeError`` from the harness whose log holds "vToken does not support it yet")."""
    from drivers.harness import run_in_subprocess
    from vtoken.assets.paths import ensure_family_model

    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from execution_paths import path_env

    model = str(ensure_family_model(family))
    t0 = time.perf_counter()
    try:
        out = run_in_subprocess(dict(engine=engine_kwargs(model), vtoken=vtoken or BASE_VTOKEN,
                                     requests=requests(family)), env=path_env(path))
    except RuntimeError as e:
        msg = str(e)
        if "vToken does not support it yet" not in msg:
            raise
        line = next(ln for ln in msg.splitlines()[::-1] if "vToken does not support it yet" in ln)
        starts = [line.find(w) for w in ("--model = ", "vtoken.policy = ") if w in line]
        line = line[min(starts):] if starts else line.strip()
        # the model's directory depends on the machine ($VTOKEN_HOME): name it by its asset name
        return {"refused": line.replace(model, f"tiny-{family}"),
                "engine_s": round(time.perf_counter() - t0, 1)}
    out["engine_s"] = round(time.perf_counter() - t0, 1)
    return out


_models: dict[str, Any] = {}


def oracle_tokens(family: str, evict: bool = True) -> dict[str, list[int]]:
    """The dense oracle's greedy tokens for every request of :func:`requests` (request id -> ids);
    ``evict=False``: without eviction (the full cache), to show that eviction changes the tokens."""
    import torch

    from vtoken.assets.paths import ensure_family_model
    from vtoken.config import parse_config, parse_request_overrides
    from reference.oracle import load_oracle_model, oracle_generate

    torch.set_num_threads(2)
    if family not in _models:
        _models.clear()
        _models[family] = load_oracle_model(str(ensure_family_model(family)))
    base = parse_config(BASE_VTOKEN)
    return {r["id"]: list(oracle_generate(_models[family], r["prompt_token_ids"], NEW_TOKENS,
                                          parse_request_overrides(r["extra_args"]).apply(base) if evict else None
                                          ).token_ids)
            for r in requests(family)}


def eviction_changes(family: str, ref: dict[str, list[int]]) -> dict[str, bool]:
    """Per request: do the oracle's tokens with eviction differ from the full cache's (so an
    engine that ignored the decisions, or made others, would be caught)?"""
    full = oracle_tokens(family, evict=False)
    return {rid: ref[rid] != full[rid] for rid in ref}


def row(family: str, path: str, out: dict, ref: dict[str, list[int]] | None) -> dict:
    """What the matrix records for one (family, path): ``status`` ``"exact"`` (every request's
    tokens equal the oracle's), ``"mismatch"`` or ``"refused"``, per request the first differing
    token (None: equal), the tokens evicted, the engine's wall time."""
    if "refused" in out:
        return {"status": "refused", "refusal": out["refused"], "engine_s": out["engine_s"]}
    first = {}
    for rid, want in ref.items():
        got = out["tokens"][rid]
        first[rid] = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                          None if len(got) == len(want) else min(len(got), len(want)))
    return {"status": "exact" if all(v is None for v in first.values()) else "mismatch", "first_diff": first,
            "evicted_tokens": out["vtoken"]["stats"]["evicted_tokens"],
            "freed_blocks": out["vtoken"]["stats"]["freed_blocks"], "engine_s": out["engine_s"]}


def family_info(family: str) -> dict:
    from vtoken.assets.families import FAMILIES, make_config

    fam = FAMILIES[family]
    cfg = make_config(fam)
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    return {"label": fam.label, "config": fam.config_cls, "query_heads": hq, "kv_heads": hkv, "head_dim": hd, "what": fam.what}


def main(argv: list[str] | None = None) -> int:
    import argparse

    from vtoken.assets.families import FAMILIES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default="v1-sync,mrv2-async", help="comma-separated; empty: refresh the families' "
                    "descriptions and the oracle's eviction_changes_tokens only (no engine)")
    ap.add_argument("families", nargs="*", default=list(FAMILIES))
    a = ap.parse_args(argv)
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data.update({"command": "PYTHONPATH=tests python -m drivers.model_families", "budget": BASE_VTOKEN["budget"],
                 "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "block_size": BLOCK,
                 "arms": [f"{p}-{g}" for p, g in ARMS + EA_ARMS]})
    fams = data.setdefault("families", {})
    for family in a.families:
        entry = fams[family] = dict(family_info(family), paths=fams.get(family, {}).get("paths", {}))
        paths = entry["paths"]
        ref = None if family in REFUSED or a.paths else oracle_tokens(family)
        for path in [p for p in a.paths.split(",") if p and p in paths_of(family)]:
            out = run_engine(family, path)
            if "refused" not in out and ref is None:
                ref = oracle_tokens(family)
            paths[path] = row(family, path, out, ref)
            print(family, path, json.dumps(paths[path]), flush=True)
        entry["paths"] = {p: paths[p] for p in paths_of(family) if p in paths}
        if ref is not None:
            entry["eviction_changes_tokens"] = eviction_changes(family, ref)
        if family in EA_REFUSED and a.paths:
            out = run_engine(family, "v1-sync", {"policy": "expected_attention", "budget": BASE_VTOKEN["budget"]})
            entry["expected_attention_refusal"] = out.get("refused")
            print(family, "expected_attention", out.get("refused"), flush=True)
        RESULTS.write_text(json.dumps(data, indent=1) + "\n")  # after each family: a partial run keeps its rows
    data["families"] = {k: fams[k] for k in FAMILIES if k in fams}
    data = dict(sorted(data.items()))
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
