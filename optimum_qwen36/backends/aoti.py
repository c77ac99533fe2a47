"""The `cpu` / `cuda` backend at run time: each step runs as AOTInductor graphs, one per region
(`compiled/<step>.<region>.pt2`: one per decoder-layer kind and the head, backends/regions.py), that take
the model's own tensors (memory-mapped from safetensors) and update the cache in place.
exporters/compile_aoti.py compiles them.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..network.model import Qwen36ForCausalLM
from ..ops.huge_pages import move_to_huge_pages
from ..ops.native import load_native_ops
from .base import (
    COMPILED_DIR,
    MIN_BATCH_ROWS,
    blocks_in_use,
    fit_chunk_images,
    no_snapshots,
    packed_prefill_args,
    rows_blocks_in_use,
)
from .compiled_graph import CompiledGraph
from .regions import StepShapes, load_step, step_files

logger = logging.getLogger(__name__)

# The steps of the cpu/cuda backend. An export for one row has one-row steps (`*_row`), any other the
# batched ones (2..batch rows).
STEPS = ("prefill_chunk", "decode_row", "decode_step", "verify_row", "verify_step", "mtp_row", "mtp_step")
# With MTP speculative decoding (neuron_config.num_speculative_tokens): the verify and draft steps.
SPECULATIVE_ROW_STEPS = ("verify_row", "mtp_row")
SPECULATIVE_BATCHED_STEPS = ("verify_step", "mtp_step")
# Tensors the graphs need that are not parameters or buffers of the model (lifted constants), if any.
EXTRA_CONSTANTS = "constants.safetensors"
# The StepShapes the graphs were compiled with (what they take is decided once, on the exporting machine).
STEP_SHAPES = "step_shapes.json"


class AOTIBackend:
    """The `cpu` (or `cuda`) backend: each step is an AOTInductor graph updating the cache in place."""

    decodes_any_batch = True
    # Every rank runs rank 0's graphs: weights are bound at load, and the embedding (where a rank's share of
    # the vocabulary starts) runs outside them.
    per_rank_graphs = False
    # A step's eager inputs (embedding, rotary tables) read the image arguments; its graphs take the result.
    takes_images = True

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

    def _run(self, method: str, args: tuple[torch.Tensor, ...], **images: torch.Tensor) -> torch.Tensor:
        used = blocks_in_use(method, args, cut_tokens=self.packs_prefill)
        return self.graphs[method](*self._on_device(used), **self._images_on_device(images)).cpu()

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
        **images: torch.Tensor,
    ) -> torch.Tensor:
        sequences = args[3].numel()
        graph_args = self._prefill_args(args, snapshot_ends, snapshot_slots)
        images = self._images_on_device(fit_chunk_images(images, graph_args[0].shape[1]))
        return self.graphs["prefill_chunk"](*graph_args, **images).cpu()[:sequences]

    def _step_graph(self, step: str, rows: int) -> str:
        """The graph of `step` (decode, verify or mtp) for a call with `rows` rows."""
        if rows < self.min_step_rows:
            raise ValueError(f"{step}_step takes {self.min_step_rows} rows or more, got {rows}: pad the call")
        return f"{step}_row" if self.min_step_rows == 1 else f"{step}_step"

    def decode_step(self, *args: torch.Tensor, rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        images = {} if rope_positions is None else {"rope_positions": rope_positions}
        return self._run(self._step_graph("decode", args[0].shape[0]), args, **images)

    @torch.no_grad()
    def prefill_chunk_hidden(
        self, *args: torch.Tensor, **images: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.graphs["prefill_chunk"]
        graph_args = self._prefill_args(args)
        images = self._images_on_device(fit_chunk_images(images, graph_args[0].shape[1]))
        hidden, inputs = step.decoder_output(*graph_args, **images)
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

    def _images_on_device(self, images: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(zip(images, self._on_device(list(images.values())), strict=True))

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
