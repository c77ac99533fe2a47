"""`NeuronModelForCausalLM`: optimum-neuron's public API over the static-shape hybrid model."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import warnings
import weakref
from pathlib import Path
from typing import Any, ClassVar

import torch
from huggingface_hub import HfApi, split_torch_state_dict_into_shards
from safetensors.torch import save_file
from transformers import GenerationConfig, PretrainedConfig
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..distributed.group import (
    COLLECTIVE_TIMEOUT,
    GLOO,
    TensorParallelGroup,
    TensorParallelWorkerError,
    launch,
    under_torchrun,
)
from ..distributed.lockstep import LockstepBackend
from ..distributed.replicated import Driver, Replicas, Worker, serve_driver, tensor_digest
from ..engine import Engine, ResumePoint, SamplingParams
from ..engine.replicated import ReplicatedEngine
from ..exporters import artifact
from ..exporters.aoti import graph_runner_releases_gil
from ..exporters.backends import COMPILED_DIR, create_backend, default_backend
from ..exporters.base import StepBackend
from ..exporters.compile_cache import CompileCache, make_compile_cache
from ..exporters.neuron import NEURON_COLLECTIVES, prepare_tensor_parallel_rank, tensor_parallel_environments
from ..network.cache import Qwen36HybridCache
from ..network.config import is_multimodal_layout, load_config, text_config_of
from ..network.model import Qwen36ForCausalLM
from ..network.neuron_config import Qwen36NeuronConfig, dtype_name
from ..network.quantization import SCALE_SUFFIX, Fp8Quantization
from ..network.sharding import (
    FunctionalCollectives,
    check_sharding_plan,
    check_tp_degree,
    parallelize,
    sharding_plan,
    unshard_scale,
    unshard_tensor,
)
from ..network.weights import (
    build_model,
    check_fp8_sharding,
    checkpoint_fp8_modules,
    fp8_modules_of_checkpoint,
    fp8_quantization,
    resolve_checkpoint,
)
from ..ops.fp8 import FP8_DTYPE
from ..ops.native import BF16_MATMUL_FLAGS, bf16_matmul_instructions
from ..prefix_caching import PrefixCache, build_prefix_cache
from ..tokenizer import PACKAGE_DIR as SHIPPED_TOKENIZER_DIR
from ..tokenizer import has_tokenizer_files
from .generation import (
    build_logits_processors,
    build_stopping_criteria,
    eos_token_ids,
    max_new_tokens_of,
    pads_finished_rows,
    prepare_generation_config,
    select_next_tokens,
)

logger = logging.getLogger(__name__)

# The output field holding the cache: `cache` in recent transformers (which still reads `past_key_values`).
OUTPUT_CACHE_FIELD = (
    "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
)

# Settings a saved model can be loaded with: the compiled graphs do not depend on them.
RUNTIME_SETTINGS = (
    "prefix_caching",
    "prefix_cache_bytes",
    "prefix_cache_granularity",
    "prefix_cache_interval",
)

# The manifest entry of a tensor-parallel artifact naming how each saved tensor is split over the ranks.
SHARDING_PLAN = "sharding_plan"

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


class NeuronModelForCausalLM:
    """Base class, mirroring optimum-neuron: `from_pretrained(..., export=True)` turns a transformers
    checkpoint into a model for the chosen backend; `from_pretrained(artifact)` loads one that was saved.

    Called on this base class, `from_pretrained` picks the subclass registered for the checkpoint's
    model_type.
    """

    model_types: ClassVar[tuple[str, ...]] = ()
    _registry: ClassVar[dict[str, type[NeuronModelForCausalLM]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for model_type in cls.model_types:
            NeuronModelForCausalLM._registry[model_type] = cls

    def __init__(
        self,
        config: PretrainedConfig,
        neuron_config: Qwen36NeuronConfig,
        model: Qwen36ForCausalLM,
        backend: StepBackend,
        generation_config: GenerationConfig,
        tokenizer_dir: str,
        tensor_parallel: Replicas | None = None,
    ) -> None:
        self.config = config
        self.neuron_config = neuron_config
        self.model = model
        # With tp_degree > 1 the ranks compare each step's inputs before running it (distributed/lockstep.py).
        if tensor_parallel is not None:
            backend = LockstepBackend(backend, tensor_parallel.lockstep)
        self.backend = backend
        self.generation_config = generation_config
        self.tokenizer_dir = tokenizer_dir
        # With tp_degree > 1: this rank's part of the replicated control plane (distributed/replicated.py);
        # the model is its object 0 on every rank, and `model.config` is this rank's share of `config`.
        self.tensor_parallel = tensor_parallel
        if tensor_parallel is not None:
            tensor_parallel.register(self)
        # With prefix caching, one KV cache lives as long as the model: its blocks hold the cached prefixes.
        self.prefix_cache: PrefixCache | None = None
        self._prefix_kv: Qwen36HybridCache | None = None
        # The cache of the last generate() call that did not hand it to its caller, kept for the next call.
        self._idle_cache: Qwen36HybridCache | None = None
        if neuron_config.prefix_caching:
            self._prefix_kv = self._new_cache()
            self.prefix_cache = build_prefix_cache(self._prefix_kv, neuron_config, config)

    # ------------------------------------------------------------------ construction
    @classmethod
    def _resolve_class(cls, config: PretrainedConfig) -> type[NeuronModelForCausalLM]:
        if cls is not NeuronModelForCausalLM:
            return cls
        if config.model_type not in cls._registry:
            raise ValueError(
                f"No NeuronModelForCausalLM class for model_type {config.model_type!r}; "
                f"supported: {sorted(cls._registry)}."
            )
        return cls._registry[config.model_type]

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
        num_speculative_tokens: int = 0,
        revision: str | None = None,
        token: str | None = None,
    ) -> Qwen36NeuronConfig:
        """The export settings for a checkpoint; defaults come from its config (dtype, context length,
        quantization); the backend is cpu unless named (cuda does not work yet; "eager" runs the PyTorch
        code uncompiled). An FP8 checkpoint keeps its FP8 weights; `quantization="fp8"` quantizes a bf16 /
        fp32 one at export, `fp8_modules` "linear" (default, as Qwen's FP8 releases) or "mlp".
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
            num_speculative_tokens=num_speculative_tokens,
            **({} if prefix_cache_bytes is None else {"prefix_cache_bytes": prefix_cache_bytes}),
            checkpoint_id=str(model_name_or_path),
            checkpoint_revision=revision,
        )

    @staticmethod
    def model_config(
        checkpoint_dir: str, neuron_config: Qwen36NeuronConfig
    ) -> tuple[PretrainedConfig, PretrainedConfig, Fp8Quantization | None]:
        """The checkpoint's config; its text config as the model is built from it (with the
        quantization_config of its FP8 weights, which the saved config.json and the compile cache key
        carry); and which linear layers are FP8."""
        config = load_config(checkpoint_dir)
        text_config = text_config_of(config)
        quantization = fp8_quantization(
            config,
            text_config,
            checkpoint_dir,
            is_multimodal_layout(config),
            neuron_config.quantization,
            neuron_config.fp8_modules,
            mtp=neuron_config.num_speculative_tokens > 0,
        )
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
    ) -> NeuronModelForCausalLM:
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
                check_fp8_sharding(text_config, quantization, neuron_config.tp_degree)
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
                lambda device, snapshot_slots: cls.cache_for(
                    model.config, neuron_config, device, snapshot_slots=snapshot_slots
                ),
                compiled_dir=None if compiled_dir is None else Path(compiled_dir),
                cache=compile_cache,
            )
        face = model_cls(
            text_config, neuron_config, model, backend, generation_config, tokenizer_dir, replicas
        )
        if isinstance(replicas, Driver):  # the workers stop with the model (or at exit)
            weakref.finalize(face, replicas.close)
        return face

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
    ) -> NeuronModelForCausalLM:
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

    # ------------------------------------------------------------------ saving
    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write config, neuron config, generation config, tokenizer, weights (safetensors shards), the
        compiled graphs, a model card and a manifest with the sha256 of every file."""
        os.makedirs(save_directory, exist_ok=True)
        self.config.save_pretrained(save_directory)
        self.neuron_config.save(save_directory)
        self.generation_config.save_pretrained(save_directory)
        self._save_weights(save_directory)
        self._save_tokenizer(save_directory)
        self.backend.save(Path(save_directory))
        if isinstance(self.tensor_parallel, Driver) and self.backend.per_rank_graphs:
            compiled = Path(save_directory) / COMPILED_DIR
            saved = sorted(p.relative_to(compiled).as_posix() for p in compiled.rglob("*") if p.is_file())
            self.tensor_parallel.call(
                self, "_add_ranks_compiled_files", (saved,), local_kwargs={"directory": Path(save_directory)}
            )
        artifact.write_model_card(save_directory, self.neuron_config)
        # Last: it hashes every file written above.
        # The plan says which slice of each saved tensor a rank binds to the graphs of `compiled/` (every
        # rank's on neuron; on cpu, rank 0's are every rank's: same local shapes, weights bound at load).
        plan = {}
        if self.neuron_config.tp_degree > 1:
            plan = {SHARDING_PLAN: sharding_plan(name for name, _ in self.model.named_parameters())}
        artifact.write_manifest(
            save_directory, self.neuron_config.backend, self.neuron_config.tp_degree, extra=plan
        )

    def _add_ranks_compiled_files(self, saved: list[str], directory: Path | None = None) -> None:
        """On a backend whose ranks compile graphs of their own: every worker sends its compiled files that
        rank 0 has not `saved` (paths in `compiled/`), and rank 0 adds them to the model it saves at
        `directory`. A worker that cannot send them says so, and every rank raises the same error."""
        group = self.tensor_parallel.group
        if not group.is_driver:
            key = f"compiled-files/{group.rank}"
            try:
                files = self.backend.compiled_files()
                group.post(key, (True, {name: data for name, data in files.items() if name not in saved}))
            except Exception as error:
                group.post(key, (False, f"{type(error).__name__}: {error}"))
                raise RuntimeError(
                    f"rank {group.rank} could not send its compiled graphs: {error}"
                ) from error
            return
        for rank in range(1, group.degree):
            key = f"compiled-files/{rank}"
            if not group.wait_for(key, COLLECTIVE_TIMEOUT, group.worker_status):
                raise TensorParallelWorkerError(
                    f"tensor-parallel worker rank {rank} did not send its compiled graphs within "
                    f"{COLLECTIVE_TIMEOUT}"
                )
            sent, files = group.take(key)
            if not sent:
                raise RuntimeError(f"rank {rank} could not send its compiled graphs: {files}")
            self.backend.add_compiled_files(directory, files)

    def _save_weights(self, directory: str | os.PathLike, max_shard_size: str = "5GB") -> None:
        if isinstance(self.tensor_parallel, Driver):
            state = self.tensor_parallel.call(self, "_full_state_dict")
        else:
            state = self._full_state_dict()
        split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
        for filename, names in split.filename_to_tensors.items():
            save_file({n: state[n].contiguous() for n in names}, os.path.join(directory, filename))
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters (with tensor parallelism: every rank's shards joined)."""
        # named_parameters() lists a tied weight once: the checkpoint keeps only the embedding.
        # On the host: safetensors and gloo take cpu tensors (a backend may keep the weights on its device).
        state = {name: p.detach().cpu() for name, p in self.model.named_parameters()}
        if self.tensor_parallel is None:
            return state
        group, gathered = self.tensor_parallel.group, {}
        for name, tensor in state.items():
            if tensor.dtype == FP8_DTYPE:  # gloo does not move float8: its bytes travel as uint8
                shards = [shard.view(FP8_DTYPE) for shard in group.all_gather(tensor.view(torch.uint8))]
            else:
                shards = group.all_gather(tensor)
            if group.is_driver:  # the workers take part in the gathers and keep nothing
                gathered[name] = shards
        full = {
            name: unshard_tensor(self.config, name, shards, group.degree)
            for name, shards in gathered.items()
            if not name.endswith(SCALE_SUFFIX)
        }
        for name, shards in gathered.items():  # the scales, once their weights are whole
            if name.endswith(SCALE_SUFFIX):
                module = name.removesuffix(SCALE_SUFFIX)
                weight_shape = tuple(full[f"{module}.weight"].shape)
                block_size = self.model.get_submodule(module).block_size
                full[name] = unshard_scale(self.config, f"{module}.weight", shards, weight_shape, block_size)
        return full

    def _save_tokenizer(self, directory: str | os.PathLike) -> None:
        """The checkpoint's own tokenizer files, or the Qwen3.5/3.6 tokenizer shipped with this package."""
        for name in TOKENIZER_FILES:
            source = os.path.join(self.tokenizer_dir, name)
            if os.path.isfile(source) and os.path.abspath(source) != os.path.abspath(
                os.path.join(directory, name)
            ):
                shutil.copyfile(source, os.path.join(directory, name))

    def push_to_hub(
        self,
        save_directory: str | os.PathLike,
        repository_id: str,
        private: bool | None = None,
        revision: str | None = None,
        token: str | None = None,
        endpoint: str | None = None,
        api: HfApi | None = None,
    ) -> str:
        """Upload a directory written by `save_pretrained` to the Hub; returns the commit URL."""
        api = api or HfApi(endpoint=endpoint, token=token)
        api.create_repo(repository_id, private=private, exist_ok=True, token=token)
        if revision is not None:
            api.create_branch(repository_id, branch=revision, exist_ok=True, token=token)
        commit = api.upload_folder(
            folder_path=str(save_directory), repo_id=repository_id, revision=revision, token=token
        )
        return str(commit)

    # ------------------------------------------------------------------ generation
    def new_cache(self) -> Qwen36HybridCache:
        """A cache for generate() (with tensor parallelism: one on every rank, each of its heads)."""
        if isinstance(self.tensor_parallel, Driver):
            return self.tensor_parallel.call(self, "_new_cache")
        return self._new_cache()

    def _empty_cache(self) -> Qwen36HybridCache:
        """An empty cache for a generate() call: the previous call's when it kept it (its memory is already
        mapped, whereas a new cache's zeroed pages fault in one by one), else a new one."""
        cache, self._idle_cache = self._idle_cache, None
        if cache is None:
            return self._new_cache()
        cache.forget()
        return cache

    def _new_cache(self) -> Qwen36HybridCache:
        # Compiled backends keep the cache on their device (cpu, cuda, neuron), where it is updated in place.
        cache = self.cache_for(
            self.model.config,
            self.neuron_config,
            self.backend.device,
            snapshot_slots=self.backend.prefill_snapshots,
        )
        if self.tensor_parallel is not None:
            self.tensor_parallel.register(cache)
        return cache

    @staticmethod
    def cache_for(
        config: PretrainedConfig,
        nc: Qwen36NeuronConfig,
        device: str = "cpu",
        num_blocks: int | None = None,
        snapshot_slots: int = 0,
    ) -> Qwen36HybridCache:
        """The cache generate() uses; compiled graphs are traced with its shapes (the KV block count is a
        dynamic dimension: `num_blocks` changes nothing compiled; `snapshot_slots` is the backend's
        `prefill_snapshots`)."""
        # Prefix caching: as many blocks again as the rows own, for the cached prefixes.
        blocks = 1 + 2 * nc.batch_size * nc.max_blocks_per_sequence if nc.prefix_caching else None
        return Qwen36HybridCache(
            config,
            nc.batch_size,
            nc.sequence_length,
            nc.kv_block_size,
            nc.torch_dtype,
            device=device,
            num_blocks=num_blocks or blocks,
            num_speculative_tokens=nc.num_speculative_tokens,
            snapshot_slots=snapshot_slots,
        )

    def create_engine(
        self,
        *,
        max_num_batched_tokens: int | None = None,
        num_kv_blocks: int | None = None,
        tokenizer: Any = None,
        prefix_caching: bool | None = None,
    ) -> Engine:
        """A continuous-batching engine over this model's backend (`optimum_qwen36.engine.Engine`): up to
        `batch_size` requests run at once, each with its own GDN slot, their KV blocks from one pool shared
        with prefix caching (when the model was exported with `prefix_caching=True`). The engine has its
        own cache, of `num_kv_blocks` blocks (default: as generate()'s). `tokenizer` enables text deltas and
        stop strings. `prefix_caching` overrides the exported setting (the graphs are the same)."""
        options = {
            "max_num_batched_tokens": max_num_batched_tokens,
            "num_kv_blocks": num_kv_blocks,
            "tokenizer": tokenizer,
            "prefix_caching": prefix_caching,
        }
        if isinstance(self.tensor_parallel, Driver):
            engine = self.tensor_parallel.call(self, "_create_engine", kwargs=options, register=True)
            return ReplicatedEngine(engine, self.tensor_parallel, self)
        return self._create_engine(**options)

    def _create_engine(
        self,
        *,
        max_num_batched_tokens: int | None,
        num_kv_blocks: int | None,
        tokenizer: Any,
        prefix_caching: bool | None,
    ) -> Engine:
        settings = self.neuron_config
        if prefix_caching is not None:
            settings = dataclasses.replace(settings, prefix_caching=prefix_caching)
        cache = self.cache_for(
            self.model.config,
            settings,
            self.backend.device,
            num_blocks=num_kv_blocks,
            snapshot_slots=self.backend.prefill_snapshots,
        )
        return Engine(
            self.backend,
            cache,
            self._block_pool_of(cache, settings),
            prefill_chunk_size=self.neuron_config.prefill_chunk_size,
            max_num_batched_tokens=max_num_batched_tokens,
            eos_token_ids=self._engine_eos_ids(tokenizer),
            vocab_size=self.config.vocab_size,
            tokenizer=tokenizer,
        )

    def _block_pool_of(self, cache: Qwen36HybridCache, settings: Qwen36NeuronConfig) -> PrefixCache:
        """The prefix cache over `cache`'s blocks; without prefix caching, one that hands out blocks and
        caches none."""
        if not settings.prefix_caching:
            settings = dataclasses.replace(settings, prefix_cache_bytes=0)
        return build_prefix_cache(cache, settings, self.config)

    def _engine_eos_ids(self, tokenizer: Any) -> list[int]:
        """generation_config's EOS ids and the tokenizer's EOS (vLLM stops on both), when the model can
        produce it (a test model's vocabulary may be smaller than the tokenizer's)."""
        ids = list(eos_token_ids(self.generation_config))
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None or eos in ids or not 0 <= eos < self.config.vocab_size:
            return ids
        return [*ids, eos]

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        logits_processor: LogitsProcessorList | None = None,
        stopping_criteria: StoppingCriteriaList | None = None,
        streamer: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor | GenerateDecoderOnlyOutput:
        """transformers-style generation from left-padded `input_ids` + `attention_mask`.

        Returns the prompts followed by the new tokens (pad_token_id after a row's EOS), or with
        `return_dict_in_generate=True` a `GenerateDecoderOnlyOutput` whose `past_key_values` is the
        `Qwen36HybridCache`; passing that cache back with the extended sequences continues without
        recomputing the cached prefix.

        With tensor parallelism every rank runs the same call on its shard (the arguments are sent to the
        workers; `streamer` stays here)."""
        kwargs = {
            "inputs": inputs,
            "generation_config": generation_config,
            "logits_processor": logits_processor,
            "stopping_criteria": stopping_criteria,
            **kwargs,
        }
        if isinstance(self.tensor_parallel, Driver):
            local = {"streamer": streamer}
            return self.tensor_parallel.call(
                self, "_generate", kwargs=kwargs, local_kwargs=local, digest=generated_digest
            )
        return self._generate(streamer=streamer, **kwargs)

    def _generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        logits_processor: LogitsProcessorList | None = None,
        stopping_criteria: StoppingCriteriaList | None = None,
        streamer: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor | GenerateDecoderOnlyOutput:
        if self.neuron_config.num_speculative_tokens:
            warnings.warn(
                "generate() decodes one token per step: MTP speculative decoding (num_speculative_tokens="
                f"{self.neuron_config.num_speculative_tokens}) runs in the engine (create_engine(), "
                "optimum-qwen36 serve).",
                stacklevel=3,
            )
        config, inputs_kwargs = prepare_generation_config(self.generation_config, generation_config, kwargs)
        input_ids = inputs if inputs is not None else inputs_kwargs.get("input_ids")
        if input_ids is None:
            raise ValueError("generate() needs input_ids (a [batch, length] tensor of token ids).")
        input_ids = self._token_ids(input_ids)
        rows = self._prompt_rows(input_ids, inputs_kwargs.get("attention_mask"))
        width = input_ids.shape[1]
        max_new_tokens = max_new_tokens_of(config, width)
        # transformers >= 5.x names the cache `cache`; `past_key_values` is the older name of the same input.
        cache = inputs_kwargs.get("cache", inputs_kwargs.get("past_key_values"))
        # A cache this call creates and does not return is kept for the next call (not with tensor
        # parallelism, whose ranks each hold their part of it).
        keep_cache = (
            cache is None
            and self._prefix_kv is None
            and self.tensor_parallel is None
            and not config.return_dict_in_generate
        )
        cache = self._check_cache(cache, rows, max_new_tokens)

        pad_token_id = config.pad_token_id
        if pad_token_id is None and config.eos_token_id is not None:
            eos = config.eos_token_id
            pad_token_id = eos[0] if isinstance(eos, list | tuple) else eos
        if pad_token_id is not None and not 0 <= pad_token_id < self.config.vocab_size:
            # Finished rows keep decoding on pad_token_id: it is fed to the model.
            raise ValueError(
                f"pad_token_id={pad_token_id} is not a token of this model's vocabulary "
                f"(0..{self.config.vocab_size - 1})."
            )
        padding_lengths = torch.tensor([width - len(r) for r in rows])
        processors = build_logits_processors(config, width, padding_lengths, logits_processor)
        criteria = build_stopping_criteria(
            config, width + max_new_tokens, stopping_criteria, inputs_kwargs.get("tokenizer")
        )
        # Like transformers: ended rows get pad_token_id only when an EOS criterion is present.
        pad_ended_rows = pad_token_id is not None and pads_finished_rows(criteria)
        if streamer is not None:
            streamer.put(input_ids)

        engine = self._generation_engine(cache)
        request_ids: list[str] = []
        sequences = input_ids
        raw_logits: list[torch.Tensor] = []
        scores: list[torch.Tensor] = []
        try:
            self._submit_rows(engine, rows, cache, max_new_tokens, request_ids)
            logits = engine.next_token_logits(request_ids)
            unfinished = torch.ones(len(rows), dtype=torch.bool)
            for step in range(max_new_tokens):
                processed = processors(sequences, logits)
                if config.output_logits:
                    raw_logits.append(logits)
                if config.output_scores:
                    scores.append(processed)
                next_tokens = select_next_tokens(processed, config.do_sample)
                if pad_ended_rows:
                    next_tokens = torch.where(unfinished, next_tokens, pad_token_id)
                sequences = torch.cat([sequences, next_tokens[:, None]], dim=1)
                if streamer is not None:
                    streamer.put(next_tokens)
                unfinished &= ~criteria(sequences, processed)
                if not unfinished.any() or step == max_new_tokens - 1:
                    break
                # Ended rows go on with pad_token_id (or their own picks), as in transformers: their logits
                # are still returned. The prefix cache keeps none of what follows their end.
                for row, request_id in enumerate(request_ids):
                    engine.append_token(request_id, int(next_tokens[row]), padding=not unfinished[row])
                logits = engine.next_token_logits(request_ids)
            self._record_rows(engine, request_ids, cache)
            cached_tokens = [engine.request(request_id).cached_prompt_tokens for request_id in request_ids]
            for request_id in request_ids:
                engine.abort(request_id)  # its blocks go back to the pool (with prefix caching: to the cache)
        except BaseException:
            for request_id in request_ids:
                engine.abort(request_id, after_error=True)  # nothing half-computed is cached
            if engine.num_steps:
                # The rows' states and KV may be past what seq_lens says: a next call starts them over.
                self._clear_rows(cache, len(rows))
            raise
        if streamer is not None:
            streamer.end()
        if keep_cache:
            self._idle_cache = cache
        if not config.return_dict_in_generate:
            return sequences
        output = GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=tuple(scores) if config.output_scores else None,
            logits=tuple(raw_logits) if config.output_logits else None,
            **{OUTPUT_CACHE_FIELD: cache},
        )
        if self.prefix_cache is not None:
            output["cached_tokens"] = torch.tensor(cached_tokens)  # per row: prompt tokens reused
        return output

    def _token_ids(self, input_ids: Any) -> torch.Tensor:
        """`input_ids` as a [batch, length] int64 tensor, refused unless every id is in the vocabulary: an id
        out of range would fail deep inside a compiled graph (on cpu, by aborting the process)."""
        ids = torch.as_tensor(input_ids)
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(
                f"input_ids must hold integer token ids, got dtype {ids.dtype}: tokenize the text (or "
                "convert the ids with .long()) instead of passing other values."
            )
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.numel() == 0:
            raise ValueError(f"input_ids must be [batch, length] with length >= 1, got {tuple(ids.shape)}.")
        ids = ids.to(torch.long)
        vocab = self.config.vocab_size
        outside = (ids < 0) | (ids >= vocab)
        if outside.any():
            row, col = (int(i) for i in outside.nonzero()[0])
            raise ValueError(
                f"input_ids[{row}, {col}] = {int(ids[row, col])} is not a token of this model's vocabulary "
                f"(0..{vocab - 1}); {int(outside.sum())} id(s) are out of range. Use the model's tokenizer."
            )
        return ids

    def _prompt_rows(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """Each row's real tokens. Rows must be left-padded (zeros of the mask before its ones)."""
        batch, width = input_ids.shape
        if batch > self.neuron_config.batch_size:
            raise ValueError(
                f"Batch of {batch} rows but the model was exported with batch_size="
                f"{self.neuron_config.batch_size}: split the batch or re-export with a larger batch_size."
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = torch.as_tensor(attention_mask).to(torch.long)
        if mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(input_ids.shape)}."
            )
        lengths = mask.sum(dim=1)
        expected = torch.arange(width).unsqueeze(0) >= (width - lengths).unsqueeze(1)
        if not torch.equal(mask.bool(), expected):
            raise ValueError(
                "attention_mask must be left padding (0s then 1s in every row). Tokenize batches with "
                "tokenizer.padding_side = 'left'."
            )
        if (lengths == 0).any():
            raise ValueError("Every row needs at least one token (a row of the attention_mask is all zeros).")
        return [input_ids[b, width - int(lengths[b]) :] for b in range(batch)]

    def _check_cache(
        self, cache: Qwen36HybridCache | None, rows: list[torch.Tensor], max_new_tokens: int
    ) -> Qwen36HybridCache:
        capacity = self.neuron_config.sequence_length
        longest = max(len(r) for r in rows)
        if longest + max_new_tokens > capacity:
            raise ValueError(
                f"A prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the compiled "
                f"sequence_length={capacity}. Shorten the prompt, lower max_new_tokens, or re-export with "
                f"sequence_length >= {longest + max_new_tokens}."
            )
        if self._prefix_kv is not None:
            if cache is not None:
                raise ValueError(
                    "past_key_values cannot be passed back with prefix caching: the prefix cache already "
                    "reuses the previous tokens, so pass the full sequences without past_key_values."
                )
            return self._prefix_kv
        if cache is None:
            return self._empty_cache()
        if not isinstance(cache, Qwen36HybridCache):
            raise ValueError(
                f"past_key_values must be the Qwen36HybridCache returned by this model's generate(), "
                f"got {type(cache).__name__}."
            )
        shapes = (cache.batch_size, cache.sequence_length, cache.snapshot_slots)
        if shapes != (self.neuron_config.batch_size, capacity, self.backend.prefill_snapshots):
            raise ValueError("past_key_values was created by a model exported with other shapes.")
        # Rows beyond this call's batch are dropped: static-batch backends run them on dummy tokens.
        cache.seq_lens[len(rows) :] = 0
        for b, tokens in enumerate(rows):
            cached = cache.cached_tokens(b)
            if len(tokens) <= len(cached) or not torch.equal(tokens[: len(cached)], cached):
                raise ValueError(
                    f"Row {b} does not extend the sequence held in past_key_values ({len(cached)} cached "
                    f"tokens): pass the previous output sequences plus at least one new token, or drop "
                    "past_key_values."
                )
        return cache

    def _generation_engine(self, cache: Qwen36HybridCache) -> Engine:
        """An engine for one generate() call over `cache` (the model's prefix-cached one, or the call's).
        generate() picks every token itself, one per step."""
        pool = self.prefix_cache
        if pool is None:
            pool = self._block_pool_of(cache, self.neuron_config)
        return Engine(
            self.backend,
            cache,
            pool,
            prefill_chunk_size=self.neuron_config.prefill_chunk_size,
            vocab_size=self.config.vocab_size,
            speculative=False,
        )

    def _submit_rows(
        self,
        engine: Engine,
        rows: list[torch.Tensor],
        cache: Qwen36HybridCache,
        max_new_tokens: int,
        request_ids: list[str],
    ) -> None:
        """One caller-sampled request per row, its id appended to `request_ids`. Without prefix caching, row
        b resumes in slot b on the tokens its cache row holds (none, unless past_key_values continues an
        earlier call), and the rows' chunks share prefill calls. With it, each row looks up the prefix cache
        once the rows before it are prefilled, so it also hits what they stored (and takes slot b)."""
        for row, tokens in enumerate(rows):
            resume = None
            if self.prefix_cache is None:
                computed = int(cache.seq_lens[row])
                blocks = cache.block_tables[row, : -(-computed // cache.block_size)]
                resume = ResumePoint(row, tuple(blocks.tolist()), computed)
            params = SamplingParams(max_tokens=max_new_tokens)
            request_id = engine.add_request(
                tokens.tolist(), params, f"row-{row}", sampled_by_caller=True, resume=resume
            )
            request_ids.append(request_id)
            if self.prefix_cache is not None:
                engine.next_token_logits([request_id])

    def _record_rows(self, engine: Engine, request_ids: list[str], cache: Qwen36HybridCache) -> None:
        """Write where each row's tokens are into the cache's rows (lengths, tokens, block tables), so that
        it reads like transformers' cache and a next call can continue it. With prefix caching the blocks
        belong to the prefix cache once the rows finish: the tables are left empty."""
        self._clear_rows(cache, cache.batch_size)
        tables = cache.block_tables
        for row, request_id in enumerate(request_ids):
            request = engine.request(request_id)
            slot, blocks = engine.placement(request_id)
            if slot != row:
                raise RuntimeError(f"generate() row {row} ran in GDN slot {slot}, not in its own")
            computed = request.num_computed
            cache.seq_lens[row] = computed
            cache.token_ids[row, :computed] = torch.tensor(request.token_ids[:computed])
            if self.prefix_cache is None:
                tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        if self.prefix_cache is None:
            # Every row gets a full table of distinct blocks (those it holds first), as reorder_cache expects.
            held = torch.zeros(cache.key_cache.shape[1], dtype=torch.bool, device=tables.device)
            held[0] = True
            held[tables.flatten()] = True
            spare = (~held).nonzero().flatten()
            for row in range(cache.batch_size):
                start = int((tables[row] > 0).sum())
                taken = spare[: cache.max_blocks_per_row - start]
                tables[row, start : start + len(taken)] = taken
                spare = spare[len(taken) :]

    @staticmethod
    def _clear_rows(cache: Qwen36HybridCache, num_rows: int) -> None:
        """Empty the first `num_rows` rows of `cache`: no tokens, no blocks."""
        cache.seq_lens[:num_rows] = 0
        cache.block_tables[:num_rows] = 0


class NeuronQwen36ForCausalLM(NeuronModelForCausalLM):
    """Qwen3.6 / Qwen3.5 hybrid models (transformers model_type `qwen3_5`, both checkpoint layouts)."""

    model_types = ("qwen3_5", "qwen3_5_text")


def _export_rank(
    cls: type[NeuronModelForCausalLM],
    model_id: str | os.PathLike,
    neuron_config: Qwen36NeuronConfig,
    options: dict[str, Any],
    group: TensorParallelGroup,
) -> NeuronModelForCausalLM:
    """One rank's model of a tensor-parallel export (run in every process of the group)."""
    return cls.export(model_id, neuron_config, tp_group=group, **options)


def generated_digest(output: torch.Tensor | GenerateDecoderOnlyOutput) -> str:
    """The tokens a generate() call produced: every rank must produce the same."""
    return tensor_digest(output if isinstance(output, torch.Tensor) else output.sequences)


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
