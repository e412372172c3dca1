"""SnapKV: keep the prompt tokens its last queries attend to (Li et al., arXiv 2404.14469)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from vtoken.policies.base import AttentionNeed, BatchedFields, EvictionPolicy, check_int_field

__all__ = ["SnapKVPolicy", "pool_logical"]


def pool_logical(x: torch.Tensor, logical_pos: torch.Tensor, live: torch.Tensor, kernel: int) -> torch.Tensor:
    """SnapKV's 1-D average pooling over neighbouring tokens, in logical order.

    Args:
        x: float64 ``[R, N]`` per-slot values (slots at and past ``live[r]`` are ignored).
        logical_pos: int64 ``[R, N]`` each slot's logical position.
        live: int64 ``[R]``.
        kernel: odd pooling width; stride 1, zero padding of ``kernel // 2`` on both sides, the
            sum always divided by ``kernel`` (``torch.nn.functional.avg_pool1d`` with
            ``count_include_pad=True``; Li et al., Sec. 4.2, "clustering via pooling").

    Returns:
        float64 ``[R, N]``: each live slot's value averaged with its ``kernel // 2`` live
        neighbours on each side in logical order (the live tokens, not the evicted ones, are
        neighbours); 0 past ``live``.
    """
    r, n = x.shape
    if n == 0:
        return x.clone()
    cols = torch.arange(n, device=x.device)[None, :]
    mask = cols < live[:, None]
    big = torch.iinfo(torch.int64).max
    order = torch.argsort(torch.where(mask, logical_pos, big), dim=1, stable=True)  # live slots first, logical order
    xs = torch.where(mask, x, 0.0).gather(1, order)
    pooled = torch.nn.functional.avg_pool1d(xs[:, None, :], kernel, stride=1, padding=kernel // 2,
                                            count_include_pad=True)[:, 0, :]
    out = torch.zeros_like(x).scatter_(1, order, pooled)
    return torch.where(mask, out, 0.0)


@dataclass
class SnapKVPolicy(EvictionPolicy):
    """SnapKV, "LLM Knows What You are Looking for Before Generation" (Li et al., NeurIPS 2024,
    arXiv 2404.14469, Sec. 4, Algorithm 1).

    Idea: the attention of the prompt's last ``window`` queries (the "observation window")
    predicts which prompt tokens generation will attend to. Per head, a token's score is the
    sum of that window's attention to it, pooled over neighbouring positions (1-D pooling,
    ``kernel`` wide) so that a selected token keeps its context; the top-scored tokens are
    kept, with the window itself.

    Statistic: ``AttentionNeed.WINDOW``: the column sums of the step's last ``window`` query
    rows (``col_sum``, averaged over the set's heads and layers); at the end of the prompt that
    is the observation window. A step without a last row (``last_row`` None: vLLM cut the window
    before an eviction point into several chunks) holds its column sums until the step that ends
    the window, which pools them with its own, so the window is the ``window`` rows before each
    point whatever the chunks.

    Score: the accumulated pooled statistic (:func:`pool_logical`: average pooling, in logical
    order over the live tokens).

    Decode (the paper compresses the prompt once, then keeps every generated token): each
    decode step adds its one query's pooled attention to the scores, so once the request is
    over its budget again the tokens the recent queries ignore go first, H2O-style, with the
    observation window's scores as the prompt tokens' start.

    Defaults: ``window = min(32, max(1, budget // 4))`` (the paper's 32, reduced for small
    budgets), ``kernel = 7``, ``recent_tokens`` = the default window (the observation window is
    always kept), no sinks, ``granularity = head`` (the paper selects per head; the
    worker reads ``window`` from the request's policy), ``slack = 0``.

    Departures from the paper:

    * Average pooling only (the paper offers max and average; its code defaults to average).
    * The decode rule above (the paper keeps every generated token uncompressed).
    * With ``prefill_eviction: chunks`` (the default) the prompt is
      cut at its eviction points (``prefill_eviction_every``), the ``window`` queries before each
      point scoring it (the paper
      compresses the whole prompt once, from its last queries); with ``after`` the window is the
      prompt's last queries, as in the paper. The windows' scores add up, so with ``head`` or
      ``layer`` sets a set may keep what the earlier windows attended to over what the question
      does: on the needle task it then loses the needle, where ``after`` or ``request`` sets keep it
      (``benchmarks/README.md``, "Task accuracy"; :meth:`known_weaknesses` warns at start-up).
    * With ``granularity`` other than ``head`` a set scores the mean over its heads.
    * Ties go to the smaller logical position (evicted first).
    """

    name: ClassVar[str] = "snapkv"
    paper: ClassVar[str] = 'SnapKV, arXiv 2404.14469'
    summary: ClassVar[str] = "attention of the prompt's last queries (window), pooled"
    needs: ClassVar[AttentionNeed] = AttentionNeed.COL_SUM | AttentionNeed.LAST_ROW | AttentionNeed.WINDOW
    prompt_statistics: ClassVar[bool] = True
    #: the batched observe pools in logical order, so it needs each slot's logical position
    observe_needs_pos: ClassVar[bool] = True

    window: int = 32
    kernel: int = 7

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int_field(self.name, "window", self.window, 1)
        check_int_field(self.name, "kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise ValueError(f"{self.name}: kernel = {self.kernel}; allowed: an odd integer >= 1")

    @classmethod
    def default_granularity(cls) -> str:
        return "head"

    @classmethod
    def default_window(cls, budget: int) -> int:
        return min(32, max(1, budget // 4))

    @classmethod
    def default_args(cls, budget: int) -> dict:
        return {"window": cls.default_window(budget)}

    @classmethod
    def default_recent_tokens(cls, budget: int) -> int:
        return cls.default_window(budget)

    @classmethod
    def known_weaknesses(cls, granularity: str, prefill_eviction: str) -> list[str]:
        """With ``chunks`` and sets other than ``request`` the windows' scores add up, so a set keeps
        what earlier windows attended to over what the question does: on the needle task it loses
        the needle (``benchmarks/README.md``, "Task accuracy"; the dense oracle agrees, so this is
        the rule, not the engine)."""
        if prefill_eviction == "chunks" and granularity != "request":
            return [f"policy snapkv with prefill_eviction chunks and granularity {granularity!r} loses what the "
                    "prompt's last queries attend to (the needle task in benchmarks/README.md, 'Task accuracy'); "
                    "prefill_eviction 'after' or granularity 'request' keep it"]
        return []

    def keeps_hit(self, prompt_len: int, hit: int) -> bool:
        """The observation window is the prompt's last ``window`` queries: when the part after
        the hit holds all of them, the request computes them itself and needs nothing of the
        hit's tokens (a hit stops at least one token short of the prompt)."""
        return prompt_len - hit < self.window

    def side_specs(self):
        # score: the pooled windows so far; pend: the column sums of a window's rows computed in
        # an earlier step than its last row (vLLM cut the window into several chunks), pooled
        # with the step that ends it, as if the window were one step (pooling is not additive
        # over steps: its edges depend on the live tokens)
        return {"score": ((), torch.float64), "pend": ((), torch.float64)}

    def observe_batched(self, fields: BatchedFields, live, col_sum, last_row, **_) -> None:
        if col_sum is None:
            return
        on = live[:, None] > 0
        col = torch.where(on, torch.nan_to_num(col_sum.to(torch.float64)), 0.0)
        pend = fields["pend"]
        if last_row is None:  # a window's rows before its last (observe)
            pend.add_(col)
            return
        pooled = pool_logical(col + pend, fields["pos"], live, self.kernel)
        fields["score"].add_(torch.where(on, pooled, 0.0))
        pend.zero_()

    def score_batched(self, fields: BatchedFields, logical_pos, live) -> torch.Tensor:
        return fields["score"]
