"""Triton kernel that moves tokens in all KV-cache views (any vLLM layout) with one launch.

Design
------
* Every cache is addressed as a paged view ``[num_blocks, H, block_size, C]`` with arbitrary
  block, head and token strides and a contiguous content dimension ``C``: exactly the
  per-layer views vLLM builds for every ``KVCacheLayout`` (``LBNHC``: token-contiguous, the
  default; ``LBHNC``: head-major, FlashInfer on SM100; block-outer ``BL..``/``BH..``; padded
  pages; kernel-block splits). A 2-D slot view ``[num_slots, row]`` is the special case
  ``block_size = 1``, ``H = 1``, ``C = row``.
* Token ``s`` (global slot id ``block * block_size + offset``), head ``h``, word ``c`` sits at
  ``base + (s // bs) * S_blk + h * S_head + (s % bs) * S_tok + c``. Slot ids and strides are
  int64 inside the kernel, so offsets past 2^31 elements do not wrap.
* The wrapper packs, for the ``V`` distinct views, an int64 *meta* tensor ``[4 * V]`` on the
  views' device: base addresses (``data_ptr()``, which includes the storage offset), then the
  block, head and token strides, measured in *words*.
* A word is the widest integer type (int64, int32, int16 or uint8) whose size divides the
  head content in bytes, every stride in bytes and every base address. The kernel copies
  words, never floats, so the move is a bit copy for every dtype (fp32, fp16, bf16,
  fp8/uint8 bytes, ...); a bf16 SmolLM2 token (3 heads x 128 elements) moves as 3 x 32
  int64 words.
* Grid ``(cdiv(M, R), V)``: program ``(b, v)`` loads view ``v``'s base pointer from ``meta``
  (``int64 -> pointer`` cast), handles moves ``b*R .. b*R+R-1`` as an ``[R, BLOCK]`` tile and
  walks the token's ``H * C`` words in ``BLOCK``-word chunks (masked tails, masked unused
  moves); word ``j`` of a token is head ``j // C``, column ``j % C``.
* Each program loads a ``src`` token chunk and stores it to the ``dst`` token in place. This
  equals gather-then-scatter **only because ``src`` and ``dst`` are disjoint and ``dst`` has
  no repeats**: no program writes a row another program reads, and no two programs write the
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

from vtoken.kernels.checks import validate_moves, validate_paged_caches, validate_views

__all__ = ["move_tokens_triton", "move_tokens_paged_triton", "interpret_mode"]

# Largest word (bytes) the kernel copies per element.
_MAX_WORD = 8
# Words per row chunk and words per program tile (R * BLOCK); both powers of two.
_MAX_BLOCK = 1024
_TILE_WORDS = 1024
_MAX_MOVES_PER_PROGRAM = 16
# CUDA limits grid dimension 1 (views) to 65535.
_MAX_VIEWS = 65535


def _move_rows_kernel(
    meta_ptr,  # int64 [4*V]: base addresses (bytes), then block, head, token strides (words)
    src_ptr,  # int64 [M]
    dst_ptr,  # int64 [M]
    M,  # number of moves
    V,  # number of views
    BS,  # tokens per block (1 for 2-D slot views)
    H,  # heads per token row (1 for 2-D slot views)
    HEAD_WORDS: tl.constexpr,  # contiguous words per head (the content C of [B, H, N, C])
    WORD: tl.constexpr,  # tl.uint8 / tl.int16 / tl.int32 / tl.int64
    R: tl.constexpr,  # moves per program
    BLOCK: tl.constexpr,  # words per row chunk
):
    pid_m = tl.program_id(0)
    pid_v = tl.program_id(1)
    base = tl.load(meta_ptr + pid_v).to(tl.pointer_type(WORD))
    s_blk = tl.load(meta_ptr + V + pid_v)
    s_head = tl.load(meta_ptr + 2 * V + pid_v)
    s_tok = tl.load(meta_ptr + 3 * V + pid_v)
    moves = pid_m * R + tl.arange(0, R)
    move_ok = moves < M
    # int64 slot ids and int64 strides: every offset below is int64 (no 2^31 wrap).
    src = tl.load(src_ptr + moves, mask=move_ok, other=0)
    dst = tl.load(dst_ptr + moves, mask=move_ok, other=0)
    src_rows = base + ((src // BS) * s_blk + (src % BS) * s_tok)[:, None]
    dst_rows = base + ((dst // BS) * s_blk + (dst % BS) * s_tok)[:, None]
    row_words = H * HEAD_WORDS
    for start in range(0, row_words, BLOCK):
        j = start + tl.arange(0, BLOCK)
        head = j // HEAD_WORDS
        cols = head.to(tl.int64) * s_head + (j - head * HEAD_WORDS)
        mask = move_ok[:, None] & (j < row_words)[None, :]
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


def _check_device(device: torch.device) -> bool:
    interpret = interpret_mode()
    if interpret and device.type != "cpu":
        raise ValueError(
            f"views are on {device} but TRITON_INTERPRET=1: the interpreter only runs on CPU "
            "tensors (raw device addresses cannot be mirrored to the host)"
        )
    if not interpret and device.type != "cuda":
        raise ValueError(
            f"views are on {device}; the Triton kernel needs CUDA tensors "
            "(or CPU tensors with TRITON_INTERPRET=1); use the reference implementation instead"
        )
    return interpret


def _launch(
    descs: list[tuple[int, int, int, int]],
    itemsize: int,
    block_size: int,
    num_heads: int,
    head_elems: int,
    src: torch.Tensor,
    dst: torch.Tensor,
    device: torch.device,
) -> None:
    """Run the kernel over views described by ``(data_ptr, s_blk, s_head, s_tok)`` (strides in
    elements); aliased descriptors are moved once."""
    interpret = _check_device(device)
    uniq = list(dict.fromkeys(descs))
    n_views = len(uniq)
    if n_views > _MAX_VIEWS:
        raise ValueError(f"{n_views} distinct views; at most {_MAX_VIEWS} per launch")
    head_bytes = head_elems * itemsize
    word = _MAX_WORD
    while word > 1:
        if head_bytes % word == 0 and all(
            ptr % word == 0 and all((st * itemsize) % word == 0 for st in strides)
            for ptr, *strides in uniq
        ):
            break
        word //= 2
    head_words = head_bytes // word
    key = (str(device), word, tuple(uniq))
    meta = _META_CACHE.get(key)
    if meta is None:
        cols = [[d[0] for d in uniq]] + [[d[i] * itemsize // word for d in uniq] for i in (1, 2, 3)]
        meta = torch.tensor([x for c in cols for x in c], dtype=torch.int64).to(device)
        if len(_META_CACHE) >= _META_CACHE_MAX:
            _META_CACHE.pop(next(iter(_META_CACHE)))
        _META_CACHE[key] = meta
    src = src.to(device).contiguous()
    dst = dst.to(device).contiguous()
    m = src.numel()
    block = min(triton.next_power_of_2(num_heads * head_words), _MAX_BLOCK)
    r = max(1, min(_MAX_MOVES_PER_PROGRAM, _TILE_WORDS // block))
    grid = (triton.cdiv(m, r), n_views)
    word_tl = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}[word]
    args = (meta, src, dst, m, n_views, block_size, num_heads)
    kw = dict(HEAD_WORDS=head_words, WORD=word_tl, R=r, BLOCK=block)
    kernel = _kernel(interpret)
    if device.type == "cuda":
        with torch.cuda.device(device):
            kernel[grid](*args, **kw)
    else:
        kernel[grid](*args, **kw)


def move_tokens_triton(
    views: Sequence[torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    debug: bool = False,
) -> None:
    """Move rows ``src[i] -> dst[i]`` in every 2-D slot view with one kernel launch.

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
    # A 2-D slot view is a paged view with one token per block and one head.
    descs = [(v.data_ptr(), v.stride(0), 0, 0) for v in views]
    _launch(descs, views[0].element_size(), 1, 1, row, src, dst, device)


