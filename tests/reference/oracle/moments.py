"""Expected Attention's query statistics in the oracle (:class:`QueryMoments`)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


class QueryMoments:
    """Expected Attention's query statistics in the oracle: per layer and query head, the sums of
    the pre-RoPE queries and of their outer products (the **full** ``D x D`` second moment; the
    engine keeps RoPE pairs only), from a forward hook on each layer's ``self_attn.q_proj``
    (pre-RoPE by construction in Llama-style models), on its ``self_attn.q_norm`` in a family
    that normalizes queries between the projection and RoPE (Qwen3, Qwen3-MoE, OLMo 2), or on
    the query columns (the first ``Hq * D``) of a fused ``self_attn.qkv_proj`` (Phi-3): the
    queries RoPE rotates, which the engine recovers by un-rotating; queries at logical
    positions below ``QUERY_SKIP`` left out.

    Raises:
        ValueError: the model has neither ``self_attn.q_proj`` nor ``self_attn.qkv_proj`` modules.
    """

    def __init__(self, model):
        cfg = model.config
        self.hq = int(cfg.num_attention_heads)
        self.d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.projs = [m for name, m in model.named_modules() if name.endswith("self_attn.q_proj")]
        self.q_cols: Optional[int] = None  # a fused projection: the query columns come first
        if not self.projs:
            self.projs = [m for name, m in model.named_modules() if name.endswith("self_attn.qkv_proj")]
            self.q_cols = self.hq * self.d if self.projs else None
        normed = [m for name, m in model.named_modules() if name.endswith("self_attn.q_norm")]
        if normed and len(normed) == len(self.projs):  # QK-norm: the normalized queries are RoPE's input
            self.projs, self.q_cols = normed, None
        if not self.projs:
            raise ValueError("oracle_generate: expected_attention needs the model's self_attn.q_proj "
                             "(or fused self_attn.qkv_proj) modules")
        self.captured: list[Optional[torch.Tensor]] = [None] * len(self.projs)
        self.qsum = torch.zeros(len(self.projs), self.hq, self.d, dtype=torch.float64)
        self.qouter = torch.zeros(len(self.projs), self.hq, self.d, self.d, dtype=torch.float64)
        self.count = 0
        self.hooks = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.projs)]

    def _hook(self, i: int):
        def fn(_mod, _inp, out):
            self.captured[i] = out.detach()
        return fn

    def add(self, positions: np.ndarray) -> None:
        """Fold the queries of the forward that just ran (tokens at ``positions``, int64 ``[q]``)."""
        from vtoken.policies.expected_attention import QUERY_SKIP

        keep = torch.from_numpy(positions >= QUERY_SKIP)
        for i, out in enumerate(self.captured):
            if out is None:
                raise RuntimeError(f"oracle_generate: layer {i}'s q_proj did not run in this forward (a model wrapper "
                                   "that skips the model's forward must replay q_proj's output to its hooks)")
            if self.q_cols is not None:
                out = out[..., :self.q_cols]
            q = out[0].reshape(-1, self.hq, self.d).to(torch.float64).cpu()[keep]  # [q', Hq, D]
            self.qsum[i] += q.sum(dim=0)
            self.qouter[i] += torch.einsum("thd,the->hde", q, q)
        self.count += int(keep.sum())
        self.captured = [None] * len(self.projs)

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
