"""Token moves inside paged KV caches: validation, the PyTorch reference, and dispatch.

A *token move* copies the cached K/V row of one slot to another slot, in every layer. The
repacker uses it to fill holes left by evicted tokens so that whole tail blocks can be freed.

Terminology used throughout ``vtoken.kernels``:

* **view**: a 2-D tensor ``[num_slots, row]`` that addresses one cache tensor (one layer's K,
  one layer's V, or a fused K/V row) by *global* slot id ``block_id * block_size + offset``.
  Rows must be contiguous (``stride(1) == 1``); the slot stride ``stride(0)`` may be anything
  ``>= row`` (for example the K half of a ``[2, num_blocks, block_size, H, hd]`` cache,
  ``kv[0].view(num_blocks * block_size, H * hd)``, or a slot-strided view of an
  ``[num_blocks, block_size, 2, H, hd]`` cache). All views of one call share shape, dtype and
  device.
* **paged cache**: a 4-D per-layer view ``[num_blocks, num_kv_heads, block_size, C]`` with
  arbitrary block/head/token strides and a contiguous content dimension ``C`` (K then V,
  ``C = 2 * head_size``): the view vLLM's ``create_kv_cache_views`` hands every attention
  backend, whatever the ``KVCacheLayout``. A token's global slot id is
  ``block_id * block_size + offset`` in the view's block unit.
* **src / dst**: int64 ``[M]`` tensors of global slot ids. ``src[i]`` is copied to ``dst[i]``.
  The two sets are disjoint and ``dst`` has no repeated slot (``src`` may repeat).

Semantics (all implementations): gather every ``src`` row first, then scatter to ``dst``, in
place, in every view. Rows whose slot is not in ``dst`` are not written. Moves are bit copies:
no dtype conversion, so NaN payloads, negative zeros and fp8 bytes survive unchanged.

This module never imports ``triton`` at import time; :func:`move_tokens_triton` loads
``vtoken.kernels.triton_move`` on first use.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from vtoken.kernels.checks import validate_moves, validate_paged_caches, validate_views

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

# Integer dtype with the same width as an element, so a view can be reinterpreted and copied
# bit for bit (and dtypes without indexing kernels, e.g. float8, still work).
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

DEBUG_ENV = "VTOKEN_KERNEL_DEBUG"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _as_bits(v: torch.Tensor) -> torch.Tensor:
    """Reinterpret ``v`` (same storage, same strides) as an integer tensor of equal width."""
    int_dtype = _INT_OF_WIDTH.get(v.element_size())
    if int_dtype is None or v.dtype == int_dtype:
        return v
    return v.view(int_dtype)


def move_tokens_reference(
    views: Sequence[torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    check_overlap: bool = True,
) -> None:
    """Move token rows ``src[i] -> dst[i]`` in every view with plain PyTorch indexing.

    Gathers all ``src`` rows of a view into a temporary, then scatters them to ``dst``, so the
    result is well defined even if the sets overlapped (the overlap check is still on by
    default because the fast path relies on disjointness). Bit copies: works for every dtype
    (fp32, fp16, bf16, uint8/float8 bytes, ...) without changing a bit.

    Args:
        views: list of ``[num_slots, row]`` slot views (see module docstring), same shape,
            dtype and device, on any device (CPU or CUDA).
        src, dst: int64 ``[M]`` global slot ids; moved to the views' device if needed.
        check_overlap: also reject overlapping ``src``/``dst`` and repeated ``dst`` ids.

    Mutates:
        every tensor in ``views`` (rows ``dst``), in place; nothing else is written.

    Raises:
        ValueError: see :func:`validate_views` and :func:`validate_moves` (range is always
            checked here).
    """
    num_slots, _row, _dtype, device = validate_views(views)
    validate_moves(
        src, dst, num_slots, check_range=len(views) > 0, check_overlap=check_overlap
    )
    if src.numel() == 0 or len(views) == 0:
        return
    src = src.to(device)
    dst = dst.to(device)
    for v in views:
        bits = _as_bits(v)
        # Advanced indexing gathers into a new tensor first, then index_put_ scatters in
        # place into the view's storage (dst has no repeats, so the result is defined).
        bits[dst] = bits[src]


def move_tokens_paged_reference(
    caches: Sequence[torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    check_overlap: bool = True,
) -> None:
    """Move tokens ``src[i] -> dst[i]`` (every head, all ``C`` elements) in every paged cache
    with plain PyTorch indexing (gather all, then scatter; bit copies).

    Args:
        caches: list of ``[num_blocks, num_kv_heads, block_size, C]`` paged views (see module
            docstring), same shape, dtype and device.
        src, dst: int64 ``[M]`` global slot ids; moved to the caches' device if needed.
        check_overlap: also reject overlapping ``src``/``dst`` and repeated ``dst`` ids.

    Mutates:
        every cache, token ``dst[i]`` in every head, in place.

    Raises:
        ValueError: see :func:`validate_paged_caches` and :func:`validate_moves` (the range is
            always checked).
    """
    nb, _h, bs, _c, _dtype, device = validate_paged_caches(caches)
    validate_moves(src, dst, nb * bs, check_range=len(caches) > 0, check_overlap=check_overlap)
    if src.numel() == 0 or len(caches) == 0:
        return
    src = src.to(device)
    dst = dst.to(device)
    sb, so = src // bs, src % bs
    db, do = dst // bs, dst % bs
    for c in caches:
        b = _as_bits(c)
        b[db, :, do] = b[sb, :, so]  # [M, H, C] gathered into a new tensor first


def triton_available() -> bool:
    """True if ``triton`` can be imported (it is optional for CPU-only installs)."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True


