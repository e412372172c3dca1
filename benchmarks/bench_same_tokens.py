"""Same request, same tokens? Each needle prompt alone, then all of them in one batch, per dtype.

For each arm (``--dtypes`` x stock and ``--policy``), a fresh offline ``vllm.LLM`` on the local
SmolLM2 (prefix caching off, block size 32, eager) in its own process generates ``--prompts``
greedy answers twice: one ``generate`` call per prompt (each request alone), then one call with
every prompt (one batch). The vToken arm gives each request the budget ``ceil(--ratio x its prompt
tokens)`` (``vtoken_budget``), ``prefill_eviction: after``. Per arm: which prompts got the same
token ids both ways, both answers and whether each holds the needle.

The prompts are RULER ``niah_single_1``-style (lm-eval's task generates the same kind): a
7-digit number after a key, hidden at an even spread of depths in repeated filler of about
``--length`` tokens, then the question; the chat template applied and the answer's start
appended, as lm-eval's task does.

Writes ``benchmarks/results/<name>.json`` (default ``same_tokens``).

Usage::

    .venv/bin/python benchmarks/bench_same_tokens.py      # bf16 and fp32, stock and SnapKV at 25 % (~5 min)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"


def needle_prompts(n: int, length_tokens: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` needle documents: ``{text, key, value, depth}``, about ``length_tokens`` tokens of
    filler each (26 per line, SmolLM2's tokenizer); document ``i``'s needle sits at line
    ``round(i / (n - 1) * (lines - 1))`` of the filler, and ``depth`` is that line over ``lines - 1``
    (0 at the top, 1 at the bottom). Seeded: the same arguments give the same documents."""
    rng = random.Random(seed)
    lines = max(length_tokens // 26, 2)
    out = []
    for i in range(n):
        key = "-".join(rng.choice(["amber", "brisk", "cobalt", "dusky", "ember", "fable", "gusty", "hazel"])
                       for _ in range(2))
        value = str(rng.randrange(1_000_000, 10_000_000))
        at = round(i / max(n - 1, 1) * (lines - 1))
        body = [FILLER] * lines
        body.insert(at, f"One of the special magic numbers for {key} is: {value}.\n")
        text = ("A special magic number is hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the number afterwards.\n" + "".join(body)
                + f"What is the special magic number for {key} mentioned in the provided text?")
        out.append(dict(text=text, key=key, value=value, depth=at / (lines - 1)))
    return out


def needle_chat_prompt(tok: Any, doc: dict[str, Any]) -> str:
    """A :func:`needle_prompts` document as the model sees it: the user turn in the tokenizer's chat
    template, then the start of the answer (as lm-eval's RULER task appends it)."""
    return (tok.apply_chat_template([{"role": "user", "content": doc["text"]}], tokenize=False,
                                    add_generation_prompt=True)
            + f"The special magic number for {doc['key']} mentioned in the provided text is")


def one_arm(dtype: str, policy: str, a: argparse.Namespace) -> dict[str, Any]:
    """The arm in this process: answers alone, then in one batch."""
    from vllm import LLM, SamplingParams

    from vtoken.assets.paths import smollm2_dir

    docs = needle_prompts(a.prompts, a.length, a.seed)
    vt = None if policy == "stock" else {"vtoken": {"policy": policy, "prefill_eviction": "after"}}
    llm = LLM(model=str(smollm2_dir()), dtype=dtype, block_size=32, max_model_len=a.length + 512,
              enforce_eager=True, kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False,
              additional_config=vt or {})
    tok = llm.get_tokenizer()
    prompts = [needle_chat_prompt(tok, d) for d in docs]
    lens = [len(tok(p).input_ids) for p in prompts]
    sps = [SamplingParams(temperature=0, max_tokens=a.max_tokens,
                          extra_args=None if vt is None else {"vtoken_budget": math.ceil(a.ratio * n)})
           for n in lens]
    alone = [list(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids) for p, sp in zip(prompts, sps)]
    batch = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sps, use_tqdm=False)]
    rows = []
    for d, n, x, y in zip(docs, lens, alone, batch):
        ax, by = tok.decode(x), tok.decode(y)
        rows.append(dict(prompt_tokens=n, depth=round(d["depth"], 3), same=x == y, alone=ax, batch=by,
                         correct_alone=d["value"] in ax, correct_batch=d["value"] in by))
    return dict(dtype=dtype, policy=policy, budget_ratio=None if vt is None else a.ratio,
                same=sum(r["same"] for r in rows), n=len(rows), rows=rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024, help="filler tokens per prompt (about)")
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--ratio", type=float, default=0.25, help="each request's budget as a fraction of its prompt")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="same_tokens")
    ap.add_argument("--one", nargs=2, metavar=("DTYPE", "POLICY"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print("ARM " + json.dumps(one_arm(a.one[0], a.one[1], a)), flush=True)
        return 0
    from common import RESULTS, machine_info

    doc: dict[str, Any] = dict(bench="bench_same_tokens", command="python " + " ".join(["benchmarks/bench_same_tokens.py"] + argv),
                               date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                               machine=machine_info(), loadavg_before=list(os.getloadavg()),
                               settings=dict(prompts=a.prompts, length=a.length, policy=a.policy, ratio=a.ratio,
                                             max_tokens=a.max_tokens, seed=a.seed, prefix_caching=False,
                                             prefill_eviction="after", greedy=True), arms=[])
    t0 = time.time()
    arms = [(d, p) for d in a.dtypes for p in ("stock", a.policy)]
    for i, (dtype, policy) in enumerate(arms, 1):
        t = time.time()
        cmd = [sys.executable, __file__, *argv, "--one", dtype, policy]
        got = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        line = next((x for x in got.stdout.splitlines() if x.startswith("ARM ")), None)
        if line is None:
            sys.stderr.write(got.stdout[-3000:] + got.stderr[-3000:])
            raise SystemExit(f"arm {dtype} {policy} failed (exit {got.returncode})")
        arm = json.loads(line[4:])
        arm["wall_s"] = round(time.time() - t, 1)
        doc["arms"].append(arm)
        print(f"[{i}/{len(arms)}] {dtype:>8} {policy:>8}: same tokens alone and batched {arm['same']}/{arm['n']}, "
              f"correct alone {sum(r['correct_alone'] for r in arm['rows'])}, batched "
              f"{sum(r['correct_batch'] for r in arm['rows'])} ({arm['wall_s']} s)", flush=True)
    doc["loadavg_after"] = list(os.getloadavg())
    doc["total_wall_s"] = round(time.time() - t0, 1)
    out = RESULTS / f"{a.name}.json"
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
