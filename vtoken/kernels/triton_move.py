"""Triton kernel that moves token rows in all KV-cache views with one launch.

Design
------
* The wrapper packs, for the ``V`` distinct views, an int64 *meta* tensor ``[2 * V]`` on the
  views' device: ``meta[:V]`` holds each view's base address (``data_ptr()``, which already
  includes the storage offset) and ``meta[V:]`` its slot stride, both measured in *words*.
* A word is the widest integer type (int64, int32, int16 or uint8) whose size
  divides the row size in bytes, every slot stride in bytes and every base address. The
  kernel copies words, never floats, so the move is a bit copy for every dtype (fp32, fp16,
  bf16, fp8/uint8 bytes, ...) and a bf16 SmolLM2 row (384 bytes) moves as 48 int64 words.
* Grid ``(cdiv(M, R), V)``: program ``(b, v)`` loads view ``v``'s base pointer from ``meta``
  (``int64 -> pointer`` cast), handles moves ``b*R .. b*R+R-1`` as an ``[R, BLOCK]`` tile and
  walks the row in ``BLOCK``-word chunks (masked tails, masked unused moves).
* Each program loads a ``src`` row chunk and stores it to the ``dst`` row in place. This equals
  gather-then-scatter **only because ``src`` and ``dst`` are disjoint and ``dst`` has no
  repeats**: no program writes a row another program reads, and no two programs write the
  same row. The kernel does not check it; the wrapper does in debug mode.

Interpreter mode (``TRITON_INTERPRET=1``, CPU tensors)
------------------------------------------------------
Pointers made from integers work in the interpreter: it copies *tensor arguments* to host
memory before running (a no-op for CPU tensors: ``storage.cpu()`` returns the same storage),
and implements ``int -> pointer`` as a bitcast; loads/stores then dereference raw host
addresses. So the raw ``data_ptr()`` values of CPU views are valid there. The wrapper refuses
CUDA views in interpreter mode, because the interpreter would only mirror the tensor
arguments (``meta``, ``src``, ``dst``), not the cache memory behind the raw device addresses.

``triton.jit`` decides between compiled and interpreted kernels when it decorates a
function (it reads ``TRITON_INTERPRET`` then), so this module decorates lazily, on first
launch, and keeps one kernel per mode: importing this module early never fixes the mode.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import triton
import triton.language as tl

from vtoken.kernels.move import validate_moves, validate_views

__all__ = ["move_tokens_triton", "interpret_mode"]

# Largest word (bytes) the kernel copies per element.
_MAX_WORD = 8
# Words per row chunk and words per program tile (R * BLOCK); both powers of two.
_MAX_BLOCK = 1024
_TILE_WORDS = 1024
_MAX_MOVES_PER_PROGRAM = 16
# CUDA limits grid dimension 1 (views) to 65535.
_MAX_VIEWS = 65535


def _move_rows_kernel(
    meta_ptr,  # int64 [2*V]: base addresses (bytes), then slot strides (words)
    src_ptr,  # int64 [M]
    dst_ptr,  # int64 [M]
    M,  # number of moves
    row_words,  # row length in words
    V,  # number of views
    WORD: tl.constexpr,  # tl.uint8 / tl.int16 / tl.int32 / tl.int64
    R: tl.constexpr,  # moves per program
    BLOCK: tl.constexpr,  # words per row chunk
):
    pid_m = tl.program_id(0)
    pid_v = tl.program_id(1)
    base = tl.load(meta_ptr + pid_v).to(tl.pointer_type(WORD))
    stride = tl.load(meta_ptr + V + pid_v)
    moves = pid_m * R + tl.arange(0, R)
    move_ok = moves < M
    src = tl.load(src_ptr + moves, mask=move_ok, other=0)
    dst = tl.load(dst_ptr + moves, mask=move_ok, other=0)
    src_rows = base + (src * stride)[:, None]
    dst_rows = base + (dst * stride)[:, None]
    for start in range(0, row_words, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = move_ok[:, None] & (cols < row_words)[None, :]
        words = tl.load(src_rows + cols[None, :], mask=mask)
        tl.store(dst_rows + cols[None, :], words, mask=mask)


_KERNELS: dict[bool, object] = {}
_META_CACHE: dict[tuple, torch.Tensor] = {}
_META_CACHE_MAX = 32


def interpret_mode() -> bool:
    """True if ``TRITON_INTERPRET`` is set to a true value right now."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in {"1", "true", "yes", "on"}


