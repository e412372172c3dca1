"""vToken on vLLM's CUDA runners (V1 ``GPUModelRunner`` and Model Runner V2), FlashAttention backend.

The seams are those of the CPU adapters (:class:`~vtoken.integrations.vllm.worker.runner_v1.VTokenV1Adapter`,
:class:`~vtoken.integrations.vllm.worker.runner_v2.VTokenV2Adapter`, see their modules and
docs/integration.md); this module supplies the CUDA side of their hooks:

* **Moves**: the worker's decisions (``WorkerEviction``, device tensors) plan them and
  :meth:`~vtoken.integrations.vllm.worker.step.WorkerStep.begin_step` applies them per
  token set through the :class:`PagedKVLayout`, on the current (the runner's main) stream,
  before the stock ``_update_states`` / ``update_requests``, so before the forward and any
  KV write of the step.
* **Offsets** (per request, batch order) go the same way into a persistent device buffer;
  physical positions (slot mapping only; RoPE keeps the logical ones) and physical
  ``seq_lens`` are computed on the device into persistent buffers, in place.
  V1: ``seq_lens`` is V1's own persistent buffer (its sampler does not read it), as on CPU.
  MRV2: attention gets a separate persistent ``seq_lens`` buffer on **every** step, offsets or
  not, so the FULL CUDA graphs capture its address (``input_batch.seq_lens`` stays logical:
  MRV2's sampler reads it, see ``runner_v2.py``).
* **Scores**: for a step whose scored requests all keep one token set and need only column
  sums or the last row, :class:`GPUStepScores` runs the two-phase Triton scorer
  (``vtoken.kernels.score_attention``) in the per-layer ``impl.forward`` wrapper, from host
  copies of the step's query start locations and physical lengths (no device sync while the
  forward is enqueued); any other step (per-layer or per-head sets, a window, key norms, query
  moments) uses the runner-neutral ``StepScores``.
* **CUDA graphs**: steps that need scores never replay a FULL graph (``cudagraphs.py``).

Pinned staging buffers are double-buffered and each reuse waits for the event recorded after
its previous copy, so a host buffer is never rewritten while its DMA may still be pending
(async scheduling runs the host one step ahead).

Nothing in this module has run on a GPU yet (README, "GPU support"): vToken starts on CUDA only
with ``VTOKEN_UNVALIDATED_PLATFORM=1`` (``frontend/platforms.py``); ``make device-check`` runs
this path end to end on one GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np
import torch

from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # V1
from vllm.v1.worker.gpu import model_runner  # Model Runner V2: model_runner.GPUModelRunner

from vtoken.integrations.vllm.worker import cudagraphs
from vtoken.integrations.vllm.worker.kv_layout import PagedKVLayout, flash_attn_kv_layout
from vtoken.integrations.vllm.worker.runner_v1 import VTokenV1Adapter
from vtoken.integrations.vllm.worker.runner_v2 import VTokenV2Adapter
from vtoken.integrations.vllm.worker.step import WorkerStep
from vtoken.policies.base import AttentionNeed

__all__ = ["PinnedStaging", "GPUStepScores", "GPUWorkerStep", "VTokenGPUModelRunner",
           "VTokenGPUModelRunnerV2", "check_caches"]


class PinnedStaging:
    """Host -> device copies of small per-step arrays without blocking the host.

    ``copy(dst, arr)`` writes ``arr`` into a pinned host buffer and enqueues
    ``dst.copy_(host, non_blocking=True)`` on the current stream. Two host buffers are used in
    turn; before one is rewritten, the event recorded after its previous copy is waited on, so
    a pending DMA never reads a half-rewritten buffer. On CPU tensors (tests) it is a plain copy.

    Args:
        slots: host buffers used in turn (2: the host runs at most one step ahead).
    """

    def __init__(self, slots: int = 2):
        self.slots = slots
        self._bufs: list[Optional[torch.Tensor]] = [None] * slots
        self._events: list = [None] * slots
        self._next = 0
        self.copies = 0  #: copies enqueued (tests)
        self.waits = 0  #: times a buffer's previous copy was waited on before reuse (tests)

    def copy(self, dst: torch.Tensor, arr: np.ndarray) -> torch.Tensor:
        """Copy ``arr`` (1-D) into ``dst[:len(arr)]``; returns that slice.

        Raises:
            ValueError: ``dst`` is shorter than ``arr``.
        """
        n = int(arr.shape[0])
        if n > dst.shape[0]:
            raise ValueError(f"staging: {n} values for a device buffer of {dst.shape[0]}")
        out = dst[:n]
        if n == 0:
            return out
        src = torch.from_numpy(np.ascontiguousarray(arr)).to(dst.dtype)
        if not dst.is_cuda:
            out.copy_(src)
            self.copies += 1
            return out
        i = self._next
        self._next = (i + 1) % self.slots
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()
            self.waits += 1
        buf = self._bufs[i]
        if buf is None or buf.dtype != dst.dtype or buf.shape[0] < n:
            buf = torch.empty(max(n, 2 * (0 if buf is None else buf.shape[0]), 256), dtype=dst.dtype, pin_memory=True)
            self._bufs[i] = buf
        buf[:n].copy_(src)
        out.copy_(buf[:n], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._events[i] = ev
        self.copies += 1
        return out


class GPUStepScores:
    """One step's attention statistics from the Triton scorer; the interface of ``scoring.StepScores``.

    Items are built with ``vtoken.kernels.step_score_row`` (the same choice of query rows as
    ``StepScores``: one row unless the policy wants column sums over a multi-row chunk) from
    host copies of the batch's query start locations and physical lengths, so building them
    reads nothing from the device. Each layer adds its sums over query heads into one fp32
    device buffer; :meth:`result` reads it back once and divides by ``heads x layers``.

    Args:
        rows: ``(batch row, req_id, AttentionNeed value)`` of the rows to score.
        host_batch: ``() -> (query_start_loc [num_reqs + 1], physical seq_lens [num_reqs])``,
            int numpy arrays in batch order, called at the first layer.
    """

    def __init__(self, rows: list[tuple[int, str, int]], host_batch: Callable[[], tuple[np.ndarray, np.ndarray]]):
        from vtoken.kernels import plan_scores, step_score_row

        self.rows = rows
        self.num_layers = 0
        self.num_heads = 0
        qsl, seq_lens = host_batch()
        items, self._rids = [], []
        for row, rid, need in rows:
            qs, qe, n = int(qsl[row]), int(qsl[row + 1]), int(seq_lens[row])
            if qe <= qs or n <= 0:
                continue
            items.append(step_score_row(row, n, qs, qe, bool(need & AttentionNeed.COL_SUM.value),
                                        bool(need & AttentionNeed.LAST_ROW.value)))
            self._rids.append(rid)
        self.plan = plan_scores(items)
        self._out: Optional[torch.Tensor] = None
        self._lse: Optional[torch.Tensor] = None
        self._logits: Optional[torch.Tensor] = None

    def accumulate(self, impl, query: torch.Tensor, kv_cache: torch.Tensor, meta, layout=None) -> None:
        """Add one layer's sums over this rank's query heads (the attention wrapper, every layer)."""
        from vtoken.kernels import score_attention

        Hq, hd = impl.num_heads, impl.head_size
        if self.num_heads and Hq != self.num_heads:
            raise ValueError(f"vToken scoring: layer with {Hq} query heads after layers with {self.num_heads}; "
                             "the tensor-parallel mean needs one head count per rank")
        self.num_heads = Hq
        self.num_layers += 1
        if not self.plan.out_size:
            return
        dev = kv_cache.device
        if self._out is None:
            self._out = self.plan.new_out(dev)
            self._lse = torch.empty(max(1, self.plan.lse_rows), Hq, dtype=torch.float32, device=dev)
            self._logits = torch.empty(max(1, self.plan.logits_per_head * Hq), dtype=torch.float32, device=dev)
        score_attention(query.reshape(-1, Hq, hd), kv_cache, meta.block_table, self.plan, self._out,
                        scale=impl.scale, lse=self._lse, logits=self._logits)

    def result(self) -> dict[str, tuple[Optional[np.ndarray], Optional[np.ndarray]]]:
        """req_id -> (col_sum, last_row), float64 ``[num_live]``: the mean over this rank's heads and the layers."""
        if self._out is None or not self.num_layers:
            return {}
        res = self.plan.results(self._out, float(self.num_heads * self.num_layers))
        return {rid: r for rid, r in zip(self._rids, res) if r[0] is not None or r[1] is not None}


