"""The backend a model runs on: compiled from the model, or loaded from an artifact's compiled files."""

from __future__ import annotations

from pathlib import Path

import torch

from ..backends.aoti import AOTIBackend
from ..backends.base import StepBackend
from ..backends.eager import EagerBackend
from ..backends.neuron import NeuronBackend
from ..network.model import Qwen36ForCausalLM
from ..network.neuron_config import Qwen36NeuronConfig
from .compile_aoti import compile_aoti_backend
from .compile_cache import CompileCache
from .neuron import compile_neuron_backend


def default_backend() -> str:
    """What `export` compiles for when no backend is named: cpu, also on a machine with a GPU (docs/EXPORT.md
    says where the cuda backend stands)."""
    return "cpu"


def default_device(backend: str) -> str:
    if backend == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "backend='cuda' needs a CUDA GPU and a CUDA build of torch; none is available here. "
                "Use backend='cpu'."
            )
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def create_backend(
    model: Qwen36ForCausalLM,
    neuron_config: Qwen36NeuronConfig,
    compiled_dir: Path | None = None,
    cache: CompileCache | None = None,
) -> StepBackend:
    """The backend of `neuron_config.backend`: compiled from `model`, or loaded from `compiled_dir` (an
    artifact's `compiled/` directory, already verified) without compiling."""
    backend = neuron_config.backend
    if backend == "eager":
        return EagerBackend(model)
    if backend in ("cpu", "cuda"):
        device = default_device(backend)
        if device != "cpu":
            model.to(device)
        if compiled_dir is not None:
            return AOTIBackend(compiled_dir, model, device)
        return compile_aoti_backend(model, neuron_config, cache, device)
    if backend == "neuron":
        if compiled_dir is not None:
            return NeuronBackend(model, neuron_config, compiled_dir=compiled_dir)
        return compile_neuron_backend(model, neuron_config)
    raise ValueError(f"Unknown backend {backend!r}.")
