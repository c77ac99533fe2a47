"""The export settings of a compiled (or eager) hybrid model, stored as `neuron_config.json`."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

NEURON_CONFIG_NAME = "neuron_config.json"

SUPPORTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUPPORTED_BACKENDS = ("eager", "cpu", "cuda", "neuron")
SUPPORTED_QUANTIZATIONS = ("fp8", "int4")
# Which linear layers FP8 or int4 quantizes (network/quantization.py lists them), or "checkpoint": those a
# quantized checkpoint holds, whichever set that is.
MODULE_SETS = ("mlp", "linear")
CHECKPOINT_MODULES = "checkpoint"
SUPPORTED_MODULE_SETS = (*MODULE_SETS, CHECKPOINT_MODULES)
# MTP speculative decoding drafts 1..3 tokens per step with the checkpoint's one MTP layer.
MAX_SPECULATIVE_TOKENS = 3
# Backends that run a model split over tp_degree processes (torch.distributed: gloo; TorchNeuron's group).
TENSOR_PARALLEL_BACKENDS = ("eager", "cpu", "neuron")


def dtype_name(dtype: str | torch.dtype) -> str:
    """Normalise `torch.bfloat16`, "bf16", "torch.bfloat16"... to one of SUPPORTED_DTYPES' keys."""
    name = str(dtype).removeprefix("torch.")
    name = {
        "bf16": "bfloat16",
        "fp32": "float32",
        "fp16": "float16",
        "half": "float16",
        "float": "float32",
    }.get(name, name)
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"Unsupported dtype {dtype!r}: choose one of {sorted(SUPPORTED_DTYPES)}.")
    return name