def check_caches(core: WorkerStep, block_size: int) -> int:
    """Check every distinct KV cache view against its layout and the manager's block size.

    Returns:
        the number of distinct cache views.

    Raises:
        ValueError: a view not laid out as its ``PagedKVLayout`` says (see ``check_view``).
        VTokenConfigError: the backend split the manager's blocks into smaller kernel blocks
            (refusal ``block_size``): the block tables vToken truncates and the slot ids it moves
            are in manager blocks.
    """
    from vtoken.integrations.vllm.frontend import refusals

    caches = core.kv_caches()
    for kv, lay in caches:
        if isinstance(lay, PagedKVLayout):
            lay.check_view(kv)
        if int(kv.shape[2]) != int(block_size):
            refusals.refuse("block_size", block_size, f"the attention backend splits it into kernel blocks of "
                            f"{int(kv.shape[2])} tokens")
    return len(caches)


class GPUWorkerStep(WorkerStep):
    """:class:`WorkerStep` with device-side moves and the Triton scorer (module docstring).

    Args:
        forward_context: the runner's ``static_forward_context``.
        layout: the backend's :class:`PagedKVLayout` (every layer).
        host_batch: see :class:`GPUStepScores`; the adapter keeps it current for the step.
    """

    def __init__(self, forward_context, layout: PagedKVLayout,
                 host_batch: Callable[[], tuple[np.ndarray, np.ndarray]]):
        super().__init__(forward_context, lambda _layer, _kv: self.layout)
        self.layout = layout
        self.host_batch = host_batch
        self._staging = PinnedStaging()

    def start_scoring(self, req_ids: list[str], positions: Optional[torch.Tensor] = None) -> None:
        """Arm a :class:`GPUStepScores` for the rows of this batch that asked for scores (batch
        order) when each keeps one token set and needs only column sums or the last row; else
        the runner-neutral scorer (:meth:`WorkerStep.start_scoring`)."""
        self.step = None
        if self.score_reqs:
            rows = [(i, r, self.score_reqs[r]) for i, r in enumerate(req_ids) if r in self.score_reqs]
            simple = AttentionNeed.COL_SUM.value | AttentionNeed.LAST_ROW.value
            if rows and all(need & ~simple == 0 and (self.decisions is None or self.decisions.granularity(r) == "request")
                            for _, r, need in rows):
                self.step = GPUStepScores(rows, self.host_batch)
            elif rows:
                super().start_scoring(req_ids, positions)

    def set_layout(self, layout: PagedKVLayout) -> None:
        """Use ``layout`` from now on (vLLM records the engine's resolved layout in the worker after
        the runner is built, before the caches are allocated); forgets the cached cache list."""
        self.layout = layout
        self._caches = None

    def needs_scores(self) -> bool:
        """This step asks for scores (the CUDA-graph dispatch predicate, ``cudagraphs.py``)."""
        return bool(self.score_reqs)


