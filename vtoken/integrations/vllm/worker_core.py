"""The runner-neutral part of vToken's worker: moves, offsets, scores.

Both model-runner adapters (``runner_v1.py`` for vLLM's V1 ``GPUModelRunner`` family,
``runner_v2.py`` for Model Runner V2) own one :class:`VTokenWorkerCore` and call it at
their runner's seams. Per step, before any KV write of the step:

1. :meth:`VTokenWorkerCore.begin_step` applies the step's token moves in every layer (they
   may read blocks the scheduler freed in this step and already handed to another request:
   reading before any write keeps that safe), records the offsets (logical minus live
   tokens) and which requests want scores; the adapter then truncates its block-table rows;
2. the adapter makes the slot mapping and attention's ``seq_lens`` physical with
   :meth:`batch_offsets` while positions stay logical (RoPE);
3. :meth:`start_scoring` arms :class:`~vtoken.integrations.vllm.scoring.StepScores`, which the
   attention wrapper (:meth:`wrap_attention`) fills layer by layer;
4. :meth:`attach_scores` hangs the statistics on the step's ``ModelRunnerOutput`` (directly,
   or through the async output object that produces it).

The backend's KV layout is reached only through
:class:`~vtoken.integrations.vllm.kv_layout.KVLayout` (a ``layout_for(layer, kv_cache)``
factory given at construction).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch

from vtoken.integrations.vllm.kv_layout import KVLayout
from vtoken.integrations.vllm.payload import ScoreMap, StepPayload
from vtoken.integrations.vllm.scoring import StepScores

logger = logging.getLogger("vllm.vtoken")

__all__ = ["VTokenWorkerCore"]

LayoutFactory = Callable[[Any, torch.Tensor], KVLayout]


class VTokenWorkerCore:
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
        self.step: Optional[StepScores] = None
        self._caches: Optional[list[tuple[torch.Tensor, KVLayout]]] = None

    # -------------------------------------------------------------- set-up
    def check_layers(self, model_name: str) -> None:
        """Refuse, naming the model feature, attention the scorer does not reproduce (ALiBi,
        soft-capping, learned sinks), read from the loaded layers.

        Raises:
            VTokenConfigError: see :func:`vtoken.integrations.vllm.refusals.check_attention_layers`.
        """
        from vtoken.integrations.vllm.refusals import check_attention_layers

        check_attention_layers(model_name, self.forward_context)

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
                    st.accumulate(_impl, query, kv_cache, attn_metadata, core.layout_for(lyr, kv_cache))
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
    def begin_step(self, payload: Optional[StepPayload], finished: Iterable[str] = ()) -> None:
        """Apply the step's moves in every layer; record offsets and score requests.

        Must run before any KV write of the step. Block-table truncation
        (``payload.truncate`` / ``payload.kept_blocks``) is the adapter's job.
        """
        if payload is not None:
            if payload.num_moves:
                src = torch.from_numpy(payload.src)
                dst = torch.from_numpy(payload.dst)
                for kv, lay in self.kv_caches():
                    lay.move_tokens(kv, src, dst)
            for rid, off in payload.offsets.items():
                if off:
                    self.offsets[rid] = off
                else:
                    self.offsets.pop(rid, None)
            self.score_reqs = payload.scores
        else:
            self.score_reqs = {}
        self.forget(finished)

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop the offsets of requests that finished or were preempted."""
        for rid in req_ids:
            self.offsets.pop(rid, None)

    def batch_offsets(self, req_ids: list[str]) -> Optional[np.ndarray]:
        """int64 ``[len(req_ids)]`` offsets in batch order, or None when all are zero."""
        if not self.offsets:
            return None
        off = np.fromiter((self.offsets.get(r, 0) for r in req_ids), dtype=np.int64, count=len(req_ids))
        return off if off.any() else None

    def start_scoring(self, req_ids: list[str]) -> None:
        """Arm :attr:`step` for the rows of this batch that asked for scores (batch order)."""
        self.step = None
        if self.score_reqs:
            rows = [(i, r, self.score_reqs[r]) for i, r in enumerate(req_ids) if r in self.score_reqs]
            if rows:
                self.step = StepScores(rows)

    def take_scores(self) -> Optional[ScoreMap]:
        """The step's statistics (req_id -> (col_sum, last_row)), or None; disarms :attr:`step`."""
        st, self.step = self.step, None
        if st is None:
            return None
        return st.result() or None

    @staticmethod
    def attach_scores(out, scores: Optional[ScoreMap]):
        """Hang ``scores`` on the step's output as ``vtoken_scores``; returns the output to pass on.

        Handles a ``ModelRunnerOutput`` (a shared empty one is copied first), Model Runner
        V2's ``AsyncOutput`` (its ``model_runner_output``) and the V1 runner's async output
        (its ``get_output`` is wrapped on the instance). On the CPU the statistics are
        host arrays computed during the forward, so nothing is left in flight.
        """
        if not scores or out is None:
            return out
        inner = getattr(out, "model_runner_output", None)
        if inner is not None:  # MRV2 AsyncOutput: get_output() returns this very object
            inner.vtoken_scores = scores
            return out
        if hasattr(out, "sampled_token_ids"):  # a ModelRunnerOutput
            from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

            if out is EMPTY_MODEL_RUNNER_OUTPUT:
                out = copy.copy(out)
            out.vtoken_scores = scores
            return out
        if hasattr(out, "get_output"):  # V1 AsyncGPUModelRunnerOutput
            orig = out.get_output

            def get_output(_orig=orig):
                res = _orig()
                res.vtoken_scores = scores
                return res

            out.get_output = get_output
            return out
        raise TypeError(f"vToken: cannot attach scores to a {type(out).__name__}")