def _kernel(interpret: bool):
    k = _KERNELS.get(interpret)
    if k is None:
        # triton.jit reads TRITON_INTERPRET at decoration time; the caller's mode is current.
        k = triton.jit(do_not_specialize=["M"])(_move_rows_kernel)
        _KERNELS[interpret] = k
    return k


def _word_bytes(views: Sequence[torch.Tensor], row: int) -> int:
    itemsize = views[0].element_size()
    row_bytes = row * itemsize
    w = _MAX_WORD
    while w > 1:
        if row_bytes % w == 0 and all(
            v.data_ptr() % w == 0 and (v.stride(0) * itemsize) % w == 0 for v in views
        ):
            break
        w //= 2
    return w


def _meta(views: Sequence[torch.Tensor], word: int, device: torch.device) -> torch.Tensor:
    itemsize = views[0].element_size()
    ptrs = tuple(v.data_ptr() for v in views)
    strides = tuple(v.stride(0) * itemsize // word for v in views)
    key = (str(device), ptrs, strides)
    meta = _META_CACHE.get(key)
    if meta is None:
        meta = torch.tensor(ptrs + strides, dtype=torch.int64).to(device)
        if len(_META_CACHE) >= _META_CACHE_MAX:
            _META_CACHE.pop(next(iter(_META_CACHE)))
        _META_CACHE[key] = meta
    return meta


def move_tokens_triton(
    views: Sequence[torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    debug: bool = False,
) -> None:
    """Move rows ``src[i] -> dst[i]`` in every view with one kernel launch.

    Args:
        views: list of ``[num_slots, row]`` slot views (rows contiguous, any slot stride), same
            shape, dtype and device: CUDA tensors normally, CPU tensors under
            ``TRITON_INTERPRET=1``. Views with identical base pointer and slot stride
            (aliased layers) are moved once.
        src, dst: int64 ``[M]`` global slot ids, disjoint, ``dst`` without repeats; copied to
            the views' device (and made contiguous) if needed.
        debug: check the id range and disjointness / unique ``dst`` first (device syncs).
            Without it these are the caller's contract: violating them is undefined.

    Mutates:
        every tensor in ``views`` (rows ``dst``), in place.

    Raises:
        ValueError: bad views or ids (see ``validate_views`` / ``validate_moves``), more than
            65535 distinct views, CUDA views under ``TRITON_INTERPRET=1``, or CPU views
            without it.
    """
    num_slots, row, _dtype, device = validate_views(views)
    validate_moves(
        src, dst, num_slots, check_range=debug and len(views) > 0, check_overlap=debug
    )
    if len(views) == 0 or src.numel() == 0 or row == 0:
        return
    interpret = interpret_mode()
    if interpret and device.type != "cpu":
        raise ValueError(
            f"views are on {device} but TRITON_INTERPRET=1: the interpreter only runs on CPU "
            "tensors (raw device addresses cannot be mirrored to the host)"
        )
    if not interpret and device.type != "cuda":
        raise ValueError(
            f"views are on {device}; the Triton kernel needs CUDA tensors "
            "(or CPU tensors with TRITON_INTERPRET=1); use move_tokens_reference instead"
        )

    # Aliased views (e.g. layers sharing one KV cache) would copy the same rows twice.
    seen: set[tuple[int, int]] = set()
    uniq = []
    for v in views:
        k = (v.data_ptr(), v.stride(0))
        if k not in seen:
            seen.add(k)
            uniq.append(v)
    n_views = len(uniq)
    if n_views > _MAX_VIEWS:
        raise ValueError(f"{n_views} distinct views; at most {_MAX_VIEWS} per launch")

    word = _word_bytes(uniq, row)
    row_words = row * uniq[0].element_size() // word
    meta = _meta(uniq, word, device)
    src = src.to(device).contiguous()
    dst = dst.to(device).contiguous()
    m = src.numel()

    block = min(triton.next_power_of_2(row_words), _MAX_BLOCK)
    r = max(1, min(_MAX_MOVES_PER_PROGRAM, _TILE_WORDS // block))
    grid = (triton.cdiv(m, r), n_views)
    word_tl = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}[word]
    kernel = _kernel(interpret)
    if device.type == "cuda":
        with torch.cuda.device(device):
            kernel[grid](meta, src, dst, m, row_words, n_views, WORD=word_tl, R=r, BLOCK=block)
    else:
        kernel[grid](meta, src, dst, m, row_words, n_views, WORD=word_tl, R=r, BLOCK=block)
