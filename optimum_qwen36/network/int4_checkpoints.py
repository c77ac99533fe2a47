"""The 4-bit checkpoint formats users have, read into the kernel's layout (ops/int4.py):

- GPTQ (`quant_method: "gptq"`): `qweight` int32 [in / 8, out], eight input features a word (feature 8r + j
  in bits 4j of row r); `qzeros` int32 [groups, out / 8], eight outputs a word; `scales` [groups, out];
  `g_idx` int32 [in], each input feature's group (a permutation of groups with `desc_act`).
  `checkpoint_format` "gptq" stores each zero point minus one (read back as the packed word plus 0x11111111,
  as GPTQModel converts it), "gptq_v2" as is; `sym` checkpoints have zero point 8.
- AWQ GEMM (`quant_method: "awq"`, `version: "gemm"`): `qweight` int32 [in, out / 8] and `qzeros` int32
  [groups, out / 8], eight outputs a word in AWQ's interleaved order (output 8c + AWQ_ORDER[j] in bits 4j);
  `scales` [groups, out].
- compressed-tensors `pack-quantized` W4A16 (`quant_method: "compressed-tensors"`, group or channel
  strategy): `weight_packed` int32 [out, in / 8] (input feature 8c + j in bits 4j of word c, the signed
  value plus 8), `weight_scale` [out, groups], `weight_zero_point` int32 [ceil(out / 8), groups] packed along
  the outputs (asymmetric only), `weight_shape` [2], and `weight_g_idx` [in] with activation ordering.

Every format dequantizes to W[o, i] = scale[g(i), o] * (q[i, o] - zero[g(i), o]) with q, zero in 0..15.
Which linears hold 4-bit weights comes from the tensors present; the config's exclusions (`dynamic` "-:"
patterns, `modules_to_not_convert`, `ignore`) must agree with them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig

from ..ops.int4 import group_count, kernel_group_size, pack_int4
from .config import excludes, module_names, pattern_matches

GPTQ, AWQ, COMPRESSED_TENSORS = "gptq", "awq", "compressed-tensors"
INT4_METHODS = (GPTQ, AWQ, COMPRESSED_TENSORS)
GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PACK_QUANTIZED = "pack-quantized"
# The tensors of a quantized linear X, by format: `X.<suffix>`; the first is the packed weight.
GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
AWQ_TENSORS = ("qweight", "qzeros", "scales")
CT_TENSORS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
GPTQ_V1_ZERO_OFFSET = 0x11111111


class Int4CheckpointError(ValueError):
    """A 4-bit checkpoint's tensors or quantization_config cannot be read as the format says."""


@dataclass(frozen=True)
class HeldInt4:
    """One linear's 4-bit weight as the kernel holds it (ops/int4.py), and its input permutation (activation
    order: x[..., input_order] meets the permuted weight) or None."""

    packed: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    input_order: torch.Tensor | None


@dataclass(frozen=True)
class ModuleScheme:
    """How one quantized linear is stored: its group size (-1: per channel) and whether it is symmetric."""

    group_size: int
    symmetric: bool


# A linear's codes [out, in], scales and zeros [out, groups], and each input feature's group (or None).
Codes = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class StoredLinear:
    """One quantized linear as a checkpoint stores it: its tensors by suffix, scheme and shape."""

    module: str
    tensors: Mapping[str, torch.Tensor]
    scheme: ModuleScheme
    out_features: int
    in_features: int

    @property
    def fields(self) -> tuple[str, Mapping[str, torch.Tensor], int, int]:
        return self.module, self.tensors, self.out_features, self.in_features

    @property
    def groups(self) -> int:
        return checkpoint_groups(self.scheme.group_size, self.in_features)


