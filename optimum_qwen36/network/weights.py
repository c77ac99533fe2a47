"""Load a Qwen3.5/3.6 checkpoint (safetensors only) into the static-shape model."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import PretrainedConfig

from ..ops.fp8 import FP8_DTYPE, quantize_fp8
from ..ops.int4 import kernel_group_size, quantize_int4
from .config import MULTIMODAL_LM_PREFIX, is_multimodal_layout, text_model_name
from .int4 import Int4Module, Int4Quantization
from .int4_checkpoints import (
    INT4_METHODS,
    Int4CheckpointFormat,
    int4_checkpoint_format,
    raw_quantization_config,
)
from .model import Qwen36ForCausalLM
from .neuron_config import CHECKPOINT_MODULES, Qwen36NeuronConfig
from .quantization import (
    MTP_LINEARS,
    SCALE_SUFFIX,
    Fp8Quantization,
    QuantizationConfig,
    linear_module_names,
    not_converted,
    replace_with_fp8_linears,
)
from .sharding import (
    TensorParallelError,
    scale_blocks,
    shard_config,
    shard_scale,
    shard_tensor,
    valid_degrees,
)
from .vision import VISION_PREFIX, Qwen36VisionModel

# What build_model holds: FP8 or 4-bit linear layers.
Quantization = Fp8Quantization | Int4Quantization

SAFETENSORS_INDEX = "model.safetensors.index.json"
FP8_SAFETENSORS_DTYPES = ("F8_E4M3", "F8_E5M2")
# Keys of the multi-token-prediction layer (used only for speculative decoding).
MTP_PREFIX = "mtp."
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer*"]

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint's tensors do not match its config."""


def resolve_checkpoint(
    model_id: str | os.PathLike, revision: str | None = None, token: str | None = None
) -> str:
    """A local directory, or a Hub id downloaded (config, safetensors and tokenizer files only)."""
    if os.path.isdir(model_id):
        return str(model_id)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            str(model_id), revision=revision, token=token, allow_patterns=CHECKPOINT_PATTERNS
        )
    except Exception as error:
        raise OSError(
            f"{model_id!r} is neither a local directory nor a Hub repository that could be downloaded "
            f"({type(error).__name__}: {error}). Pass a directory holding config.json and *.safetensors, "
            "or a Hub id while online (set HF_TOKEN for private repositories)."
        ) from error


def safetensors_files(checkpoint_dir: str) -> list[str]:
    index_path = os.path.join(checkpoint_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(checkpoint_dir) if n.endswith(".safetensors"))
    if not names:
        found = sorted(os.listdir(checkpoint_dir))
        raise CheckpointError(
            f"No *.safetensors weights in {checkpoint_dir} (found {found}). optimum-qwen36 loads safetensors "
            "only; convert pickled .bin weights with transformers' save_pretrained(safe_serialization=True)."
        )
    missing = [n for n in names if not os.path.isfile(os.path.join(checkpoint_dir, n))]
    if missing:
        raise CheckpointError(f"{checkpoint_dir} lists weight files that are missing: {missing}.")
    return [os.path.join(checkpoint_dir, n) for n in names]