# ---------------------------------------------------------------------- V1 runner
class _CUDARunnerHooks:
    """What both CUDA runners add after vLLM's own steps: the attention-backend check once the
    model is loaded, and FlashAttention's KV layout (checked against the caches) once they exist."""

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        from vtoken.integrations.vllm.frontend.platforms import check_layer_backends

        check_layer_backends(self.compilation_config.static_forward_context)

    def initialize_kv_cache(self, *args, **kwargs):
        res = super().initialize_kv_cache(*args, **kwargs)
        self._vt.set_layout(flash_attn_kv_layout(self.cache_config))
        check_caches(self._vt, self.cache_config.block_size)
        return res


class VTokenGPUModelRunner(_CUDARunnerHooks, VTokenV1Adapter, GPUModelRunner):
    """V1 CUDA ``GPUModelRunner`` with vToken (module docstring; seams in ``runner_v1.py``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._vt_route = cudagraphs.RouteStats()
        cudagraphs.install_v1_dispatch(self.cudagraph_dispatcher, self._vt.needs_scores, self._vt_route)
        self._vt_init_buffers()

    def _vt_init_buffers(self) -> None:
        """Persistent device buffers: per-request offsets (int32) and physical positions (int64)."""
        self._vt_stage = PinnedStaging()
        self._vt_off = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=self.device)
        self._vt_phys_pos = torch.zeros(self.max_num_tokens, dtype=torch.int64, device=self.device)

    def _vt_new_step(self) -> GPUWorkerStep:
        return GPUWorkerStep(self.compilation_config.static_forward_context,
                             flash_attn_kv_layout(self.cache_config), self._vt_host_batch)

    def _vt_host_batch(self) -> tuple[np.ndarray, np.ndarray]:
        n = self.input_batch.num_reqs
        return self.query_start_loc.np[: n + 1], self.optimistic_seq_lens_cpu[:n].numpy()

    def _vt_physical_inputs(self, off: np.ndarray, num_reqs: int, T: int, num_scheduled_tokens: np.ndarray) -> None:
        off_dev = self._vt_stage.copy(self._vt_off, off)  # [num_reqs] int32, pinned -> device
        self.seq_lens[:num_reqs] -= off_dev
        self.optimistic_seq_lens_cpu[:num_reqs] -= torch.from_numpy(off).to(self.optimistic_seq_lens_cpu.dtype)
        phys = self._vt_phys_pos[:T]
        torch.sub(self.positions[:T], off_dev[self.req_indices.gpu[:T]].to(torch.int64), out=phys)
        self.input_batch.block_table.compute_slot_mapping(num_reqs, self.query_start_loc.gpu[: num_reqs + 1], phys)


# ---------------------------------------------------------------------- Model Runner V2
class VTokenGPUModelRunnerV2(_CUDARunnerHooks, VTokenV2Adapter, model_runner.GPUModelRunner):
    """Model Runner V2 CUDA ``GPUModelRunner`` with vToken (module docstring; seams in ``runner_v2.py``)."""

    _vt_always_physical = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._vt_route = cudagraphs.RouteStats()
        self._vt_init_buffers()

    def _vt_init_buffers(self) -> None:
        """Persistent device buffers: per-token offsets, physical positions, per-request offsets and
        attention's physical ``seq_lens`` (the one FULL graphs capture)."""
        self._vt_stage_tok = PinnedStaging()
        self._vt_stage_req = PinnedStaging()
        self._vt_off_tok = torch.zeros(self.max_num_tokens, dtype=torch.int64, device=self.device)
        self._vt_phys_pos = torch.zeros(self.max_num_tokens, dtype=torch.int64, device=self.device)
        self._vt_off_req = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=self.device)
        self._vt_phys_seq_lens = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=self.device)
        self._vt_host: tuple[np.ndarray, np.ndarray] = (np.zeros(1, np.int32), np.zeros(0, np.int32))

    def _vt_new_step(self) -> GPUWorkerStep:
        return GPUWorkerStep(self.compilation_config.static_forward_context,
                             flash_attn_kv_layout(self.cache_config), lambda: self._vt_host)

    def update_requests(self, scheduler_output) -> None:
        # the graph manager may be (re)built after __init__: wrap its dispatch before vLLM dispatches
        cudagraphs.install_v2_dispatch(getattr(self, "cudagraph_manager", None), self._vt.needs_scores,
                                       self._vt_route)
        super().update_requests(scheduler_output)

    def prepare_attn(self, input_batch):
        # host copies for the scorer's items, physical: logical length (computed + scheduled) - offset
        self._vt_host = self._vt_host_lengths(input_batch)
        return super().prepare_attn(input_batch)

    def _vt_host_lengths(self, input_batch) -> tuple[np.ndarray, np.ndarray]:
        """``(query_start_loc [nr + 1], physical seq_lens [nr])`` on the host, batch order:
        ``num_computed_tokens + num_scheduled_tokens - offset`` (exact without speculative decoding,
        which vToken refuses)."""
        nr = input_batch.num_reqs
        n = (np.asarray(input_batch.num_computed_tokens_np[:nr], dtype=np.int64)
             + np.asarray(input_batch.num_scheduled_tokens[:nr], dtype=np.int64))
        off = self._vt.batch_offsets(list(input_batch.req_ids[:nr]))
        return np.asarray(input_batch.query_start_loc_np[: nr + 1]), (n if off is None else n - off)

    def _vt_physical_positions(self, input_batch, off: np.ndarray) -> torch.Tensor:
        n_pad = int(input_batch.positions.shape[0])
        if n_pad > self._vt_off_tok.shape[0]:  # eager-only tensors (the slot mapping is computed outside graphs)
            self._vt_off_tok = torch.zeros(n_pad, dtype=torch.int64, device=self.device)
            self._vt_phys_pos = torch.zeros(n_pad, dtype=torch.int64, device=self.device)
        per_tok = np.zeros(n_pad, dtype=np.int64)
        per_tok[: input_batch.num_tokens] = np.repeat(off, np.asarray(input_batch.num_scheduled_tokens[: len(off)]))
        off_tok = self._vt_stage_tok.copy(self._vt_off_tok, per_tok)
        phys = self._vt_phys_pos[:n_pad]
        torch.sub(input_batch.positions, off_tok, out=phys)
        return phys

    def _vt_physical_seq_lens(self, input_batch, off: Optional[np.ndarray]):
        """``input_batch`` with attention's ``seq_lens`` in the persistent physical buffer (every step)."""
        n_pad = int(input_batch.seq_lens.shape[0])
        phys = self._vt_phys_seq_lens[:n_pad]
        phys.copy_(input_batch.seq_lens)
        ub = input_batch.seq_lens_cpu_upper_bound
        if off is not None:
            n = len(off)
            phys[:n] -= self._vt_stage_req.copy(self._vt_off_req, off)
            ub = ub.clone()
            ub[:n] -= torch.from_numpy(off).to(ub.dtype)
        return dataclasses.replace(input_batch, seq_lens=phys, seq_lens_cpu_upper_bound=ub)
