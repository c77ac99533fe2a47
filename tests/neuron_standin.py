"""A stand-in for TorchNeuron (torch-neuronx) in tests without the Neuron SDK. It does what the neuron backend
relies on, the way the real package does it (per the torch-neuronx source cited in
optimum_qwen36/exporters/neuron.py):

- `import torch_neuronx` works; `torch_neuronx.nki_op(name, mutates_args=...)` registers a custom op.
- `torch.compile(fn, backend="neuron", ...)` is lazy: a graph is built on the first call with a new input
  signature (shapes, dtypes, devices, non-tensor values), then reused.
- The runtime's compilation cache is created once per process, at the first device work (here: moving a
  module to the stand-in's device, `DEVICE`, or the first build), and reads
  TORCH_NEURONX_NEFF_CACHE_DIR (default /tmp/neff_cache; here a directory the test chooses) and
  TORCH_NEURONX_NEFF_DISABLE_CACHE then: later changes have no effect until `restart()` (a new process).
- A graph's NEFF is looked up in memory, then at `<cache>/<k[:2]>/<k[2:4]>/<k>.neff` (k: a hash of the graph)
  and, on a miss, compiled and written there through a temporary file and a rename. A hit only reads.

Nothing runs on a device: a built step runs the eager function, so the tests use `DEVICE`, the CPU
(moving a module there counts as device work). The real
`optimum_qwen36.nki.neuron_ops` needs the real SDK; a stand-in module takes its place and, when it is
imported, registers the same two ops through `torch_neuronx.nki_op`. `events` records all of it, in order.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import tempfile
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import optimum_qwen36.nki
from optimum_qwen36.nki.kernels.chunk_gated_delta_rule_torch import chunk_gated_delta_rule_torch
from optimum_qwen36.nki.kernels.fused_recurrent_gated_delta_rule_torch import (
    fused_recurrent_gated_delta_rule_torch,
)

NEFF_CACHE_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"
DEVICE = "cpu"
DISABLE_CACHE_ENV = "TORCH_NEURONX_NEFF_DISABLE_CACHE"
NEURON_OPS = "optimum_qwen36.nki.neuron_ops"
OPS = ("optimum_qwen36::chunk_gated_delta_rule", "optimum_qwen36::fused_recurrent_gated_delta_rule")


@dataclass(frozen=True)
class Build:
    """The first call of a compiled function with one input signature."""

    step: str
    key: str
    outcome: str  # "compiled" (written to the persistent cache), "persistent hit" or "memory hit"
    cache_dir: Path | None  # where the runtime looked (None: persistent cache disabled)


class StandInNeuronSDK:
    def __init__(self, default_cache_dir: Path) -> None:
        self.default_cache_dir = default_cache_dir  # stands for /tmp/neff_cache
        self.events: list[tuple[str, str]] = []
        self.compile_calls: list[tuple[str, dict[str, Any]]] = []
        self.builds: list[Build] = []
        self.module = types.ModuleType("torch_neuronx")
        self.module.nki_op = self.nki_op
        self._real_compile = torch.compile
        self._reset_runtime()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Make the stand-in what `import torch_neuronx`, `torch.compile` and the neuron_ops import reach
        (monkeypatch undoes it; call `restart()` at the end too, to drop the stand-in neuron_ops module)."""
        monkeypatch.setitem(sys.modules, "torch_neuronx", self.module)
        monkeypatch.setattr(torch, "compile", self.compile)
        move = torch.nn.Module.to

        def to(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
            if DEVICE in (*map(str, args), str(kwargs.get("device"))):  # e.g. model.to(device)
                self._runtime_cache_dir()  # the first device work starts the runtime
            return move(module, *args, **kwargs)

        monkeypatch.setattr(torch.nn.Module, "to", to)
        monkeypatch.setattr(sys, "meta_path", [_NeuronOpsFinder(self), *sys.meta_path])

    def restart(self) -> None:
        """What a new process sees: the runtime not started, nothing in memory, neuron_ops not imported."""
        self._reset_runtime()
        sys.modules.pop(NEURON_OPS, None)
        if hasattr(optimum_qwen36.nki, "neuron_ops"):
            delattr(optimum_qwen36.nki, "neuron_ops")

    def _reset_runtime(self) -> None:
        self.cache_dir: Path | None = None  # what the runtime read (None: not started, or cache disabled)
        self._started = False
        self._in_memory: set[str] = set()

    # ------------------------------------------------------------------ torch_neuronx API
    def nki_op(self, name: str, *, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
        def register(fn: Callable) -> Callable:
            self.events.append(("register", name))
            return fn

        return register

    def compile(self, model: Callable | None = None, **kwargs: Any) -> Callable:
        """torch.compile: the "neuron" backend is the stand-in's, any other is the real torch.compile."""
        inspect.signature(self._real_compile).bind(model, **kwargs)  # the arguments torch.compile takes
        if kwargs.get("backend") != "neuron":
            return self._real_compile(model, **kwargs)
        name = getattr(model, "__name__", type(model).__name__)
        self.events.append(("torch.compile", name))
        self.compile_calls.append((name, kwargs))
        built: dict[tuple[Any, ...], Build] = {}

        def compiled(*args: Any) -> Any:
            signature = tuple(_describe(a) for a in args)
            if signature not in built:
                built[signature] = self._build(model, name, signature, kwargs)
            return model(*args)

        return compiled

    # ------------------------------------------------------------------ the runtime
    def _runtime_cache_dir(self) -> Path | None:
        """NeuronResourceManager -> CompilationCache -> PersistentCacheBackend: created once, at first use."""
        if not self._started:
            self._started = True
            if os.environ.get(DISABLE_CACHE_ENV) != "1":
                self.cache_dir = Path(os.environ.get(NEFF_CACHE_ENV) or self.default_cache_dir)
                self.cache_dir.mkdir(parents=True, exist_ok=True)
            self.events.append(("runtime", str(self.cache_dir)))
        return self.cache_dir

    def _build(self, fn: Callable, name: str, signature: tuple[Any, ...], options: dict[str, Any]) -> Build:
        owner = getattr(fn, "__self__", None)
        layout = (
            [(n, tuple(p.shape), str(p.dtype)) for n, p in owner.named_parameters()]
            if isinstance(owner, torch.nn.Module)
            else []
        )
        graph = repr((getattr(fn, "__qualname__", name), signature, layout, sorted(options.items())))
        key = hashlib.sha256(graph.encode()).hexdigest()[:32]
        cache_dir = self._runtime_cache_dir()
        path = None if cache_dir is None else cache_dir / key[:2] / key[2:4] / f"{key}.neff"
        if key in self._in_memory:
            outcome = "memory hit"
        elif path is not None and path.is_file() and path.read_bytes():
            outcome = "persistent hit"
        else:
            outcome = "compiled"
            if path is not None:
                _atomic_write(path, f"stand-in NEFF {key}\n{graph}\n".encode())
        self._in_memory.add(key)
        build = Build(name, key, outcome, cache_dir)
        self.builds.append(build)
        self.events.append((outcome, name))
        return build

    def define_neuron_ops(self, module: types.ModuleType) -> None:
        """The stand-in optimum_qwen36.nki.neuron_ops: registers the two ops, as the real module does."""
        self.events.append(("import", NEURON_OPS))
        nki_op = sys.modules["torch_neuronx"].nki_op
        module.chunk_gated_delta_rule = nki_op(OPS[0], mutates_args=())(chunk_gated_delta_rule_torch)
        module.fused_recurrent_gated_delta_rule = nki_op(OPS[1], mutates_args=())(
            fused_recurrent_gated_delta_rule_torch
        )


class _NeuronOpsFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers `import optimum_qwen36.nki.neuron_ops` with the stand-in module."""

    def __init__(self, sdk: StandInNeuronSDK) -> None:
        self.sdk = sdk

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname == NEURON_OPS else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        self.sdk.define_neuron_ops(module)


def _describe(value: Any) -> Any:
    """What Dynamo guards on for an argument, roughly: a tensor's shape, dtype and device, else the value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), value.device.type)
    return ("value", repr(value))


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=".tmp.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(partial, path)