def checkpoint_tensors(checkpoint_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint; tensors are memory-mapped, read on access."""
    for path in safetensors_files(checkpoint_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open objects are not iterable)
                yield name, f.get_tensor(name)


def build_vision_tower(
    vision_config: PretrainedConfig,
    checkpoint_dir: str,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> Qwen36VisionModel:
    """The vision tower of a Qwen3_5ForConditionalGeneration checkpoint (its `model.visual.*` tensors, in
    dtype)."""
    with torch.device("meta"):
        tower = Qwen36VisionModel(vision_config)
    loaded = {}
    for path in safetensors_files(checkpoint_dir):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open objects are not iterable)
                if key.startswith(VISION_PREFIX):
                    loaded[key.removeprefix(VISION_PREFIX)] = f.get_tensor(key).to(device, dtype)
    expected = {name: tuple(p.shape) for name, p in tower.named_parameters()}
    missing = sorted(set(expected) - set(loaded))
    unexpected = sorted(set(loaded) - set(expected))
    wrong = [n for n in set(expected) & set(loaded) if tuple(loaded[n].shape) != expected[n]]
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"Checkpoint {checkpoint_dir}'s vision tower ({VISION_PREFIX}*) does not match its "
            f"vision_config: missing {_head(missing)}, unexpected {_head(unexpected)}, of another shape "
            f"{_head(sorted(wrong))}."
        )
    tower.load_state_dict(loaded, strict=False, assign=True)
    tower.inv_freq = Qwen36VisionModel.vision_inv_freq(vision_config).to(device)
    return tower.eval().requires_grad_(False)


def count_checkpoint_tensors(checkpoint_dir: str) -> int:
    """How many tensors `checkpoint_tensors` yields (reads the safetensors headers only)."""
    total = 0
    for path in safetensors_files(checkpoint_dir):
        with safe_open(path, framework="pt") as f:
            total += len(f.keys())
    return total


def model_key(checkpoint_key: str, multimodal: bool, mtp: bool = False) -> str | None:
    """The static model's parameter name for a checkpoint key, or None for keys the LM does not use
    (`mtp`: whether the model has its MTP layer)."""
    if checkpoint_key.startswith(VISION_PREFIX) or (checkpoint_key.startswith(MTP_PREFIX) and not mtp):
        return None
    if multimodal:
        if checkpoint_key.startswith(MULTIMODAL_LM_PREFIX):
            return text_model_name(checkpoint_key)
        if checkpoint_key == "lm_head.weight":
            return checkpoint_key
        return None if checkpoint_key.startswith("model.") else checkpoint_key
    return checkpoint_key


def build_model(
    config: PretrainedConfig,
    checkpoint_dir: str,
    multimodal: bool,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    quantization: Quantization | None = None,
    mtp: bool = False,
    shard: tuple[int, int] | None = None,
) -> Qwen36ForCausalLM:
    """Build the model on the meta device, then assign every parameter from the checkpoint (cast to dtype;
    the linear layers of `quantization` as block-scaled FP8 or 4-bit weights, read as stored or quantized
    here). `mtp`: also
    the multi-token-prediction layer (`mtp.*`), which the checkpoint must hold. `shard` (rank, degree):
    that tensor-parallel rank's model, holding its slice of each tensor (network/sharding.py).

    Shows a progress bar per tensor on a terminal (tqdm; off when stderr is not a TTY) and logs the time."""
    start = time.perf_counter()
    rank, degree = shard or (0, 1)
    whole = _meta_model(config, mtp, quantization)
    model = whole if degree == 1 else _meta_model(shard_config(config, degree), mtp, quantization)
    fp8 = quantization if isinstance(quantization, Fp8Quantization) else None
    fp8_weights = {f"{module}.weight" for module in (fp8.modules if fp8 else ())}
    int4 = quantization if isinstance(quantization, Int4Quantization) else None
    int4_modules = {name: whole.get_submodule(name) for name in (int4.module_names if int4 else ())}
    int4_tensors: dict[str, dict[str, torch.Tensor]] = {}
    whole_shapes = {name: tuple(p.shape) for name, p in whole.named_parameters()}  # tied weights appear once
    expected = {name: p for name, p in model.named_parameters()}
    loaded: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    progress = tqdm(
        checkpoint_tensors(checkpoint_dir),
        total=count_checkpoint_tensors(checkpoint_dir),
        desc=f"Loading weights as {str(dtype).removeprefix('torch.')}",
        unit="tensor",
        disable=None,
    )
    for key, tensor in progress:
        name = model_key(key, multimodal, mtp)
        if name is None:
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the embedding is the output projection
        module, _, suffix = name.rpartition(".")
        if module in int4_modules and int4_part(int4, suffix):
            int4_tensors.setdefault(module, {})[suffix] = tensor
            continue
        if name not in expected:
            unexpected.append(key)
            continue
        _check_shape(key, name, tensor, whole_shapes[name], quantization)
        if name in fp8_weights and not fp8.prequantized:
            # Quantized whole, then split: a rank's blocks and scales are those of one process.
            weight, scale = quantize_fp8(tensor, fp8.block_size)
            scale_name = name.removesuffix(".weight") + SCALE_SUFFIX
            for part_name, part in ((name, weight), (scale_name, scale)):
                part = _shard(config, part_name, part, whole_shapes, quantization, rank, degree)
                loaded[part_name] = part.to(device)
            continue
        tensor = _shard(config, name, tensor, whole_shapes, quantization, rank, degree)
        is_scale = name.endswith(SCALE_SUFFIX)
        loaded[name] = _loaded_tensor(key, tensor, name in fp8_weights, is_scale, dtype).to(device)
    for module, tensors in int4_tensors.items():
        linear = int4_modules[module]
        held = read_int4(int4, module, tensors, linear.out_features, linear.in_features)
        loaded.update({f"{module}.{part}": t.to(device) for part, t in held.items()})
    missing = sorted(set(expected) - set(loaded))
    if mtp and missing and missing == sorted(n for n in expected if n.startswith(MTP_PREFIX)):
        raise CheckpointError(
            f"Checkpoint {checkpoint_dir} has no multi-token-prediction weights (`mtp.*`), which "
            "num_speculative_tokens needs (Qwen's Qwen3.5 / Qwen3.6 releases carry them; transformers' "
            "save_pretrained drops them). Export without num_speculative_tokens, or use the original "
            "checkpoint."
        )
    missing_scales = [name for name in missing if name.endswith(SCALE_SUFFIX)]
    if missing_scales:
        raise CheckpointError(
            f"Checkpoint {checkpoint_dir} has FP8 weights without their scales: {_head(missing_scales)}. "
            "Every float8 `X.weight` needs `X.weight_scale_inv` (without it the weights are wrong by the "
            "scale factor); re-download or re-quantize the checkpoint."
        )
    if missing or unexpected:
        raise CheckpointError(
            f"Checkpoint {checkpoint_dir} does not match its config: missing {_head(missing)}, "
            f"unexpected {_head(unexpected)}."
        )
    model.load_state_dict(loaded, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = model.inv_freq_for(config).to(device)
    model.mrope_axes = model.mrope_axes_for(config).to(device)
    logger.info(
        "Loaded %d tensors (%.1f MB as %s) from %s in %.1f s",
        len(loaded),
        sum(t.numel() * t.element_size() for t in loaded.values()) / 1e6,
        dtype,
        checkpoint_dir,
        time.perf_counter() - start,
    )
    return model.eval().requires_grad_(False)


def _meta_model(config: PretrainedConfig, mtp: bool, quantization: Quantization | None) -> Qwen36ForCausalLM:
    """The model of `config` on the meta device (no storage), with its FP8 or 4-bit linears."""
    with torch.device("meta"):
        model = Qwen36ForCausalLM(config, mtp=mtp)
    if isinstance(quantization, Fp8Quantization):
        replace_with_fp8_linears(model, quantization)
    elif quantization is not None:
        quantization.replace_linears(model)
    return model


def int4_part(quantization: Int4Quantization, suffix: str) -> bool:
    """Whether a tensor `X.<suffix>` of a 4-bit linear X goes to `read_int4`: the format's tensors, or the
    model-dtype weight quantized here."""
    if quantization.checkpoint is None:
        return suffix == "weight"
    return suffix in quantization.checkpoint.tensor_suffixes


def read_int4(
    quantization: Int4Quantization,
    module: str,
    tensors: dict[str, torch.Tensor],
    out_features: int,
    in_features: int,
) -> dict[str, torch.Tensor]:
    """A 4-bit linear's parameters (by name) from its checkpoint tensors: read from the checkpoint's format,
    or its weight quantized (round to nearest, asymmetric per group)."""
    if quantization.checkpoint is not None:
        held = quantization.checkpoint.read(module, tensors, out_features, in_features)
        parts = {"packed_weight": held.packed, "scales": held.scales, "zeros": held.zeros}
        return parts if held.input_order is None else {**parts, "input_order": held.input_order}
    weight = tensors["weight"]
    if tuple(weight.shape) != (out_features, in_features):
        raise CheckpointError(
            f"Tensor {module}.weight has shape {tuple(weight.shape)} but the config implies "
            f"{(out_features, in_features)}: the checkpoint and its config.json do not match."
        )
    group_size = dict(quantization.modules)[module].group_size
    packed, scales, zeros = quantize_int4(weight, kernel_group_size(group_size, in_features))
    return {"packed_weight": packed, "scales": scales, "zeros": zeros}


def _check_shape(
    key: str,
    name: str,
    tensor: torch.Tensor,
    shape: tuple[int, ...],
    quantization: Fp8Quantization | None,
) -> None:
    """Raise unless the checkpoint tensor has the shape the (whole) model's config implies."""
    if tuple(tensor.shape) == shape:
        return
    if name.endswith(SCALE_SUFFIX):
        raise CheckpointError(
            f"FP8 scale {key!r} has shape {tuple(tensor.shape)}, but its weight in blocks of "
            f"{list(quantization.block_size)} (quantization_config.weight_block_size) needs "
            f"{shape} = [ceil(rows / block), ceil(cols / block)]."
        )
    raise CheckpointError(
        f"Tensor {key!r} has shape {tuple(tensor.shape)} but the config implies {shape}: the checkpoint and "
        "its config.json do not match."
    )


def _shard(
    config: PretrainedConfig,
    name: str,
    tensor: torch.Tensor,
    whole_shapes: dict[str, tuple[int, ...]],
    quantization: Fp8Quantization | None,
    rank: int,
    degree: int,
) -> torch.Tensor:
    """Rank `rank`'s slice of the whole tensor `name`: a copy, so the rank does not keep the whole tensor's
    storage (an FP8 scale: the scales of the rank's slice of its weight)."""
    if degree == 1:
        return tensor
    if name.endswith(SCALE_SUFFIX):
        weight_name = name.removesuffix(SCALE_SUFFIX) + ".weight"
        block = quantization.block_size
        return shard_scale(config, weight_name, tensor, whole_shapes[weight_name], block, rank, degree)
    return shard_tensor(config, name, tensor, rank, degree).clone()


def check_quantized_sharding(config: PretrainedConfig, quantization: Quantization, degree: int) -> None:
    """Raise TensorParallelError unless every rank's slice of every FP8 weight is made of whole scale
    blocks (checked before any process starts), naming the degrees that are; 4-bit weights are not split."""
    if isinstance(quantization, Int4Quantization):
        raise TensorParallelError(
            f"tp_degree={degree}: 4-bit weights do not run with tensor parallelism in this version. Export "
            "with tp_degree=1, or with quantization='fp8' (or unquantized) to split the model."
        )
    whole = _meta_model(config, quantization.mtp, quantization)
    shapes = {f"{m}.weight": tuple(whole.get_submodule(m).weight.shape) for m in quantization.modules}
    block = quantization.block_size

    def problem(degree: int) -> str | None:
        for name, shape in shapes.items():
            for rank in range(degree):
                try:
                    scale_blocks(config, name, shape, block, rank, degree)
                except TensorParallelError as error:
                    return str(error)
        return None

    found = problem(degree)
    if found is not None:
        valid = [d for d in valid_degrees(config, 16) if problem(d) is None]
        raise TensorParallelError(f"{found} Choose a tp_degree among {valid}.")


def _loaded_tensor(
    key: str, tensor: torch.Tensor, is_fp8_weight: bool, is_scale: bool, dtype: torch.dtype
) -> torch.Tensor:
    """A checkpoint tensor as the model holds it: FP8 weights and scales as stored, the rest in dtype."""
    if is_fp8_weight:
        if tensor.dtype != FP8_DTYPE:
            raise CheckpointError(
                f"{key!r} is {tensor.dtype}, but the checkpoint's other quantized weights and its "
                "quantization_config make it an FP8 (float8_e4m3fn) weight."
            )
        return tensor
    if is_scale:
        if not tensor.dtype.is_floating_point or tensor.dtype.itemsize < 2:
            raise CheckpointError(f"{key!r} is {tensor.dtype}; FP8 scales are bfloat16 or float32.")
        return tensor
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise CheckpointError(
            f"{key!r} is {tensor.dtype}, but this module is not quantized: optimum-qwen36 runs FP8 (e4m3) "
            "weights in the linear layers of the attention, Gated DeltaNet and MLP blocks only."
        )
    return tensor.to(dtype)


def checkpoint_entries(checkpoint_dir: str, multimodal: bool, mtp: bool) -> Iterator[tuple[str, str, Any]]:
    """(model name, checkpoint key, its open safetensors file) for every key the model uses (`mtp`: the MTP
    layer's too); nothing is read until the caller asks the file."""
    for path in safetensors_files(checkpoint_dir):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                name = model_key(key, multimodal, mtp)
                if name is not None:
                    yield name, key, f


def checkpoint_fp8_modules(checkpoint_dir: str, multimodal: bool, mtp: bool = False) -> set[str]:
    """The modules (model names) whose checkpoint weight is FP8 or which have a `weight_scale_inv`, read from
    the safetensors headers only (`mtp`: the MTP layer's too)."""
    modules = set()
    for name, key, f in checkpoint_entries(checkpoint_dir, multimodal, mtp):
        if name.endswith(SCALE_SUFFIX):
            modules.add(name.removesuffix(SCALE_SUFFIX))
        elif name.endswith(".weight") and f.get_slice(key).get_dtype() in FP8_SAFETENSORS_DTYPES:
            modules.add(name.removesuffix(".weight"))
    return modules


def fp8_modules_of_checkpoint(text_config: PretrainedConfig, stored: set[str]) -> str:
    """The name of an FP8 checkpoint's quantized set: "linear" or "mlp" when its decoder layers' FP8 linears
    are one of those exactly."""
    trunk = {module for module in stored if not module.startswith(MTP_PREFIX)}
    for fp8_modules in ("linear", "mlp"):
        if trunk == set(linear_module_names(text_config, fp8_modules)):
            return fp8_modules
    return CHECKPOINT_MODULES


def fp8_quantization(
    config: PretrainedConfig,
    text_config: PretrainedConfig,
    checkpoint_dir: str,
    multimodal: bool,
    quantization: str | None,
    fp8_modules: str | None,
    mtp: bool = False,
) -> Fp8Quantization | None:
    """What `build_model` quantizes: an FP8 checkpoint's modules as stored (checked against its
    quantization_config and the requested `fp8_modules`), or `fp8_modules` of a bf16 / fp32 checkpoint
    quantized at export; None for an unquantized model. `mtp`: the model has its MTP layer, whose linears
    are FP8 where the checkpoint stores them so, or follow `fp8_modules` (its `fc` kept)."""
    stored_config = QuantizationConfig.from_config(config)
    stored = checkpoint_fp8_modules(checkpoint_dir, multimodal, mtp)
    if stored_config is None and stored:
        raise CheckpointError(
            f"{checkpoint_dir} holds FP8 weights ({_head(sorted(stored))}) but its config.json has no "
            "quantization_config: the block size of their scales is unknown. Restore the checkpoint's "
            "config.json (quant_method 'fp8', weight_block_size [128, 128], ...)."
        )
    if stored_config is not None and not stored:
        raise CheckpointError(
            f"{checkpoint_dir}'s config.json has an FP8 quantization_config but no weight is FP8 and none "
            "has a weight_scale_inv: the weights and the config do not belong together."
        )
    if stored:
        if quantization != "fp8":
            raise ValueError(
                f"{checkpoint_dir} is an FP8 checkpoint: export it with quantization='fp8' (the default "
                "from_pretrained picks for it)."
            )
        # The MTP layer is exempt: transformers drops it, so a config may list it as unconverted whatever it
        # stores; its weights' dtype and scales say what it is.
        not_listed = list(stored_config.modules_to_not_convert)
        listed = sorted(m for m in stored if not m.startswith(MTP_PREFIX) and not_converted(not_listed, m))
        if listed:
            raise CheckpointError(
                f"{_head(listed)} hold FP8 weights but quantization_config.modules_to_not_convert lists "
                "them as unquantized: the checkpoint contradicts its config."
            )
        supported = {*linear_module_names(text_config, "linear"), *(MTP_LINEARS if mtp else ())}
        unsupported = sorted(stored - supported)
        if unsupported:
            raise CheckpointError(
                f"{_head(unsupported)} are FP8 in the checkpoint; optimum-qwen36 runs FP8 weights only in "
                "the attention, Gated DeltaNet (in_proj_qkv, in_proj_z, out_proj) and MLP linear layers "
                "(and the MTP layer's `fc`)."
            )
        found = fp8_modules_of_checkpoint(text_config, stored)
        if fp8_modules not in (None, CHECKPOINT_MODULES, found):
            raise ValueError(
                f"fp8_modules={fp8_modules!r}, but {checkpoint_dir} is already quantized with "
                f"fp8_modules={found!r}. Drop fp8_modules, or start from the bf16 checkpoint to quantize "
                "another set."
            )
        block = stored_config.weight_block_size
        return Fp8Quantization(tuple(sorted(stored)), block, prequantized=True, mtp=mtp)
    if quantization is None:
        return None
    if fp8_modules in (None, CHECKPOINT_MODULES):
        raise ValueError(
            f"{checkpoint_dir} is not an FP8 checkpoint: choose which linear layers to quantize with "
            "fp8_modules='mlp' or 'linear'."
        )
    return Fp8Quantization(tuple(linear_module_names(text_config, fp8_modules, mtp)), mtp=mtp)


def checkpoint_quantization(
    config: PretrainedConfig,
    text_config: PretrainedConfig,
    checkpoint_dir: str,
    neuron_config: Qwen36NeuronConfig,
) -> Quantization | None:
    """What `build_model` quantizes for these export settings: a 4-bit checkpoint's linears as stored, an
    FP8 checkpoint's, or those the settings quantize at export; None for an unquantized model."""
    multimodal, mtp = is_multimodal_layout(config), neuron_config.num_speculative_tokens > 0
    raw = raw_quantization_config(config)
    stored_int4 = raw is not None and raw.get("quant_method") in INT4_METHODS
    if stored_int4 or neuron_config.quantization == "int4":
        return int4_quantization(config, text_config, checkpoint_dir, multimodal, neuron_config, mtp)
    return fp8_quantization(
        config,
        text_config,
        checkpoint_dir,
        multimodal,
        neuron_config.quantization,
        neuron_config.fp8_modules,
        mtp=mtp,
    )


def checkpoint_int4_format(config: PretrainedConfig) -> Int4CheckpointFormat | None:
    """The 4-bit format of a checkpoint's quantization_config (GPTQ, AWQ, compressed-tensors); None for
    others."""
    raw = raw_quantization_config(config)
    if raw is None or raw.get("quant_method") not in INT4_METHODS:
        return None
    return int4_checkpoint_format(raw)


def stored_int4_modules(
    checkpoint_format: Int4CheckpointFormat, checkpoint_dir: str, multimodal: bool, mtp: bool
) -> dict[str, Int4Module]:
    """The linears (model names) a 4-bit checkpoint stores in 4 bits (those with the format's packed
    weight), each with its group size and whether a non-trivial group index permutes its inputs; reads
    the headers and the group indices only."""
    packed, index_suffix = checkpoint_format.packed_suffix, checkpoint_format.tensor_suffixes[-1]
    found: dict[str, int] = {}
    group_indices: dict[str, torch.Tensor] = {}
    for name, key, f in checkpoint_entries(checkpoint_dir, multimodal, mtp):
        module, _, suffix = name.rpartition(".")
        if suffix == packed:
            found[module] = checkpoint_format.module_scheme(module).group_size
        elif suffix == index_suffix and index_suffix.endswith("g_idx"):
            group_indices[module] = f.get_tensor(key)
    modules = {}
    for module, group_size in found.items():
        index = group_indices.get(module)
        size = index.numel() if index is not None else 0
        natural = torch.arange(size) // (size if group_size == -1 else group_size)
        modules[module] = Int4Module(group_size, index is not None and not torch.equal(index.long(), natural))
    return modules


def int4_quantization(
    config: PretrainedConfig,
    text_config: PretrainedConfig,
    checkpoint_dir: str,
    multimodal: bool,
    neuron_config: Qwen36NeuronConfig,
    mtp: bool,
) -> Int4Quantization:
    """A 4-bit checkpoint's quantized linears as stored (checked against its config's exclusions and the
    requested settings), or `int4_modules` of a bf16 / fp32 checkpoint quantized at export."""
    checkpoint_format = checkpoint_int4_format(config)
    if checkpoint_format is None:
        if checkpoint_fp8_modules(checkpoint_dir, multimodal, mtp) or raw_quantization_config(config):
            raise ValueError(
                f"{checkpoint_dir} is already quantized: quantization='int4' quantizes a bf16 / fp32 "
                "checkpoint."
            )
        names = linear_module_names(text_config, neuron_config.int4_modules, mtp)
        return Int4Quantization.at_export(names, neuron_config.int4_group_size, mtp)
    if neuron_config.quantization != "int4":
        raise ValueError(
            f"{checkpoint_dir} holds 4-bit weights ({checkpoint_format.method}): export it with "
            "quantization='int4' (the default from_pretrained picks for it)."
        )
    modules = stored_int4_modules(checkpoint_format, checkpoint_dir, multimodal, mtp)
    if not modules:
        raise CheckpointError(
            f"{checkpoint_dir}'s config.json has a {checkpoint_format.method} quantization_config but no "
            f"tensor is a packed 4-bit weight (`X.{checkpoint_format.packed_suffix}`): the weights and the "
            "config do not belong together."
        )
    listed = sorted(m for m in modules if not m.startswith(MTP_PREFIX) and checkpoint_format.is_excluded(m))
    if listed:
        raise CheckpointError(
            f"{_head(listed)} hold 4-bit weights but the quantization_config excludes them "
            "(modules_to_not_convert / ignore / dynamic): the checkpoint contradicts its config."
        )
    if config.tie_word_embeddings and "lm_head" in modules:
        raise CheckpointError("lm_head holds 4-bit weights but tie_word_embeddings is true: untie the head.")
    if neuron_config.int4_modules not in (None, CHECKPOINT_MODULES) or neuron_config.int4_group_size:
        raise ValueError(
            f"{checkpoint_dir} is already quantized to 4 bits: drop int4_modules and int4_group_size (its "
            "own modules and group sizes are used), or start from the bf16 checkpoint."
        )
    return Int4Quantization(tuple(sorted(modules.items())), checkpoint_format, mtp)


def _head(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
