"""KV-cache token-move kernels (see ``docs/core-contracts.md``, section ``vtoken/kernels/``).

* :func:`move_tokens_reference`: PyTorch gather-then-scatter, any device, any dtype.
* :func:`move_tokens_triton`: one Triton launch for all views (CUDA, or CPU under
  ``TRITON_INTERPRET=1``); triton is imported lazily.
* :func:`move_tokens`: Triton on CUDA, reference otherwise.
* :func:`move_tokens_paged` (``_reference`` / ``_triton``): the same for vLLM's per-layer
  paged views ``[num_blocks, H, block_size, 2*head_size]`` in any ``KVCacheLayout``.
* :func:`score_attention` (``_reference`` / ``_triton``) with :func:`plan_scores`: the
  policies' attention statistics read back from the paged K cache (``vtoken.kernels.score``).

This package never imports vllm.
"""

from vtoken.kernels.move import (
    move_tokens,
    move_tokens_paged,
    move_tokens_paged_reference,
    move_tokens_paged_triton,
    move_tokens_reference,
    move_tokens_triton,
    triton_available,
    validate_moves,
    validate_paged_caches,
    validate_views,
)
from vtoken.kernels.score import (
    ScorePlan,
    ScoreRow,
    plan_scores,
    score_attention,
    score_attention_reference,
    score_attention_triton,
    step_score_row,
)

__all__ = [
    "ScorePlan",
    "ScoreRow",
    "plan_scores",
    "score_attention",
    "score_attention_reference",
    "score_attention_triton",
    "step_score_row",
    "move_tokens",
    "move_tokens_paged",
    "move_tokens_paged_reference",
    "move_tokens_paged_triton",
    "move_tokens_reference",
    "move_tokens_triton",
    "triton_available",
    "validate_moves",
    "validate_paged_caches",
    "validate_views",
]
