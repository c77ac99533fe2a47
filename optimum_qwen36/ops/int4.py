"""4-bit integer weights with a scale and a zero point per group of input features (GPTQ, AWQ and
compressed-tensors W4A16 all dequantize to W[m, k] = scale[m, g(k)] * (q[m, k] - zero[m, g(k)]), q and
zero in 0..15), held the way the native kernel reads them:

- `packed` uint8 [M, ceil(K / 128) * 64]: two 4-bit codes a byte, in blocks of 128 input features (the
  last block padded with zeros) ordered for the kernel (`BLOCK_LOW` / `BLOCK_HIGH`: byte b of a block holds
  feature BLOCK_LOW[b] in its low nibble and BLOCK_HIGH[b] in its high one), so that splitting nibbles and
  interleaving them with a constant byte gives four vectors of 32 consecutive features as bf16.
- `scales` [M, groups] (float32, float16 or bfloat16, as the checkpoint stores them) and `zeros` uint8
  [M, groups], groups of `group_size` features along the padded input (a group size of at least K, i.e. per
  channel, is held as one group over the padded input).

`int4_linear` is F.linear on such a weight: the native kernel on CPU (`csrc/int4_linear.cpp`: decode rows
stream the 4-bit weight and widen it in registers; longer inputs dequantize one tile at a time), else its
PyTorch twin `int4_linear_torch`. Activations are not quantized: the result is F.linear on the dequantized
weight, up to float32 summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .native import load_native_ops

INT4_BLOCK = 128
INT4_MAX = 15
DEFAULT_GROUP_SIZE = 128
# Group sizes the kernel runs: 32 and 64 (whole vectors of a block) or whole blocks.
SUB_BLOCK_GROUP_SIZES = (32, 64)


def _block_order() -> tuple[torch.Tensor, torch.Tensor]:
    """For byte b of a 128-feature block: the features of its low and high nibbles. Lane L (16 bytes) of a
    64-byte block holds features 8L..8L+7 and 32+8L.. in its low nibbles, 64+8L.. and 96+8L.. in its high
    ones: what the kernel's byte unpacks (within 128-bit lanes) put in natural order."""
    byte = torch.arange(64)
    lane, j = byte // 16, byte % 16
    low = torch.where(j < 8, 8 * lane + j, 32 + 8 * lane + j - 8)
    return low, low + 64


BLOCK_LOW, BLOCK_HIGH = _block_order()


def padded_features(in_features: int) -> int:
    return -(-in_features // INT4_BLOCK) * INT4_BLOCK


def kernel_group_size(group_size: int, in_features: int) -> int:
    """The group size as held: per channel (or any group covering all K features) is one group over the
    padded input. Raises ValueError for sizes the kernel does not run."""
    if group_size == -1 or group_size >= in_features:
        return padded_features(in_features)
    if group_size not in SUB_BLOCK_GROUP_SIZES and group_size % INT4_BLOCK != 0:
        raise ValueError(
            f"group_size {group_size} is not supported for 4-bit weights: use 32, 64, a multiple of 128, or "
            "-1 (per output channel)."
        )
    return group_size


def group_count(group_size: int, in_features: int) -> int:
    """Groups of the padded input, `group_size` as held (`kernel_group_size`)."""
    return -(-padded_features(in_features) // group_size)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [M, K] (0..15, natural order) -> the kernel's packed bytes [M, ceil(K / 128) * 64]."""
    rows, cols = codes.shape
    padded = F.pad(codes.to(torch.uint8), (0, padded_features(cols) - cols))
    blocks = padded.view(rows, -1, INT4_BLOCK)
    packed = blocks[..., BLOCK_LOW] | (blocks[..., BLOCK_HIGH] << 4)
    return packed.reshape(rows, -1).contiguous()


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The kernel's packed bytes -> uint8 codes [M, in_features] in natural order."""
    rows = packed.shape[0]
    blocks = packed.view(rows, -1, INT4_BLOCK // 2)
    codes = torch.empty(rows, blocks.shape[1], INT4_BLOCK, dtype=torch.uint8, device=packed.device)
    codes[..., BLOCK_LOW] = blocks & 0xF
    codes[..., BLOCK_HIGH] = blocks >> 4
    return codes.reshape(rows, -1)[:, :in_features]


def expand_groups(values: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """[M, groups] repeated over each group's features: [M, in_features]."""
    return values.repeat_interleave(group_size, dim=1)[:, :in_features]


def dequantize_int4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """scale * (q - zero) computed in float32 (exact: a small integer times a 16- or 32-bit scale), then
    cast to dtype; [M, in_features] in natural order."""
    codes = unpack_int4(packed, in_features).float()
    offset = codes - expand_groups(zeros.float(), group_size, in_features)
    return (offset * expand_groups(scales.float(), group_size, in_features)).to(dtype)


def quantize_int4(
    weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to nearest with an asymmetric zero point per group: (packed, scales, zeros), `group_size` as
    held (`kernel_group_size`). Each group's [min, max] (widened to include 0) spans 0..15; the scale is
    rounded to scale_dtype first and the codes computed with that rounded scale, so dequantizing with the
    stored scale gives what was quantized."""
    w = weight.float()
    rows, cols = w.shape
    groups = group_count(group_size, cols)
    padded = F.pad(w, (0, groups * group_size - cols)).view(rows, groups, group_size)
    low = padded.amin(dim=2).clamp(max=0)
    high = padded.amax(dim=2).clamp(min=0)
    scale = ((high - low) / INT4_MAX).to(scale_dtype).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = (-low / scale).round().clamp(0, INT4_MAX)
    codes = (padded / scale[..., None] + zero[..., None]).round().clamp(0, INT4_MAX)
    codes = codes.reshape(rows, -1)[:, :cols].to(torch.uint8)
    return pack_int4(codes), scale.to(scale_dtype), zero.to(torch.uint8)


def int4_linear_torch(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The reference: F.linear on the weight dequantized to x's dtype."""
    weight = dequantize_int4(packed, scales, zeros, group_size, x.shape[-1], x.dtype)
    return F.linear(x, weight)


def int4_linear(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """F.linear(x, W) for the 4-bit weight W (no bias: Qwen's linears have none)."""
    if x.device.type == "cpu" and load_native_ops():
        return torch.ops.optimum_qwen36.int4_linear(x, packed, scales, zeros, group_size)
    return int4_linear_torch(x, packed, scales, zeros, group_size)
