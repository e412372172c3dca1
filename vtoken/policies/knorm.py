"""K-norm: keep the keys with the smallest L2 norm (Devoto et al., arXiv 2406.11430)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from vtoken.policies.base import AttentionNeed, BatchedFields, EvictionPolicy

__all__ = ["KNormPolicy", "NORM_BITS", "round_norm"]

#: significant bits a key norm keeps (:func:`round_norm`)
NORM_BITS = 12


def round_norm(x):
    """Round norms (float64 tensor) to :data:`NORM_BITS` significant bits; ``NaN`` stays.

    Keys that are equal before RoPE (a repeated token's key in the first layer, which sees no
    context yet) have equal norms in exact arithmetic, but the rotation rounds differently at
    each position, and differently in every RoPE implementation (vLLM's and transformers'), so
    their float norms differ in the last bits and the order of such a tie would depend on
    rounding noise. Rounded to 12 significant bits (relative spacing 2.4e-4, far above the
    rotation's 1e-7 noise and far below any difference that matters to the policy) they tie
    exactly, and the tie goes to the older token, as for every policy.
    """
    scale = float(1 << NORM_BITS)
    m, e = torch.frexp(x)
    return torch.ldexp(torch.round(m * scale) / scale, e.to(x.dtype))


@dataclass
class KNormPolicy(EvictionPolicy):
    """K-norm, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"
    (Devoto et al., EMNLP 2024, arXiv 2406.11430, Sec. 3-4).

    Idea: in trained decoders a key's L2 norm is inversely correlated with the attention it
    receives, so the keys with the **lowest** norm are the ones to keep. The score needs no
    attention weights: only the key, at the time it is written.

    Score: ``-norm``, the L2 norm of the token's key (``stats.key_norm``), recorded once, in the
    step that writes the key, rounded to 12 significant bits (:func:`round_norm`: equal keys
    tie exactly whatever RoPE's rounding), and kept with the token. RoPE is a rotation, so the norm of the
    cached (rotated) key is that of the raw key. With several (layer, KV head) pairs in a token
    set the norm is their mean (``docs/granularity.md``).

    Defaults: ``granularity = head`` (the paper compresses each head's cache by its own norms;
    on the worker), no protections (``sink_tokens = 0``, ``recent_tokens = 0``;
    the paper ranks every token by its norm: the first tokens, whose keys have small norms,
    survive by that rule), ``slack = 0``.

    Needs: ``AttentionNeed.KEY_NORM``: the norms of the keys written in each step, computed on
    the worker from the keys the attention layer receives (no pass over the KV cache).

    Departures from the paper:

    * Every layer is compressed, including the first ones, which the paper leaves uncompressed
      in its main experiments (their norms predict attention less well).
    * With ``granularity`` other than ``head`` a set ranks the mean norm of its heads.
    * Ties go to the smaller logical position (evicted first).
    """

    name: ClassVar[str] = "knorm"
    paper: ClassVar[str] = 'K-norm, arXiv 2406.11430'
    summary: ClassVar[str] = 'smallest key L2 norm, recorded when the key is written'
    needs: ClassVar[AttentionNeed] = AttentionNeed.KEY_NORM
    prompt_statistics: ClassVar[bool] = True
    observes_written_only: ClassVar[bool] = True

    @classmethod
    def default_granularity(cls) -> str:
        return "head"

    def side_specs(self):
        return {"norm": ((), torch.float64)}

    def observe_batched(self, fields: BatchedFields, live, col_sum, last_row,
                        key_norm: Optional[torch.Tensor] = None, **_) -> None:
        if key_norm is not None:
            kn = key_norm.to(torch.float64)
            fields["norm"].copy_(torch.where(torch.isnan(kn), fields["norm"], round_norm(kn)))

    def score_batched(self, fields: BatchedFields, logical_pos, live) -> torch.Tensor:
        return -fields["norm"]