def move_tokens_triton(
    views: Sequence[torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    debug: bool | None = None,
) -> None:
    """Move token rows ``src[i] -> dst[i]`` in every view with ONE Triton kernel launch.

    See :func:`vtoken.kernels.triton_move.move_tokens_triton` for the kernel design.
    Runs on CUDA tensors on a GPU, and on CPU tensors when ``TRITON_INTERPRET=1``.

    Args:
        views, src, dst: as for :func:`move_tokens_reference`; ``src``/``dst`` are moved to
            the views' device if needed.
        debug: also check id range, ``src``/``dst`` disjointness and unique ``dst`` (device
            syncs). ``None`` reads the ``VTOKEN_KERNEL_DEBUG`` environment variable. Without
            it, out-of-range ids are undefined behaviour (memory corruption) and overlapping
            ``src``/``dst`` give an unspecified mix of old and new rows.

    Mutates:
        every tensor in ``views`` (rows ``dst``), in place.

    Raises:
        ValueError: structural problems (always checked), range/overlap problems (debug),
            CUDA tensors under ``TRITON_INTERPRET=1``, or CPU tensors without it.
        ImportError: triton is not installed.
    """
    from vtoken.kernels import triton_move

    if debug is None:
        debug = _env_flag(DEBUG_ENV)
    triton_move.move_tokens_triton(views, src, dst, debug=debug)


def move_tokens_paged_triton(
    caches: Sequence[torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    debug: bool | None = None,
) -> None:
    """Move tokens ``src[i] -> dst[i]`` in every paged cache with ONE Triton kernel launch.

    See :func:`vtoken.kernels.triton_move.move_tokens_paged_triton` (any block/head/token
    strides, int64 offsets). Runs on CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``.

    Args:
        caches, src, dst: as for :func:`move_tokens_paged_reference`.
        debug: range/overlap checks (device syncs); ``None`` reads ``VTOKEN_KERNEL_DEBUG``.

    Raises:
        ValueError: as for :func:`move_tokens_triton`.
        ImportError: triton is not installed.
    """
    from vtoken.kernels import triton_move

    if debug is None:
        debug = _env_flag(DEBUG_ENV)
    triton_move.move_tokens_paged_triton(caches, src, dst, debug=debug)


def move_tokens_paged(
    caches: Sequence[torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    debug: bool | None = None,
) -> None:
    """Move tokens in every paged cache: Triton for CUDA caches, the PyTorch reference
    otherwise (CPU, or no triton). Arguments and errors as for the two implementations."""
    if len(caches) > 0 and isinstance(caches[0], torch.Tensor) and caches[0].is_cuda:
        if triton_available():
            move_tokens_paged_triton(caches, src, dst, debug=debug)
            return
    move_tokens_paged_reference(caches, src, dst, check_overlap=debug is not False)


def move_tokens(
    views: Sequence[torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    debug: bool | None = None,
) -> None:
    """Move token rows ``src[i] -> dst[i]`` in every view; the entry point for the repacker.

    Dispatch: Triton (one launch for all views) when the views are CUDA tensors and triton is
    importable; the PyTorch reference otherwise (CPU tensors, or no triton).

    Args:
        views, src, dst: as for :func:`move_tokens_reference`.
        debug: Triton path only: range/overlap checks (see :func:`move_tokens_triton`). The
            reference path always checks the range and, when ``debug`` is not ``False``,
            the overlap.

    Mutates:
        every tensor in ``views`` (rows ``dst``), in place.

    Raises:
        ValueError: as for the chosen implementation.
    """
    if len(views) > 0 and isinstance(views[0], torch.Tensor) and views[0].is_cuda:
        if triton_available():
            move_tokens_triton(views, src, dst, debug=debug)
            return
    move_tokens_reference(views, src, dst, check_overlap=debug is not False)
