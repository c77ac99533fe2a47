"""A stand-in for TorchNeuron (torch-neuronx) in tests without the Neuron SDK. It does what the neuron backend
relies on, the way the real package does it (per the torch-neuronx source cited in
optimum_qwen36/backends/neuron.py and docs/EXPORT.md, "Neuron"):

- `import torch_neuronx` works; `torch_neuronx.nki_op(name, mutates_args=...)` registers a custom op.
- `torch.compile(fn, backend="neuron", ...)` is lazy: a graph is built on the first call with a new input
  signature (shapes, dtypes, devices, non-tensor values), then reused.
- The runtime's compilation cache is created once per process, at the first device work (here: moving a
  module to the stand-in's device, `DEVICE`, or the first build), and reads
  TORCH_NEURONX_NEFF_CACHE_DIR (default /tmp/neff_cache; here a directory the test chooses) and
  TORCH_NEURONX_NEFF_DISABLE_CACHE then: later changes have no effect until `restart()` (a new process).
- A graph's NEFF is looked up in memory, then at `<cache>/<k[:2]>/<k[2:4]>/<k>.neff` (k: a hash of the graph)
  and, on a miss, compiled and written there through a temporary file and a rename. A hit only reads.

- A graph's key covers what Dynamo specializes a graph on: the inputs' signature, the parameters' layout and
  the modules' int attributes (a rank's vocabulary start, say: the ranks of a tensor-parallel model compile
  different graphs).
- torch.distributed (torch_neuronx/distributed/backend.py): importing torch_neuronx registers the "neuron"
  backend; `init_process_group("neuron")` creates a ProcessGroupNeuron, a Python ProcessGroup whose first
  creation in a process sets up the runtime: it asserts the runtime has not started, sets
  NEURON_RT_VISIBLE_CORES (unless set) to the rank's local rank (LOCAL_RANK with LOCAL_WORLD_SIZE, else its
  place among the ranks of its host: here every rank's host is this one), starts the runtime and asserts one
  visible core. Compiling a graph resolves its collectives' group name to the group's ranks through
  torch.distributed's registry (`get_process_group_ranks`: a group it does not know raises).
  The runtime claims the NeuronCores it sees (NEURON_RT_VISIBLE_CORES, else all `INSTANCE_CORES`): a core
  another process holds fails its start. Not modelled: the root communicator address
  (NEURON_RT_ROOT_COMM_ID), the device index a rank's tensors get, the compiler's lowering of collectives
  into NEFFs and its cross-process cache lock.

Nothing runs on a device: a built step runs the eager function, so the tests use `DEVICE`, the CPU (moving a
module there counts as device work), and the process group's collectives run through gloo on it (the real
one's are device collectives). The real `optimum_qwen36.nki.neuron_ops` needs the real SDK; a stand-in module
takes its place and, when it is imported, registers the same two ops through `torch_neuronx.nki_op`. `events`
records all of it, in order (and, in processes a test starts, a log file: `reach_new_processes`).
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import importlib.abc
import importlib.machinery
import inspect
import json
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
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

import optimum_qwen36.nki
from optimum_qwen36.network.sharding import GROUP_NAME  # the name the graphs' collectives carry
from optimum_qwen36.nki.kernels.chunk_gated_delta_rule_torch import chunk_gated_delta_rule_torch
from optimum_qwen36.nki.kernels.fused_recurrent_gated_delta_rule_torch import (
    fused_recurrent_gated_delta_rule_torch,
)

NEFF_CACHE_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"
VISIBLE_CORES_ENV = "NEURON_RT_VISIBLE_CORES"
INSTANCE_CORES = 8
DEVICE = "cpu"
DISABLE_CACHE_ENV = "TORCH_NEURONX_NEFF_DISABLE_CACHE"
NEURON_OPS = "optimum_qwen36.nki.neuron_ops"
OPS = ("optimum_qwen36::chunk_gated_delta_rule", "optimum_qwen36::fused_recurrent_gated_delta_rule")
# Set in the environment of processes a test starts: where their stand-in keeps its files.
STANDIN_ROOT_ENV = "OPTIMUM_QWEN36_TEST_NEURON_STANDIN"
# A test sets it to a rank: the compiler fails on that rank of a tensor-parallel model.
FAIL_COMPILE_ON_RANK_ENV = "OPTIMUM_QWEN36_TEST_NEURON_FAIL_COMPILE_ON_RANK"
SITE_DIR = Path(__file__).parent / "neuron_standin_site"


@dataclass(frozen=True)
class Build:
    """The first call of a compiled function with one input signature."""

    step: str
    key: str
    outcome: str  # "compiled" (written to the persistent cache), "persistent hit" or "memory hit"
    cache_dir: Path | None  # where the runtime looked (None: persistent cache disabled)


class StandInNeuronSDK:
    def __init__(self, default_cache_dir: Path, log: Path | None = None) -> None:
        self.default_cache_dir = default_cache_dir  # stands for /tmp/neff_cache
        # The instance's NeuronCores: a lock file each, held by the process whose runtime claimed it.
        self.cores_dir = default_cache_dir.parent / "neuron-cores"
        self.log = log
        self.events: list[tuple[str, str]] = []
        self.compile_calls: list[tuple[str, dict[str, Any]]] = []
        self.builds: list[Build] = []
        self.module = types.ModuleType("torch_neuronx")
        self.module.nki_op = self.nki_op
        self.module.is_neuron_runtime_initialized = lambda: self._started
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
        # `import torch_neuronx` registers its torch.distributed backend (undone with the registries).
        for registry in ("_plugins", "backend_capability", "backend_type_map", "default_device_backend_map"):
            monkeypatch.setattr(dist.Backend, registry, dict(getattr(dist.Backend, registry)))
        monkeypatch.setattr(dist.Backend, "backend_list", list(dist.Backend.backend_list))
        monkeypatch.setattr(dist.Backend, "NEURON", "neuron", raising=False)
        dist.Backend.register_backend("neuron", self._process_group, devices=[DEVICE])

    def reach_new_processes(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Install the stand-in in the Python processes started from here on (tensor-parallel workers),
        each logging its events to `<root>/events-<pid>.jsonl` (`logged_events`)."""
        path = os.pathsep.join(filter(None, [str(SITE_DIR), os.environ.get("PYTHONPATH")]))
        monkeypatch.setenv("PYTHONPATH", path)
        monkeypatch.setenv(STANDIN_ROOT_ENV, str(self.default_cache_dir.parent))

    def logged_events(self) -> dict[int, list[tuple[str, str]]]:
        """The events of each process `reach_new_processes` reached, by pid."""
        logs = sorted(self.default_cache_dir.parent.glob("events-*.jsonl"))
        return {
            int(log.stem.removeprefix("events-")): [
                tuple(json.loads(line)) for line in log.read_text().splitlines()
            ]
            for log in logs
        }

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
        for claim in getattr(self, "_claims", []):
            claim.close()  # the process ended: its cores are free
        self._claims: list[Any] = []
        self._process_group_created = False
        self.rank: int | None = None  # in a tensor-parallel group

    def _event(self, kind: str, what: str) -> None:
        self.events.append((kind, what))
        if self.log is not None:
            with self.log.open("a") as log:
                log.write(json.dumps([kind, what]) + "\n")

    # ------------------------------------------------------------------ torch_neuronx API
    def nki_op(self, name: str, *, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
        def register(fn: Callable) -> Callable:
            self._event("register", name)
            return fn

        return register

    def compile(self, model: Callable | None = None, **kwargs: Any) -> Callable:
        """torch.compile: the "neuron" backend is the stand-in's, any other is the real torch.compile."""
        inspect.signature(self._real_compile).bind(model, **kwargs)  # the arguments torch.compile takes
        if kwargs.get("backend") != "neuron":
            return self._real_compile(model, **kwargs)
        name = getattr(model, "__name__", type(model).__name__)
        self._event("torch.compile", name)
        self.compile_calls.append((name, kwargs))
        built: dict[tuple[Any, ...], Build] = {}

        def compiled(*args: Any, **inputs: Any) -> Any:
            # Dynamo guards on the keyword arguments too: a call with others traces (and builds) anew.
            signature = (
                *(_describe(a) for a in args),
                *((k, _describe(v)) for k, v in sorted(inputs.items())),
            )
            if signature not in built:
                built[signature] = self._build(model, name, signature, kwargs)
            return model(*args, **inputs)

        return compiled

    # ------------------------------------------------------------------ the runtime
    def _runtime_cache_dir(self) -> Path | None:
        """NeuronResourceManager -> CompilationCache -> PersistentCacheBackend: created once, at first use."""
        if not self._started:
            self._started = True
            if os.environ.get(DISABLE_CACHE_ENV) != "1":
                self.cache_dir = Path(os.environ.get(NEFF_CACHE_ENV) or self.default_cache_dir)
                self.cache_dir.mkdir(parents=True, exist_ok=True)
            self._event("runtime", str(self.cache_dir))
            self._claim_cores()
        return self.cache_dir

    def visible_cores(self) -> list[int]:
        spec = os.environ.get(VISIBLE_CORES_ENV)
        if not spec:
            return list(range(INSTANCE_CORES))
        cores = []
        for part in spec.split(","):
            first, _, last = part.partition("-")
            cores.extend(range(int(first), int(last or first) + 1))
        return cores

    def _claim_cores(self) -> None:
        """nrt_init: the cores this process sees become its own, or the start fails."""
        self.cores_dir.mkdir(parents=True, exist_ok=True)
        cores = self.visible_cores()
        for core in cores:
            claim = (self.cores_dir / f"{core}.lock").open("w")
            try:
                fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                claim.close()
                raise RuntimeError(
                    f"nrt_init failed: NeuronCore {core} is in use by another process"
                ) from None
            self._claims.append(claim)
        self._event("cores", ",".join(map(str, cores)))

    # ------------------------------------------------------------------ torch.distributed
    def _process_group(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> ProcessGroup:
        """The "neuron" backend's creator (`init_process_group("neuron")`): a ProcessGroupNeuron."""
        self._event("process group", f"rank {rank} of {size}")
        self.rank = rank
        if not self._process_group_created:
            self._process_group_created = True
            assert not self._started, (
                "Neuron runtime should not be initialized before the init_process_group."
            )
            local_rank = rank  # its place among the ranks of its host: here every rank's host is this one
            if os.environ.get("LOCAL_RANK") and os.environ.get("LOCAL_WORLD_SIZE"):
                local_rank = int(os.environ["LOCAL_RANK"])
            if not os.environ.get(VISIBLE_CORES_ENV):
                os.environ[VISIBLE_CORES_ENV] = str(local_rank)
            self._runtime_cache_dir()
            assert len(self.visible_cores()) == 1, (
                "Attempted to have more than one device per process in distributed setup"
            )
        # Its collectives run by gloo on the stand-in's device, the CPU. A plain ProcessGroup, not a Python
        # subclass as the real one is: gloo's threads would take the GIL for every call into a Python
        # subclass, and deadlock with a main thread that waits for a collective holding it.
        group = ProcessGroup(store, rank, size)
        transport = dist.ProcessGroupGloo(dist.PrefixStore("stand-in-neuron", store), rank, size, timeout)
        group._set_default_backend(ProcessGroup.BackendType.GLOO)
        group._register_backend(torch.device(DEVICE), ProcessGroup.BackendType.GLOO, transport)
        return group

    def _build(self, fn: Callable, name: str, signature: tuple[Any, ...], options: dict[str, Any]) -> Build:
        owner = getattr(fn, "__self__", None)
        layout, constants = [], []
        if isinstance(owner, torch.nn.Module):
            layout = [(n, tuple(p.shape), str(p.dtype)) for n, p in owner.named_parameters()]
            constants = [
                (n, attribute, value)
                for n, module in owner.named_modules()
                for attribute, value in vars(module).items()
                if type(value) is int
            ]
        graph = repr(
            (getattr(fn, "__qualname__", name), signature, layout, constants, sorted(options.items()))
        )
        key = hashlib.sha256(graph.encode()).hexdigest()[:32]
        cache_dir = self._runtime_cache_dir()
        path = None if cache_dir is None else cache_dir / key[:2] / key[2:4] / f"{key}.neff"
        self._resolve_collective_group()
        if os.environ.get(FAIL_COMPILE_ON_RANK_ENV) == str(self.rank):
            raise RuntimeError(f"neuronx-cc failed on {name} (the stand-in, on purpose, on rank {self.rank})")
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
        self._event(outcome, name)
        return build

    def _resolve_collective_group(self) -> None:
        """What compiling a graph does with its collectives' group name (collective_legalization): resolve it
        to the group's ranks through torch.distributed's registry (raises for a group it does not know).
        Recorded once per group: its backend and ranks."""
        try:
            group = dist.distributed_c10d._resolve_process_group(GROUP_NAME)
        except RuntimeError:
            return  # no collectives: a model of one process
        described = f"{dist.get_backend(group)} on ranks {dist.get_process_group_ranks(group)}"
        if ("collective group", described) not in self.events:
            self._event("collective group", described)

    def define_neuron_ops(self, module: types.ModuleType) -> None:
        """The stand-in optimum_qwen36.nki.neuron_ops: registers the two ops, as the real module does."""
        self._event("import", NEURON_OPS)
        nki_op = sys.modules["torch_neuronx"].nki_op
        module.chunk_gated_delta_rule = nki_op(OPS[0], mutates_args=())(chunk_gated_delta_rule_torch)
        module.fused_recurrent_gated_delta_rule = nki_op(OPS[1], mutates_args=())(
            fused_recurrent_gated_delta_rule_torch
        )


def install_in_this_process(root: Path) -> StandInNeuronSDK:
    """The stand-in in a process a test started (`reach_new_processes`; tests/neuron_standin_site), for the
    process's lifetime, as the `sdk` fixture of the tests installs it."""
    from optimum_qwen36.backends import neuron

    sdk = StandInNeuronSDK(root / "default-neff-cache", log=root / f"events-{os.getpid()}.jsonl")
    sdk.install(pytest.MonkeyPatch())
    neuron.NeuronBackend.__init__.__kwdefaults__["device"] = DEVICE
    return sdk


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
