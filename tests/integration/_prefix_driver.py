"""Engine driver for the prefix-caching tests (``test_prefix_caching.py``); run in a fresh process.

``python tests/integration/_prefix_driver.py SPEC.json OUT.json``. One in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``VTOKEN_CHECK=1``) runs ``phases`` one after the
other (a phase starts when every request of the previous one has finished; its requests
arrive together, or ``arrive_after`` engine steps into the phase).

After every engine step (with ``"digests": true``, sync scheduling only) it hashes the
contents (every layer's K and V) of every block that a request holds and that has a block
hash, keyed by (block id, block hash), and fails the run if a block's contents change while
it keeps its hash: a repack that wrote a cached or shared block, or stale KV a later request
could hit. It also records the largest ``ref_cnt`` seen (sharing really happened).

Spec: ``{"engine": {LLM kwargs}, "vtoken": {...}, "phases": [[{"id", "prompt_token_ids",
"max_tokens", "extra_args", "arrive_after", "continue"}, ...], ...], "digests": bool}``; a request
with ``"continue": ID`` is a next turn: its prompt is ID's prompt + ID's answer + its own tokens.
Output: ``tokens``, ``num_cached_tokens`` (``RequestOutput.num_cached_tokens``), ``finished``
(vToken's lifetime figures per request: ``protected``, ``cached_tokens``, ``evicted`` ...),
``free_start``, ``free_after_phase`` (one per phase), ``max_ref_cnt``, ``shared_steps`` (steps
with a block held by two or more requests), ``digest_checks``, ``stats``, ``paths``, ``prompts``
(every request's prompt as submitted).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's drivers/ (run as a script)


def _block_digest(caches, block_id: int) -> str:
    h = hashlib.sha1()
    for t in caches:
        h.update(t[block_id].contiguous().view(-1).numpy().tobytes())
    return h.hexdigest()


def run(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ["VTOKEN_CHECK"] = "1"
    os.environ["VTOKEN_RECORD_FINISHED"] = "1"  # the finished requests' records (out["finished"])
    from vllm import LLM, SamplingParams

    from drivers.harness import _execution_path

    kw = dict(spec["engine"], seed=0, additional_config={"vtoken": spec["vtoken"]})
    llm = LLM(**kw)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    sched = core.scheduler
    pool = sched.kv_cache_manager.block_pool
    mgr = sched._vt_mgr
    caches = None
    if spec.get("digests"):
        runner = core.model_executor.driver_worker.worker.model_runner
        caches = [t for t, _ in runner._vt.kv_caches()]
    out: dict[str, Any] = dict(tokens={}, num_cached_tokens={}, free_start=pool.get_num_free_blocks(),
                               free_after_phase=[], max_ref_cnt=0, shared_steps=0, digest_checks=0)
    digests: dict[tuple, str] = {}
    prompts: dict[str, list] = {}
    for phase in spec["phases"]:
        pending = sorted(phase, key=lambda r: r.get("arrive_after", 0))
        step = 0
        while pending or engine.has_unfinished_requests():
            while pending and pending[0].get("arrive_after", 0) <= step:
                r = pending.pop(0)
                if r.get("continue"):  # a next turn: that request's prompt + its answer + these tokens
                    prev = r["continue"]
                    r["prompt_token_ids"] = prompts[prev] + out["tokens"][prev] + r["prompt_token_ids"]
                prompts[r["id"]] = r["prompt_token_ids"]
                sp = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False,
                                    extra_args=r.get("extra_args") or None)
                engine.add_request(r["id"], {"prompt_token_ids": r["prompt_token_ids"]}, sp)
            step += 1
            if step > 4000:
                raise RuntimeError("prefix driver: no progress")
            for o in engine.step():
                out["tokens"][o.request_id] = list(o.outputs[0].token_ids)
                if o.finished:
                    out["num_cached_tokens"][o.request_id] = o.num_cached_tokens
            held = [b for blocks in mgr.req_to_blocks.values() for b in blocks]
            if held:
                m = max(b.ref_cnt for b in held)
                out["max_ref_cnt"] = max(out["max_ref_cnt"], m)
                out["shared_steps"] += m > 1
            if caches is not None:
                for b in {b.block_id: b for b in held}.values():
                    if b.block_hash is None:
                        continue
                    key = (b.block_id, repr(b.block_hash))
                    d = _block_digest(caches, b.block_id)
                    if digests.setdefault(key, d) != d:
                        raise AssertionError(f"block {b.block_id} changed while it keeps its hash (ref_cnt {b.ref_cnt})")
                    out["digest_checks"] += 1
        out["free_after_phase"].append(pool.get_num_free_blocks())
    # vLLM appends a random suffix to the request id inside the engine ("A" -> "A-1a2b3c4d")
    out["finished"] = {f["req_id"].rsplit("-", 1)[0]: f for f in sched.vt_finished}
    out["stats"] = sched.vt_stats.as_dict()
    out["paths"] = _execution_path(llm, core)
    out["prompts"] = prompts
    return out


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(spec)))