def move_tokens_paged_triton(
    caches: Sequence[torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    debug: bool = False,
) -> None:
    """Move tokens ``src[i] -> dst[i]`` in every per-layer paged cache with one kernel launch.

    Args:
        caches: list of vLLM per-layer views ``[num_blocks, num_kv_heads, block_size, C]``
            (``C = 2 * head_size`` elements: K then V), any block/head/token strides, contiguous
            ``C``; same shape, dtype and device. These are the views
            ``vllm.v1.kv_cache_interface.create_kv_cache_views`` builds for every
            ``KVCacheLayout`` (``LBNHC``, ``LBHNC``, block-outer, padded pages, kernel-block
            splits). Views with identical base pointer and strides are moved once.
        src, dst: int64 ``[M]`` global slot ids ``block * block_size + offset`` in the views'
            block unit, disjoint, ``dst`` without repeats.
        debug: check the id range and disjointness / unique ``dst`` first (device syncs).

    Mutates:
        every cache (token ``dst[i]``, every head, all ``C`` elements), in place.

    Raises:
        ValueError: see :func:`vtoken.kernels.move.validate_paged_caches`, bad ids (debug),
            more than 65535 distinct caches, or a device/interpreter mismatch.
    """
    num_blocks, num_heads, block_size, content, _dtype, device = validate_paged_caches(caches)
    validate_moves(
        src,
        dst,
        num_blocks * block_size,
        check_range=debug and len(caches) > 0,
        check_overlap=debug,
    )
    if len(caches) == 0 or src.numel() == 0 or content == 0:
        return
    descs = [(c.data_ptr(), c.stride(0), c.stride(1), c.stride(2)) for c in caches]
    _launch(descs, caches[0].element_size(), block_size, num_heads, content, src, dst, device)
