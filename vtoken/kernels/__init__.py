"""KV-cache token-move kernels (see ``docs/core-contracts.md``, section ``vtoken/kernels/``).

* :func:`move_tokens_reference`: PyTorch gather-then-scatter, any device, any dtype.
* :func:`move_tokens_triton`: one Triton launch for all views (CUDA, or CPU under
  ``TRITON_INTERPRET=1``); triton is imported lazily.
* :func:`move_tokens`: Triton on CUDA, reference otherwise.

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

__all__ = [
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
