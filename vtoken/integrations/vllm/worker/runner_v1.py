"""vToken adapter for vLLM's V1 model runner (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``
and its CPU subclass ``vllm.v1.worker.cpu_model_runner.CPUModelRunner``).

Seams (patches/ entries under ``vllm.v1.worker.gpu_model_runner.GPUModelRunner``):

* ``_update_states``: before the stock method (so before the forward and any KV write),
  :meth:`~vtoken.integrations.vllm.worker.step.WorkerStep.begin_step` applies the
  cached blocks' copies and the moves; the request's ``block_ids`` and its row of the input
  batch's block table get the copies' block ids (``payload.unshare``) and are cut to the kept
  prefix.
* ``_prepare_inputs``: after the stock method, ``seq_lens`` (and the pinned
  ``optimistic_seq_lens_cpu``) and the slot mapping become physical (``position - offset``)
  while ``positions`` stay logical. The V1 sampler reads neither buffer, so subtracting in
  place is safe here (unlike Model Runner V2, see ``runner_v2.py``).
* ``sample_tokens``: the step's attention statistics are folded into the side cache, and
  Naive-Evict's changed freed-block counts ride on its output.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vtoken.integrations.vllm.worker.kv_layout import KVLayout, cpu_kv_layout
from vtoken.integrations.vllm.worker.step import WorkerStep

#: torch -> numpy integer dtypes of the runner's host tensors (:meth:`VTokenV1Adapter._vt_physical_inputs`)
_NP = {torch.int32: np.int32, torch.int64: np.int64}

__all__ = ["VTokenV1Adapter", "VTokenCPUModelRunner", "cpu_layout_for"]


def cpu_layout_for(layer, kv_cache: torch.Tensor) -> KVLayout:
    """The CPU attention backend's layout of one layer (``[num_blocks, H, block_size, 2*hd]``)."""
    nb, H, bs, two_hd = kv_cache.shape
    return cpu_kv_layout(kv_cache.dtype, layer.isa, bs, two_hd // 2, H)


class VTokenV1Adapter:
    """vToken's seams on a V1 runner (module docstring); mixed in before the runner class.

    Hooks a device-specific runner overrides: :meth:`_vt_new_step` (the worker step and its
    KV layout) and :meth:`_vt_physical_inputs` (how ``seq_lens`` and the slot mapping become
    physical). ``gpu_runner.VTokenGPUModelRunner`` is the CUDA one.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._vt = self._vt_new_step()

    def _vt_new_step(self) -> WorkerStep:
        return WorkerStep(self.compilation_config.static_forward_context, cpu_layout_for)

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        self._vt.check_layers(self.model_config.model)
        self._vt.find_rope(self.model, ((self.vllm_config.additional_config or {}).get("vtoken") or {}).get("policy"))
        self._vt.wrap_attention()

    def _update_states(self, scheduler_output):
        p = getattr(scheduler_output, "vtoken", None)
        if self._vt.test_dir:  # test hook: finished requests' live keys, before this step's moves
            for rid in scheduler_output.finished_req_ids:
                rs = self.requests.get(rid)
                if rs is not None:
                    self._vt.dump_kv_digest(rid, list(rs.block_ids[0]), rs.num_computed_tokens - self._vt.offsets.get(rid, 0))
        self._vt.begin_step(p, scheduler_output.finished_req_ids, scheduler_output)
        if p is not None:
            for rid in p.truncate.keys() | p.unshare.keys():
                rs = self.requests.get(rid)
                if rs is None:
                    continue
                for i, _, new in p.unshare.get(rid, ()):  # prefix caching: a cached block's private copy
                    if i < len(rs.block_ids[0]):  # (a resumed request's ids are replaced by the step's anyway)
                        rs.block_ids[0][i] = new
                keep = p.truncate.get(rid)
                if keep is not None:
                    for ids in rs.block_ids:
                        del ids[keep:]
                idx = self.input_batch.req_id_to_index.get(rid)
                if idx is not None:
                    self.input_batch.block_table.add_row(rs.block_ids, idx)
        return super()._update_states(scheduler_output)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        res = super()._prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs)
        num_reqs = self.input_batch.num_reqs
        req_ids = self.input_batch.req_ids[:num_reqs]
        off = self._vt.batch_offsets(req_ids)
        if off is not None:
            self._vt_physical_inputs(off, num_reqs, int(scheduler_output.total_num_scheduled_tokens),
                                     num_scheduled_tokens)
        self._vt.start_scoring(req_ids, self.positions[: int(scheduler_output.total_num_scheduled_tokens)])
        return res

    def _vt_physical_inputs(self, off: np.ndarray, num_reqs: int, T: int, num_scheduled_tokens: np.ndarray) -> None:
        """``seq_lens`` / ``optimistic_seq_lens_cpu`` minus the offsets, slot mapping from ``position - offset``."""
        # (host arrays converted on the host, in-place sub_ on the slices: few torch ops per step)
        self.seq_lens[:num_reqs].sub_(torch.from_numpy(off.astype(_NP[self.seq_lens.dtype], copy=False)))
        self.optimistic_seq_lens_cpu[:num_reqs].sub_(
            torch.from_numpy(off.astype(_NP[self.optimistic_seq_lens_cpu.dtype], copy=False)))
        per_tok = np.repeat(off.astype(_NP[self.positions.dtype], copy=False), num_scheduled_tokens[:num_reqs])
        phys = self.positions[:T] - torch.from_numpy(per_tok)
        self.input_batch.block_table.compute_slot_mapping(num_reqs, self.query_start_loc.gpu[: num_reqs + 1], phys)

    def sample_tokens(self, *args, **kwargs):
        out = super().sample_tokens(*args, **kwargs)
        self._vt.finish_step()
        return self._vt.attach_naive_freed(out, self._vt.take_naive_freed())


class VTokenCPUModelRunner(VTokenV1Adapter, CPUModelRunner):
    """V1 ``CPUModelRunner`` with vToken's moves, physical addressing and scores (module docstring)."""
