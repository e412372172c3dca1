"""Paged KV-cache views built with vLLM's own layout functions (test helper, CPU tensors).

``vllm_kv_views`` reproduces what vLLM's KV allocation does for one group of same-shaped
attention layers: ``compute_layout_strides`` picks the layer and block byte strides for the
``KVCacheLayout`` (as ``kv_cache_utils.get_kv_cache_config_from_groups`` does, including the
block-outer interleaving and padded pages), and ``create_kv_cache_views`` cuts the int8
backing buffer into one ``[num_blocks, num_kv_heads, block_size, 2*head_size]`` view per
layer. Only the tests import vllm; ``vtoken/kernels`` never does.
"""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

ALL_LAYOUTS = list(KVCacheLayout)


def vllm_kv_views(
    layout: KVCacheLayout,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    page_pad_bytes: int = 0,
    kernel_block_size: int | None = None,
    head_size_v: int | None = None,
    raw: torch.Tensor | None = None,
    lead_bytes: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Return ``(raw int8 buffer, [per-layer view])`` laid out by vLLM 0.32's functions.

    Args:
        page_pad_bytes: extra bytes per page (``page_size_padded``; block-compact layouts only).
        kernel_block_size: split each manager block into kernel blocks of this many tokens
            (the views then have ``num_blocks * block_size // kernel_block_size`` blocks).
        raw: a backing buffer to use (int8, at least ``lead_bytes + size`` bytes); default a
            fresh ``torch.empty`` (pages not touched until written).
        lead_bytes: the group starts this many bytes into ``raw`` (tests misaligned bases).
        device: where a fresh ``raw`` is allocated.
    """
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        head_size_v=head_size_v,
        dtype=dtype,
        page_size_padded=None,
    )
    if page_pad_bytes:
        spec = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            head_size_v=head_size_v,
            dtype=dtype,
            page_size_padded=spec.page_size_bytes + page_pad_bytes,
        )
    page = spec.page_size_bytes
    block_stride = page * num_layers if layout.is_block_outermost else None
    if block_stride is None and page_pad_bytes:
        block_stride = page
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, num_blocks, num_layers, layout, fixed_strides=(None, block_stride, None, None, None)
    )
    size = num_layers * num_blocks * page
    if raw is None:
        raw = torch.empty(lead_bytes + size, dtype=torch.int8, device=device)
    assert raw.numel() >= lead_bytes + size
    tensor = KVCacheTensor(
        size=size,
        layers=[f"layer.{i}" for i in range(num_layers)],
        layer_stride=layer_stride,
        block_stride=block_stride,
        offset=lead_bytes,
    )
    views = create_kv_cache_views(raw, spec, num_blocks, layout, tensor, kernel_block_size)
    return raw, views
