"""Scissorhands: persistence of importance (Liu et al., arXiv 2305.17118)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vtoken.policies.base import AttentionNeed, EvictionPolicy, check_int_field

__all__ = ["ScissorhandsPolicy"]


@dataclass
class ScissorhandsPolicy(EvictionPolicy):
    """Scissorhands (Liu et al., NeurIPS 2023, "Scissorhands: Exploiting the Persistence
    of Importance Hypothesis for LLM KV Cache Compression at Test Time",
    arXiv 2305.17118, Sec. 3-4, Algorithm 1 (budget) and 2 (compression)).

    Idea: "persistence of importance": tokens that were pivotal at one step stay
    pivotal later. Over a history window of the last ``window`` steps, count for each
    token the steps in which it received less than uniform attention
    (``prob < 1/t``, ``t`` = number of keys attended at that step). Tokens that were
    often unimportant are dropped; the ones with low counts are kept. Compression runs
    in batches: once the cache passes its limit, ``m`` tokens are dropped at once, so
    the work happens once every ``m`` tokens.

    State: a ring buffer ``hist`` of ``window`` boolean rows over the slots (``True`` =
    below uniform at that step) and the ring index ``state.extra["ring"]``. A step
    with ``stats.last_row`` overwrites the oldest row; tokens absent at a step (not
    yet written) count 0 for it. Score: ``-count`` (higher = keep). The batched worker
    path keeps the same window packed: per slot and token set,
    ``ceil(window / 64)`` int64 words (bit ``j`` of word ``w`` = ring row ``64 w + j``) and
    the running count (int32), so a step reads and writes one word and one count per slot
    (12 bytes per slot and set at ``window <= 64``, not ``window`` booleans).

    Fields:
        window: history length in steps (>= 1). Built from a config without a
            ``policy_args.window``, it is ``max(1, budget // 2)``; built directly, 128
            (i.e. ``256 // 2`` for the config's default budget of 256).

    Defaults (tokens, ``B`` = ``vtoken.budget``), and where they come from. The
    reference notes could not verify the paper's own values of the history window
    ``w``, the recent window ``r`` and the drop size ``m``; these follow the
    ratios of one third-party reimplementation, ``w = 0.5B``, ``r = 0.25B``,
    ``m = 0.5B``, and **are to be checked against the paper's Algorithm 1**:

    * ``window = max(1, B // 2)`` steps (``w = 0.5B``);
    * ``recent_tokens = B // 4`` (``r = 0.25B``, the paper's step that zeroes the
      counts of the most recent tokens, expressed as a protection);
    * ``slack = B // 2`` (``m = 0.5B``): with vToken's pacing the cache grows to
      ``B + m`` tokens, then ``m`` tokens are dropped at once, back to ``B``. Note
      that the reimplementation's ``B`` is the *peak* (compress when the cache
      reaches B, down to B - m) whereas ``vtoken.budget`` is the size *after*
      compression; set ``vtoken.slack`` explicitly for an equal-peak comparison.
    * ``sink_tokens = 0`` (the paper has no explicit sinks).

    Needs: ``AttentionNeed.LAST_ROW`` (the last query row of every step that samples
    a token; non-final prefill chunks add no history row).

    Departures from the paper:

    * Token sets (``granularity``, ``docs/granularity.md``): by default one set per (layer, KV head), as the paper budgets each
      head, with the row of a KV head the mean over its query heads before the
      ``< 1/t`` test (a mean keeps each row a distribution, so the test keeps its
      meaning). ``layer``, ``head_shared`` and ``request`` average over the layer's, the KV head's across layers,
      or every query head.
    * The prompt contributes a single history row (its last query row), not one row
      per prompt query.
    * ``t`` is the number of live keys at the step (the cache size after earlier
      evictions), not the number of tokens generated so far.
    * Ties in the count go to the smaller logical position (evicted first).
    """

    name: ClassVar[str] = "scissorhands"
    paper: ClassVar[str] = 'Scissorhands, arXiv 2305.17118'
    summary: ClassVar[str] = 'steps below uniform attention in a history window'
    needs: ClassVar[AttentionNeed] = AttentionNeed.LAST_ROW
    #: the prompt adds one history row, its last query's, which a request computes even after a
    #: prefix-cache hit, so a hit needs no protection (tests/integration/test_prefix_caching.py)
    prompt_statistics: ClassVar[bool] = False

    window: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int_field(self.name, "window", self.window, 1)

    # ----- defaults -----
    @classmethod
    def default_granularity(cls) -> str:
        return "head"

    @classmethod
    def default_window(cls, budget: int) -> int:
        """History window in steps when ``policy_args`` leaves ``window`` unset."""
        return max(1, budget // 2)

    @classmethod
    def default_recent_tokens(cls, budget: int) -> int:
        return budget // 4

    @classmethod
    def default_slack(cls, budget: int) -> int:
        return budget // 2

    @classmethod
    def default_args(cls, budget: int) -> dict:
        return {"window": cls.default_window(budget)}

    def side_specs(self):
        # the window's bits packed 64 to an int64 word (bit j of word w: step w * 64 + j of the
        # ring), and their running count, so a step touches one word and one count per slot
        # instead of summing ``window`` booleans (``docs/granularity.md``, cost)
        return {"hist": ((-(-self.window // 64),), torch.int64), "cnt": ((), torch.int32)}

    def request_specs(self):
        return {"ring": torch.int64}

    def observe_batched(self, fields, live, col_sum, last_row) -> None:
        if last_row is None:
            return
        hist, cnt, ring = fields["hist"], fields["cnt"], fields["ring"]  # [R, N, words] int64, [R, N], [R]
        r, n = last_row.shape
        cols = torch.arange(n, device=last_row.device)[None, :]
        t = live.clamp(min=1).to(torch.float64)[:, None]
        below = (last_row.to(torch.float64) < 1.0 / t) & (cols < live[:, None])
        at = ring % self.window
        idx = (at // 64)[:, None, None].expand(r, n, 1)
        bit = (at % 64)[:, None]
        word = hist.gather(2, idx)[:, :, 0]  # [R, N]
        old = torch.bitwise_and(torch.bitwise_right_shift(word, bit), 1)  # (arithmetic shift: bit 63 too)
        new = below.to(torch.int64)
        on = (live > 0)[:, None]  # the per-request path skips a request with no live token
        mask = torch.bitwise_left_shift(torch.ones_like(bit), bit)
        word = torch.where(on, torch.bitwise_or(torch.bitwise_and(word, torch.bitwise_not(mask)),
                                                torch.bitwise_left_shift(new, bit)), word)
        hist.scatter_(2, idx, word[:, :, None])
        cnt.add_(torch.where(on, new - old, 0).to(cnt.dtype))
        ring.copy_(torch.where(live > 0, (ring + 1) % self.window, ring))

    def score_batched(self, fields, logical_pos, live) -> torch.Tensor:
        return -fields["cnt"].to(torch.float64)
