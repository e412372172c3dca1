"""The worker's step, runner-neutral: decisions, moves, offsets, statistics.

Both model-runner adapters (``runner_v1.py`` for vLLM's V1 ``GPUModelRunner`` family,
``runner_v2.py`` for Model Runner V2) own one :class:`WorkerStep` and call it at
their runner's seams. Per step, before any KV write of the step:

1. :meth:`WorkerStep.begin_step` lets
   :class:`~vtoken.integrations.vllm.worker.eviction.WorkerEviction` select each evicting
   request's victims and applies the moves it plans in every layer (they may read blocks the
   scheduler freed in this step and already handed to another request: reading before any
   write keeps that safe), records the offsets (logical minus live tokens) and which requests
   want statistics; the adapter then truncates its block-table rows;
2. the adapter makes the slot mapping and attention's ``seq_lens`` physical with
   :meth:`batch_offsets` while positions stay logical (RoPE);
3. :meth:`start_scoring` arms :class:`~vtoken.integrations.vllm.worker.scoring.StepScores`, which the
   attention wrapper (:meth:`wrap_attention`) fills layer by layer;
4. :meth:`finish_step` folds them into the side cache; under tensor parallelism (each rank
   scores only its own ``Hq / TP`` query heads) it sums them over the TP group with one
   all-reduce first, so every rank holds the mean over **all** query heads and layers
   (:meth:`_reduce_over_tp`). No statistic leaves the worker;
5. :meth:`attach_naive_freed` hangs Naive-Evict's changed freed-block counts on the step's
   ``ModelRunnerOutput`` (directly, or through the async output object that produces it).

The backend's KV layout is reached only through
:class:`~vtoken.integrations.vllm.worker.kv_layout.KVLayout` (a ``layout_for(layer, kv_cache)``
factory given at construction).
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import os
import time
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch

from vtoken.policies.base import AttentionNeed
from vtoken.integrations.vllm.worker.kv_layout import CPULayerStack, KVLayout
from vtoken.integrations.vllm.protocol import ScoreMap, StepPayload
from vtoken.integrations.vllm.worker.scoring import StepScores
from vtoken.integrations.vllm.worker.eviction import WorkerEviction

logger = logging.getLogger("vllm.vtoken")

__all__ = ["WorkerStep"]

LayoutFactory = Callable[[Any, torch.Tensor], KVLayout]


def _set_attrs(obj: Any, attrs: dict[str, Any]) -> None:
    for k, v in attrs.items():
        setattr(obj, k, v)


class WorkerStep:
    """Per-worker vToken state shared by every runner adapter (module docstring).

    Args:
        forward_context: the runner's ``compilation_config.static_forward_context``
            (layer name -> attention layer), read for the KV caches and attention impls.
        layout_for: ``(layer, kv_cache) -> KVLayout`` for the attention backend in use.
    """

    def __init__(self, forward_context: dict[str, Any], layout_for: LayoutFactory):
        self.forward_context = forward_context
        self.layout_for = layout_for
        self.offsets: dict[str, int] = {}  # req_id -> logical tokens minus live tokens (non-zero only)
        self.score_reqs: dict[str, int] = {}  # req_id -> AttentionNeed value, this step
        self.score_windows: dict[str, int] = {}  # req_id -> WINDOW rows of this prefill step (payload.windows)
        self.step: Optional[StepScores] = None
        self._caches: Optional[list[tuple[torch.Tensor, KVLayout]]] = None
        self._stack: Any = False  # CPULayerStack of kv_caches(), None where they do not stack; False: not built
        self._layer_idx: Optional[dict[int, int]] = None
        self._tp = None  # vLLM's TP GroupCoordinator, looked up on the first scored step
        #: all-reduces issued and float64 bytes they carried (this rank; 0 when TP == 1)
        self.reduce_calls = 0
        self.reduce_bytes = 0
        #: test hook (docs/scaling.md): ``VTOKEN_TEST_WORKER_DIR`` -> per-rank KV digests and all-reduce log
        self.test_dir = os.environ.get("VTOKEN_TEST_WORKER_DIR") or None
        #: the decisions (made on the first payload that announces a request state)
        self.decisions: Optional[WorkerEviction] = None
        #: preempted requests whose state is kept: req_id -> every layer's K/V blocks holding its
        #: live tokens (host memory, ``[cdiv(live, B), H, B, 2*hd]`` per layer), restored at the resume
        self._saved_kv: dict[str, list[torch.Tensor]] = {}
        self.suspended_requests = 0  #: preemptions whose K/V was saved (tests)
        #: since the last output: token moves (every set) and seconds spent selecting and moving
        #: (``vtoken:moved_tokens_total``, ``vtoken:repack_seconds_total``; :meth:`attach_naive_freed`)
        self.report = {"moved": 0, "seconds": 0.0}
        #: prefix caching: cached blocks copied into private ones (:meth:`copy_blocks`)
        self.copied_blocks = 0
        #: the model's RoPE (:meth:`find_rope`): ``(cos_sin [max_position, D], a, b)``, or None
        self.rope: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        #: why :attr:`rope` is None (Expected Attention cannot run), or None
        self.rope_missing: Optional[str] = "the model was not loaded"
        self._rope_prefix: Optional[torch.Tensor] = None  # prefix sums of the RoPE table (made once)

    # -------------------------------------------------------------- set-up
    def check_layers(self, model_name: str) -> None:
        """Refuse, naming the model feature, attention the scorer does not reproduce (ALiBi,
        soft-capping, learned sinks), read from the loaded layers.

        Raises:
            VTokenConfigError: see :func:`vtoken.integrations.vllm.frontend.refusals.check_attention_layers`.
        """
        from vtoken.integrations.vllm.frontend.refusals import check_attention_layers

        check_attention_layers(model_name, self.forward_context)

    def find_rope(self, model: Any, policy: Optional[str] = None) -> None:
        """Find the model's rotary embedding (vLLM's ``RotaryEmbedding``: its ``cos_sin_cache``,
        ``is_neox_style``, ``rotary_dim``, ``head_size``), which Expected Attention needs to
        un-rotate queries and to rotate their moments to future positions (:attr:`rope`).

        Args:
            model: the runner's loaded model.
            policy: the engine's ``vtoken.policy``; ``expected_attention`` makes a model without
                a plain RoPE an error at start-up.

        Raises:
            VTokenConfigError: ``policy`` is ``expected_attention`` and the model has no RoPE, a
                partial one (``rotary_dim < head_size``), a scaled kind other than Llama 3's, or
                layers with different RoPEs (refusal ``ea_rope``; the start-up check from the
                model's config, ``refusals.rope_problem``, catches these before the load).
        """
        found: dict[int, Any] = {}
        for mod in model.modules():
            if all(hasattr(mod, a) for a in ("cos_sin_cache", "is_neox_style", "rotary_dim", "head_size")):
                found.setdefault(id(mod), mod)
        mods = list(found.values())
        self.rope, self.rope_missing, self._rope_prefix = None, None, None
        if not mods:
            self.rope_missing = "the model has no rotary position embedding"
        elif any(type(m).__name__ not in ("RotaryEmbedding", "Llama3RotaryEmbedding") for m in mods):
            self.rope_missing = (f"its rotary embedding is {sorted({type(m).__name__ for m in mods})}; allowed: "
                                 "RotaryEmbedding, Llama3RotaryEmbedding")
        elif any(m.rotary_dim != m.head_size for m in mods):
            self.rope_missing = "its rotary embedding covers part of each head (rotary_dim < head_size)"
        elif len({(m.is_neox_style, tuple(m.cos_sin_cache.shape)) for m in mods}) != 1 or not all(
                torch.equal(mods[0].cos_sin_cache, m.cos_sin_cache) for m in mods[1:]):
            self.rope_missing = "its layers use different rotary embeddings"
        else:
            from vtoken.policies.expected_attention import rope_pairs

            m = mods[0]
            a, b = rope_pairs(int(m.head_size), bool(m.is_neox_style))
            dev = m.cos_sin_cache.device
            self.rope = (m.cos_sin_cache, a.to(dev), b.to(dev))
        if self.rope is None and policy == "expected_attention":
            from vtoken.integrations.vllm.frontend.refusals import refuse

            refuse("ea_rope", policy, f"the loaded model: {self.rope_missing}")

    def wrap_attention(self) -> int:
        """Wrap each attention impl's ``forward`` (per instance) to feed :attr:`step`; returns the count."""
        core = self
        n = 0
        for layer in self.forward_context.values():
            impl = getattr(layer, "impl", None)
            if impl is None or not hasattr(impl, "forward") or getattr(impl, "_vt_wrapped", False):
                continue
            orig = impl.forward

            def fwd(lyr, query, key, value, kv_cache, attn_metadata, output, *a, _orig=orig, _impl=impl, **kw):
                res = _orig(lyr, query, key, value, kv_cache, attn_metadata, output, *a, **kw)
                st = core.step
                if st is not None and attn_metadata is not None and kv_cache.numel() > 0:
                    per_layer = st.grans or st.needs_keys or st.moment_rows or st.deferred
                    st.accumulate(_impl, query, kv_cache, attn_metadata, core.layout_for(lyr, kv_cache),
                                  layer_index=core.layer_index(kv_cache) if per_layer else None, key=key)
                return res

            impl.forward = fwd
            impl._vt_wrapped = True
            n += 1
        logger.debug("vToken: wrapped %d attention layers for scoring", n)
        return n

    def kv_caches(self) -> list[tuple[torch.Tensor, KVLayout]]:
        """Every distinct per-layer KV cache tensor with its layout (deduplicated by storage)."""
        if self._caches is None:
            seen: dict[int, tuple[torch.Tensor, KVLayout]] = {}
            for layer in self.forward_context.values():
                kv = getattr(layer, "kv_cache", None)
                if kv is None or getattr(layer, "impl", None) is None:
                    continue
                t = kv[0] if isinstance(kv, (list, tuple)) else kv
                if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.data_ptr() in seen:
                    continue
                seen[t.data_ptr()] = (t, self.layout_for(layer, t))
            self._caches = list(seen.values())
        return self._caches

    # -------------------------------------------------------------- per step
    def begin_step(self, payload: Optional[StepPayload], finished: Iterable[str] = (),
                   scheduler_output: Any = None) -> None:
        """Apply the step's moves in every layer; record offsets and score requests.

        Must run before any KV write of the step. Block-table truncation
        (``payload.truncate`` / ``payload.kept_blocks``) is the adapter's job. The moves are this
        worker's own choice (:class:`~vtoken.integrations.vllm.worker.eviction.WorkerEviction`,
        which reads ``scheduler_output`` for the step's block ids and token counts).
        """
        if payload is not None and payload.states and self.decisions is None:
            caches = self.kv_caches()
            kv = caches[0][0]  # every layout's view: [num_blocks, H, block_size, 2*hd]
            self.decisions = WorkerEviction(kv.shape[0], kv.shape[2], kv.device,
                                             kv_bytes=sum(t.numel() * t.element_size() for t, _ in caches),
                                             num_layers=len(caches), num_kv_heads=kv.shape[1])
            self.decisions.key_reader = self.eviction_key_stats
        if payload is not None and payload.unshare:
            self.copy_blocks(payload.unshare)
        if self.decisions is not None and scheduler_output is not None:
            t0 = time.perf_counter()
            for gran, src, dst, sets in self.decisions.begin(scheduler_output, payload):
                self._apply_set_moves(gran, src, dst, sets)
                self.report["moved"] += src.numel()  # (a host-known size: plan_moves made it)
            # preempted (after its eviction's moves) and resumed requests' K/V, in that order: a
            # block one leaves may be the block another resumes into in this very step
            for rid, ids in self.decisions.suspending:
                self._saved_kv[rid] = [self._to_host(kv.index_select(0, ids.to(kv.device))) for kv, _ in self.kv_caches()]
            for rid, ids in self.decisions.resuming:
                for (kv, _), saved in zip(self.kv_caches(), self._saved_kv.pop(rid)):
                    kv[ids.to(kv.device)] = saved.to(kv.device, non_blocking=True)
            self.suspended_requests += len(self.decisions.suspending)
            self.report["seconds"] += time.perf_counter() - t0
        if payload is not None:
            if payload.offsets:  # (every evicting request's, every step: one C-level update)
                self.offsets.update(payload.offsets)
                if 0 in payload.offsets.values():
                    for rid in [r for r, off in payload.offsets.items() if not off]:
                        del self.offsets[rid]
            self.score_reqs = payload.scores
            self.score_windows = payload.windows
        else:
            self.score_reqs = {}
            self.score_windows = {}
        self.forget(finished)
        for rid in finished:
            self._saved_kv.pop(rid, None)

    @staticmethod
    def _to_host(t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` (pinned and without a host sync for a CUDA tensor)."""
        if t.device.type == "cpu":
            return t
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    def copy_blocks(self, unshare: dict[str, list[tuple[int, int, int]]]) -> None:
        """Prefix caching, a request's first eviction (``StepPayload.unshare``): copy each cached
        block into its new private block, every slot, in every layer and KV head and in the
        side caches, as one gather-then-scatter batch (a block one copy
        reads may be another copy's target in the same step), before any move of the step."""
        pairs = [(old, new) for entries in unshare.values() for _, old, new in entries]
        if not pairs:
            return
        caches = self.kv_caches()
        bs = caches[0][0].shape[2]  # every layout's view: [num_blocks, H, block_size, 2*hd]
        ids = torch.tensor(pairs, dtype=torch.int64)
        offs = torch.arange(bs, dtype=torch.int64)
        src = (ids[:, 0, None] * bs + offs).reshape(-1)
        dst = (ids[:, 1, None] * bs + offs).reshape(-1)
        self._move_every_layer(src, dst)
        if self.decisions is not None:
            self.decisions.copy_slots(src, dst)
        self.copied_blocks += len(pairs)

    def layer_stack(self) -> Optional[CPULayerStack]:
        """Every layer's KV cache as one :class:`CPULayerStack` (built once), or None where the
        caches do not stack (another backend or allocation): moves then go layer by layer."""
        if self._stack is False:
            self._stack = CPULayerStack.build(self.kv_caches())
            logger.debug("vToken: KV moves %s", "in one batch over every layer" if self._stack is not None
                         else "layer by layer")
        return self._stack

    def _move_every_layer(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move K and V of slots ``src`` to ``dst`` (int64 ``[M]``) in every layer and KV head:
        one batch through :meth:`layer_stack`, else layer by layer."""
        stack = self.layer_stack()
        if stack is not None:
            stack.move(src, dst)
            return
        for kv, lay in self.kv_caches():
            lay.move_tokens(kv, src.to(kv.device), dst.to(kv.device))

    def _apply_set_moves(self, gran: str, src: torch.Tensor, dst: torch.Tensor, sets: torch.Tensor) -> None:
        """Apply one group's K/V moves to the (layer, KV head) pairs each move's token set covers
        (``docs/granularity.md``; layer ``l`` is the ``l``-th of :meth:`kv_caches`, the order
        :meth:`wrap_attention` numbers the scored layers by)."""
        if not src.numel():
            return
        caches = self.kv_caches()
        stack = self.layer_stack()
        if stack is not None and gran in ("request", "head_shared", "layer", "head"):
            hk = caches[0][0].shape[1]
            layers = {"request": None, "head_shared": None, "layer": sets, "head": sets // hk}[gran]
            heads = {"request": None, "head_shared": sets, "layer": None, "head": sets % hk}[gran]
            stack.move(src, dst, layers, heads)  # every layer's moves in one gather and one scatter
            return
        if gran == "request":
            self._move_every_layer(src, dst)
        elif gran == "head_shared":
            for kv, lay in caches:
                lay.move_tokens(kv, src, dst, heads=sets)
        elif gran in ("layer", "head"):
            hk = caches[0][0].shape[1]
            layer = sets if gran == "layer" else sets // hk
            # the moves grouped by layer with one sort and one host read of the counts
            order = torch.argsort(layer, stable=True)
            counts = torch.bincount(layer, minlength=len(caches)).tolist()
            parts = zip(*(t[order].split(counts) for t in (src, dst, sets)))
            for (kv, lay), (s_, d_, h_), c in zip(caches, parts, counts):
                if c:
                    lay.move_tokens(kv, s_, d_, heads=None if gran == "layer" else h_ % hk)
        else:
            raise ValueError(f"vToken: unknown granularity {gran!r}")

    def key_similarity_sets(self, table: torch.Tensor, live: torch.Tensor, gran: str) -> torch.Tensor:
        """KeyDiff's statistic for the requests about to evict: per token set, each live slot's
        cosine similarity to its head's anchor (:func:`vtoken.policies.keydiff.key_similarity`),
        from the keys in the KV cache, one batched read per layer.

        Args:
            table: int64 ``[R, nblk]`` block ids of each request (its block-table prefix).
            live: int64 ``[R]`` live tokens of each request.
            gran: the requests' granularity; a set covering several (layer, KV head) pairs
                gets their mean (``head``: ``l * Hkv + g``; ``head_shared``: mean over layers;
                ``layer``: over KV heads; ``request``: over both). Under tensor parallelism
                ``layer`` and ``request`` sets sum their ranks' similarities and head counts
                (one all-reduce on the TP group's CPU group); ``head`` and ``head_shared`` sets
                are this rank's own KV heads.

        Returns:
            float64 ``[R, S, max(live)]``; ``NaN`` past each request's live count.
        """
        from vtoken.policies.keydiff import key_similarity

        # float64 straight from the cache's dtype (one converting copy; key_similarity computes in float64)
        keys, _ = self._read_live(table, live, values=False, dtype=torch.float64)  # [R, L*Hkv, n, hd]
        r, nl, hk, n = keys.shape[0], len(self.kv_caches()), keys.shape[1] // len(self.kv_caches()), keys.shape[2]
        # one batched similarity over every layer's heads (not one small op chain per layer)
        sims = key_similarity(keys, live.to(keys.device)).view(r, nl, hk, n).to(table.device)  # [R, L, Hkv, n]
        return self._key_stat_sets(sims, gran, table.device)

    def expected_attention_sets(self, table: torch.Tensor, live: torch.Tensor, gran: str,
                                moments: tuple[torch.Tensor, torch.Tensor, torch.Tensor], start: torch.Tensor,
                                n_future: int) -> torch.Tensor:
        """Expected Attention's statistic for the requests about to evict: per token set, each live
        slot's expected attention (:func:`vtoken.policies.expected_attention.expected_attention`)
        from the keys and values in the KV cache (one batched read of each per layer) and the
        requests' query moments.

        Args:
            table, live, gran: as :meth:`key_similarity_sets` (sets reduce the same way).
            moments: float64 ``(qsum [R, L, Hq, D], qpair [R, L, Hq, D/2, 3], count [R])``, this
                rank's query heads (``WorkerEviction``).
            start: int64 ``[R]``: each request's next logical position.
            n_future: positions the RoPE rotation is averaged over.

        Returns:
            float64 ``[R, S, max(live)]``; ``NaN`` past each request's live count.

        Raises:
            RuntimeError: the model has no usable RoPE (:meth:`find_rope`).
        """
        from vtoken.policies.expected_attention import expected_attention, rope_prefix_sums, rotation_from_prefix

        if self.rope is None:
            raise RuntimeError(f"vToken: policy 'expected_attention' cannot run on this model: {self.rope_missing}")
        cos_sin, a, b = self.rope
        if self._rope_prefix is None:
            self._rope_prefix = rope_prefix_sums(cos_sin)
        keys, vals = self._read_live(table, live, values=True)  # [R, L*Hkv, n, hd] each
        nl = len(self.kv_caches())
        r, n = keys.shape[0], keys.shape[2]
        hk = keys.shape[1] // nl
        qsum, qpair, count = (t.to(keys.device) for t in moments)
        cb, sb = rotation_from_prefix(self._rope_prefix, start.to(cos_sin.device), n_future)
        dev = keys.device
        ea = expected_attention(keys, live.to(dev), qsum.reshape(r, -1, qsum.shape[-1]),
                                qpair.reshape(r, -1, *qpair.shape[-2:]), count, cb.to(dev), sb.to(dev),
                                a.to(dev), b.to(dev), vnorm=torch.linalg.vector_norm(vals, dim=-1))
        return self._key_stat_sets(ea.view(r, nl, hk, n).to(table.device), gran, table.device)

    def eviction_key_stats(self, policy: Any, table: torch.Tensor, live: torch.Tensor, gran: str,
                           moments: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                           start: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The eviction-time statistic of a policy with ``eviction_keys``
        (``WorkerEviction.key_reader``): :meth:`expected_attention_sets` for a policy that needs
        ``AttentionNeed.QUERY_MOMENTS``, else KeyDiff's :meth:`key_similarity_sets`."""
        if policy.needs & AttentionNeed.QUERY_MOMENTS:
            return self.expected_attention_sets(table, live, gran, moments, start, policy.n_future)
        return self.key_similarity_sets(table, live, gran)

    def _read_live(self, table: torch.Tensor, live: torch.Tensor, values: bool, dtype: torch.dtype = torch.float32
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Keys (and values) of each request's live slots in every layer: ``[R, L * Hkv, max(live), hd]``
        (layer-major), one batched read per layer. ``dtype`` (float32 or float64) is the result's
        where every layer is read in one copy (:meth:`CPULayerStack.read_rows`); elsewhere float32."""
        caches = self.kv_caches()
        bs = caches[0][0].shape[2]
        n = int(live.max()) if live.numel() else 0
        stack = self.layer_stack()
        if stack is not None and stack.views is not None and n:  # every layer in one copy each
            rows = table[:, : -(-n // bs)]
            return stack.read_rows(rows, n, 0, dtype), (stack.read_rows(rows, n, 1, dtype) if values else None)
        if not values:
            cols = torch.arange(n, device=table.device)
            blocks = table.gather(1, (cols // bs)[None, :].expand(table.shape[0], n).clamp(max=table.shape[1] - 1))
            return torch.cat([lay.gather_keys_batched(kv, blocks, cols % bs) for kv, lay in caches], dim=1), None
        kv0 = caches[0][0]  # every layout's view: [num_blocks, H, block_size, 2*hd]
        h, hd = kv0.shape[1], kv0.shape[3] // 2
        rows = table[:, : -(-n // bs)] if n else table
        keys = torch.empty(table.shape[0], len(caches) * h, n, hd, dtype=torch.float32, device=kv0.device)
        vals = torch.empty_like(keys)
        for i, (kv, lay) in enumerate(caches):  # each layer's whole blocks read and converted into its rows
            lay.gather_kv_rows(kv, rows, n, (keys[:, i * h:(i + 1) * h], vals[:, i * h:(i + 1) * h]))
        return keys, vals

    def _key_stat_sets(self, sims: torch.Tensor, gran: str, device) -> torch.Tensor:
        """Per-(layer, KV head) statistics float64 ``[R, L, Hkv, n]`` -> the token sets' ``[R, S, n]``
        (:meth:`key_similarity_sets`' rules, the TP all-reduce of ``layer`` / ``request`` sets included)."""
        r, nl, hk, n = sims.shape
        if gran == "head":
            return sims.reshape(r, nl * hk, n)
        if gran == "head_shared":
            return sims.mean(dim=1)
        tot = sims.sum(dim=2)  # [R, L, n]: summed over this rank's KV heads
        heads = float(hk)
        if self._tp_world() > 1:
            flat = torch.cat([tot.reshape(-1).cpu(), torch.tensor([heads], dtype=torch.float64)])
            torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM, group=self._tp.cpu_group)
            self.reduce_calls += 1
            self.reduce_bytes += flat.numel() * flat.element_size()
            tot, heads = flat[:-1].reshape(tot.shape).to(device), float(flat[-1])
        per_layer = tot / heads
        if gran == "layer":
            return per_layer
        if gran == "request":
            return per_layer.mean(dim=1, keepdim=True)
        raise ValueError(f"vToken: unknown granularity {gran!r}")

    def layer_index(self, kv_cache: torch.Tensor) -> int:
        """Index of a layer's KV cache in :meth:`kv_caches` (the layer's token sets)."""
        if self._layer_idx is None:
            self._layer_idx = {t.data_ptr(): i for i, (t, _) in enumerate(self.kv_caches())}
        return self._layer_idx[kv_cache.data_ptr()]

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop the offsets of requests that finished or were preempted."""
        for rid in req_ids:
            self.offsets.pop(rid, None)

    def batch_offsets(self, req_ids: list[str]) -> Optional[np.ndarray]:
        """int64 ``[len(req_ids)]`` offsets in batch order, or None when all are zero."""
        if not self.offsets:
            return None
        off = np.fromiter(map(self.offsets.get, req_ids, itertools.repeat(0)), dtype=np.int64, count=len(req_ids))
        return off if off.any() else None

    def start_scoring(self, req_ids: list[str], positions: Optional[torch.Tensor] = None) -> None:
        """Arm :attr:`step` for the rows of this batch that asked for scores (batch order).

        ``positions``: the step's logical (RoPE) positions, ``[>= num_tokens]`` in batch order;
        needed when a row asks for ``AttentionNeed.QUERY_MOMENTS`` (Expected Attention)."""
        self.step = None
        if self.score_reqs:
            rows = [(i, r, self.score_reqs[r]) for i, r in enumerate(req_ids) if r in self.score_reqs]
            if rows:
                grans = windows = None
                if self.decisions is not None:
                    grans = {r: g for _, r, _ in rows if (g := self.decisions.granularity(r)) != "request"} or None
                    windows = {r: w for _, r, need in rows if need & AttentionNeed.WINDOW.value
                               and (w := self.score_windows.get(r, self.decisions.window(r))) is not None} or None
                rope = None
                if any(need & AttentionNeed.QUERY_MOMENTS.value for _, _, need in rows):
                    if self.rope is None or positions is None:
                        raise RuntimeError("vToken: policy 'expected_attention' cannot run here: "
                                           f"{self.rope_missing or 'the runner gave no positions'}")
                    rope = (self.rope, positions)
                self.step = StepScores(rows, grans=grans, windows=windows, rope=rope, stack=self.layer_stack())

    def finish_step(self) -> None:
        """Fold the step's statistics (req_id -> (col_sum, last_row)) into the side cache
        (:meth:`WorkerEviction.fold`); disarms :attr:`step`.

        Under tensor parallelism the statistics are reduced over the TP group first
        (:meth:`_reduce_over_tp`); whether that collective runs depends only on the step's
        payload (``payload.scores``, identical on every rank), never on local state.
        """
        st, self.step = self.step, None
        wanted, self.score_reqs = self.score_reqs, {}
        if st is not None and getattr(st, "moment_rows", None) and self.decisions is not None:
            self.decisions.fold_moments(*st.take_moments())  # this rank's own query heads
        if st is not None and self.decisions is not None and getattr(st, "needs_keys", False):
            # K-norm: the norms go straight into the slots they were written to (no live pass)
            direct = self.decisions.written_only(st.keyed_rids(), tp=self._tp_world() > 1)
            got = st.take_key_norms(direct) if direct else None
            if got is not None:
                self.decisions.write_key_norms(*got)
        if wanted and self._tp_world() > 1:
            res = self._reduce_over_tp(st) or None
        elif st is None:
            return
        elif self.decisions is not None and hasattr(st, "batched"):
            res = st.batched()  # the one-query rows as padded tensors (no per-request arrays)
        else:
            res = st.result() or None
        if self.decisions is not None:  # folded here; no statistic goes back
            self.decisions.fold(res)

    def take_naive_freed(self) -> Optional[dict[str, int]]:
        """The step's changed Naive-Evict freed-block counts
        (:meth:`WorkerEviction.take_naive_freed`), or None."""
        if self.decisions is None:
            return None
        world = self._tp_world()
        return self.decisions.take_naive_freed(self._tp_sum if world > 1 else None, world)

    def _tp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a host tensor over the TP group (its CPU process group, as the statistics)."""
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=self._tp.cpu_group)
        self.reduce_calls += 1
        self.reduce_bytes += t.numel() * t.element_size()
        return t

    # -------------------------------------------------------------- tensor parallel
    def _tp_world(self) -> int:
        """World size of vLLM's tensor-parallel group (1 when no group is set up, e.g. unit tests)."""
        if self._tp is None:
            from vllm.distributed import parallel_state

            if not parallel_state.model_parallel_is_initialized():
                return 1
            self._tp = parallel_state.get_tp_group()
        return self._tp.world_size

    def _reduce_over_tp(self, st: Optional[StepScores]) -> ScoreMap:
        """Sum the step's statistics over the TP group: the mean over all query heads and layers.

        Each rank's :class:`StepScores` holds, per request, the mean over its own ``h_r``
        query heads (vLLM partitions query heads across ranks, ``h_r = Hq / TP``, even when
        KV heads are replicated) and over layers. One flat float64 tensor is packed in a
        deterministic order, identical on every rank because it follows the step's batch
        order and physical lengths, which come from the same ``SchedulerOutput``:
        ``[h_r, h_r * s_1, h_r * s_2, ...]`` with, per scored row in batch order, its
        ``col_sum`` then its ``last_row`` (where asked). After ``all_reduce(SUM)`` on the
        group's CPU process group (gloo: float64, and host arrays stay on the host), the
        first element is ``sum_r h_r = Hq`` and each statistic is divided by it:
        ``sum_r h_r * mean_r / Hq`` = the mean over all ``Hq`` heads (and the ``L`` layers,
        already divided), as :mod:`vtoken.policies.base` defines. Equal to the TP=1 value
        up to float reduction order.

        Requests with per-head token sets (``head``, ``head_shared``) are left out: each rank
        decides for its own KV heads. ``layer`` sets (``[L, n]``) are summed like the rest.

        Returns:
            req_id -> (col_sum, last_row), float64 ``[num_live]`` (``[S, num_live]`` for sets).
        """
        res = st.result() if st is not None else {}
        # per-head sets (head, head_shared) are this rank's own KV heads: nothing to sum
        local = {rid for rid, g in (getattr(st, "grans", None) or {}).items() if g in ("head", "head_shared")}
        order = [rid for _, rid, _ in (st.rows if st is not None else []) if rid in res and rid not in local]
        h = float(st.num_heads) if st is not None else 0.0
        parts = [np.array([h])]
        for rid in order:
            parts += [h * a.ravel() for a in res[rid] if a is not None]
        flat = torch.from_numpy(np.concatenate(parts))
        t0 = time.perf_counter()
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM, group=self._tp.cpu_group)
        dt = time.perf_counter() - t0
        self.reduce_calls += 1
        self.reduce_bytes += flat.numel() * flat.element_size()
        if self.test_dir:
            self._test_log("allreduce", dict(bytes=flat.numel() * flat.element_size(), rows=len(order), us=dt * 1e6))
        total = float(flat[0])
        out: ScoreMap = {rid: res[rid] for rid in local if rid in res}
        i = 1
        for rid in order:
            got = []
            for a in res[rid]:
                if a is None:
                    got.append(None)
                    continue
                got.append((flat[i:i + a.size] / total).numpy().reshape(a.shape))
                i += a.size
            out[rid] = tuple(got)
        if i != flat.numel():  # cannot happen when every rank packed the same layout
            raise RuntimeError(f"vToken: TP score reduction unpacked {i} of {flat.numel()} values")
        return out

    # -------------------------------------------------------------- test hook
    def _rank(self) -> int:
        self._tp_world()
        return 0 if self._tp is None else self._tp.rank_in_group

    def _test_log(self, kind: str, rec: dict) -> None:
        with open(os.path.join(self.test_dir, f"{kind}-rank{self._rank()}.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")

    def dump_kv_digest(self, req_id: str, block_ids: list[int], num_live: int) -> None:
        """Test hook (``VTOKEN_TEST_WORKER_DIR`` set): save the request's live K rows, physical order.

        Writes ``<dir>/kv-rank<r>-<req_id>.npy``: float32 ``[layers, Hkv_local, num_live, hd]``
        read back through the :class:`KVLayout` from ``block_ids`` (the request's row). Must be
        called before the step's moves (they may overwrite the request's freed blocks).
        """
        if not self.test_dir or num_live <= 0:
            return
        bt = torch.tensor(block_ids, dtype=torch.int64)
        ks = [lay.gather_keys(kv, bt, num_live).float() for kv, lay in self.kv_caches()]
        safe = req_id.replace("/", "_")
        np.save(os.path.join(self.test_dir, f"kv-rank{self._rank()}-{safe}.npy"), torch.stack(ks).numpy())

    def attach_naive_freed(self, out, naive_freed: Optional[dict[str, int]]):
        """Hang ``naive_freed`` (req_id -> Naive-Evict's freed blocks) on the step's output as
        ``vtoken_naive_freed``, the moves and seconds since the last output (:attr:`report`) as
        ``vtoken_worker``, and the faults confined to one request since then
        (:meth:`WorkerEviction.take_faults`, req_id -> message) as ``vtoken_faults``; returns the
        output to pass on.

        Handles a ``ModelRunnerOutput`` (a shared empty one is copied first), Model Runner
        V2's ``AsyncOutput`` (its ``model_runner_output``) and the V1 runner's async output
        (its ``get_output`` is wrapped on the instance).
        """
        faults = self.decisions.take_faults() if self.decisions is not None else None
        if out is None or (not naive_freed and not faults and not self.report["moved"] and not self.report["seconds"]):
            return out
        attrs = {"vtoken_naive_freed": naive_freed, "vtoken_worker": self.report, "vtoken_faults": faults}
        self.report = {"moved": 0, "seconds": 0.0}
        inner = getattr(out, "model_runner_output", None)
        if inner is not None:  # MRV2 AsyncOutput: get_output() returns this very object
            _set_attrs(inner, attrs)
            return out
        if hasattr(out, "sampled_token_ids"):  # a ModelRunnerOutput
            from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

            if out is EMPTY_MODEL_RUNNER_OUTPUT:
                out = copy.copy(out)
            _set_attrs(out, attrs)
            return out
        if hasattr(out, "get_output"):  # V1 AsyncGPUModelRunnerOutput
            orig = out.get_output

            def get_output(_orig=orig):
                res = _orig()
                _set_attrs(res, attrs)
                return res

            out.get_output = get_output
            return out
        raise TypeError(f"vToken: cannot attach Naive-Evict counts to a {type(out).__name__}")
