"""Structural checks of the token-move kernels' inputs (views, paged caches, src/dst).

Shared by the PyTorch reference (:mod:`vtoken.kernels.move`) and the Triton kernels
(:mod:`vtoken.kernels.triton_move`), so neither imports the other for them. Terms (view,
paged cache, src/dst) as in :mod:`vtoken.kernels.move`. This module never imports vllm or triton.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["validate_moves", "validate_paged_caches", "validate_views"]


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
