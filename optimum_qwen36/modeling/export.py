"""Turning a transformers checkpoint into a model for a backend, and loading a saved one: the export
settings, the network built from the checkpoint (one rank's shard of it under tensor parallelism, each
rank in its own process), and its backend, compiled or taken from an artifact or the compile cache."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import weakref
from pathlib import Path
from typing import Any, Self

import torch
from transformers import GenerationConfig, PretrainedConfig

from ..backends.base import COMPILED_DIR
from ..backends.compiled_graph import graph_runner_releases_gil
from ..backends.neuron import NEURON_COLLECTIVES, prepare_tensor_parallel_rank, tensor_parallel_environments
from ..distributed.group import GLOO, TensorParallelGroup, launch, under_torchrun
from ..distributed.replicated import Driver, Worker, serve_driver
from ..exporters import artifact
from ..exporters.compile_cache import CompileCache, make_compile_cache
from ..exporters.factory import create_backend, default_backend
from ..network.config import is_multimodal_layout, load_config, text_config_of
from ..network.neuron_config import CHECKPOINT_MODULES, Qwen36NeuronConfig, dtype_name
from ..network.sharding import FunctionalCollectives, check_sharding_plan, check_tp_degree, parallelize
from ..network.weights import (
    Quantization,
    build_model,
    check_quantized_sharding,
    checkpoint_fp8_modules,
    checkpoint_int4_format,
    checkpoint_quantization,
    fp8_modules_of_checkpoint,
    resolve_checkpoint,
)
from ..ops.int4 import DEFAULT_GROUP_SIZE
from ..ops.native import BF16_MATMUL_FLAGS, bf16_matmul_instructions
from ..tokenizer import PACKAGE_DIR as SHIPPED_TOKENIZER_DIR
from ..tokenizer import has_tokenizer_files

logger = logging.getLogger(__name__)

# Settings a saved model can be loaded with: the compiled graphs do not depend on them.
RUNTIME_SETTINGS = (
    "prefix_caching",
    "prefix_cache_bytes",
    "prefix_cache_granularity",
    "prefix_cache_interval",
)

# The manifest entry of a tensor-parallel artifact naming how each saved tensor is split over the ranks.
SHARDING_PLAN = "sharding_plan"


class ExportMixin:
    """`from_pretrained(..., export=True)` / `export()` and `from_pretrained(artifact)` of the model class."""

    @classmethod
    def get_neuron_config(
        cls,
        model_name_or_path: str | os.PathLike,
        *,
        batch_size: int = 1,
        sequence_length: int | None = None,
        dtype: str | torch.dtype | None = None,
        backend: str | None = None,
        prefill_chunk_size: int | None = None,
        kv_block_size: int = 64,
        tp_degree: int = 1,
        prefix_caching: bool = False,
        prefix_cache_bytes: int | None = None,
        prefix_cache_granularity: int = 64,
        prefix_cache_interval: int = 2048,
        quantization: str | None = None,
        fp8_modules: str | None = None,
        int4_modules: str | None = None,
        int4_group_size: int | None = None,
        num_speculative_tokens: int = 0,
        revision: str | None = None,
        token: str | None = None,
    ) -> Qwen36NeuronConfig:
        """The export settings for a checkpoint; defaults come from its config (dtype, context length,
        quantization); the backend is cpu unless named ("eager" runs the PyTorch code uncompiled). An FP8
        checkpoint keeps its FP8 weights; `quantization="fp8"` quantizes a bf16 / fp32 one at export,
        `fp8_modules` "linear" (default, as Qwen's FP8 releases) or "mlp". A 4-bit checkpoint (GPTQ, AWQ,
        compressed-tensors) keeps its 4-bit weights; `quantization="int4"` quantizes a bf16 / fp32 one at
        export, `int4_modules` "linear" (default) or "mlp", `int4_group_size` input features per scale
        (default 128; -1: per output channel).
        `num_speculative_tokens` k (1..3) loads the checkpoint's MTP layer: the engine (`create_engine`,
        `serve`) then drafts k tokens per step and verifies them in one step (MTP speculative decoding)."""
        checkpoint_dir = resolve_checkpoint(model_name_or_path, revision=revision, token=token)
        config = load_config(checkpoint_dir)
        text_config = text_config_of(config)
        stored_fp8 = checkpoint_fp8_modules(checkpoint_dir, is_multimodal_layout(config))
        if stored_fp8:
            quantization = quantization or "fp8"
            fp8_modules = fp8_modules or fp8_modules_of_checkpoint(text_config, stored_fp8)
        elif quantization == "fp8" and fp8_modules is None:
            fp8_modules = "linear"
        int4_format = checkpoint_int4_format(config)
        if int4_format is not None:
            if quantization not in (None, "int4"):
                raise ValueError(
                    f"{model_name_or_path} holds 4-bit weights ({int4_format.method}): export it with "
                    "quantization='int4' (the default from_pretrained picks for it)."
                )
            quantization = "int4"
            int4_modules = int4_modules or CHECKPOINT_MODULES
        elif quantization == "int4":
            int4_modules = int4_modules or "linear"
            int4_group_size = int4_group_size or DEFAULT_GROUP_SIZE
        if sequence_length is None:
            sequence_length = min(4096, text_config.max_position_embeddings)
        if dtype is None:
            dtype = getattr(text_config, "dtype", None) or "bfloat16"
        if prefill_chunk_size is None:
            prefill_chunk_size = min(256, sequence_length)
        check_tp_degree(text_config, tp_degree)
        return Qwen36NeuronConfig(
            batch_size=batch_size,
            sequence_length=sequence_length,
            prefill_chunk_size=prefill_chunk_size,
            kv_block_size=kv_block_size,
            dtype=dtype_name(dtype),
            backend=backend or default_backend(),
            tp_degree=tp_degree,
            prefix_caching=prefix_caching,
            prefix_cache_granularity=prefix_cache_granularity,
            prefix_cache_interval=prefix_cache_interval,
            quantization=quantization,
            fp8_modules=fp8_modules,
            int4_modules=int4_modules,
            int4_group_size=int4_group_size,
            num_speculative_tokens=num_speculative_tokens,
            **({} if prefix_cache_bytes is None else {"prefix_cache_bytes": prefix_cache_bytes}),
            checkpoint_id=str(model_name_or_path),
            checkpoint_revision=revision,
        )

    @staticmethod
    def model_config(
        checkpoint_dir: str, neuron_config: Qwen36NeuronConfig
    ) -> tuple[PretrainedConfig, PretrainedConfig, Quantization | None]:
        """The checkpoint's config; its text config as the model is built from it (with the
        quantization_config of its FP8 or 4-bit weights, which the saved config.json and the compile cache
        key carry); and which linear layers are quantized."""
        config = load_config(checkpoint_dir)
        text_config = text_config_of(config)
        quantization = checkpoint_quantization(config, text_config, checkpoint_dir, neuron_config)
        if quantization is not None:
            text_config.quantization_config = quantization.config_dict(text_config)
        return config, text_config, quantization

    @classmethod
    def export(
        cls,
        model_id: str | os.PathLike,
        neuron_config: Qwen36NeuronConfig,
        *,
        token: str | None = None,
        revision: str | None = None,
        compile_cache: CompileCache | None = None,
        compiled_dir: str | os.PathLike | None = None,
        tp_group: TensorParallelGroup | None = None,
    ) -> Self:
        """Build the model for `neuron_config.backend` from a transformers checkpoint (dir or Hub id).

        Compiled backends take their graphs from `compile_cache` when it holds them (else compile and
        store them there), or from `compiled_dir` (a verified artifact's graphs) without compiling. With
        `tp_degree` > 1, this process and tp_degree - 1 workers each build one rank's shard
        (`tp_group`: the rank this call builds, given by the launcher)."""
        if neuron_config.tp_degree > 1 and tp_group is None:
            if neuron_config.backend == "cpu" and not graph_runner_releases_gil():
                raise RuntimeError(
                    f"tp_degree={neuron_config.tp_degree} on the cpu backend runs its collectives inside "
                    "compiled graphs, which needs the graph runner extension (built with the C++ compiler "
                    "torch.utils.cpp_extension uses); it could not be built here (see the warning above). "
                    "Install a C++ compiler, or use backend='eager' for tensor parallelism."
                )
            options = {
                "token": token,
                "revision": revision,
                "compiled_dir": compiled_dir,
                "compile_cache": compile_cache,
            }
            if neuron_config.quantization is not None:  # a clear error before any worker starts
                checkpoint_dir = resolve_checkpoint(model_id, revision=revision, token=token)
                _, text_config, quantization = cls.model_config(checkpoint_dir, neuron_config)
                check_quantized_sharding(text_config, quantization, neuron_config.tp_degree)
            collective_backend, environments = GLOO, None
            if neuron_config.backend == "neuron":  # before any worker starts: the SDK, each rank's core
                collective_backend = NEURON_COLLECTIVES
                prepare_tensor_parallel_rank()
                if not under_torchrun():  # torchrun gives each process its LOCAL_RANK, and so its core
                    environments = tensor_parallel_environments(neuron_config.tp_degree)
            job = functools.partial(_export_rank, cls, model_id, neuron_config, options)
            return launch(neuron_config.tp_degree, job, serve_driver, collective_backend, environments)[1]
        checkpoint_dir = resolve_checkpoint(model_id, revision=revision, token=token)
        config, text_config, quantization = cls.model_config(checkpoint_dir, neuron_config)
        model_cls = cls._resolve_class(config)
        if text_config.max_position_embeddings < neuron_config.sequence_length:
            raise ValueError(
                f"sequence_length={neuron_config.sequence_length} exceeds the model's "
                f"max_position_embeddings={text_config.max_position_embeddings}."
            )
        _warn_if_bf16_is_slow_here(neuron_config)
        model = build_model(
            text_config,
            checkpoint_dir,
            is_multimodal_layout(config),
            neuron_config.torch_dtype,
            quantization=quantization,
            mtp=neuron_config.num_speculative_tokens > 0,
            shard=None if tp_group is None else (tp_group.rank, tp_group.degree),
        )
        replicas = None
        if tp_group is not None:
            parallelize(model, tp_group.rank, FunctionalCollectives(tp_group.degree))
            replicas = Driver(tp_group) if tp_group.is_driver else Worker(tp_group)
        generation_config = _generation_config(checkpoint_dir, text_config)
        tokenizer_dir = checkpoint_dir if has_tokenizer_files(checkpoint_dir) else str(SHIPPED_TOKENIZER_DIR)
        with contextlib.ExitStack() as compiling:
            if tp_group is not None and neuron_config.backend == "neuron":
                # TorchNeuron's process group sets up the process's Neuron runtime, so it comes before any
                # device work; the warm-up then runs the steps, collectives included, on every rank. A rank
                # without the SDK fails before it joins (the others would wait for it in the group).
                prepare_tensor_parallel_rank()
                tp_group.rendezvous()
            elif tp_group is not None and neuron_config.backend != "eager":
                # Every rank's graphs are the same code (same local shapes, weights bound at load): with a
                # compile cache, the other ranks take rank 0's compilation from it instead of redoing it.
                if compile_cache is not None and compiled_dir is None:
                    compiling.enter_context(tp_group.driver_first("compiled"))
                compiling.enter_context(tp_group.stand_in())
            backend = create_backend(
                model,
                neuron_config,
                compiled_dir=None if compiled_dir is None else Path(compiled_dir),
                cache=compile_cache,
            )
        face = model_cls(
            text_config, neuron_config, model, backend, generation_config, tokenizer_dir, replicas
        )
        face._load_beyond_text(config, checkpoint_dir)
        if isinstance(replicas, Driver):  # the workers stop with the model (or at exit)
            weakref.finalize(face, replicas.close)
        return face

    def _load_beyond_text(self, config: PretrainedConfig, checkpoint_dir: str) -> None:
        """Load what the model class runs besides the language model, from the checkpoint whose config
        (both layouts) is `config`: nothing for the text model."""

    @classmethod
    def from_pretrained(
        cls,
        model_id: str | os.PathLike,
        *,
        export: bool = False,
        revision: str | None = None,
        token: str | None = None,
        trust_compiled_code: bool = False,
        compile_cache_dir: str | os.PathLike | None = None,
        compile_cache_repo: str | None = None,
        use_compile_cache: bool = True,
        **neuron_config_kwargs: Any,
    ) -> Self:
        """Load a saved model, or with `export=True` export a transformers checkpoint first
        (`neuron_config_kwargs` as for `get_neuron_config`: batch_size, sequence_length, dtype, ...).

        A saved compiled model is verified before use (sha256 of every file, versions, CPU ISA, tp degree).
        Compiled graphs downloaded from the Hub are native code: loading them needs
        `trust_compiled_code=True`. Exports reuse earlier compilations from the compile cache
        (`compile_cache_dir`, default $OPTIMUM_QWEN36_CACHE or ~/.cache/optimum-qwen36) unless
        `use_compile_cache=False`; with `compile_cache_repo` (default $OPTIMUM_QWEN36_CACHE_REPO), a Hub
        repository backs that cache: local misses are downloaded from it (only with
        `trust_compiled_code=True`, verified by sha256) and new compilations are uploaded to it."""
        if export:
            neuron_config = cls.get_neuron_config(
                model_id, revision=revision, token=token, **neuron_config_kwargs
            )
            cache = None
            if use_compile_cache:
                trusted = trust_compiled_code
                cache = make_compile_cache(
                    compile_cache_dir, compile_cache_repo, trust_compiled_code=trusted, token=token
                )
            return cls.export(model_id, neuron_config, revision=revision, token=token, compile_cache=cache)
        fixed = sorted(set(neuron_config_kwargs) - set(RUNTIME_SETTINGS))
        if fixed:
            raise ValueError(
                f"Export settings {fixed} only apply with export=True; a saved model keeps the settings it "
                f"was exported with (only {list(RUNTIME_SETTINGS)} can be changed when loading)."
            )
        directory, from_hub = artifact.resolve_artifact(model_id, revision=revision, token=token)
        neuron_config = dataclasses.replace(Qwen36NeuronConfig.load(directory), **neuron_config_kwargs)
        compiled = neuron_config.backend != "eager"
        if compiled and from_hub and not trust_compiled_code:
            raise artifact.UntrustedCodeError(
                f"{model_id} holds graphs compiled for the {neuron_config.backend!r} backend: loading them "
                "runs native code from the Hub. If you trust this repository, pass trust_compiled_code=True "
                "(the files are still checked against the sha256 in its manifest)."
            )
        if compiled:
            manifest = artifact.verify_artifact(directory, neuron_config.backend, neuron_config.tp_degree)
            if neuron_config.tp_degree > 1:
                check_sharding_plan(manifest.get(SHARDING_PLAN))
        elif os.path.isfile(os.path.join(directory, artifact.MANIFEST_NAME)):
            # No compiled code: the hashes matter, the versions that wrote it do not.
            artifact.verify_files(directory, artifact.read_manifest(directory))
        compiled_dir = os.path.join(directory, COMPILED_DIR) if compiled else None
        return cls.export(directory, neuron_config, compiled_dir=compiled_dir)


def _export_rank(
    cls: type[ExportMixin],
    model_id: str | os.PathLike,
    neuron_config: Qwen36NeuronConfig,
    options: dict[str, Any],
    group: TensorParallelGroup,
) -> ExportMixin:
    """One rank's model of a tensor-parallel export (run in every process of the group)."""
    return cls.export(model_id, neuron_config, tp_group=group, **options)


def _warn_if_bf16_is_slow_here(neuron_config: Qwen36NeuronConfig) -> None:
    """The eager backend runs ATen's bf16 matrix products as they are (the cpu backend widens prefill's to
    float32 and streams decode's through the native kernel there)."""
    eager = neuron_config.backend == "eager"
    if neuron_config.dtype == "bfloat16" and eager and not bf16_matmul_instructions():
        logger.warning(
            "This CPU has none of %s: on the eager backend, bfloat16 matrix products run far slower here "
            "than float32. Use backend='cpu', or dtype='float32' (--dtype float32) unless memory requires "
            "bfloat16.",
            ", ".join(BF16_MATMUL_FLAGS),
        )


def _generation_config(checkpoint_dir: str, config: PretrainedConfig) -> GenerationConfig:
    if os.path.isfile(os.path.join(checkpoint_dir, "generation_config.json")):
        return GenerationConfig.from_pretrained(checkpoint_dir)
    return GenerationConfig.from_model_config(config)
