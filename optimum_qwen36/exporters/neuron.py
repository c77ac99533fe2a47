"""The `neuron` backend: TorchNeuron (`torch.compile(backend="neuron", fullgraph=True, dynamic=False)` on the
`neuron` device). The Gated DeltaNet ops dispatch to NKI kernels on that device (`optimum_qwen36.nki`).

The compiled NEFFs live in the Neuron compile cache; this backend points that cache into the artifact
(`compiled/neuron_cache/`), so a saved model carries its NEFFs and loading it does not recompile.

NOT RUN ON HARDWARE: the Neuron SDK cannot be installed where this project is developed. What is tested is
the wiring (the error without the SDK, the compile arguments, the cache location) against a stand-in.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..modeling.qwen36 import Qwen36ForCausalLM
from ..neuron_config import Qwen36NeuronConfig

NEURON_CACHE_DIR = "neuron_cache"
# The Neuron compiler's cache location (read by torch-neuronx when it compiles a graph).
NEURON_CACHE_ENV = "NEURON_COMPILE_CACHE_URL"
INSTALL_HINT = (
    "The 'neuron' backend needs the AWS Neuron SDK (torch-neuronx, neuronx-cc, nki) on a Trainium or "
    "Inferentia instance. Install them from the AWS Neuron pip repository, not PyPI (whose packages of "
    "those names are placeholders):\n"
    "  pip install torch-neuronx neuronx-cc nki --extra-index-url https://pip.repos.neuron.amazonaws.com\n"
    "Elsewhere use backend='cpu' (or 'cuda' with a GPU)."
)


class NeuronSDKUnavailableError(ImportError):
    """torch-neuronx (the Neuron SDK's PyTorch integration) cannot be imported."""


def require_torch_neuronx() -> ModuleType:
    """Import torch-neuronx, which registers the `neuron` device and torch.compile backend."""
    try:
        return importlib.import_module("torch_neuronx")
    except Exception as error:  # the PyPI placeholder raises on import, not only ImportError
        raise NeuronSDKUnavailableError(f"{INSTALL_HINT}\n(import torch_neuronx failed: {error})") from error


class NeuronBackend:
    """Each step compiled by TorchNeuron; the cache tensors live on the `neuron` device."""

    name = "neuron"

    def __init__(
        self,
        model: Qwen36ForCausalLM,
        neuron_config: Qwen36NeuronConfig,
        make_cache: Callable[[str], Any],
        compiled_dir: Path | None = None,
        *,
        compile_fn: Callable[..., Any] | None = None,
        device: str = "neuron",
    ) -> None:
        require_torch_neuronx()
        if neuron_config.tp_degree != 1:
            raise NotImplementedError(
                f"tp_degree={neuron_config.tp_degree}: tensor parallelism is not implemented for the neuron "
                "backend yet; export with tp_degree=1."
            )
        fresh_export = compiled_dir is None
        if compiled_dir is None:
            # A fresh export: NEFFs go to a private directory until save() copies them into the artifact.
            compiled_dir = Path(tempfile.mkdtemp(prefix="optimum-qwen36-neuron-"))
            weakref.finalize(self, shutil.rmtree, compiled_dir, True)
        self.files_dir = compiled_dir
        self.cache_dir = compiled_dir / NEURON_CACHE_DIR
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        os.environ[NEURON_CACHE_ENV] = str(self.cache_dir)
        self.device = device
        self.tp_degree = neuron_config.tp_degree
        self.model = model.to(device)
        compile_fn = compile_fn or torch.compile
        # Static shapes everywhere: one NEFF per step, no recompilation at run time.
        options = dict(backend="neuron", fullgraph=True, dynamic=False)
        self._steps = {
            "prefill_chunk": compile_fn(self.model.prefill_chunk, **options),
            "decode_step": compile_fn(self.model.decode_step, **options),
        }
        if fresh_export:
            # torch.compile is lazy: run each step once so that its NEFF is built now and lands in the cache.
            from .backends import example_step_args

            examples = example_step_args(neuron_config, make_cache(device))
            for method in self._steps:  # decode_step at the full batch: the static batch it always runs
                self._run(method, examples[method])

    def _run(self, method: str, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        with torch.no_grad():
            out = self._steps[method](*(a.to(self.device) for a in args))
        return out.cpu()

    def prefill_chunk(self, *args: torch.Tensor) -> torch.Tensor:
        return self._run("prefill_chunk", args)

    def decode_step(self, *args: torch.Tensor) -> torch.Tensor:
        return self._run("decode_step", args)

    def save(self, directory: Path) -> None:
        target = directory / "compiled" / NEURON_CACHE_DIR
        if target.resolve() != self.cache_dir.resolve():
            shutil.copytree(self.cache_dir, target, dirs_exist_ok=True)
