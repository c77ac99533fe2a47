"""Compiled backends for the model's two static-shape steps, and the factory `NeuronModelForCausalLM` uses.

- `cpu` / `cuda`: AOTInductor packages for two steps, `prefill_chunk` and `decode_step` (2..batch rows;
  one row runs padded to two), or `decode_row` where the exported batch is one row; each step is compiled
  by regions (`compiled/<step>.<region>.pt2`: one graph per decoder-layer kind and the head, regions.py)
  that take the model's own tensors (memory-mapped from safetensors).
- `neuron`: see `exporters/neuron.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch.overrides import TorchFunctionMode

from ..network.cache import CacheStorage
from ..network.model import Qwen36ForCausalLM
from ..network.neuron_config import Qwen36NeuronConfig
from ..ops.attention import (
    paged_attention_native,
    paged_attention_torch,
    paged_attention_varlen_native,
    paged_attention_varlen_torch,
)
from ..ops.conv import (
    causal_conv1d_decode,
    causal_conv1d_decode_native,
    causal_conv1d_varlen,
    causal_conv1d_varlen_native,
)
from ..ops.gdn import (
    gdn_decode_step_native,
    gdn_decode_step_torch,
    gdn_prefill_chunk_native,
    gdn_prefill_chunk_torch,
    gdn_verify_step_native,
    gdn_verify_step_torch,
    native_chunk_supported,
)
from ..ops.huge_pages import move_to_huge_pages
from ..ops.native import (
    bf16_linear_vectorized,
    bf16_matmul_instructions,
    gdn_prefill_vectorized,
    load_native_ops,
)
from .aoti import CompiledGraph
from .base import (
    MIN_BATCH_ROWS,
    PREFILL_SNAPSHOTS,
    EagerBackend,
    StepBackend,
    blocks_in_use,
    example_step_args,
    no_snapshots,
    packed_prefill_args,
    rows_blocks_in_use,
)
from .compile_cache import CompileCache, compile_key
from .matvec import DecodeLinears, WidenedLinears
from .regions import StepShapes, compile_regions, load_step, step_files

logger = logging.getLogger(__name__)

COMPILED_DIR = "compiled"
# The steps of the cpu/cuda backend. An export for one row has one-row steps (`*_row`), any other the
# batched ones (2..batch rows). On cpu the linear layers of every step but prefill are traced as
# matvec.DecodeLinears says: the native bf16 kernel, or, on one row, a matrix-vector product; both stream
# the weights faster than ATen's matrix-matrix kernels (prefill's: `linears_mode`).
STEPS = ("prefill_chunk", "decode_row", "decode_step", "verify_row", "verify_step", "mtp_row", "mtp_step")
# With MTP speculative decoding (neuron_config.num_speculative_tokens): the verify and draft steps.
SPECULATIVE_ROW_STEPS = ("verify_row", "mtp_row")
SPECULATIVE_BATCHED_STEPS = ("verify_step", "mtp_step")
# Tensors the graphs need that are not parameters or buffers of the model (lifted constants), if any.
EXTRA_CONSTANTS = "constants.safetensors"
# The StepShapes the graphs were compiled with (what they take is decided once, on the exporting machine).
STEP_SHAPES = "step_shapes.json"


def graphs_to_compile(neuron_config: Qwen36NeuronConfig) -> list[str]:
    """The one-row steps for a batch of one row, else the batched ones only: a row's decode (verify, draft)
    is then the same computation whatever else runs with it (batch invariance: one-row graphs, compiled
    apart, may round differently), and one row runs padded to two (`min_step_rows`; a compiled dynamic
    batch starts at 2 rows, `regions._dims`)."""
    speculative = neuron_config.num_speculative_tokens > 0
    if neuron_config.batch_size == 1:
        return ["prefill_chunk", "decode_row", *(SPECULATIVE_ROW_STEPS if speculative else ())]
    return ["prefill_chunk", "decode_step", *(SPECULATIVE_BATCHED_STEPS if speculative else ())]


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under every name it has (tied weights appear under each name)."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return {name: t.detach() for name, t in tensors.items()}


class AOTIBackend:
    """The `cpu` (or `cuda`) backend: each step is an AOTInductor graph updating the cache in place."""

    decodes_any_batch = True
    # Every rank runs rank 0's graphs: weights are bound at load, and the embedding (where a rank's share of
    # the vocabulary starts) runs outside them.
    per_rank_graphs = False

    def __init__(self, files_dir: Path, model: Qwen36ForCausalLM, device: str) -> None:
        self.name = torch.device(device).type
        self.device = device
        self.files_dir = files_dir
        extra_file = files_dir / EXTRA_CONSTANTS
        extra = load_file(extra_file, device=device) if extra_file.is_file() else {}
        if self.name == "cpu":
            load_native_ops()  # the graphs call its custom ops (attention; FP8 and bf16 linear layers)
            # Before the graphs bind the weights: each decode step streams them all.
            moved = move_to_huge_pages(model)
            logger.debug("Moved %.2f GB of weights into transparent huge pages", moved / 1e9)

        shapes_file = files_dir / STEP_SHAPES
        recorded = json.loads(shapes_file.read_text()) if shapes_file.is_file() else None
        shapes = StepShapes(**recorded) if recorded is not None else StepShapes()

        def complete(step: str) -> bool:
            return all((files_dir / f).is_file() for f in step_files(model, step, shapes))

        present = [step for step in STEPS if complete(step)]
        if "prefill_chunk" not in present or not {"decode_row", "decode_step"} & set(present):
            files = step_files(model, "prefill_chunk", shapes) + step_files(model, "decode_step", shapes)
            needed = ", ".join(dict.fromkeys(files))
            found = sorted(path.name for path in files_dir.glob("*.pt2"))
            raise FileNotFoundError(
                f"{files_dir} lacks compiled graphs of this model (found: {', '.join(found) or 'none'}; "
                f"needed: {needed}, or the decode_row ones for a batch of one row). Re-export the model with "
                "from_pretrained(..., export=True)."
            )
        if recorded is None:
            raise FileNotFoundError(
                f"{files_dir} lacks {STEP_SHAPES} (what its graphs take, recorded at export). Re-export "
                "the model with from_pretrained(..., export=True)."
            )
        self.packs_prefill = shapes.any_prefill_tokens
        self.decodes_in_prefill = shapes.decode_rows_in_prefill
        self.prefill_snapshots = shapes.prefill_snapshots
        # A batch above one row runs every row in the batched steps: fewer rows are padded.
        self.min_step_rows = 1 if "decode_row" in present else MIN_BATCH_ROWS
        speculative_steps = SPECULATIVE_ROW_STEPS if self.min_step_rows == 1 else SPECULATIVE_BATCHED_STEPS
        if model.mtp is not None and not set(speculative_steps) <= set(present):
            needed = ", ".join(f for step in speculative_steps for f in step_files(model, step, shapes))
            raise FileNotFoundError(
                f"{files_dir} lacks the verify and MTP graphs that num_speculative_tokens needs ({needed}). "
                "Re-export the model with from_pretrained(..., export=True, num_speculative_tokens=...)."
            )
        self.model = model

        @functools.cache
        def load(file: str) -> CompiledGraph:
            prefix = f"{file}/"
            own = {name.removeprefix(prefix): t for name, t in extra.items() if name.startswith(prefix)}
            return CompiledGraph(files_dir / file, own, device)

        self.graphs = {step: load_step(model, step, load, device, shapes) for step in present}

    def _run(self, method: str, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        used = blocks_in_use(method, args, cut_tokens=self.packs_prefill)
        return self.graphs[method](*self._on_device(used)).cpu()

    def _prefill_args(
        self,
        args: tuple[torch.Tensor, ...],
        snapshot_ends: torch.Tensor | None = None,
        snapshot_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The prefill graph's arguments: the call's, packed, and its snapshots padded to the graph's
        `prefill_snapshots` entries (which it always takes)."""
        used = blocks_in_use("prefill_chunk", args, cut_tokens=self.packs_prefill)
        used = packed_prefill_args(used) if self.packs_prefill else used
        wanted = 0 if snapshot_ends is None else len(snapshot_ends)
        if wanted > self.prefill_snapshots:
            raise ValueError(
                f"this prefill graph takes {self.prefill_snapshots} GDN state snapshots per call, got "
                f"{wanted}"
            )
        if self.prefill_snapshots:
            ends, slots = no_snapshots(self.prefill_snapshots, args[-2].shape[1] - 1, "cpu")
            if wanted:
                ends[:wanted], slots[:wanted] = snapshot_ends, snapshot_slots
            used = (*used, ends, slots)
        return self._on_device(used)

    def prefill_chunk(
        self,
        *args: torch.Tensor,
        snapshot_ends: torch.Tensor | None = None,
        snapshot_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        sequences = args[3].numel()
        graph_args = self._prefill_args(args, snapshot_ends, snapshot_slots)
        return self.graphs["prefill_chunk"](*graph_args).cpu()[:sequences]

    def _step_graph(self, step: str, rows: int) -> str:
        """The graph of `step` (decode, verify or mtp) for a call with `rows` rows."""
        if rows < self.min_step_rows:
            raise ValueError(f"{step}_step takes {self.min_step_rows} rows or more, got {rows}: pad the call")
        return f"{step}_row" if self.min_step_rows == 1 else f"{step}_step"

    def decode_step(self, *args: torch.Tensor) -> torch.Tensor:
        return self._run(self._step_graph("decode", args[0].shape[0]), args)

    @torch.no_grad()
    def prefill_chunk_hidden(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.graphs["prefill_chunk"]
        hidden, inputs = step.decoder_output(*self._prefill_args(args))
        logits = step.head(self.model.last_valid(hidden, inputs))
        return logits.cpu()[: args[3].numel()], self.model.model.norm(hidden).cpu()

    @torch.no_grad()
    def position_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Eager: the head over many positions is one matrix product, which ATen runs well."""
        return self.model.position_logits(*self._on_device((normed,))).cpu()

    def verify_step(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, start_pos, num_valid, slots, block_tables, key_cache, *caches = args
        tables = rows_blocks_in_use(start_pos, num_valid, block_tables, key_cache.shape[2])
        graph = self.graphs[self._step_graph("verify", len(input_ids))]
        out = graph(*self._on_device((input_ids, start_pos, num_valid, slots, tables, key_cache, *caches)))
        return tuple(o.cpu() for o in out)

    def mtp_step(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, hidden, start_pos, num_valid, block_tables, key_cache, value_cache = args
        tables = rows_blocks_in_use(start_pos, num_valid, block_tables, key_cache.shape[2])
        if input_ids.shape[1] == 1:  # the graphs take 2..chunk positions: one more, never real
            input_ids = torch.nn.functional.pad(input_ids, (0, 1))
            hidden = torch.nn.functional.pad(hidden, (0, 0, 0, 1))
        graph = self.graphs[self._step_graph("mtp", len(input_ids))]
        out = graph(
            *self._on_device((input_ids, hidden, start_pos, num_valid, tables, key_cache, value_cache))
        )
        return tuple(o.cpu() for o in out)

    def _on_device(self, args: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if self.device == "cpu":
            return tuple(args)
        return tuple(a.to(self.device, non_blocking=True) for a in args)

    def save(self, directory: Path) -> None:
        target = directory / COMPILED_DIR
        if target.resolve() == self.files_dir.resolve():
            return
        target.mkdir(parents=True, exist_ok=True)
        for path in self.files_dir.iterdir():
            if path.suffix in (".pt2", ".safetensors") or path.name == STEP_SHAPES:
                shutil.copyfile(path, target / path.name)

    @classmethod
    def compile(
        cls,
        model: Qwen36ForCausalLM,
        neuron_config: Qwen36NeuronConfig,
        cache: CompileCache | None,
        device: str,
    ) -> AOTIBackend:
        """Compile the step graphs (or take them from the compile cache) and bind the model's weights."""
        backend = torch.device(device).type
        key = compile_key(model.config.to_dict(), neuron_config.to_dict(), backend)
        entry = cache.lookup(key) if cache is not None else None
        if entry is None:
            logger.info(
                "Compiling %s for %s (compile cache key %s): %s",
                ", ".join(graphs_to_compile(neuron_config)),
                device,
                key[:16],
                ", ".join(f"{k}={v}" for k, v in _describe(model, neuron_config).items()),
            )
            staging = Path(tempfile.mkdtemp(prefix="optimum-qwen36-compile-"))
            try:
                cpu_kernels = uses_cpu_kernels(backend)
                packs = prefill_takes_any_tokens(model, cpu_kernels)
                snapshots = PREFILL_SNAPSHOTS if packs else 0
                shapes = StepShapes(packs, decode_rows_in_prefill=packs, prefill_snapshots=snapshots)
                storage = CacheStorage.for_settings(
                    model.config, neuron_config, device, snapshot_slots=snapshots
                )
                examples = example_step_args(
                    neuron_config, storage, model.config.hidden_size, packs, snapshots
                )
                graphs = {graph: examples[graph] for graph in graphs_to_compile(neuron_config)}
                _compile_graphs(model, graphs, staging, cpu_kernels=cpu_kernels, shapes=shapes)
                if cache is not None:
                    entry = cache.store(key, staging, _describe(model, neuron_config))
                    shutil.rmtree(staging)
                else:
                    entry = staging
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        else:
            logger.info("Reusing compiled graphs from %s", entry)
        instance = cls(entry, model, device)
        if cache is None:
            # No cache to keep the files: they live as long as this backend.
            weakref.finalize(instance, shutil.rmtree, entry, True)
        return instance


def uses_cpu_kernels(device_type: str) -> bool:
    """Whether the graphs compiled for `device_type` call this package's native CPU ops where they build
    (attention, GDN, bf16 linears); elsewhere (cuda) they trace the ops' PyTorch twins."""
    return device_type == "cpu"


def prefill_takes_any_tokens(model: Qwen36ForCausalLM, cpu_kernels: bool) -> bool:
    """Whether the prefill graphs take 2..chunk tokens of packed sequences (each chunk's valid tokens,
    several running requests' chunks in one call) rather than one sequence's whole chunk: where the GDN
    layers' chunked delta rule is the native op (cpu, its vector build, head sizes it takes). The PyTorch
    form (cuda, other CPUs) walks 64-token blocks in Python, so its export would specialise the token
    count. Decided at export and recorded with the graphs (`STEP_SHAPES`)."""
    config = model.config
    return (
        cpu_kernels
        and gdn_prefill_vectorized()
        and native_chunk_supported(config.linear_key_head_dim, config.linear_value_head_dim)
    )


def linears_mode(step: str, native_bf16: bool, bf16_matmul: bool) -> TorchFunctionMode | None:
    """How `step`'s linear layers are traced on cpu: prefill_chunk's bf16 ones as float32 products of the
    widened values where the CPU has no bf16 matrix instructions (`bf16_matmul` False: matvec.WidenedLinears,
    through the native bf16 kernel when `native_bf16`), else as they are; every other step as
    matvec.DecodeLinears says (the native bf16 kernel for bf16 weights when `native_bf16`, float32 weights
    as weight @ x.T); decode_row (the one graph whose shapes are all static: the other one-row graphs take
    a dynamic number of positions) writes its other linears as matrix-vector products."""
    if step == "prefill_chunk":
        return None if bf16_matmul else WidenedLinears(native_bf16)
    return DecodeLinears(native_bf16, static_rows=step == "decode_row")


def _compile_graphs(
    model: Qwen36ForCausalLM,
    graphs: dict[str, tuple[torch.Tensor, ...]],
    out_dir: Path,
    cpu_kernels: bool,
    shapes: StepShapes,
) -> None:
    """Compile the regions of each step (name -> example arguments) into out_dir, taking `shapes`.
    With cpu_kernels, where the native ops build: attention calls `optimum_qwen36::paged_attention`, GDN
    layers `optimum_qwen36::gdn_decode_step` / `gdn_prefill_chunk`, and the linear layers of every step but
    prefill_chunk are traced as matvec.DecodeLinears says (prefill_chunk's as `linears_mode` says)."""
    total = time.perf_counter()
    native_bf16 = cpu_kernels and bf16_linear_vectorized()
    bf16_matmul = bf16_matmul_instructions()
    if cpu_kernels and load_native_ops():
        # The chunked delta rule's scalar build is slower than the compiled PyTorch twin; packed prefill
        # steps (whose conv is varlen) exist only with its vector build.
        vectorized = gdn_prefill_vectorized()
        model.set_kernels(
            paged_attention_native,
            paged_attention_varlen_native,
            gdn_decode_step_native,
            gdn_prefill_chunk_native if vectorized else gdn_prefill_chunk_torch,
            gdn_verify_step_native,
            causal_conv1d_varlen_native if vectorized else causal_conv1d_varlen,
            causal_conv1d_decode_native,
        )
    try:
        extra = compile_regions(
            model,
            graphs,
            out_dir,
            lambda step: linears_mode(step, native_bf16, bf16_matmul) if cpu_kernels else None,
            shapes,
        )
    finally:
        model.set_kernels(
            paged_attention_torch,
            paged_attention_varlen_torch,
            gdn_decode_step_torch,
            gdn_prefill_chunk_torch,
            gdn_verify_step_torch,
            causal_conv1d_varlen,
            causal_conv1d_decode,
        )
    if extra:
        save_file(extra, out_dir / EXTRA_CONSTANTS)
    (out_dir / STEP_SHAPES).write_text(json.dumps(dataclasses.asdict(shapes)))
    logger.info("Compiled %s in %.1f s", ", ".join(graphs), time.perf_counter() - total)


def _describe(model: Qwen36ForCausalLM, neuron_config: Qwen36NeuronConfig) -> dict[str, Any]:
    settings = neuron_config.to_dict()
    return {
        "model_type": model.config.model_type,
        "layers": model.config.num_hidden_layers,
        "hidden_size": model.config.hidden_size,
        **{k: settings[k] for k in ("backend", "batch_size", "sequence_length", "prefill_chunk_size")},
        "dtype": settings["dtype"],
    }


def default_backend() -> str:
    """What `export` compiles for when no backend is named: cpu, also on a machine with a GPU, until the
    cuda backend works there (the README says how it fails)."""
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
        return AOTIBackend.compile(model, neuron_config, cache, device)
    if backend == "neuron":
        from .neuron import NeuronBackend

        return NeuronBackend(model, neuron_config, compiled_dir=compiled_dir)
    raise ValueError(f"Unknown backend {backend!r}.")
