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
"max_tokens", "extra_args", "arrive_after", "continue", "abort_after"}, ...], ...], "digests": bool,
"kv_events": "tcp://127.0.0.1:PORT"}``; a request with ``"continue": ID`` is a next turn: its prompt
is ID's prompt + ID's answer + its own tokens; ``"abort_after": N`` aborts it N steps after it arrived.

With ``kv_events`` the engine publishes vLLM's KV-cache events (``--kv-events-config``, ZMQ
publisher bound there) and the driver subscribes to them as a KV-aware router would: after every
step it reads every batch published so far, keeps the multiset of (block hash, group) that the
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events describe, and compares it with
the block pool's own hash map (``BlockPool.cached_block_hash_to_block``); ``kv_events`` in the
output counts the checks, the mismatches (with the first ones) and every stored block's token ids
(block hash -> token ids) for the test to check against the prompts.
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

# this checkout's vtoken/ and tests/ (drivers/, reference/), run as a script
sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]


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
    if spec.get("kv_events"):
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                endpoint=spec["kv_events"], replay_endpoint=spec["kv_events_replay"],
                                                topic="kv")
        router = _Router(spec["kv_events"], spec["kv_events_replay"])  # (binds: a publisher given a host address connects)
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
    if spec.get("kv_events"):
        router.attach(sched)
    else:
        router = None
    aborts: dict[str, int] = {}
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
                if r.get("abort_after") is not None:
                    aborts[r["id"]] = step + r["abort_after"]
            for rid in [rid for rid, at in aborts.items() if at <= step]:
                engine.abort_request([rid])
                del aborts[rid]
                out.setdefault("aborted", []).append(rid)
            step += 1
            if step > 4000:
                raise RuntimeError("prefix driver: no progress")
            for o in engine.step():
                out["tokens"][o.request_id] = list(o.outputs[0].token_ids)
                if o.finished:
                    out["num_cached_tokens"][o.request_id] = o.num_cached_tokens
            if router is not None:
                router.check(pool)
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
    if router is not None:
        out["kv_events"] = router.result()
    return out


class _Router:
    """A KV-aware router's view of the engine: vLLM's own ZMQ publisher, subscribed to."""

    def __init__(self, endpoint: str, replay_endpoint: str):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.published = 0
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.bind(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self.received = 0
        self.held: dict[tuple, int] = {}  # (block hash, group) -> blocks that carry it
        self.tokens: dict[str, list[int]] = {}  # block hash (hex) -> its token ids
        self.checks = self.mismatches = self.stored = self.removed = 0
        self.first: list[str] = []
        self.next_seq = self.replayed = 0
        self.replay_endpoint = replay_endpoint

    def attach(self, sched) -> None:
        import time

        pub = sched.kv_event_publisher
        orig = pub.publish

        def publish(batch):  # (counts the batches, so a check waits for all of them)
            self.published += 1
            return orig(batch)

        pub.publish = publish
        time.sleep(0.5)  # (PUB drops what it publishes before the subscription reaches it; replayed then)

    def _drain(self) -> None:
        """Read every published batch in sequence order. PUB/SUB may drop a batch (e.g. before the
        subscription reached the publisher): a gap, or batches still missing after a wait, are
        asked again from the publisher's replay socket, as a router does (``replayed``)."""
        import time

        import zmq

        end = time.monotonic() + 10.0
        wait_until = time.monotonic() + 0.5
        while self.received < self.published:
            if self.sub.poll(50):
                _topic, seq, payload = self.sub.recv_multipart(zmq.NOBLOCK)
                seq = int.from_bytes(seq, "big")
                if seq > self.next_seq:
                    self._replay(seq)
                self._apply(seq, payload)
            elif time.monotonic() > wait_until:
                self._replay(None)
                wait_until = time.monotonic() + 0.5
            if time.monotonic() > end:
                raise RuntimeError(f"kv events: {self.published - self.received} batches never arrived")

    def _replay(self, upto) -> None:
        """Ask the replay socket for the batches from :attr:`next_seq` (before ``upto``)."""
        import zmq

        req = zmq.Context.instance().socket(zmq.DEALER)  # (several replies to one request)
        req.connect(self.replay_endpoint)
        try:
            req.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
            while req.poll(5000):
                _, topic, seq, payload = req.recv_multipart()
                if not payload and not topic:  # (the end marker)
                    break
                seq = int.from_bytes(seq, "big")
                if upto is None or seq < upto:
                    self.replayed += int(seq >= self.next_seq)
                    self._apply(seq, payload)
        finally:
            req.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return  # (already read: a replayed batch that also arrived live)
        if seq != self.next_seq:
            raise RuntimeError(f"kv events: batch {seq} before {self.next_seq}")
        self.next_seq += 1
        self.received += 1
        for ev in self.decode(payload).events:
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                self.held.clear()
                continue
            for h in ev.block_hashes:
                key = (h.hex() if isinstance(h, bytes) else str(h), ev.group_idx or 0)
                if kind == "BlockStored":
                    self.held[key] = self.held.get(key, 0) + 1
                    self.stored += 1
                elif kind == "BlockRemoved":
                    self.held[key] = self.held.get(key, 0) - 1
                    self.removed += 1
                    if not self.held[key]:
                        del self.held[key]
            if kind == "BlockStored":
                bs = ev.block_size
                for i, h in enumerate(ev.block_hashes):
                    self.tokens[h.hex() if isinstance(h, bytes) else str(h)] = list(ev.token_ids[i * bs:(i + 1) * bs])

    def check(self, pool) -> None:
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash

        self._drain()
        want: dict[tuple, int] = {}
        for key, blocks in pool.cached_block_hash_to_block._cache.items():
            h = maybe_convert_block_hash(get_block_hash(key))
            k = (h.hex() if isinstance(h, bytes) else str(h), get_group_id(key))
            want[k] = 1 if not isinstance(blocks, dict) else len(blocks)
        self.checks += 1
        if want != self.held:
            self.mismatches += 1
            if len(self.first) < 3:
                only_pool = sorted(set(want) - set(self.held))[:3]
                only_ev = sorted(set(self.held) - set(want))[:3]
                self.first.append(f"check {self.checks}: pool-only {only_pool}, events-only {only_ev}")

    def result(self) -> dict[str, Any]:
        return dict(checks=self.checks, mismatches=self.mismatches, first=self.first, stored=self.stored,
                    removed=self.removed, batches=self.received, replayed=self.replayed, held=len(self.held), tokens=self.tokens)


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(spec)))
