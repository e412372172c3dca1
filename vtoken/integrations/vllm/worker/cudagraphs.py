"""CUDA graphs: steps that need attention scores never replay a FULL graph.

vLLM's default on CUDA is ``cudagraph_mode=FULL_AND_PIECEWISE``: uniform decode batches
replay one FULL graph (every kernel of the forward, attention included, captured once;
no Python runs), mixed batches run PIECEWISE graphs whose splitting ops (attention among
them) run eagerly. vToken's scorer is launched from the per-layer ``impl.forward``
wrapper, in Python, only on steps that asked for scores. Captured in a FULL graph it would
either be missing (nothing asked at capture) or replay with stale items, so a FULL replay
would silently skip scoring. vToken therefore **routes every step that needs scores away
from FULL graphs**, and leaves every other step to vLLM's choice (docs/integration.md,
"CUDA"):

* Model Runner V2 (``CudaGraphManager.dispatch``, wrapped per instance by
  :func:`install_v2_dispatch`): a FULL descriptor is re-dispatched with
  ``uniform_token_count=None, max_query_len=None``, which only PIECEWISE descriptors accept
  (they match any batch); if that still gives FULL (``cudagraph_mode=FULL``: mixed-batch FULL
  graphs), the step runs eagerly (``CUDAGraphMode.NONE``).
* V1 runner (``CudagraphDispatcher.dispatch``, wrapped per instance by
  :func:`install_v1_dispatch`): FULL is added to ``invalid_modes``; the dispatcher then picks
  PIECEWISE when a key exists, else NONE. If FULL was the only allowed mode (a data-parallel
  re-dispatch pinned to FULL), the step runs with ``valid_modes={NONE}``.

The per-step predicate is ``needs_scores()``: true when the step's payload asks for scores
for a request in the batch (``WorkerStep.score_reqs``, set in ``begin_step`` before
vLLM dispatches). Moves and physical offsets are applied outside any graph (before the
forward, into persistent buffers), so unscored steps keep their FULL graphs.

The pure decision functions (:func:`v1_modes`, :func:`v2_route`) are what the CPU tests
check, on vLLM's own dispatcher and graph manager objects.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

logger = logging.getLogger("vllm.vtoken")

__all__ = ["v1_modes", "v2_route", "install_v1_dispatch", "install_v2_dispatch", "RouteStats"]


class RouteStats:
    """Counts of dispatch decisions on scored steps (read by tests and the device check)."""

    def __init__(self) -> None:
        self.scored = 0  #: scored steps dispatched
        self.rerouted = 0  #: of those, steps vLLM would have run as a FULL graph (so vToken changed the mode)
        self.modes: dict[str, int] = {}  #: mode name -> scored steps that ran in it

    def record(self, rerouted: bool, mode: Any) -> None:
        self.scored += 1
        self.rerouted += int(rerouted)
        name = getattr(mode, "name", str(mode))
        self.modes[name] = self.modes.get(name, 0) + 1


def v1_modes(needs_scores: bool, valid_modes, invalid_modes):
    """The ``(valid_modes, invalid_modes)`` vToken passes to the V1 ``CudagraphDispatcher.dispatch``.

    Args:
        needs_scores: the step scores at least one request.
        valid_modes, invalid_modes: the caller's arguments (sets of ``CUDAGraphMode`` or None).

    Returns:
        the arguments unchanged when ``needs_scores`` is false or FULL is not allowed anyway;
        otherwise ``invalid_modes | {FULL}``, or ``({NONE}, None)`` when FULL was the only mode
        left.
    """
    from vllm.config.compilation import CUDAGraphMode

    if not needs_scores:
        return valid_modes, invalid_modes
    allowed = set(valid_modes or CUDAGraphMode.valid_runtime_modes()) - set(invalid_modes or ())
    if CUDAGraphMode.FULL not in allowed:
        return valid_modes, invalid_modes
    if allowed - {CUDAGraphMode.FULL}:
        return valid_modes, set(invalid_modes or ()) | {CUDAGraphMode.FULL}
    return {CUDAGraphMode.NONE}, None


def install_v1_dispatch(dispatcher, needs_scores: Callable[[], bool], stats: Optional[RouteStats] = None) -> None:
    """Wrap ``dispatcher.dispatch`` (a V1 ``CudagraphDispatcher``) per instance (idempotent).

    Same signature and result as upstream; on a step where ``needs_scores()`` is true the
    modes are narrowed by :func:`v1_modes`.
    """
    from vllm.config.compilation import CUDAGraphMode

    if getattr(dispatcher.dispatch, "_vtoken_wrapped", False):
        return
    orig = dispatcher.dispatch

    def dispatch(num_tokens: int, uniform_decode: bool = False, has_lora: bool = False, num_active_loras: int = 0,
                 valid_modes=None, invalid_modes=None):
        scored = bool(needs_scores())
        v, inv = v1_modes(scored, valid_modes, invalid_modes)
        mode, desc = orig(num_tokens, uniform_decode=uniform_decode, has_lora=has_lora,
                          num_active_loras=num_active_loras, valid_modes=v, invalid_modes=inv)
        if scored and stats is not None:
            stock = mode if (v, inv) == (valid_modes, invalid_modes) else orig(
                num_tokens, uniform_decode=uniform_decode, has_lora=has_lora, num_active_loras=num_active_loras,
                valid_modes=valid_modes, invalid_modes=invalid_modes)[0]
            stats.record(stock == CUDAGraphMode.FULL, mode)
        return mode, desc

    dispatch._vtoken_wrapped = True
    dispatcher.dispatch = dispatch


def v2_route(needs_scores: bool, desc, redispatch: Callable[[], Any], num_reqs: int, num_tokens: int):
    """The descriptor vToken runs on Model Runner V2, given vLLM's choice ``desc``.

    Args:
        needs_scores: the step scores at least one request.
        desc: vLLM's ``BatchExecutionDescriptor`` for the step.
        redispatch: ``() -> BatchExecutionDescriptor``: the same dispatch with
            ``uniform_token_count=None`` and ``max_query_len=None`` (PIECEWISE descriptors only).
        num_reqs, num_tokens: the step's unpadded shape (what vLLM's own eager fallback uses).

    Returns:
        ``desc`` when no scores are needed or it is not FULL; else the re-dispatched
        descriptor if it is not FULL; else an eager (``CUDAGraphMode.NONE``) descriptor of the
        unpadded shape, as vLLM's dispatch builds when no graph matches.
    """
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    if not needs_scores or desc.cg_mode != CUDAGraphMode.FULL:
        return desc
    alt = redispatch()
    if alt.cg_mode != CUDAGraphMode.FULL:
        return alt
    return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens, num_reqs=num_reqs,
                                    num_active_loras=desc.num_active_loras, num_ubatches=desc.num_ubatches)


def install_v2_dispatch(manager, needs_scores: Callable[[], bool], stats: Optional[RouteStats] = None) -> None:
    """Wrap ``manager.dispatch`` (Model Runner V2's ``CudaGraphManager``) per instance (idempotent)."""
    if manager is None or getattr(manager.dispatch, "_vtoken_wrapped", False):
        return
    orig = manager.dispatch

    def dispatch(num_reqs: int, num_tokens: int, uniform_token_count, num_active_loras: int,
                 max_query_len=None, num_ubatches: int = 1):
        desc = orig(num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len, num_ubatches)
        scored = bool(needs_scores())
        if not scored:
            return desc
        out = v2_route(True, desc, lambda: orig(num_reqs, num_tokens, None, num_active_loras, None, num_ubatches),
                       num_reqs, num_tokens)
        if stats is not None:
            stats.record(out is not desc, out.cg_mode)
        return out

    dispatch._vtoken_wrapped = True
    manager.dispatch = dispatch
