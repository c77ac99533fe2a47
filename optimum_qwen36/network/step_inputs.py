"""What the layers of one step read (`StepInputs`), and the index arithmetic that derives it from the step's
arguments: the positions of its tokens and where their K/V go in the paged cache.

Attention KV is paged: `key_cache`/`value_cache` are [n_attention_layers, num_blocks, block_size, n_kv_heads,
head_dim] and a row's positions map to blocks through its block table. Block 0 is the null block: writes of
padding positions land there and it is never read as valid. GDN layers keep, per cache slot, a conv state
[conv_dim, kernel - 1] (model dtype) and a recurrent state [HV, K, V] (always float32).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ops.conv import snapshot_conv_tail, varlen_conv_indices

NULL_BLOCK = 0
# A layer's entry in its kind's cache tensors: an int, or an int64 tensor [1] in a graph shared by layers
# (indexing with a 0-d tensor would read its value while tracing).
CacheIndex = int | torch.Tensor
# The cache tensors among a step's arguments, in their order: an MTP step passes the first two (its layer
# is an attention layer), a verify step all six.
CACHE_FIELDS = (
    "key_cache",
    "value_cache",
    "conv_state",
    "recurrent_state",
    "spec_conv_state",
    "spec_recurrent_state",
)


@dataclass
class StepInputs:
    """What every layer of one step reads, built once per step by the entry point.

    Attention: rotary cos / sin [B, T, rot], the flat cache slot each new K/V goes to [B, T], the rows'
    block tables [B, max_blocks] and each query's position [B, T] (it sees the keys at 0..position). GDN:
    the state slot of each row [B]; for a prefill chunk of one sequence also which of its positions are real
    (`valid` [1, C]) and how many (`num_valid`), None for a decode step. Then the four cache tensors,
    updated in place (an MTP step has no GDN layer: no slots or GDN states). A verify step also has the
    speculative state tensors [n_gdn_layers, slots, T, ...]: its GDN layers write the state after each
    position there instead of the slot.

    A packed prefill step (S sequences one after the other in one row of N tokens, every token real) has
    `cu_seqlens` [S + 1] (sequence s is tokens cu_seqlens[s]..cu_seqlens[s + 1]), block tables and slots
    per sequence [S, ...], and the conv indices of `ops.conv.varlen_conv_indices` (`conv_heads` [S, W - 1],
    `conv_taps` [S, W - 1, W], `conv_tail` [S, W - 1]); no `valid` / `num_valid`. It may also snapshot
    GDN states inside its sequences for the prefix cache: the state before packed token `snapshot_ends` [P]
    goes to slot `snapshot_slots` [P] (`ops.gdn`), its conv state from the source rows `snapshot_tail`
    [P, W - 1] (`ops.conv.snapshot_conv_tail`)."""

    cos: torch.Tensor
    sin: torch.Tensor
    write_slots: torch.Tensor
    block_tables: torch.Tensor
    positions: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slots: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    num_valid: torch.Tensor | None = None
    conv_state: torch.Tensor | None = None
    recurrent_state: torch.Tensor | None = None
    spec_conv_state: torch.Tensor | None = None
    spec_recurrent_state: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    conv_heads: torch.Tensor | None = None
    conv_taps: torch.Tensor | None = None
    conv_tail: torch.Tensor | None = None
    snapshot_ends: torch.Tensor | None = None
    snapshot_slots: torch.Tensor | None = None
    snapshot_tail: torch.Tensor | None = None


def step_inputs(
    inv_freq: torch.Tensor,
    dtype: torch.dtype,
    positions: torch.Tensor,
    write_slots: torch.Tensor,
    block_tables: torch.Tensor,
    caches: Sequence[torch.Tensor],
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    **fields: torch.Tensor | None,
) -> StepInputs:
    """The inputs of a step whose tokens stand at `positions` [B, T] (rotary tables at the RoPE frequencies
    `inv_freq`, in `dtype`) and write their K/V at `write_slots`; `caches` as in CACHE_FIELDS; `fields` the
    step's other StepInputs fields. `rope` (positions [3, B, T], axes [frequencies]): the tokens' multimodal
    rotary positions instead, each frequency turned by the position on its axis (network/vision.py)."""
    if rope is None:
        freqs = positions.float().unsqueeze(-1) * inv_freq
    else:
        rope_positions, axes = rope
        freqs = rope_positions[axes].permute(1, 2, 0).float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    tensors = dict(zip(CACHE_FIELDS, caches, strict=False))
    return StepInputs(cos, sin, write_slots, block_tables, positions, **tensors, **fields)


def cache_slots(positions: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slot of each position: block_tables[b, pos // bs] * bs + pos % bs (bs = block_size)."""
    blocks = torch.gather(block_tables, 1, positions // block_size)
    return blocks * block_size + positions % block_size


def row_positions(
    start: torch.Tensor, num_valid: torch.Tensor, tokens: int, block_tables: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions start[b] + t [B, T] of T tokens per row, which are real (t < num_valid[b]), and the cache
    slot of each new K/V: positions that are not real write into the null block (spread over its slots)
    instead of the row's blocks."""
    offsets = torch.arange(tokens, device=start.device)
    positions, valid = start.unsqueeze(1) + offsets, offsets < num_valid.unsqueeze(1)
    null_slots = NULL_BLOCK * block_size + offsets.unsqueeze(0) % block_size
    max_pos = block_tables.shape[1] * block_size - 1
    real_slots = cache_slots(positions.clamp(max=max_pos), block_tables, block_size)
    return positions, valid, torch.where(valid, real_slots, null_slots)


def packed_positions(
    start_pos: torch.Tensor,
    num_valid: torch.Tensor,
    tokens: int,
    block_tables: torch.Tensor,
    block_size: int,
    conv_width: int,
    snapshots: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """For sequences packed one after the other in one row of `tokens` tokens (sequence s has num_valid[s]
    tokens from position start_pos[s], its blocks in block_tables[s]): the positions [1, tokens], the cache
    slot of each new K/V [1, tokens], and the packed step's other StepInputs fields: the sequences' bounds,
    the conv indices, and the `snapshots` (snapshot_ends, snapshot_slots; or none) with their conv tails."""
    cu_seqlens = F.pad(num_valid.cumsum(0), (1, 0))
    packed = torch.arange(tokens, device=start_pos.device)
    sequence = torch.searchsorted(cu_seqlens[1:], packed, right=True)
    position = start_pos[sequence] + packed - cu_seqlens[sequence]
    blocks = block_tables[sequence, position // block_size]
    write_slots = (blocks * block_size + position % block_size).unsqueeze(0)
    conv_heads, conv_taps, conv_tail = varlen_conv_indices(cu_seqlens, conv_width)
    fields = dict(cu_seqlens=cu_seqlens, conv_heads=conv_heads, conv_taps=conv_taps, conv_tail=conv_tail)
    if snapshots:
        snapshot_ends, snapshot_slots = snapshots
        snapshot_tail = snapshot_conv_tail(cu_seqlens, snapshot_ends, conv_width)
        fields.update(snapshot_ends=snapshot_ends, snapshot_slots=snapshot_slots, snapshot_tail=snapshot_tail)
    return position.unsqueeze(0), write_slots, fields