@dataclass(frozen=True)
class Int4CheckpointFormat:
    """A checkpoint's validated 4-bit `quantization_config`."""

    method: str
    scheme: ModuleScheme
    # gptq: "gptq" (zero points stored minus one) or "gptq_v2".
    checkpoint_format: str = "gptq_v2"
    excluded: tuple[str, ...] = ()
    # gptq `dynamic`: (pattern, group size or None) for "+:" / bare patterns that override the scheme.
    overrides: tuple[tuple[str, int | None], ...] = ()
    # compressed-tensors: (targets, scheme) per config group.
    groups: tuple[tuple[tuple[str, ...], ModuleScheme], ...] = field(default=())

    @property
    def tensor_suffixes(self) -> tuple[str, ...]:
        return {GPTQ: GPTQ_TENSORS, AWQ: AWQ_TENSORS}.get(self.method, CT_TENSORS)

    @property
    def packed_suffix(self) -> str:
        return self.tensor_suffixes[0]

    def is_excluded(self, module: str) -> bool:
        """Whether the config keeps `module` (a model name) unquantized."""
        return any(excludes(entry, module) for entry in self.excluded)

    def module_scheme(self, module: str) -> ModuleScheme:
        """The scheme of the quantized linear `module` (a model name)."""
        if self.method == COMPRESSED_TENSORS:
            for targets, scheme in self.groups:
                if any(_targets_module(target, module) for target in targets):
                    return scheme
            raise Int4CheckpointError(
                f"{module} holds a 4-bit weight but no quantization_config.config_groups entry targets it."
            )
        for pattern, group_size in self.overrides:
            if pattern_matches(pattern, module) and group_size is not None:
                return ModuleScheme(group_size, self.scheme.symmetric)
        return self.scheme

    def read(
        self, module: str, tensors: Mapping[str, torch.Tensor], out_features: int, in_features: int
    ) -> HeldInt4:
        """The module's checkpoint tensors (by suffix) as the kernel holds them; raises
        Int4CheckpointError naming the tensor that is missing or mis-shaped."""
        linear = StoredLinear(module, tensors, self.module_scheme(module), out_features, in_features)
        read = {GPTQ: self._read_gptq, AWQ: _read_awq}.get(self.method, _read_compressed)
        codes, scales, zeros, group_index = read(linear)
        return hold(module, codes, scales, zeros, group_index, linear.scheme.group_size, in_features)

    def _read_gptq(self, linear: StoredLinear) -> Codes:
        module, tensors, out_features, in_features = linear.fields
        groups = linear.groups
        qweight = _tensor(module, tensors, "qweight", (in_features // 8, out_features), torch.int32)
        qzeros = _tensor(module, tensors, "qzeros", (groups, -(-out_features // 8)), torch.int32)
        scales = _scales(module, tensors, "scales", (groups, out_features))
        g_idx = tensors.get("g_idx")
        if g_idx is not None:
            _check_shape(module, "g_idx", g_idx, (in_features,))
        codes = unpack_words(qweight, 0)[:in_features].t()
        words = qzeros.long() & 0xFFFFFFFF
        if self.checkpoint_format == "gptq":
            words = (words + GPTQ_V1_ZERO_OFFSET) & 0xFFFFFFFF
        zeros = unpack_words(words, 1)[:, :out_features].t()
        return codes, scales.t(), zeros, g_idx


def _read_awq(linear: StoredLinear) -> Codes:
    module, tensors, out_features, in_features = linear.fields
    groups = linear.groups
    qweight = _tensor(module, tensors, "qweight", (in_features, out_features // 8), torch.int32)
    qzeros = _tensor(module, tensors, "qzeros", (groups, out_features // 8), torch.int32)
    scales = _scales(module, tensors, "scales", (groups, out_features))
    codes = _awq_natural_order(unpack_words(qweight, 1)).t()
    zeros = _awq_natural_order(unpack_words(qzeros, 1)).t()
    return codes, scales.t(), zeros, None


def _read_compressed(linear: StoredLinear) -> Codes:
    module, tensors, out_features, in_features = linear.fields
    groups, scheme = linear.groups, linear.scheme
    shape = tensors.get("weight_shape")
    if shape is not None and [int(v) for v in shape.flatten()] != [out_features, in_features]:
        raise Int4CheckpointError(
            f"{module}.weight_shape is {shape.tolist()}, but the config implies "
            f"[{out_features}, {in_features}]."
        )
    packed = _tensor(module, tensors, "weight_packed", (out_features, -(-in_features // 8)), torch.int32)
    scales = _scales(module, tensors, "weight_scale", (out_features, groups))
    codes = unpack_words(packed, 1)[:, :in_features]
    if scheme.symmetric:
        zeros = torch.full((out_features, groups), 8, dtype=torch.uint8)
    else:
        zero_point = _tensor(
            module, tensors, "weight_zero_point", (-(-out_features // 8), groups), torch.int32
        )
        zeros = unpack_words(zero_point, 0)[:out_features]
    g_idx = tensors.get("weight_g_idx")
    if g_idx is not None:
        _check_shape(module, "weight_g_idx", g_idx, (in_features,))
    return codes, scales, zeros, g_idx


def checkpoint_groups(group_size: int, in_features: int) -> int:
    return 1 if group_size == -1 else -(-in_features // group_size)


def unpack_words(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words holding eight 4-bit codes each (code j in bits 4j) -> uint8 codes, the eight of a word
    consecutive along `dim`."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    codes = (
        words.long().unsqueeze(dim + 1) >> shifts.view([8 if d == dim + 1 else 1 for d in range(3)])
    ) & 0xF
    shape = list(words.shape)
    shape[dim] *= 8
    return codes.reshape(shape).to(torch.uint8)


def pack_words(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8 codes (0..15) -> int32 words of eight codes each (code j in bits 4j), the eight of a word
    consecutive along `dim` (padded with zero codes to a multiple of eight): `unpack_words`' inverse."""
    count = codes.shape[dim]
    pad = [0, 0, 0, 0]
    pad[2 * (1 - dim) + 1] = -(-count // 8) * 8 - count
    padded = torch.nn.functional.pad(codes.long(), pad)
    shape = list(padded.shape)
    shape[dim : dim + 1] = [shape[dim] // 8, 8]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64).view([8 if d == dim + 1 else 1 for d in range(3)])
    words = (padded.view(shape) << shifts).sum(dim + 1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _awq_natural_order(codes: torch.Tensor) -> torch.Tensor:
    """AWQ's codes [rows, cols] with each word's eight in AWQ_ORDER -> natural column order."""
    rows, cols = codes.shape
    natural = torch.empty_like(codes).view(rows, cols // 8, 8)
    natural[..., list(AWQ_ORDER)] = codes.view(rows, cols // 8, 8)
    return natural.view(rows, cols)


def hold(
    module: str,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_index: torch.Tensor | None,
    group_size: int,
    in_features: int,
) -> HeldInt4:
    """Codes [out, in], scales and zeros [out, groups] and each input's group -> the kernel's layout: with
    an activation order, inputs sorted by group (so each group's features are consecutive) and that order
    kept; groups padded to the padded input."""
    input_order = None
    natural = torch.arange(in_features) // (in_features if group_size == -1 else group_size)
    if group_index is not None and not torch.equal(group_index.long(), natural):
        order = torch.sort(group_index.long(), stable=True).indices
        if not torch.equal(group_index.long()[order], natural):
            raise Int4CheckpointError(
                f"{module}'s group index (g_idx) does not give each group exactly {group_size} input "
                "features: it is not an activation order of the quantization_config's group_size."
            )
        codes, input_order = codes[:, order], order
    held = kernel_group_size(group_size, in_features)
    pad = group_count(held, in_features) - scales.shape[1]
    scales = torch.nn.functional.pad(scales, (0, pad))
    zeros = torch.nn.functional.pad(zeros, (0, pad))
    return HeldInt4(pack_int4(codes), scales.contiguous(), zeros.contiguous(), held, input_order)


def _tensor(
    module: str,
    tensors: Mapping[str, torch.Tensor],
    suffix: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    if suffix not in tensors:
        raise Int4CheckpointError(
            f"{module}.{suffix} is missing: the checkpoint's other tensors make {module} a 4-bit linear "
            f"({sorted(tensors)} found). Re-download or re-quantize the checkpoint."
        )
    tensor = tensors[suffix]
    if tensor.dtype != dtype:
        raise Int4CheckpointError(f"{module}.{suffix} is {tensor.dtype}; the format stores it as {dtype}.")
    _check_shape(module, suffix, tensor, shape)
    return tensor


def _scales(
    module: str, tensors: Mapping[str, torch.Tensor], suffix: str, shape: tuple[int, ...]
) -> torch.Tensor:
    if suffix in tensors and not tensors[suffix].dtype.is_floating_point:
        raise Int4CheckpointError(f"{module}.{suffix} is {tensors[suffix].dtype}; scales are floating point.")
    dtype = tensors[suffix].dtype if suffix in tensors else torch.float16
    return _tensor(module, tensors, suffix, shape, dtype)


def _check_shape(module: str, suffix: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise Int4CheckpointError(
            f"{module}.{suffix} has shape {tuple(tensor.shape)}, but the linear's shape and the "
            f"quantization_config's group size need {shape}."
        )


def _targets_module(target: str, module: str) -> bool:
    """A compressed-tensors target: the class name `Linear`, `re:` a regular expression, or a module's
    exact name (either layout)."""
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return pattern_matches(target.removeprefix("re:"), module)
    return target in module_names(module)


def _bits_error(field_name: str, bits: Any) -> Int4CheckpointError:
    return Int4CheckpointError(
        f"quantization_config {field_name}={bits!r}: optimum-qwen36 loads 4-bit integer weights only (bits "
        "2, 3 and 8 are not supported); use a 4-bit build of the model."
    )


def _group_size(field_name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not (value == -1 or value > 0):
        raise Int4CheckpointError(
            f"quantization_config {field_name}={value!r}: expected a positive group size or -1 (per channel)."
        )
    return value


def int4_checkpoint_format(values: Mapping[str, Any]) -> Int4CheckpointFormat:
    """The validated format of a 4-bit `quantization_config` (quant_method gptq, awq or
    compressed-tensors)."""
    method = values.get("quant_method")
    if method == GPTQ:
        return _gptq_format(values)
    if method == AWQ:
        return _awq_format(values)
    if method == COMPRESSED_TENSORS:
        return _compressed_format(values)
    raise Int4CheckpointError(f"quantization_config quant_method={method!r} is not a 4-bit format.")


def _gptq_format(values: Mapping[str, Any]) -> Int4CheckpointFormat:
    if values.get("bits") != 4:
        raise _bits_error("bits", values.get("bits"))
    checkpoint_format = values.get("checkpoint_format") or values.get("format") or "gptq"
    if checkpoint_format not in GPTQ_FORMATS:
        raise Int4CheckpointError(
            f"quantization_config checkpoint_format={checkpoint_format!r}: optimum-qwen36 reads GPTQ "
            f"weights packed as {GPTQ_FORMATS} (others, e.g. marlin, are laid out for one GPU kernel)."
        )
    pack_dtype = values.get("pack_dtype", "int32")
    if pack_dtype not in ("int32", "torch.int32"):
        raise Int4CheckpointError(
            f"quantization_config pack_dtype={pack_dtype!r}: only int32 words are supported."
        )
    scheme = ModuleScheme(
        _group_size("group_size", values.get("group_size", 128)), bool(values.get("sym", True))
    )
    excluded, overrides = list(values.get("modules_to_not_convert") or ()), []
    for pattern, settings in (values.get("dynamic") or {}).items():
        if pattern.startswith("-:"):
            excluded.append("re:" + pattern.removeprefix("-:"))
            continue
        settings = settings or {}
        if settings.get("bits", 4) != 4:
            raise _bits_error(f"dynamic[{pattern!r}].bits", settings.get("bits"))
        group = settings.get("group_size")
        overrides.append(
            (pattern.removeprefix("+:"), None if group is None else _group_size("group_size", group))
        )
    return Int4CheckpointFormat(GPTQ, scheme, checkpoint_format, tuple(excluded), tuple(overrides))


def _awq_format(values: Mapping[str, Any]) -> Int4CheckpointFormat:
    bits = values.get("bits", values.get("w_bit"))
    if bits != 4:
        raise _bits_error("bits", bits)
    version = str(values.get("version", "gemm")).lower()
    if version != "gemm":
        raise Int4CheckpointError(
            f"quantization_config version={version!r}: optimum-qwen36 reads AWQ's GEMM packing only (GEMV, "
            "exllama and marlin packings are laid out for one GPU kernel)."
        )
    group = _group_size("group_size", values.get("group_size", values.get("q_group_size", 128)))
    scheme = ModuleScheme(group, not values.get("zero_point", True))
    if scheme.symmetric:
        raise Int4CheckpointError(
            "quantization_config zero_point=false: only AWQ with zero points is supported."
        )
    return Int4CheckpointFormat(AWQ, scheme, excluded=tuple(values.get("modules_to_not_convert") or ()))


def _compressed_format(values: Mapping[str, Any]) -> Int4CheckpointFormat:
    groups = []
    for name, group in (values.get("config_groups") or {}).items():
        where = f"config_groups.{name}"
        group_format = group.get("format") or values.get("format")
        if group_format != PACK_QUANTIZED:
            raise Int4CheckpointError(
                f"quantization_config {where} format={group_format!r}: optimum-qwen36 reads "
                "compressed-tensors "
                f"{PACK_QUANTIZED!r} 4-bit weights (W4A16) only."
            )
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 4:
            raise _bits_error(f"{where}.weights.num_bits", weights.get("num_bits"))
        if weights.get("type", "int") != "int":
            raise Int4CheckpointError(
                f"quantization_config {where}.weights.type={weights.get('type')!r}: int only."
            )
        if group.get("input_activations") is not None:
            raise Int4CheckpointError(
                f"quantization_config {where}.input_activations is set: only weight-only schemes (W4A16) run "
                "here, activations stay in the model dtype."
            )
        strategy = weights.get("strategy")
        if strategy == "group":
            group_size = _group_size(f"{where}.weights.group_size", weights.get("group_size"))
        elif strategy == "channel":
            group_size = -1
        else:
            raise Int4CheckpointError(
                f"quantization_config {where}.weights.strategy={strategy!r}: 'group' and 'channel' are "
                "supported."
            )
        targets = tuple(group.get("targets") or ())
        groups.append((targets, ModuleScheme(group_size, bool(weights.get("symmetric", True)))))
    if not groups:
        raise Int4CheckpointError("quantization_config has no config_groups: the 4-bit scheme is unknown.")
    return Int4CheckpointFormat(
        COMPRESSED_TENSORS, groups[0][1], excluded=tuple(values.get("ignore") or ()), groups=tuple(groups)
    )


def raw_quantization_config(config: PretrainedConfig) -> dict[str, Any] | None:
    """config.json's quantization_config (top level, or the text config's), as a dict; None without one."""
    raw = getattr(config, "quantization_config", None)
    if raw is None and hasattr(config, "text_config"):
        raw = getattr(config.text_config, "quantization_config", None)
    if raw is None:
        return None
    return dict(raw) if isinstance(raw, dict) else raw.to_dict()