@dataclasses.dataclass
class Qwen36NeuronConfig:
    """Static shapes and settings a model is exported with.

    Field names follow optimum-neuron where they exist (`batch_size`, `sequence_length`, `tp_degree`,
    `checkpoint_id`, `checkpoint_revision`). Every compiled graph is specialised on these values.
    """

    batch_size: int = 1
    # Compiled maximum of prompt + new tokens per row.
    sequence_length: int = 4096
    # Tokens per prefill step; a prompt is processed as a sequence of such chunks.
    prefill_chunk_size: int = 256
    # Attention KV is paged in blocks of this many tokens (the GDN kernels' chunk size divides it).
    kv_block_size: int = 64
    dtype: str = "bfloat16"
    backend: str = "eager"
    tp_degree: int = 1
    checkpoint_id: str | None = None
    checkpoint_revision: str | None = None
    # Prefix caching (docs/PREFIX_CACHING.md): attention KV blocks and GDN state checkpoints reused across
    # requests within prefix_cache_bytes; checkpoints at multiples of prefix_cache_granularity tokens.
    prefix_caching: bool = False
    prefix_cache_bytes: int = 4 * 2**30
    prefix_cache_granularity: int = 64
    prefix_cache_interval: int = 2048
    # Weight quantization: None, "fp8" (block-scaled e4m3 weights, 1 byte each) for `fp8_modules`, or
    # "int4" (4-bit weights with a scale and zero point per group of `int4_group_size` inputs) for
    # `int4_modules`.
    quantization: str | None = None
    fp8_modules: str | None = None
    int4_modules: str | None = None
    int4_group_size: int | None = None
    # MTP speculative decoding: tokens the checkpoint's multi-token-prediction layer drafts per step (0: off).
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        self.dtype = dtype_name(self.dtype)
        if self.quantization not in (None, *SUPPORTED_QUANTIZATIONS):
            raise ValueError(
                f"Unknown quantization {self.quantization!r}: choose None or {SUPPORTED_QUANTIZATIONS}."
            )
        if self.fp8_modules not in (None, *SUPPORTED_MODULE_SETS):
            raise ValueError(
                f"Unknown fp8_modules {self.fp8_modules!r}: choose 'mlp' (MLP linears) or 'linear' (every "
                "attention, Gated DeltaNet and MLP linear, as Qwen's FP8 releases)."
            )
        if self.fp8_modules is not None and self.quantization != "fp8":
            raise ValueError(f"fp8_modules={self.fp8_modules!r} needs quantization='fp8'.")
        if self.quantization == "fp8" and self.fp8_modules is None:
            raise ValueError("quantization='fp8' needs fp8_modules ('mlp' or 'linear').")
        self._check_int4()
        for name in ("batch_size", "sequence_length", "prefill_chunk_size", "kv_block_size", "tp_degree"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Qwen36NeuronConfig.{name} must be a positive integer, got {value!r}.")
        self._check_speculative()
        if not isinstance(self.prefix_cache_bytes, int) or self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be an integer >= 0, got {self.prefix_cache_bytes!r}.")
        if self.backend not in SUPPORTED_BACKENDS:
            raise ValueError(f"Unknown backend {self.backend!r}: choose one of {SUPPORTED_BACKENDS}.")
        if self.kv_block_size % 16 != 0:
            raise ValueError(f"kv_block_size must be a multiple of 16, got {self.kv_block_size}.")
        if self.prefill_chunk_size > self.sequence_length:
            raise ValueError(
                f"prefill_chunk_size ({self.prefill_chunk_size}) cannot exceed sequence_length "
                f"({self.sequence_length})."
            )
        if self.tp_degree > 1 and self.backend not in TENSOR_PARALLEL_BACKENDS:
            raise ValueError(
                f"tp_degree={self.tp_degree} runs on the {' / '.join(TENSOR_PARALLEL_BACKENDS)} backends "
                f"in this version: the {self.backend!r} backend does not run sharded graphs yet. Export "
                f"with backend={' or '.join(map(repr, TENSOR_PARALLEL_BACKENDS))}, or with tp_degree=1."
            )

    def _check_int4(self) -> None:
        if self.int4_modules not in (None, *SUPPORTED_MODULE_SETS):
            raise ValueError(
                f"Unknown int4_modules {self.int4_modules!r}: choose 'mlp' (MLP linears) or 'linear' (every "
                "attention, Gated DeltaNet and MLP linear)."
            )
        if (
            self.int4_modules is not None or self.int4_group_size is not None
        ) and self.quantization != "int4":
            raise ValueError("int4_modules and int4_group_size need quantization='int4'.")
        if self.quantization == "int4" and self.int4_modules is None:
            raise ValueError("quantization='int4' needs int4_modules ('mlp', 'linear' or 'checkpoint').")
        if self.quantization == "int4" and self.backend == "neuron":
            raise ValueError(
                "quantization='int4' does not run on the neuron backend: its graphs have no 4-bit weight "
                "path (docs/INT4.md). Export with backend='cpu', or quantization='fp8' on neuron."
            )
        size = self.int4_group_size
        if size is not None and (
            not isinstance(size, int)
            or isinstance(size, bool)
            or not (size in (-1, 32, 64) or (size > 0 and size % 128 == 0))
        ):
            raise ValueError(
                f"int4_group_size must be 32, 64, a multiple of 128 or -1 (per output channel), got {size!r}."
            )

    def _check_speculative(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be an integer in 0..{MAX_SPECULATIVE_TOKENS} "
                f"(0: no speculative decoding), got {k!r}."
            )
        if k >= self.prefill_chunk_size:
            # The MTP layer catches up over a verify step's k + 1 positions in one call of at most a chunk.
            raise ValueError(
                f"num_speculative_tokens={k} needs prefill_chunk_size >= {k + 1} (got "
                f"{self.prefill_chunk_size}): a verify step's {k + 1} positions go through the MTP layer in "
                "one call of at most a chunk."
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return SUPPORTED_DTYPES[self.dtype]

    @property
    def max_blocks_per_sequence(self) -> int:
        return -(-self.sequence_length // self.kv_block_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Qwen36NeuronConfig:
        values = dict(values)
        # Written by earlier versions, where the GDN recurrent state could only be float32 (it still is).
        if values.pop("recurrent_state_dtype", "float32") != "float32":
            raise ValueError(f"{NEURON_CONFIG_NAME}: the Gated DeltaNet recurrent state is always float32.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"{NEURON_CONFIG_NAME} has fields this version of optimum-qwen36 does not know: {unknown}. "
                "It was written by a newer version: upgrade optimum-qwen36 or re-export the model."
            )
        return cls(**values)

    def save(self, directory: str | os.PathLike) -> None:
        with open(os.path.join(directory, NEURON_CONFIG_NAME), "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Qwen36NeuronConfig:
        path = os.path.join(directory, NEURON_CONFIG_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{directory} has no {NEURON_CONFIG_NAME}: it is not an exported optimum-qwen36 model. "
                "To export a transformers checkpoint, call from_pretrained(..., export=True)."
            )
        with open(path) as f:
            return cls.from_dict(json.load(f))
