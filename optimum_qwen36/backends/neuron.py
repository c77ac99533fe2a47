"""The `neuron` backend at run time: each step compiled by TorchNeuron (`torch.compile(backend="neuron",
fullgraph=True, dynamic=False)`, static shapes) and run on the `neuron` device, where the Gated DeltaNet
ops dispatch to NKI kernels; the process's NEFF cache, where TorchNeuron keeps the compiled steps and a
loaded artifact's NEFFs are copied; and the NeuronCores of tensor-parallel ranks. docs/EXPORT.md
("Neuron") says more.
"""

from __future__ import annotations

import atexit
import filecmp
import importlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from ..network.model import Qwen36ForCausalLM
from ..network.neuron_config import Qwen36NeuronConfig
from ..network.quantization import rescale_for_range
from ..ops.fp8 import NEURON_E4M3_MAX
from .base import COMPILED_DIR

logger = logging.getLogger(__name__)

# Where an artifact keeps its NEFFs: compiled/neuron_cache/, in the compiler's own layout.
NEURON_CACHE_DIR = "neuron_cache"
# TorchNeuron's persistent NEFF cache directory (read once per process by its runtime).
NEFF_CACHE_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"
NEFF_SUFFIX = ".neff"
# TorchNeuron's torch.distributed backend (registered by `import torch_neuronx`).
NEURON_COLLECTIVES = "neuron"
# The NeuronCores a process may use ("0-3", "0,2,4", ...), read by the runtime when it starts.
VISIBLE_CORES_ENV = "NEURON_RT_VISIBLE_CORES"
INSTALL_HINT = (
    "The 'neuron' backend needs TorchNeuron (torch-neuronx 2.13.* or 2.14.* with the same PyTorch "
    "2.13 / 2.14, Python 3.12-3.14, Neuron SDK 2.33+), the Neuron compiler and nki, on a Trn2 or Trn3 "
    "instance. Install them from the AWS Neuron pip repository, not PyPI (whose packages of those names "
    "are placeholders):\n"
    '  pip install "torch-neuronx==2.14.*" "neuronx-cc==2.*" nki '
    "--extra-index-url https://pip.repos.neuron.amazonaws.com "
    "--extra-index-url https://download.pytorch.org/whl/cpu\n"
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


def neff_files(directory: Path) -> set[str]:
    """The NEFFs under `directory`, as paths relative to it (in-progress `.tmp.*` files are not NEFFs)."""
    if not directory.is_dir():
        return set()
    return {p.relative_to(directory).as_posix() for p in directory.rglob(f"*{NEFF_SUFFIX}") if p.is_file()}


def _write_file(target: Path, data: bytes) -> None:
    """Write through a temporary name and a rename, as the runtime writes: no reader sees half a NEFF."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".tmp.{target.name}.{os.getpid()}")
    partial.write_bytes(data)
    os.replace(partial, target)


@dataclass(frozen=True)
class NeffCache:
    """This process's TorchNeuron NEFF cache directory."""

    directory: Path
    # NEFFs it held when this process took it: not carried into artifacts (they may be anyone's).
    preexisting: frozenset[str]

    def neffs(self) -> set[str]:
        return neff_files(self.directory)

    def written_here(self) -> set[str]:
        """NEFFs this process added (compiled, or copied in from loaded artifacts)."""
        return self.neffs() - self.preexisting


_process_cache: NeffCache | None = None


def process_neff_cache() -> NeffCache:
    """The process's NEFF cache, chosen on first use and exported as TORCH_NEURONX_NEFF_CACHE_DIR.

    The runtime reads that variable once, so the directory cannot change afterwards: a per-model
    directory would only be honoured for the first model of a process. A later change of the variable is
    undone (with a warning), so that this module and the runtime keep agreeing on where the NEFFs are."""
    global _process_cache
    if _process_cache is None:
        configured = os.environ.get(NEFF_CACHE_ENV)
        if configured:
            directory = Path(configured)
            directory.mkdir(parents=True, exist_ok=True)
        else:
            directory = Path(tempfile.mkdtemp(prefix="optimum-qwen36-neff-"))
            atexit.register(shutil.rmtree, directory, True)
        _process_cache = NeffCache(directory, frozenset(neff_files(directory)))
        logger.info("TorchNeuron NEFF cache of this process: %s", directory)
    elif os.environ.get(NEFF_CACHE_ENV) != str(_process_cache.directory):
        logger.warning(
            "%s changed to %r after the Neuron runtime read it; it keeps using %s (it reads the variable "
            "once per process), and so does optimum-qwen36.",
            NEFF_CACHE_ENV,
            os.environ.get(NEFF_CACHE_ENV),
            _process_cache.directory,
        )
    os.environ[NEFF_CACHE_ENV] = str(_process_cache.directory)
    return _process_cache


def visible_cores(spec: str) -> list[int]:
    """The cores a NEURON_RT_VISIBLE_CORES value names ("0-3,6" -> [0, 1, 2, 3, 6])."""
    cores = []
    for part in spec.replace(" ", "").split(","):
        first, _, last = part.partition("-")
        if not first.isdigit() or not (last or first).isdigit() or int(last or first) < int(first):
            raise ValueError(
                f"{VISIBLE_CORES_ENV}={spec!r} is not a list of NeuronCores: write core numbers and ranges "
                "separated by commas, e.g. '0-3' or '0,2,4,6'."
            )
        cores.extend(range(int(first), int(last or first) + 1))
    return cores


def prepare_tensor_parallel_rank() -> None:
    """In a process about to be a rank of a tensor-parallel model (before any worker starts, in rank 0's):
    the SDK imported (it registers the "neuron" process group backend), the process's NEFF cache chosen
    before the runtime reads its location, and a clear error where the runtime has already started:
    creating TorchNeuron's process group sets the runtime up (its cores, its rank), once per process."""
    sdk = require_torch_neuronx()
    joined = dist.is_initialized() and dist.get_backend() == NEURON_COLLECTIVES  # under torchrun, say
    if sdk.is_neuron_runtime_initialized() and not joined:
        raise RuntimeError(
            "This process has already started the Neuron runtime (a neuron model or tensor was created in "
            "it, or a tensor-parallel model before): TorchNeuron sets up a tensor-parallel rank's runtime "
            "when it creates the rank's process group, once per process. Create the tensor-parallel model "
            "in a new process, before any other Neuron work."
        )
    process_neff_cache()


def tensor_parallel_environments(degree: int) -> list[dict[str, str]]:
    """The environment of each rank of a tensor-parallel model that `launch` spawns: this process's NEFF
    cache directory for every rank, and, when NEURON_RT_VISIBLE_CORES names the cores the model may use, one
    of them per rank (TorchNeuron gives a rank of a tensor-parallel group one NeuronCore; unset, it gives
    rank r of a machine its r-th core)."""
    environments = [{NEFF_CACHE_ENV: str(process_neff_cache().directory)} for _ in range(degree)]
    spec = os.environ.get(VISIBLE_CORES_ENV)
    if spec:
        cores = visible_cores(spec)
        if len(cores) < degree:
            raise ValueError(
                f"tp_degree={degree} runs one rank per NeuronCore, and {VISIBLE_CORES_ENV}={spec!r} names "
                f"{len(cores)}: name {degree} cores (e.g. {VISIBLE_CORES_ENV}=0-{degree - 1}), or unset it."
            )
        if len(cores) > degree:
            logger.info("tp_degree=%d uses NeuronCores %s of %s", degree, cores[:degree], spec)
        for environment, core in zip(environments, cores, strict=False):
            environment[VISIBLE_CORES_ENV] = str(core)
    return environments


class NeuronBackend:
    """Each step compiled by TorchNeuron; the cache tensors live on the `neuron` device."""

    name = "neuron"
    # With tensor parallelism each rank compiles its own graphs: they hold rank-specific constants (the
    # first token of its share of the vocabulary), so its NEFFs may be its own.
    per_rank_graphs = True
    # A prefill or decode call with image arguments runs a graph of its own (static shapes: one more NEFF
    # per step, compiled at export by exporters/neuron.py's `compile_image_steps`).
    takes_images = True
    decodes_any_batch = False  # static shapes: decode always runs the exported batch
    min_step_rows = 1
    packs_prefill = False  # static shapes: one sequence's chunk per prefill call
    prefill_snapshots = 0
    decodes_in_prefill = False

    def __init__(
        self,
        model: Qwen36ForCausalLM,
        neuron_config: Qwen36NeuronConfig,
        compiled_dir: Path | None = None,
        *,
        device: str = "neuron",
    ) -> None:
        require_torch_neuronx()
        # Before the model moves to the device: the runtime reads the cache location at its first device work.
        self.neff_cache = process_neff_cache()
        self._neffs_before = self.neff_cache.neffs()
        # NEFFs copied in from the artifact being loaded (its save() carries them on), and those compiling
        # its steps wrote (`record_compiled`).
        self._carried: set[str] = set()
        self._compiled: set[str] = set()
        if compiled_dir is not None:
            self._carried = self._copy_in(compiled_dir / NEURON_CACHE_DIR)
        from ..nki import load_neuron_ops

        # Registers the NKI custom ops now: the first import must not happen inside the traced step.
        load_neuron_ops()
        # Neuron's e4m3 saturates at +-240, not 448: FP8 weights are requantized for that range.
        rescale_for_range(model, NEURON_E4M3_MAX)
        self.device = device
        self.model = model.to(device)
        # Static shapes everywhere: one NEFF per step and shape, no recompilation at run time.
        options = dict(backend="neuron", fullgraph=True, dynamic=False)
        steps = ["prefill_chunk", "decode_step"]
        k = neuron_config.num_speculative_tokens
        if k:
            steps += ["prefill_chunk_hidden", "verify_step", "mtp_step"]
        # Lazy: each step compiles at its first call (to cache hits where its NEFF is in the cache).
        self.steps = {name: torch.compile(getattr(self.model, name), **options) for name in steps}
        chunk = neuron_config.prefill_chunk_size
        # The MTP step runs at two static widths: k + 1 positions (drafting after a verify step) and a whole
        # chunk (after a prefill chunk); a call is padded to the narrower that holds it. The config keeps
        # k + 1 <= chunk.
        self.mtp_widths = sorted({k + 1, chunk}) if k else []

    def _copy_in(self, source: Path) -> set[str]:
        """Put an artifact's NEFFs where the runtime looks (not the artifact itself: it must stay as it was
        verified). A file of the same name already there is replaced unless it holds the same bytes: the
        runtime must run the NEFFs whose sha256 the manifest check verified."""
        names = neff_files(source)
        for name in sorted(names):
            target = self.neff_cache.directory / name
            if not target.is_file() or not filecmp.cmp(source / name, target, shallow=False):
                _write_file(target, (source / name).read_bytes())
        if not names:
            logger.warning("%s holds no NEFF: the neuron steps will be compiled again.", source)
        return names

    def record_compiled(self) -> set[str]:
        """The NEFFs written into the cache since this backend was created: what compiling its steps wrote
        (exporters/neuron.py), which a saved model carries."""
        self._compiled = self.neff_cache.neffs() - self._neffs_before
        return self._compiled

    def run(
        self, method: str, args: tuple[torch.Tensor, ...], images: dict[str, torch.Tensor] | None = None
    ) -> Any:
        """Step `method` on the device (with a prompt's image arguments: its image graph); its results back
        on the CPU."""
        on_device = {name: tensor.to(self.device) for name, tensor in (images or {}).items()}
        with torch.no_grad():
            out = self.steps[method](*(a.to(self.device) for a in args), **on_device)
        return tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()

    def prefill_chunk(self, *args: torch.Tensor, **images: torch.Tensor) -> torch.Tensor:
        return self.run("prefill_chunk", args, images)

    def decode_step(self, *args: torch.Tensor, **images: torch.Tensor) -> torch.Tensor:
        return self.run("decode_step", args, images)

    def prefill_chunk_hidden(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.run("prefill_chunk_hidden", args)

    def verify_step(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.run("verify_step", args)

    def mtp_step(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP step at the narrowest compiled width that holds its positions (padding never real)."""
        input_ids, hidden, *rest = args
        width = next(w for w in self.mtp_widths if w >= input_ids.shape[1])
        pad = width - input_ids.shape[1]
        input_ids = torch.nn.functional.pad(input_ids, (0, pad))
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, pad))
        return self.run("mtp_step", (input_ids, hidden, *rest))

    def neffs(self) -> set[str]:
        """The NEFFs a saved model carries: those of the loaded artifact and those this backend's warm-up
        compiled; when there are none (every step was already compiled in this process, so the runtime found
        them in memory), all the NEFFs this process wrote, which include them."""
        return (self._carried | self._compiled) or self.neff_cache.written_here()

    def compiled_files(self) -> dict[str, bytes]:
        """The NEFFs `save` writes, by their path in the artifact's `compiled/` directory."""
        source = self.neff_cache.directory
        return {f"{NEURON_CACHE_DIR}/{name}": (source / name).read_bytes() for name in sorted(self.neffs())}

    def add_compiled_files(self, directory: Path, files: dict[str, bytes]) -> None:
        """Write another rank's NEFFs (`compiled_files`) into the model saved at `directory`. A NEFF's name
        is a hash of its graph: one already there is the same."""
        for name, data in files.items():
            parts = Path(name).parts
            if parts[0] != NEURON_CACHE_DIR or ".." in parts or not name.endswith(NEFF_SUFFIX):
                raise ValueError(f"{name!r} is not the path of a NEFF under compiled/{NEURON_CACHE_DIR}/")
            target = directory / COMPILED_DIR / name
            if not target.is_file():
                _write_file(target, data)

    def save(self, directory: Path) -> None:
        target = directory / COMPILED_DIR / NEURON_CACHE_DIR
        source = self.neff_cache.directory
        target.mkdir(parents=True, exist_ok=True)
        if target.resolve() == source.resolve():
            return
        names = self.neffs()
        if not names:
            # Saving without them would give an artifact that compiles again at every load.
            raise RuntimeError(
                f"This process wrote no NEFF of its steps into the NEFF cache {source}: they were compiled "
                f"into a cache that already held them ({NEFF_CACHE_ENV} pointing at a shared cache), or "
                f"before this model was created (the runtime reads {NEFF_CACHE_ENV} once per process). "
                f"Export in a fresh process, with {NEFF_CACHE_ENV} unset or pointing at an empty directory."
            )
        for name in sorted(names):
            _write_file(target / name, (source / name).read_bytes())
