"""Tiny checkpoints in the 4-bit formats users have (GPTQ v1 / v2, AWQ GEMM, compressed-tensors
pack-quantized), written independently of the package's readers and quantizer: each linear is quantized by a
plain per-group loop, then packed bit by bit as the format documents it (GPTQ / AWQ: the layouts of
GPTQModel's `pack_exllama` and `pack_awq`, checked against them; compressed-tensors: that library's own
`pack_to_int32`). Each writer returns the transformers model holding the dequantized weights (the
reference) beside the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from conftest import save_tiny_checkpoint
from safetensors.torch import save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
QUANTIZED = (
    ".mlp.",
    ".linear_attn.in_proj_qkv.",
    ".linear_attn.in_proj_z.",
    ".linear_attn.out_proj.",
    *(f".self_attn.{p}_proj." for p in "qkvo"),
)


def is_quantized(key: str) -> bool:
    return key.endswith(".weight") and any(part in key for part in QUANTIZED)


def quantize_groups(
    weight: torch.Tensor, group_size: int, symmetric: bool, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [out, in] 0..15, scales [out, groups] float16, zeros [out, groups] 0..15), group by group:
    input feature i belongs to group group_index[i]. Symmetric: zero 8, scale max |w| / 7.5; else the
    group's [min, max] over 0..15."""
    out_features, in_features = weight.shape
    groups = int(group_index.max()) + 1
    codes = torch.zeros(out_features, in_features, dtype=torch.int64)
    scales = torch.zeros(out_features, groups, dtype=torch.float16)
    zeros = torch.zeros(out_features, groups, dtype=torch.int64)
    for g in range(groups):
        columns = (group_index == g).nonzero().flatten()
        block = weight[:, columns].double()
        if symmetric:
            scale = (block.abs().amax(1) / 7.5).to(torch.float16).double()
            zero = torch.full((out_features,), 8.0, dtype=torch.float64)
        else:
            low, high = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
            scale = ((high - low) / 15).to(torch.float16).double()
            zero = (-low / scale).round().clamp(0, 15)
        q = (block / scale[:, None] + zero[:, None]).round().clamp(0, 15)
        codes[:, columns] = q.long()
        scales[:, g], zeros[:, g] = scale.half(), zero.long()
    return codes, scales, zeros


def dequantize_groups(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_index: torch.Tensor
) -> torch.Tensor:
    index = group_index.long()
    return (codes - zeros[:, index]).float() * scales[:, index].float()


def pack_along(codes: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit codes per int32 word along `dim`: the word's nibble j (bits 4j..4j+3) holds the code at
    position order[j] of its eight."""
    moved = codes.movedim(dim, -1)
    words = torch.zeros(*moved.shape[:-1], moved.shape[-1] // 8, dtype=torch.int64)
    for j, position in enumerate(order):
        words |= (moved[..., position::8] & 0xF) << (4 * j)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def group_indices(in_features: int, group_size: int, act_order: bool, seed: int) -> torch.Tensor:
    """Each input feature's group: consecutive groups, or (act_order) groups of a random permutation as
    GPTQ's desc_act makes them (feature perm[j] in group j // group_size)."""
    size = in_features if group_size == -1 else group_size
    natural = torch.arange(in_features) // size
    if not act_order:
        return natural.int()
    order = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
    index = torch.empty(in_features, dtype=torch.int32)
    index[order] = natural.int()
    return index


def write_int4(
    directory: Path,
    method: str,
    *,
    layout: str = "causal",
    seed: int = 3,
    group_size: int = 32,
    symmetric: bool = False,
    act_order: bool = False,
    checkpoint_format: str = "gptq_v2",
    excluded: tuple[str, ...] = (),
    quantization_config: dict[str, Any] | None = None,
    **overrides: Any,
) -> tuple[Path, torch.nn.Module]:
    """A tiny checkpoint whose attention, GDN and MLP linears (less `excluded`, model-name substrings) are
    4-bit in `method`'s layout ("gptq", "awq", "compressed-tensors"); returns it and the transformers model
    with the dequantized weights. `quantization_config` replaces the written one."""
    _, model = save_tiny_checkpoint(directory, layout, seed=seed, **overrides)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    for index, (key, value) in enumerate(state.items()):
        if not is_quantized(key) or any(part in key for part in excluded):
            tensors[key] = value
            continue
        module = key.removesuffix(".weight")
        group_index = group_indices(value.shape[1], group_size, act_order, seed + index)
        codes, scales, zeros = quantize_groups(value, group_size, symmetric, group_index)
        state[key] = dequantize_groups(codes, scales, zeros, group_index)
        packed = _packed(method, module, codes, scales, zeros, group_index, checkpoint_format, symmetric)
        tensors.update(packed if act_order else {k: v for k, v in packed.items() if "g_idx" not in k})
    for path in directory.glob("*.safetensors"):
        path.unlink()
    save_file(tensors, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization_config or _config(
        method, group_size, symmetric, act_order, checkpoint_format, excluded
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    model.load_state_dict(state)
    return directory, model.eval()


def _packed(
    method: str,
    module: str,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_index: torch.Tensor,
    checkpoint_format: str,
    symmetric: bool,
) -> dict[str, torch.Tensor]:
    """The format's tensors of one linear (GPTQ's `g_idx` and compressed-tensors' `weight_g_idx` always;
    the caller drops them without an activation order)."""
    if method == "gptq":
        stored_zeros = zeros - 1 if checkpoint_format == "gptq" else zeros
        return {
            f"{module}.qweight": pack_along(codes.t(), 0),  # [in / 8, out]
            f"{module}.qzeros": pack_along(stored_zeros.t() & 0xF, 1),  # [groups, out / 8]
            f"{module}.scales": scales.t().contiguous(),
            f"{module}.g_idx": group_index,
        }
    if method == "awq":
        return {
            f"{module}.qweight": pack_along(codes.t(), 1, AWQ_ORDER),  # [in, out / 8]
            f"{module}.qzeros": pack_along(zeros.t(), 1, AWQ_ORDER),
            f"{module}.scales": scales.t().contiguous(),
        }
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    # compressed-tensors stores signed values (code - 8) and float32 scales here, so that its own
    # decompression (in the scale dtype) is exact.
    tensors = {
        f"{module}.weight_packed": pack_to_int32((codes - 8).to(torch.int8), 4),
        f"{module}.weight_scale": scales.float(),
        f"{module}.weight_shape": torch.tensor(list(codes.shape)),
        f"{module}.weight_g_idx": group_index,
    }
    if not symmetric:
        tensors[f"{module}.weight_zero_point"] = pack_to_int32((zeros - 8).to(torch.int8), 4, packed_dim=0)
    return tensors


def _config(
    method: str,
    group_size: int,
    symmetric: bool,
    act_order: bool,
    checkpoint_format: str,
    excluded: tuple[str, ...],
) -> dict[str, Any]:
    if method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": act_order,
            "sym": symmetric,
            "checkpoint_format": checkpoint_format,
            "pack_dtype": "int32",
        }
    if method == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": ["visual"],
        }
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "channel" if group_size == -1 else "group",
        "group_size": None if group_size == -1 else group_size,
        "actorder": "group" if act_order else None,
        "dynamic": False,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": "pack-quantized"}},
        "ignore": ["lm_head", "re:.*in_proj_a$", "re:.*in_proj_b$", "re:model[.]visual.*", *excluded],
    }
