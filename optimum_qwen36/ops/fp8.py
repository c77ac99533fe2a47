"""Block-scaled float8_e4m3fn weights, as in Qwen's FP8 checkpoints: `weight` [M, K] e4m3 and
`weight_scale_inv` [ceil(M / br), ceil(K / bc)], a multiplier per [br, bc] block (W ~ weight * scale_inv).

`fp8_linear` is F.linear on such a weight. On CPU it runs the native kernel (`csrc/fp8_linear.cpp`:
decode rows stream the one-byte weight and widen it in registers; longer inputs dequantize one tile at a
time); elsewhere, or where the kernel could not be built, its PyTorch twin `fp8_linear_torch`. Activations
are not quantized (weight-only FP8): the result is F.linear on the dequantized weight, up to float32
summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .native import load_native_ops

FP8_DTYPE = torch.float8_e4m3fn
# Largest finite e4m3fn value; Neuron's e4m3 saturates at 240 instead (weights are rescaled for it).
E4M3_MAX = 448.0
NEURON_E4M3_MAX = 240.0
DEFAULT_BLOCK_SIZE = (128, 128)


def scale_shape(weight_shape: tuple[int, ...], block_size: tuple[int, int]) -> tuple[int, int]:
    rows, cols = weight_shape
    return -(-rows // block_size[0]), -(-cols // block_size[1])


def expand_scale(
    scale_inv: torch.Tensor, weight_shape: tuple[int, ...], block_size: tuple[int, int]
) -> torch.Tensor:
    """scale_inv repeated over its blocks: [M, K] (a view where the blocks tile the weight exactly)."""
    rows, cols = weight_shape
    r, c = scale_inv.shape
    expanded = scale_inv[:, None, :, None].expand(r, block_size[0], c, block_size[1])
    return expanded.reshape(r * block_size[0], c * block_size[1])[:rows, :cols]


def quantize_fp8(
    weight: torch.Tensor,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    max_value: float = E4M3_MAX,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale_inv) with each block's largest |value| mapped to max_value. The scale is rounded
    to scale_dtype first and the weight divided by that rounded scale, so dequantizing with the stored scale
    is what was quantized."""
    w = weight.float()
    rows, cols = w.shape
    r, c = scale_shape(w.shape, block_size)
    padded = F.pad(w, (0, c * block_size[1] - cols, 0, r * block_size[0] - rows))
    blocks = padded.view(r, block_size[0], c, block_size[1])
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / max_value, torch.ones_like(amax)).to(scale_dtype)
    q = (w / expand_scale(scale.float(), w.shape, block_size)).clamp(-max_value, max_value)
    return q.to(FP8_DTYPE), scale


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """weight * scale_inv per block, computed in float32 (exact: a 4-bit by 8-bit mantissa product), then
    cast to dtype."""
    return (weight.float() * expand_scale(scale_inv.float(), weight.shape, block_size)).to(dtype)


def requantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int], max_value: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same weight quantized for a narrower e4m3 range (Neuron's +-240), scales kept in their dtype."""
    dequantized = dequantize_fp8(weight, scale_inv, block_size, torch.float32)
    return quantize_fp8(dequantized, block_size, max_value, scale_inv.dtype)


def fp8_linear_torch(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]
) -> torch.Tensor:
    """The reference: F.linear on the weight dequantized to x's dtype."""
    return F.linear(x, dequantize_fp8(weight, scale_inv, block_size, x.dtype))


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]
) -> torch.Tensor:
    """F.linear(x, W) for the block-scaled e4m3 weight W (no bias: Qwen's quantized linears have none)."""
    if x.device.type == "cpu" and load_native_ops():
        return torch.ops.optimum_qwen36.fp8_linear(x, weight, scale_inv, block_size[0], block_size[1])
    return fp8_linear_torch(x, weight, scale_inv, block_size)
