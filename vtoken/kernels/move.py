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


def validate_views(views: Sequence[torch.Tensor]) -> tuple[int, int, torch.dtype, torch.device]:
    """Check that ``views`` is a list of compatible slot views.

    Args:
        views: sequence of 2-D tensors ``[num_slots, row]``, any dtype, any device.

    Returns:
        ``(num_slots, row, dtype, device)`` shared by all views. For an empty sequence,
        ``(0, 0, torch.uint8, cpu)``.

    Raises:
        ValueError: a view is not a tensor, is not 2-D, has non-contiguous rows
            (``stride(1) != 1`` with ``row > 1``), has a slot stride smaller than the row (rows
            would overlap), or differs from the first view in shape, dtype or device.
    """
    if len(views) == 0:
        return 0, 0, torch.uint8, torch.device("cpu")
    first = views[0]
    for i, v in enumerate(views):
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"views[{i}] is a {type(v).__name__}, expected a torch.Tensor")
        if v.dim() != 2:
            raise ValueError(
                f"views[{i}] has shape {tuple(v.shape)}; slot views must be 2-D [num_slots, row]"
            )
        if v.shape != first.shape:
            raise ValueError(
                f"views[{i}] has shape {tuple(v.shape)} but views[0] has {tuple(first.shape)}; "
                "all views must have the same [num_slots, row] shape"
            )
        if v.dtype != first.dtype:
            raise ValueError(
                f"views[{i}] has dtype {v.dtype} but views[0] has {first.dtype}; "
                "all views must share one dtype"
            )
        if v.device != first.device:
            raise ValueError(
                f"views[{i}] is on {v.device} but views[0] is on {first.device}; "
                "all views must be on one device"
            )
        num_slots, row = v.shape
        if row > 1 and v.stride(1) != 1:
            raise ValueError(
                f"views[{i}] has row stride {v.stride(1)}; rows must be contiguous (stride 1)"
            )
        if num_slots > 1 and v.stride(0) < row:
            raise ValueError(
                f"views[{i}] has slot stride {v.stride(0)} < row length {row}; rows would overlap"
            )
    return int(first.shape[0]), int(first.shape[1]), first.dtype, first.device


def validate_paged_caches(
    caches: Sequence[torch.Tensor],
) -> tuple[int, int, int, int, torch.dtype, torch.device]:
    """Check that ``caches`` is a list of compatible paged per-layer views.

    Args:
        caches: sequence of 4-D tensors ``[num_blocks, num_kv_heads, block_size, C]``, any
            dtype, any device, any non-negative block/head/token strides.

    Returns:
        ``(num_blocks, num_kv_heads, block_size, C, dtype, device)`` shared by all caches; for
        an empty sequence ``(0, 0, 1, 0, torch.uint8, cpu)``.

    Raises:
        ValueError: a cache is not a tensor, is not 4-D, has a non-contiguous content
            dimension (``stride(3) != 1`` with ``C > 1``), or differs from the first cache in
            shape, dtype or device.
    """
    if len(caches) == 0:
        return 0, 0, 1, 0, torch.uint8, torch.device("cpu")
    first = caches[0]
    for i, c in enumerate(caches):
        if not isinstance(c, torch.Tensor):
            raise ValueError(f"caches[{i}] is a {type(c).__name__}, expected a torch.Tensor")
        if c.dim() != 4:
            raise ValueError(
                f"caches[{i}] has shape {tuple(c.shape)}; paged caches must be 4-D "
                "[num_blocks, num_kv_heads, block_size, C]"
            )
        if c.shape != first.shape:
            raise ValueError(
                f"caches[{i}] has shape {tuple(c.shape)} but caches[0] has "
                f"{tuple(first.shape)}; all caches must have the same shape"
            )
        if c.dtype != first.dtype:
            raise ValueError(
                f"caches[{i}] has dtype {c.dtype} but caches[0] has {first.dtype}; "
                "all caches must share one dtype"
            )
        if c.device != first.device:
            raise ValueError(
                f"caches[{i}] is on {c.device} but caches[0] is on {first.device}; "
                "all caches must be on one device"
            )
        if c.shape[3] > 1 and c.stride(3) != 1:
            raise ValueError(
                f"caches[{i}] has content stride {c.stride(3)}; the last dimension (C) must be "
                "contiguous (stride 1)"
            )
        if any(st < 0 for st in c.stride()):
            raise ValueError(f"caches[{i}] has a negative stride {c.stride()}")
    nb, h, bs, content = (int(x) for x in first.shape)
    return nb, h, bs, content, first.dtype, first.device


def validate_moves(
    src: torch.Tensor,
    dst: torch.Tensor,
    num_slots: int,
    *,
    check_range: bool = True,
    check_overlap: bool = True,
) -> None:
    """Check a move list ``src[i] -> dst[i]``.

    Args:
        src, dst: int64 tensors ``[M]`` of global slot ids, any device.
        num_slots: number of slots in each view; valid ids are ``0 <= id < num_slots``.
        check_range: check the id range (reads the ids; a device sync for CUDA tensors).
        check_overlap: check that ``src`` and ``dst`` are disjoint and that ``dst`` has no
            repeats (``O(M log M)``; a device sync for CUDA tensors).

    Raises:
        ValueError: ``src``/``dst`` is not a 1-D int64 tensor, their lengths differ, they are
            on different devices, an id is out of range, a slot is both a source and a
            destination, or a destination slot repeats.
    """
    for name, t in (("src", src), ("dst", dst)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} is a {type(t).__name__}, expected an int64 torch.Tensor")
        if t.dtype != torch.int64:
            raise ValueError(f"{name} has dtype {t.dtype}; slot ids must be int64")
        if t.dim() != 1:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; slot ids must be 1-D [M]")
    if src.numel() != dst.numel():
        raise ValueError(
            f"src has {src.numel()} slot ids but dst has {dst.numel()}; lengths must match"
        )
    if src.device != dst.device:
        raise ValueError(f"src is on {src.device} but dst is on {dst.device}")
    if src.numel() == 0:
        return
    if check_range:
        for name, t in (("src", src), ("dst", dst)):
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= num_slots:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"{name} slot id {bad} is out of range [0, {num_slots})"
                )
    if check_overlap:
        # One sort-based pass; diagnose only on failure.
        src_set = torch.unique(src)
        if torch.unique(torch.cat([src_set, dst])).numel() != src_set.numel() + dst.numel():
            both = torch.isin(src, dst)
            if bool(both.any()):
                slot = int(src[both][0])
                raise ValueError(
                    f"slot {slot} is both a source and a destination; "
                    "src and dst must be disjoint"
                )
            uniq, counts = torch.unique(dst, return_counts=True)
            slot = int(uniq[counts > 1][0])
            raise ValueError(f"destination slot {slot} appears more than once in dst")


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
