"""Checkpoints in the layout of Qwen's FP8 releases, written by a plain per-block loop independent of the
package's quantizer, in the multimodal layout with `model.language_model.`-prefixed `modules_to_not_convert`
entries (transformers #48349) and FP8 `mtp.*` tensors (a stray one the language model must ignore, or a
whole MTP layer)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from conftest import mtp_tensor_shapes, save_tiny_checkpoint
from safetensors.torch import save_file

from optimum_qwen36.ops.fp8 import E4M3_MAX

BLOCK = (32, 32)  # several blocks per weight (partial edge blocks: the ops tests and 128 x 128 at export)
QUANTIZED = (".mlp.", ".linear_attn.in_proj_qkv.", ".linear_attn.in_proj_z.", ".linear_attn.out_proj.")
QUANTIZED_ATTENTION = tuple(f".self_attn.{p}_proj." for p in "qkvo")


def is_official_fp8(key: str) -> bool:
    return (
        key.startswith("model.language_model.")
        and key.endswith(".weight")
        and any(part in key for part in (*QUANTIZED, *QUANTIZED_ATTENTION))
    )


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block, as Qwen's release scripts do: scale = amax / 448 (bf16), q = e4m3(w / scale)."""
    rows, cols = weight.shape
    scales = torch.zeros(math.ceil(rows / block[0]), math.ceil(cols / block[1]), dtype=torch.bfloat16)
    q = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = weight[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]].float()
            scale = (tile.abs().max() / E4M3_MAX).to(torch.bfloat16)
            scales[i, j] = scale
            q[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = (
                (tile / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            )
    return q, scales


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    expanded = scales.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.float() * expanded[: q.shape[0], : q.shape[1]]


def write_official_fp8(
    directory: Path,
    seed: int = 5,
    block: tuple[int, int] = BLOCK,
    mtp_reference: Path | None = None,
    **overrides: Any,
) -> tuple[Path, torch.nn.Module]:
    """A tiny Qwen3_5ForConditionalGeneration checkpoint (text config: the tiny one with `overrides`) in the
    official FP8 layout with scale blocks of `block`; returns it and the transformers model holding the
    dequantized weights (the reference). `mtp_reference`: the checkpoint also holds a random MTP layer with
    every linear (`fc` too) in FP8, and this directory gets the same trunk and MTP layer with the dequantized
    weights in float32."""
    _, model = save_tiny_checkpoint(directory, "conditional", seed=seed, **overrides)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors = {}
    for key, value in state.items():
        if is_official_fp8(key):
            q, scales = quantize_blocks(value, block)
            tensors[key], tensors[key + "_scale_inv"] = q, scales
            state[key] = dequantize_blocks(q, scales, block)
        else:
            tensors[key] = value
    dequantized_mtp = {}
    if mtp_reference is None:  # a stray quantized MTP tensor: the language model ignores it
        tensors["mtp.layers.0.mlp.gate_proj.weight"] = torch.zeros(128, 64).to(torch.float8_e4m3fn)
        tensors["mtp.layers.0.mlp.gate_proj.weight_scale_inv"] = torch.ones(4, 2, dtype=torch.bfloat16)
    else:
        generator = torch.Generator().manual_seed(seed)
        for key, shape in mtp_tensor_shapes(model.config.text_config).items():
            scale = 0.2 if len(shape) == 1 else model.config.text_config.initializer_range
            value = torch.randn(shape, generator=generator) * scale
            if len(shape) == 2:
                q, scales = quantize_blocks(value, block)
                tensors[key], tensors[key + "_scale_inv"] = q, scales
                value = dequantize_blocks(q, scales, block)
            else:
                tensors[key] = value
            dequantized_mtp[key] = value
    for path in directory.glob("*.safetensors"):
        path.unlink()
    save_file(tensors, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    kept = ["lm_head", "model.visual"] + (["mtp"] if mtp_reference is None else [])
    kept += [
        f"model.language_model.layers.{i}.linear_attn.{name}"
        for i in range(model.config.text_config.num_hidden_layers)
        for name in ("in_proj_a", "in_proj_b")
    ]
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": kept,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    model.load_state_dict(state)
    if mtp_reference is not None:
        model.save_pretrained(mtp_reference)
        save_file(dequantized_mtp, mtp_reference / "mtp.safetensors")
    return directory, model.eval()
