"""vToken adapter for vLLM's Model Runner V2 (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``
and its CPU subclass ``vllm.v1.worker.cpu.model_runner.CPUModelRunner``).

Seams (patches/ entries under ``vllm.v1.worker.gpu.model_runner.GPUModelRunner``):

* ``finish_requests``: offsets of finished and preempted requests are dropped.
* ``update_requests``: before the stock method (which appends this step's new blocks, zeroes
  fresh blocks and applies copy-on-write copies) and so before any KV write of the step,
  :meth:`~vtoken.integrations.vllm.worker.step.WorkerStep.begin_step` applies the
  moves, and each truncated row is rewritten from the kept block ids
  (``BlockTables.append_block_ids(..., overwrite=True)``: Model Runner V2 keeps no host copy
  of its block tables, so the payload carries the ids).
* ``prepare_attn``: the slot mapping is computed from **physical** positions
  (``dataclasses.replace(input_batch, positions=physical)``); everything else, RoPE and the
  sampler included, keeps the logical ``input_batch.positions``.
* ``model_state.prepare_attn`` (wrapped per instance in ``load_model``): attention metadata is
  built from physical ``seq_lens`` and ``seq_lens_cpu_upper_bound`` held in separate
  tensors. ``input_batch.seq_lens`` itself stays logical: Model Runner V2's
  ``combine_sampled_and_draft_tokens`` and its sampler classify a row as a chunked prefill
  when ``seq_len < prefill_len``, so a physical value there would silently drop the sampled
  token of every request whose live tokens fall below its prompt length.
* ``sample_tokens``: the step's attention statistics are folded into the side cache, and
  Naive-Evict's changed freed-block counts ride on its output.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from vllm.v1.worker.cpu.model_runner import CPUModelRunner

from vtoken.integrations.vllm.worker.runner_v1 import cpu_layout_for
from vtoken.integrations.vllm.worker.step import WorkerStep

__all__ = ["VTokenV2Adapter", "VTokenCPUModelRunnerV2"]


class VTokenV2Adapter:
    """vToken's seams on a Model Runner V2 runner (module docstring); mixed in before the runner class.

    Hooks a device-specific runner overrides: :meth:`_vt_new_step`, :meth:`_vt_physical_positions`,
    :meth:`_vt_physical_seq_lens` and :attr:`_vt_always_physical` (route attention's ``seq_lens``
    through the hook on every step, offsets or not: CUDA graphs capture the buffer it returns).
    ``gpu_runner.VTokenGPUModelRunnerV2`` is the CUDA one.
    """

    _vt_always_physical = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._vt = self._vt_new_step()
        #: this step's per-row offsets (batch order), set by prepare_attn for the metadata build
        self._vt_batch_off: Optional[np.ndarray] = None

    def _vt_new_step(self) -> WorkerStep:
        return WorkerStep(self.compilation_config.static_forward_context, cpu_layout_for)

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        self._vt.check_layers(self.model_config.model)
        self._vt.find_rope(self.model, ((self.vllm_config.additional_config or {}).get("vtoken") or {}).get("policy"))
        self._vt.wrap_attention()
        ms = self.model_state
        orig = ms.prepare_attn
        runner = self

        def prepare_attn(input_batch, *a, **kw):
            off, runner._vt_batch_off = runner._vt_batch_off, None
            if off is not None or runner._vt_always_physical:
                input_batch = runner._vt_physical_seq_lens(input_batch, off)
            return orig(input_batch, *a, **kw)

        ms.prepare_attn = prepare_attn

    # -------------------------------------------------------------- per step
    def finish_requests(self, scheduler_output) -> None:
        super().finish_requests(scheduler_output)
        self._vt.forget(scheduler_output.finished_req_ids)
        self._vt.forget(scheduler_output.preempted_req_ids or ())

    def update_requests(self, scheduler_output) -> None:
        p = getattr(scheduler_output, "vtoken", None)
        self._vt.begin_step(p, (), scheduler_output)
        if p is not None:
            for rid, kept in p.kept_blocks.items():
                idx = self.req_states.req_id_to_index.get(rid)
                if idx is not None:
                    self.block_tables.append_block_ids(idx, (list(kept),), overwrite=True)
        super().update_requests(scheduler_output)

    def prepare_attn(self, input_batch):
        req_ids = list(input_batch.req_ids[: input_batch.num_reqs])
        off = self._vt.batch_offsets(req_ids)
        self._vt_batch_off = off
        self._vt.start_scoring(req_ids, input_batch.positions)
        if off is None:
            res = super().prepare_attn(input_batch)
        else:
            phys = self._vt_physical_positions(input_batch, off)
            res = super().prepare_attn(dataclasses.replace(input_batch, positions=phys))
        return res

    def _vt_physical_positions(self, input_batch, off: np.ndarray) -> torch.Tensor:
        """``input_batch.positions`` minus each token's request offset (a new tensor)."""
        n_tok = input_batch.num_tokens
        per_tok = np.zeros(input_batch.positions.shape[0], dtype=np.int64)
        per_tok[:n_tok] = np.repeat(off, np.asarray(input_batch.num_scheduled_tokens[: len(off)]))
        return input_batch.positions - torch.from_numpy(per_tok).to(input_batch.positions.device,
                                                                   input_batch.positions.dtype)

    def _vt_physical_seq_lens(self, input_batch, off: np.ndarray):
        """A copy of ``input_batch`` whose ``seq_lens`` / upper bound are physical (new tensors)."""
        n = len(off)
        off_t = torch.from_numpy(off)
        seq_lens = input_batch.seq_lens.clone()
        seq_lens[:n] -= off_t.to(seq_lens.device, seq_lens.dtype)
        ub = input_batch.seq_lens_cpu_upper_bound.clone()
        ub[:n] -= off_t.to(ub.dtype)
        return dataclasses.replace(input_batch, seq_lens=seq_lens, seq_lens_cpu_upper_bound=ub)

    def sample_tokens(self, *args, **kwargs):
        out = super().sample_tokens(*args, **kwargs)
        self._vt.finish_step()
        return self._vt.attach_naive_freed(out, self._vt.take_naive_freed())


class VTokenCPUModelRunnerV2(VTokenV2Adapter, CPUModelRunner):
    """Model Runner V2 ``CPUModelRunner`` with vToken (module docstring)."""
