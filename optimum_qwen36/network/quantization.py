"""FP8 weights in the model: which linear layers are quantized, Qwen's `quantization_config`, `Fp8Linear`.

Qwen's FP8 releases quantize `linear_attn.{in_proj_qkv, in_proj_z, out_proj}`, `self_attn.{q,k,v,o}_proj`
and `mlp.*` to block-scaled e4m3 (`fp8_modules="linear"`); the seed quantized the MLPs only ("mlp").
Never quantized: embeddings, lm_head, norms, `linear_attn.{conv1d, in_proj_a, in_proj_b, A_log, dt_bias}`,
and no state: the GDN recurrent state stays float32, the conv state and the KV cache the model dtype.
The MTP layer (`mtp.*`, loaded for speculative decoding) follows the same sets for its attention and MLP
linears; its `fc` is FP8 only where a checkpoint stores it so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from ..ops.fp8 import DEFAULT_BLOCK_SIZE, FP8_DTYPE, fp8_linear, requantize_fp8, scale_shape
from .config import LINEAR_ATTENTION, excludes
from .neuron_config import MODULE_SETS

SCALE_SUFFIX = ".weight_scale_inv"
MLP_LINEARS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GDN_LINEARS = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj")
ATTENTION_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
# Linear layers that always stay in the model dtype (small, or the routing of the GDN gates).
KEPT_LINEARS = ("linear_attn.in_proj_a", "linear_attn.in_proj_b")


# The multi-token-prediction layer (`mtp.*`, loaded for speculative decoding): one full-attention decoder
# layer after `fc`, which joins the embedding and the trunk's hidden state.
MTP_LAYER = "mtp.layers.0"
MTP_LINEARS = ("mtp.fc", *(f"{MTP_LAYER}.{module}" for module in (*ATTENTION_LINEARS, *MLP_LINEARS)))


def linear_module_names(config: PretrainedConfig, modules: str, mtp: bool = False) -> list[str]:
    """The linear layers a module set (`fp8_modules`, `int4_modules`: "mlp" or "linear") quantizes, by the
    model's parameter names (`mtp`: with the MTP layer's, whose `fc` stays in the model dtype)."""
    if modules not in MODULE_SETS:
        raise ValueError(f"The quantized module set must be one of {MODULE_SETS}, got {modules!r}.")
    gdn = () if modules == "mlp" else GDN_LINEARS
    attention = () if modules == "mlp" else ATTENTION_LINEARS
    names = []
    for index, layer_type in enumerate(config.layer_types):
        mixer = gdn if layer_type == LINEAR_ATTENTION else attention
        names += [f"model.layers.{index}.{module}" for module in (*mixer, *MLP_LINEARS)]
    if mtp:
        names += [f"{MTP_LAYER}.{module}" for module in (*attention, *MLP_LINEARS)]
    return names


def kept_linear_names(config: PretrainedConfig, quantized: set[str], mtp: bool = False) -> list[str]:
    """Every linear layer of the model (`mtp`: and of its MTP layer) that is not in `quantized`:
    `modules_to_not_convert`."""
    names = ["lm_head"]
    for index, layer_type in enumerate(config.layer_types):
        mixer = (*GDN_LINEARS, *KEPT_LINEARS) if layer_type == LINEAR_ATTENTION else ATTENTION_LINEARS
        names += [f"model.layers.{index}.{module}" for module in (*mixer, *MLP_LINEARS)]
    if mtp:
        names += MTP_LINEARS
    return [name for name in names if name not in quantized]


def not_converted(entries: list[str], module: str) -> bool:
    """Whether a `modules_to_not_convert` entry names `module` (a model name such as
    `model.layers.0.mlp.gate_proj`): config.excludes."""
    return any(excludes(entry, module) for entry in entries)


@dataclass(frozen=True)
class QuantizationConfig:
    """A checkpoint's validated FP8 `quantization_config`."""

    weight_block_size: tuple[int, int]
    modules_to_not_convert: tuple[str, ...]

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> QuantizationConfig | None:
        """From config.json (top level, or the text config of a text-only checkpoint); None without one."""
        raw = getattr(config, "quantization_config", None)
        if raw is None and hasattr(config, "text_config"):
            raw = getattr(config.text_config, "quantization_config", None)
        if raw is None:
            return None
        values = raw if isinstance(raw, dict) else raw.to_dict()
        method = values.get("quant_method")
        if method != "fp8":
            raise ValueError(
                f"config.json has quantization_config quant_method={method!r}; optimum-qwen36 loads FP8 "
                "checkpoints (quant_method 'fp8'), 4-bit ones ('gptq', 'awq', 'compressed-tensors') and "
                "bf16 / fp32 ones."
            )
        fmt = values.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config fmt={fmt!r}: only e4m3 FP8 weights are supported.")
        scheme = values.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(
                f"quantization_config activation_scheme={scheme!r}: only 'dynamic' (no stored activation "
                "scales) is supported."
            )
        block = values.get("weight_block_size")
        if not (
            isinstance(block, list | tuple)
            and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise ValueError(
                f"quantization_config weight_block_size={block!r}: expected two positive integers such as "
                "[128, 128] (per-tensor or per-channel FP8 scales are not supported)."
            )
        return cls(tuple(block), tuple(values.get("modules_to_not_convert") or ()))


@dataclass(frozen=True)
class Fp8Quantization:
    """Which linear layers hold FP8 weights, in blocks of which size, and whether the checkpoint already
    stores them that way (else they are quantized when the model is built)."""

    modules: tuple[str, ...]
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE
    prequantized: bool = False
    # Whether the model has its MTP layer (whose linears `modules` may or may not name).
    mtp: bool = False

    def config_dict(self, config: PretrainedConfig) -> dict[str, Any]:
        """The `quantization_config` of a saved model, in the layout of Qwen's FP8 releases."""
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.block_size),
            "modules_to_not_convert": kept_linear_names(config, set(self.modules), self.mtp),
        }


class Fp8Linear(nn.Module):
    """A bias-free linear layer with a block-scaled e4m3 weight: `weight` [out, in] float8_e4m3fn and
    `weight_scale_inv` [ceil(out / br), ceil(in / bc)], the names of Qwen's FP8 checkpoints."""

    def __init__(self, in_features: int, out_features: int, block_size: tuple[int, int]) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block_size = in_features, out_features, block_size
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        scales = scale_shape((out_features, in_features), block_size)
        self.weight_scale_inv = nn.Parameter(torch.empty(scales, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.block_size)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, block_size={self.block_size}"
        )


def replace_with_fp8_linears(model: nn.Module, quantization: Fp8Quantization) -> None:
    """Swap each named nn.Linear for an Fp8Linear of the same shape (on the meta device, before loading)."""
    for name in quantization.modules:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        if not isinstance(linear, nn.Linear) or linear.bias is not None:
            raise ValueError(f"{name} is not a bias-free linear layer: it cannot hold FP8 weights.")
        with torch.device("meta"):
            fp8 = Fp8Linear(linear.in_features, linear.out_features, quantization.block_size)
        setattr(parent, child, fp8)


@torch.no_grad()
def rescale_for_range(model: nn.Module, max_value: float) -> None:
    """Requantize every Fp8Linear for an e4m3 format that saturates at max_value (Neuron's +-240)."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            weight, scale = requantize_fp8(
                module.weight, module.weight_scale_inv, module.block_size, max_value
            )
            module.weight.data, module.weight_scale_inv.data = weight, scale
