"""vToken worker and model runner (V1 runner, CPU).

``VTokenCPUWorker`` (a ``CPUWorker`` subclass, set as ``parallel_config.worker_cls``
by the plugin) builds a :class:`VTokenCPUModelRunner` by rebinding the module global
``vllm.v1.worker.cpu_worker.CPUModelRunner`` around ``init_device`` (patches/ entry).

The runner, per step, before the stock ``_update_states`` and so before the forward
and before any KV write of the step:

1. applies the step's token moves in every layer (``kv_layout.move_tokens_cpu``);
2. truncates the block-table rows of requests that freed tail blocks;
3. records the requests' offsets (logical minus live tokens).

After the stock ``_prepare_inputs`` it turns ``seq_lens`` and the slot mapping
physical (``position - offset``) while ``positions`` stay logical, so RoPE sees the
logical position and the stock kernel sees a dense sequence of live tokens.

Attention statistics for the policies are computed by a wrapper around each
attention layer's ``impl.forward`` (installed after ``load_model``), which reads the
request's keys back from the KV cache, and ride back on
``ModelRunnerOutput.vtoken_scores``.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Optional

import numpy as np
import torch

from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vtoken.integrations.vllm.kv_layout import TokenLayout, _regions, gather_keys_cpu, move_tokens_cpu, probe_cpu_layout
from vtoken.policies.base import AttentionNeed

logger = logging.getLogger("vllm.vtoken")  # a child of vLLM's logger: same handlers and format

__all__ = ["VTokenCPUWorker", "VTokenCPUModelRunner", "StepScores"]


class StepScores:
    """Accumulates one step's attention statistics per request across layers.

    For each request row that asked for scores: post-softmax probabilities of the
    step's query rows against the request's physical slots ``0..seq_len-1``, averaged
    over query heads, summed over layers; divided by the number of layers at the end
    (so: the mean over layers and heads, as ``vtoken.policies.base`` defines).

    Rows that need one query row (decode steps, and prefill rows of policies that only
    want the last row) are scored together in one batched gather + einsum per layer
    (keys padded to the longest row and masked); prefill rows that need column sums over
    several query rows take a per-row causal path. The gather indices are built once
    per step, at the first layer.
    """

    def __init__(self, rows: list[tuple[int, str, int]]):
        self.rows = rows  # (batch row, req_id, AttentionNeed value)
        self.col: dict[str, torch.Tensor] = {}
        self.last: dict[str, torch.Tensor] = {}
        self.num_layers = 0
        self._plan: Optional[dict[str, Any]] = None
        self._single_acc: Optional[torch.Tensor] = None  # float64 [R, max_n]

    def _build(self, meta, kv_cache: torch.Tensor) -> dict[str, Any]:
        qsl = meta.query_start_loc
        singles, multis = [], []
        for row, rid, need in self.rows:
            qs, qe = int(qsl[row]), int(qsl[row + 1])
            n = int(meta.seq_lens[row])
            if qe <= qs or n <= 0:
                continue
            if qe - qs == 1 or not need & AttentionNeed.COL_SUM.value:
                singles.append((row, rid, need, n, qe - 1))
            else:
                multis.append((row, rid, need, n, qs, qe))
        plan: dict[str, Any] = dict(singles=singles, multis=multis, idx={})
        if singles:
            bs = kv_cache.shape[2]
            max_n = max(x[3] for x in singles)
            s = torch.arange(max_n)
            bt = meta.block_table[torch.tensor([x[0] for x in singles])].to(torch.int64)  # [R, max_blocks]
            blocks = bt[:, (s // bs).clamp(max=bt.shape[1] - 1)].clamp(0, kv_cache.shape[0] - 1)  # [R, max_n]
            lens = torch.tensor([x[3] for x in singles])
            plan.update(blocks=blocks, offsets=s % bs, pad=s[None, :] >= lens[:, None],
                        q_index=torch.tensor([x[4] for x in singles]), max_n=max_n)
        return plan

    def accumulate(self, impl, query: torch.Tensor, kv_cache: torch.Tensor, meta, layout: TokenLayout) -> None:
        """Fold one layer's probabilities in (called by the attention wrapper, every layer)."""
        if self._plan is None:
            self._plan = self._build(meta, kv_cache)
        plan = self._plan
        self.num_layers += 1
        Hq, hd, Hkv = impl.num_heads, impl.head_size, impl.num_kv_heads
        q_all = query.view(-1, Hq, hd)
        if plan["singles"]:
            idx = plan["idx"].get(id(layout))
            if idx is None:
                idx = plan["idx"][id(layout)] = layout.idx_k[plan["offsets"]]  # [max_n, hd]
            kr, _ = _regions(kv_cache)  # [nb, bs*hd, Hkv]
            k = kr[plan["blocks"][:, :, None], idx[None]]  # [R, max_n, hd, Hkv]
            k = k.permute(0, 3, 1, 2).float()  # [R, Hkv, max_n, hd]
            R = k.shape[0]
            q = q_all[plan["q_index"]].float().view(R, Hkv, Hq // Hkv, hd)
            logits = torch.einsum("rkgd,rknd->rkgn", q, k) * impl.scale
            logits.masked_fill_(plan["pad"][:, None, None, :], float("-inf"))
            probs = torch.softmax(logits, dim=-1).mean(dim=(1, 2)).double()  # [R, max_n]
            self._single_acc = probs if self._single_acc is None else self._single_acc + probs
        for row, rid, need, n, qs, qe in plan["multis"]:
            q = q_all[qs:qe]
            ql = qe - qs
            k = gather_keys_cpu(kv_cache, layout, meta.block_table[row].to(torch.int64), n)  # [Hkv, n, hd]
            k = k.repeat_interleave(Hq // Hkv, dim=0)  # [Hq, n, hd]
            logits = torch.bmm(q.permute(1, 0, 2).float(), k.transpose(1, 2)) * impl.scale  # [Hq, ql, n]
            qpos = torch.arange(n - ql, n).view(1, ql, 1)  # query i sits at physical index n - ql + i
            logits = logits.masked_fill(torch.arange(n).view(1, 1, n) > qpos, float("-inf"))
            probs = torch.softmax(logits, dim=-1).mean(dim=0).double()  # [ql, n]
            c = probs.sum(dim=0)
            self.col[rid] = c if rid not in self.col else self.col[rid] + c
            if need & AttentionNeed.LAST_ROW.value:
                r = probs[-1]
                self.last[rid] = r if rid not in self.last else self.last[rid] + r

    def result(self) -> dict[str, tuple[Optional[np.ndarray], Optional[np.ndarray]]]:
        """req_id -> (col_sum, last_row), float64 numpy ``[num_live]`` (None where not asked)."""
        L = max(self.num_layers, 1)
        out = {}
        if self._plan is not None and self._single_acc is not None:
            acc = (self._single_acc / L).numpy()
            for i, (_, rid, need, n, _) in enumerate(self._plan["singles"]):
                row = acc[i, :n]
                col = row if need & AttentionNeed.COL_SUM.value else None
                last = row.copy() if need & AttentionNeed.LAST_ROW.value else None
                out[rid] = (col, last)
        for rid, c in self.col.items():
            r = self.last.get(rid)
            out[rid] = ((c / L).numpy(), None if r is None else (r / L).numpy())
        return out


class VTokenCPUModelRunner(CPUModelRunner):
    """``CPUModelRunner`` that applies vToken's moves and physical addressing (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._vt_offsets: dict[str, int] = {}
        self._vt_score_reqs: dict[str, int] = {}
        self._vt_step: Optional[StepScores] = None
        self._vt_caches: Optional[list[tuple[torch.Tensor, TokenLayout]]] = None
        self._vt_layouts: dict[int, TokenLayout] = {}  # data_ptr -> layout

    # -------------------------------------------------------------- set-up
    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        self._vt_wrap_attention()

    def _vt_layout_for(self, layer, kv_cache: torch.Tensor) -> TokenLayout:
        key = kv_cache.data_ptr()
        lay = self._vt_layouts.get(key)
        if lay is None:
            nb, H, bs, two_hd = kv_cache.shape
            lay = probe_cpu_layout(kv_cache.dtype, layer.isa, bs, two_hd // 2, H)
            self._vt_layouts[key] = lay
        return lay

    def _vt_wrap_attention(self) -> None:
        runner = self
        n = 0
        for name, layer in self.compilation_config.static_forward_context.items():
            impl = getattr(layer, "impl", None)
            if impl is None or not hasattr(impl, "forward") or getattr(impl, "_vt_wrapped", False):
                continue
            orig = impl.forward

            def fwd(lyr, query, key, value, kv_cache, attn_metadata, output, *a, _orig=orig, _impl=impl, **kw):
                res = _orig(lyr, query, key, value, kv_cache, attn_metadata, output, *a, **kw)
                st = runner._vt_step
                if st is not None and attn_metadata is not None and kv_cache.numel() > 0:
                    st.accumulate(_impl, query, kv_cache, attn_metadata, runner._vt_layout_for(lyr, kv_cache))
                return res

            impl.forward = fwd
            impl._vt_wrapped = True
            n += 1
        logger.debug("vToken: wrapped %d attention layers for scoring", n)

    def _vt_kv_list(self) -> list[tuple[torch.Tensor, TokenLayout]]:
        if self._vt_caches is None:
            seen: dict[int, tuple[torch.Tensor, TokenLayout]] = {}
            for name, layer in self.compilation_config.static_forward_context.items():
                kv = getattr(layer, "kv_cache", None)
                if kv is None or getattr(layer, "impl", None) is None:
                    continue
                t = kv[0] if isinstance(kv, (list, tuple)) else kv
                if not isinstance(t, torch.Tensor):
                    continue
                if t.numel() == 0 or t.data_ptr() in seen:
                    continue
                seen[t.data_ptr()] = (t, self._vt_layout_for(layer, t))
            self._vt_caches = list(seen.values())
        return self._vt_caches

    # -------------------------------------------------------------- per step
    def _update_states(self, scheduler_output):
        p = getattr(scheduler_output, "vtoken", None)
        if p is not None:
            if p.num_moves:
                src = torch.from_numpy(p.src)
                dst = torch.from_numpy(p.dst)
                for kv, lay in self._vt_kv_list():
                    move_tokens_cpu(kv, lay, src, dst)
            for rid, keep in p.truncate.items():
                rs = self.requests.get(rid)
                if rs is None:
                    continue
                for ids in rs.block_ids:
                    del ids[keep:]
                idx = self.input_batch.req_id_to_index.get(rid)
                if idx is not None:
                    self.input_batch.block_table.add_row(rs.block_ids, idx)
            for rid, off in p.offsets.items():
                if off:
                    self._vt_offsets[rid] = off
                else:
                    self._vt_offsets.pop(rid, None)
            self._vt_score_reqs = p.scores
        else:
            self._vt_score_reqs = {}
        for rid in scheduler_output.finished_req_ids:
            self._vt_offsets.pop(rid, None)
        return super()._update_states(scheduler_output)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        res = super()._prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs)
        num_reqs = self.input_batch.num_reqs
        req_ids = self.input_batch.req_ids[:num_reqs]
        if self._vt_offsets:
            off = np.fromiter((self._vt_offsets.get(r, 0) for r in req_ids), dtype=np.int64, count=num_reqs)
            if off.any():
                T = int(scheduler_output.total_num_scheduled_tokens)
                off_t = torch.from_numpy(off)
                self.seq_lens[:num_reqs] -= off_t.to(self.seq_lens.dtype)
                self.optimistic_seq_lens_cpu[:num_reqs] -= off_t.to(self.optimistic_seq_lens_cpu.dtype)
                per_tok = torch.from_numpy(np.repeat(off, num_scheduled_tokens[:num_reqs]))
                phys = self.positions[:T] - per_tok.to(self.positions.dtype)
                self.input_batch.block_table.compute_slot_mapping(num_reqs, self.query_start_loc.gpu[: num_reqs + 1], phys)
        if self._vt_score_reqs:
            rows = [(i, r, self._vt_score_reqs[r]) for i, r in enumerate(req_ids) if r in self._vt_score_reqs]
            self._vt_step = StepScores(rows) if rows else None
        else:
            self._vt_step = None
        return res

    def sample_tokens(self, *args, **kwargs):
        out = super().sample_tokens(*args, **kwargs)
        st, self._vt_step = self._vt_step, None
        if st is not None and out is not None and hasattr(out, "sampled_token_ids"):
            scores = st.result()
            if scores:
                if out is EMPTY_MODEL_RUNNER_OUTPUT:
                    out = copy.copy(out)
                out.vtoken_scores = scores
        return out


class VTokenCPUWorker(CPUWorker):
    """``CPUWorker`` that builds :class:`VTokenCPUModelRunner` (V1 runner only)."""

    def init_device(self) -> None:
        import vllm.v1.worker.cpu_worker as cpu_worker_mod

        if getattr(self, "use_v2_model_runner", False):
            raise RuntimeError("vToken needs the V1 model runner: set VLLM_USE_V2_MODEL_RUNNER=0")
        orig = cpu_worker_mod.CPUModelRunner
        cpu_worker_mod.CPUModelRunner = VTokenCPUModelRunner
        try:
            super().init_device()
        finally:
            cpu_worker_mod.CPUModelRunner = orig
