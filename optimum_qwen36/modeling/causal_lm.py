"""`NeuronModelForCausalLM`: optimum-neuron's public API over the static-shape hybrid model, composed from
export (export.py), saving (saving.py) and generation (generation.py)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, ClassVar

from transformers import GenerationConfig, PretrainedConfig

from ..backends.base import ImageEncoder, StepBackend
from ..distributed.lockstep import LockstepBackend
from ..distributed.replicated import Driver, Replicas, on_every_rank
from ..engine import Engine
from ..engine.replicated import ReplicatedEngine
from ..network.cache import CacheStorage
from ..network.model import Qwen36ForCausalLM
from ..network.neuron_config import Qwen36NeuronConfig
from ..prefix_caching import PrefixCache, build_prefix_cache
from .cache import Qwen36HybridCache
from .export import ExportMixin
from .generation import GenerateMixin
from .generation_config import eos_token_ids
from .saving import SaveMixin


class NeuronModelForCausalLM(ExportMixin, SaveMixin, GenerateMixin):
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
        # generate()'s engine, built at its first call and kept as long as the model (with prefix caching,
        # its blocks hold the cached prefixes).
        self._generation_engine: Engine | None = None
        self._calls = itertools.count()
        # The vision tower, where the model class runs one (NeuronQwen36ForConditionalGeneration).
        self.image_encoder: ImageEncoder | None = None

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

    # ------------------------------------------------------------------ engines and caches
    def generation_engine(self) -> Engine:
        """The engine every generate() call runs in (one per rank under tensor parallelism)."""
        if self._generation_engine is None:
            self._generation_engine = self._build_engine(
                max_num_batched_tokens=None, num_kv_blocks=None, tokenizer=None, prefix_caching=None
            )
        return self._generation_engine

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """generate()'s prefix cache, when the model was exported with prefix caching."""
        if not self.neuron_config.prefix_caching:
            return None
        return self.generation_engine().prefix_cache

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
        own cache storage, of `num_kv_blocks` blocks (default: as generate()'s). `tokenizer` enables text
        deltas and stop strings. `prefix_caching` overrides the exported setting (the graphs are the same)."""
        options = {
            "max_num_batched_tokens": max_num_batched_tokens,
            "num_kv_blocks": num_kv_blocks,
            "tokenizer": tokenizer,
            "prefix_caching": prefix_caching,
        }
        if isinstance(self.tensor_parallel, Driver):
            engine = self.tensor_parallel.call(self, "_build_engine", kwargs=options, register=True)
            return ReplicatedEngine(engine, self.tensor_parallel, self)
        return self._build_engine(**options)

    def _build_engine(
        self,
        *,
        max_num_batched_tokens: int | None,
        num_kv_blocks: int | None,
        tokenizer: Any,
        prefix_caching: bool | None,
    ) -> Engine:
        """An engine with a storage of its own on this rank (`create_engine` has every rank build one)."""
        neuron_config = self.neuron_config
        if prefix_caching is not None:
            neuron_config = dataclasses.replace(neuron_config, prefix_caching=prefix_caching)
        storage = CacheStorage.for_settings(
            self.model.config,
            neuron_config,
            self.backend.device,
            num_blocks=num_kv_blocks,
            snapshot_slots=self.backend.prefill_snapshots,
        )
        if not neuron_config.prefix_caching:  # a prefix cache that hands out blocks and caches none
            neuron_config = dataclasses.replace(neuron_config, prefix_cache_bytes=0)
        return Engine(
            self.backend,
            storage,
            build_prefix_cache(storage, neuron_config, self.config),
            prefill_chunk_size=self.neuron_config.prefill_chunk_size,
            max_num_batched_tokens=max_num_batched_tokens,
            eos_token_ids=self._engine_eos_ids(tokenizer),
            vocab_size=self.config.vocab_size,
            tokenizer=tokenizer,
            image_encoder=self.image_encoder,
        )

    def _engine_eos_ids(self, tokenizer: Any) -> list[int]:
        """generation_config's EOS ids and the tokenizer's EOS (vLLM stops on both), when the model can
        produce it (a test model's vocabulary may be smaller than the tokenizer's)."""
        ids = list(eos_token_ids(self.generation_config))
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None or eos in ids or not 0 <= eos < self.config.vocab_size:
            return ids
        return [*ids, eos]

    @on_every_rank(register=True)
    def new_cache(self) -> Qwen36HybridCache:
        """An empty cache of this model's shapes (with tensor parallelism: one on every rank, each of its
        heads), as generate() returns them."""
        return self._empty_cache()

    def _empty_cache(self) -> Qwen36HybridCache:
        """A cache generate() returns: the rows' KV and states, or with prefix caching only their tokens."""
        neuron_config = self.neuron_config
        return Qwen36HybridCache(
            self.model.config,
            neuron_config.batch_size,
            neuron_config.sequence_length,
            neuron_config.kv_block_size,
            neuron_config.torch_dtype,
            device=self.backend.device,
            holds_states=not neuron_config.prefix_caching,
        )


class NeuronQwen36ForCausalLM(NeuronModelForCausalLM):
    """Qwen3.6 / Qwen3.5 hybrid models (transformers model_type `qwen3_5`, both checkpoint layouts)."""

    model_types = ("qwen3_5", "qwen3_5_text")
