"""4-bit weights in the model: `Int4Linear`, which linear layers hold them (`Int4Quantization`), and the
checkpoint a model with them is saved as: compressed-tensors `pack-quantized` W4A16, which transformers
(and vLLM) load.

A 4-bit checkpoint (GPTQ, AWQ, compressed-tensors: network/int4_checkpoints.py) keeps the linears it
stores in 4 bits, whichever they are; quantizing at export (`quantization="int4"`) takes the linears of
`int4_modules` ("linear": every attention, Gated DeltaNet and MLP linear, or "mlp"), round to nearest with
an asymmetric zero point per group of `int4_group_size` input features. Never quantized at export:
embeddings, lm_head, norms, `linear_attn.{conv1d, in_proj_a, in_proj_b, A_log, dt_bias}` (as FP8's sets),
and no state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from ..ops.int4 import (
    DEFAULT_GROUP_SIZE,
    group_count,
    int4_linear,
    kernel_group_size,
    padded_features,
    unpack_int4,
)
from .int4_checkpoints import COMPRESSED_TENSORS, PACK_QUANTIZED, Int4CheckpointFormat, pack_words
from .model import Qwen36ForCausalLM
from .quantization import kept_linear_names

INT4_PARAMETERS = ("packed_weight", "scales", "zeros", "input_order")


@dataclass(frozen=True)
class Int4Module:
    """One 4-bit linear: its group size as stored (-1: per output channel) and whether its inputs are
    permuted (GPTQ's `desc_act` / compressed-tensors' activation order)."""

    group_size: int
    permuted: bool = False


@dataclass(frozen=True)
class Int4Quantization:
    """Which linear layers hold 4-bit weights, and where they come from: a 4-bit checkpoint (`checkpoint`,
    its format) or the model-dtype weights quantized when the model is built (`checkpoint` None)."""

    modules: tuple[tuple[str, Int4Module], ...]
    checkpoint: Int4CheckpointFormat | None = None
    # Whether the model has its MTP layer (whose linears `modules` may or may not name).
    mtp: bool = False

    @classmethod
    def at_export(
        cls, names: list[str], group_size: int = DEFAULT_GROUP_SIZE, mtp: bool = False
    ) -> Int4Quantization:
        return cls(tuple((name, Int4Module(group_size)) for name in sorted(names)), mtp=mtp)

    @property
    def module_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.modules)

    def replace_linears(self, model: nn.Module) -> None:
        """Swap each named nn.Linear for an Int4Linear of the same shape (on the meta device, before
        loading)."""
        for name, module in self.modules:
            parent_name, _, child = name.rpartition(".")
            try:
                parent = model.get_submodule(parent_name)
            except AttributeError:
                parent = None
            linear = getattr(parent, child, None)
            if not isinstance(linear, nn.Linear) or linear.bias is not None:
                raise ValueError(f"{name} is not a bias-free linear layer: it cannot hold 4-bit weights.")
            group_size = kernel_group_size(module.group_size, linear.in_features)
            with torch.device("meta"):
                int4 = Int4Linear(linear.in_features, linear.out_features, group_size, module.permuted)
            setattr(parent, child, int4)

    def config_dict(self, config: PretrainedConfig) -> dict[str, Any]:
        """The `quantization_config` of a saved model: compressed-tensors pack-quantized, one config group
        per (group size or per channel, activation order), targeting its modules by name; every other linear
        ignored."""
        with torch.device("meta"):
            model = Qwen36ForCausalLM(config, mtp=self.mtp)
        schemes: dict[tuple[int, bool], list[str]] = {}
        for name, module in self.modules:
            # compressed-tensors' group strategy needs whole groups: one covering the input is per channel.
            in_features = model.get_submodule(name).in_features
            group_size = -1 if module.group_size >= in_features else module.group_size
            schemes.setdefault((group_size, module.permuted), []).append(name)
        groups = {}
        for index, ((group_size, permuted), names) in enumerate(sorted(schemes.items())):
            weights = {
                "num_bits": 4,
                "type": "int",
                "symmetric": False,
                "strategy": "channel" if group_size == -1 else "group",
                "group_size": None if group_size == -1 else group_size,
                "dynamic": False,
                "actorder": "group" if permuted else None,
                "observer": "minmax",
            }
            groups[f"group_{index}"] = {
                "targets": names,
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": PACK_QUANTIZED,
            }
        return {
            "quant_method": COMPRESSED_TENSORS,
            "format": PACK_QUANTIZED,
            "quantization_status": "compressed",
            "config_groups": groups,
            "ignore": kept_linear_names(config, set(self.module_names), self.mtp),
            "kv_cache_scheme": None,
        }


class Int4Linear(nn.Module):
    """A bias-free linear layer with a 4-bit weight in the kernel's layout (ops/int4.py): `packed_weight`
    uint8 [out, padded in / 2], `scales` [out, groups] and `zeros` uint8 [out, groups] per `group_size`
    input features; with `permuted`, `input_order` [in]: the weight's columns are x[..., input_order]."""

    def __init__(self, in_features: int, out_features: int, group_size: int, permuted: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = group_count(group_size, in_features)
        parameter = lambda *shape, dtype: nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)  # noqa: E731
        self.packed_weight = parameter(out_features, padded_features(in_features) // 2, dtype=torch.uint8)
        self.scales = parameter(out_features, groups, dtype=torch.float32)
        self.zeros = parameter(out_features, groups, dtype=torch.uint8)
        self.input_order = parameter(in_features, dtype=torch.int64) if permuted else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        return int4_linear(x, self.packed_weight, self.scales, self.zeros, self.group_size)

    def extra_repr(self) -> str:
        order = ", permuted inputs" if self.input_order is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}{order}"
        )

    def compressed_tensors(self) -> dict[str, torch.Tensor]:
        """This weight as compressed-tensors pack-quantized tensors (by suffix): `weight_packed` [out, in / 8]
        (the code is the signed value plus 8), `weight_scale` and packed `weight_zero_point` per stored group,
        `weight_shape`, and with permuted inputs `weight_g_idx`, each input feature's group."""
        codes = unpack_int4(self.packed_weight, self.in_features)
        groups = group_count(self.group_size, self.in_features)
        stored_groups = 1 if self.group_size >= self.in_features else -(-self.in_features // self.group_size)
        tensors = {}
        if self.input_order is not None:
            natural = torch.empty_like(codes)
            natural[:, self.input_order] = codes
            codes = natural
            group_index = torch.empty(self.in_features, dtype=torch.int32)
            group_index[self.input_order] = (torch.arange(self.in_features) // self.group_size).int()
            tensors["weight_g_idx"] = group_index
        assert groups >= stored_groups
        tensors["weight_packed"] = pack_words(codes, 1)
        tensors["weight_scale"] = self.scales[:, :stored_groups].contiguous()
        tensors["weight_zero_point"] = pack_words(self.zeros[:, :stored_groups], 0)
        tensors["weight_shape"] = torch.tensor([self.out_features, self.in_features])
        return tensors


def compressed_tensors_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model's parameters (`state`, by name) with each Int4Linear's held as compressed-tensors
    pack-quantized tensors (the layout of the saved checkpoint)."""
    saved = dict(state)
    for name, module in model.named_modules():
        if isinstance(module, Int4Linear):
            for parameter in INT4_PARAMETERS:
                saved.pop(f"{name}.{parameter}", None)
            saved.update({f"{name}.{suffix}": t for suffix, t in module.compressed_tensors().items()})
    return saved
