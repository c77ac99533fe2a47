"""Causal attention of a step's queries over the paged KV cache: the PyTorch twin and the native CPU op.

Both compute, for query t of row b, attention over the keys at positions 0..positions[b, t] of row b's
blocks (`block_tables[b]`, in order), with the G = H / KVH query heads of a KV head sharing it.

- `paged_attention_torch`: gathers every block of the table and masks (one graph of static or dynamic
  shapes on any backend; it computes the whole table, whatever the positions).
- `paged_attention_native`: `optimum_qwen36::paged_attention` (csrc/paged_attention.cpp), which stops at the
  last key each block of queries sees; bf16 on AVX-512 BF16 CPUs runs its flash kernel, other cases
  ATen's attention over the visible keys.

Their varlen forms take sequences packed along the tokens (a packed prefill step): query [1, N, H, D],
sequence s is tokens cu_seqlens[s]..cu_seqlens[s + 1] with the blocks block_tables[s], positions [1, N].
`paged_attention_varlen_torch` runs the PyTorch twin per sequence (eager only: it reads cu_seqlens' values);
`paged_attention_varlen_native` is `optimum_qwen36::paged_attention_varlen`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .native import layer_index
from .varlen import sequence_spans

# (query [B, T, H, D], key_cache, value_cache [L, blocks, block_size, KVH, D], cache_idx, block_tables
# [B, max_blocks], positions [B, T], scale) -> [B, T, H, D]
PagedAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "int | torch.Tensor", torch.Tensor, torch.Tensor, float],
    torch.Tensor,
]
# (query [1, N, H, D], key_cache, value_cache, cache_idx, block_tables [S, max_blocks], cu_seqlens [S + 1],
# positions [1, N], scale) -> [1, N, H, D]
PagedAttentionVarlen = Callable[..., torch.Tensor]


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
    batch, tokens, heads, head_dim = query.shape
    kv_heads = keys.shape[2]
    group = heads // kv_heads
    # Written out rather than through scaled_dot_product_attention, whose kernel choice depends on the
    # device: on cuda its fused kernels pad the mask and export cannot prove the padding's bounds for a
    # dynamic block-table width. Scores and softmax in float32 whatever the cache dtype.
    grouped = query.reshape(batch, tokens, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    grouped = grouped.reshape(batch, kv_heads, group * tokens, head_dim).float()
    scores = grouped @ keys.permute(0, 2, 3, 1).float() * scale  # [B, KVH, G * T, S]
    # Built at the scores' [B, 1, G * T, S] layout from the start (row g * T + t sees positions[b, t]): a
    # reshaped broadcast of a dynamic width made torch 2.11's export fail on cuda.
    key_positions = torch.arange(keys.shape[1], device=positions.device)
    attend = key_positions.view(1, 1, -1) <= positions.repeat(1, group).unsqueeze(-1)
    attend = attend.unsqueeze(1)
    # The smallest float, not -inf: a padding row that sees no key gets finite (unused) values, not NaN.
    scores = scores.masked_fill(~attend, torch.finfo(torch.float32).min)
    out = scores.softmax(-1) @ values.permute(0, 2, 1, 3).float()  # [B, KVH, G * T, D]
    out = out.reshape(batch, kv_heads, group, tokens, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, tokens, heads, head_dim).to(query.dtype)


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


def paged_attention_varlen_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cache_idx: int | torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.zeros_like(query)
    for s, tokens in sequence_spans(cu_seqlens):
        out[:, tokens] = paged_attention_torch(
            query[:, tokens], key_cache, value_cache, cache_idx, block_tables[s : s + 1],
            positions[:, tokens], scale,
        )  # fmt: skip
    return out


def paged_attention_varlen_native(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cache_idx: int | torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The native op (load it first: `ops.native.load_native_ops()`)."""
    layer = layer_index(cache_idx, query.device)
    return torch.ops.optimum_qwen36.paged_attention_varlen(
        query, key_cache, value_cache, layer, block_tables, cu_seqlens, positions, scale
    )
