"""Causal attention of a step's queries over the paged KV cache: the PyTorch twin and the native CPU op.

Both compute, for query t of row b, attention over the keys at positions 0..positions[b, t] of row b's
blocks (`block_tables[b]`, in order), with the G = H / KVH query heads of a KV head sharing it.

- `paged_attention_torch`: gathers every block of the table and masks (one graph of static or dynamic
  shapes on any backend; it computes the whole table, whatever the positions).
- `paged_attention_native`: `optimum_qwen36::paged_attention` (csrc/paged_attention.cpp), which stops at the
  last key each block of queries sees; bf16 on AVX-512 BF16 CPUs runs its flash kernel, other cases
  ATen's attention over the visible keys.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .native import layer_index

# (query [B, T, H, D], key_cache, value_cache [L, blocks, block_size, KVH, D], cache_idx, block_tables
# [B, max_blocks], positions [B, T], scale) -> [B, T, H, D]
PagedAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "int | torch.Tensor", torch.Tensor, torch.Tensor, float],
    torch.Tensor,
]


def paged_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cache_idx: int | torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    # Gather each row's blocks into a contiguous [B, S, kv_heads, D] view of its sequence (one indexing of
    # the whole cache: a tensor cache_idx must not copy out the layer's whole entry first).
    keys = key_cache[cache_idx, block_tables].flatten(1, 2)
    values = value_cache[cache_idx, block_tables].flatten(1, 2)
    key_positions = torch.arange(keys.shape[1], device=positions.device)
    attend = key_positions.view(1, 1, -1) <= positions.unsqueeze(-1)  # [B, T, S]
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=attend.unsqueeze(1),
        scale=scale,
        enable_gqa=query.shape[2] != keys.shape[2],
    )
    return out.transpose(1, 2)


def paged_attention_native(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cache_idx: int | torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The native op (load it first: `ops.native.load_native_ops()`)."""
    return torch.ops.optimum_qwen36.paged_attention(
        query, key_cache, value_cache, layer_index(cache_idx, query.device), block_tables, positions, scale
    )
