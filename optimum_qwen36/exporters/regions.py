"""Regional compilation: tracing and compiling each step's regions (backends/regions.py says how a step
is cut: one graph per distinct decoder-layer kind, the head, or the MTP graph).

Compiling a whole-model step makes Inductor generate (and the C++ compiler build) every layer again, so
export time grows with the layer count; a region graph is compiled once for all layers of its kind.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..backends.base import MIN_BATCH_ROWS, MIN_PACKED_SEQUENCES, MIN_PREFILL_TOKENS, MIN_TABLE_BLOCKS
from ..backends.regions import (
    HEAD,
    HEAD_WEIGHTS,
    INPUTS_OF,
    LAYER_FIELDS,
    MTP,
    MTP_STEPS,
    LayerKind,
    StepShapes,
    head_step,
    layer_arguments,
    layer_fields,
    layer_kinds,
    model_weights,
    mtp_tensor_names,
    region_file,
    step_files,
)
from ..network.model import Qwen36DecoderLayer, Qwen36ForCausalLM, StepInputs
from .aoti import export_method
from .compile_workers import CompilePool, default_workers

logger = logging.getLogger(__name__)

# The steps with a head graph of their own, and what it computes (prefill's: the logits of its last valid
# token, one row).
HEAD_FUNCTION_OF = {
    "prefill_chunk": "decode_logits",
    "decode_row": "decode_logits",
    "decode_step": "decode_logits",
    "verify_row": "verify_logits",
    "verify_step": "verify_logits",
}
# Steps of 2..batch rows (one row runs the *_row step).
BATCHED_STEPS = ("decode_step", "verify_step", "mtp_step")


class _Call(nn.Module):
    """`fn(*args)` as the forward of a module holding `module`, so that `functional_call` can swap
    `module`'s tensors (under the names "module.<name>") while `fn` runs."""

    def __init__(self, module: nn.Module, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.module = module
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)


class _TensorsAsInputs(nn.Module):
    """Runs `fn(*args)` with `module`'s tensors named `tensor_names` replaced by the trailing arguments.

    `module` is held outside this wrapper's module tree, so `torch.export` sees none of its tensors as the
    wrapper's own: the replaced ones are graph inputs, and a graph compiled from one layer runs any layer of
    its kind."""

    def __init__(
        self, module: nn.Module, fn: Callable[..., torch.Tensor], tensor_names: Sequence[str]
    ) -> None:
        super().__init__()
        object.__setattr__(self, "_call", _Call(module, fn))
        self.tensor_names = tuple(tensor_names)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        split = len(args) - len(self.tensor_names)
        tensors = {f"module.{name}": t for name, t in zip(self.tensor_names, args[split:], strict=True)}
        return torch.func.functional_call(self._call, tensors, args[:split])


def layer_region(model: Qwen36ForCausalLM, kind: LayerKind, step: str, shapes: StepShapes) -> nn.Module:
    """A module running the kind's layers: arguments (hidden, *fields, cache_idx, *layer tensors)."""
    template: Qwen36DecoderLayer = model.model.layers[kind.layers[0]]
    fields = layer_fields(kind.layer_type, step, shapes)

    def run(hidden: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        given = dict(zip(fields, args[:-1], strict=True))
        step_inputs = StepInputs(**{f.name: given.get(f.name) for f in dataclasses.fields(StepInputs)})
        return template(hidden, step_inputs, args[-1])

    return _TensorsAsInputs(template, run, kind.tensor_names)


def head_region(model: Qwen36ForCausalLM, step: str) -> nn.Module:
    """A module running the step's head: arguments (hidden [B, T, hidden], *HEAD_WEIGHTS)."""
    return _TensorsAsInputs(model, getattr(model, HEAD_FUNCTION_OF[step]), HEAD_WEIGHTS)


def mtp_region(model: Qwen36ForCausalLM) -> nn.Module:
    """A module running the MTP layer and lm_head: arguments (embeds, hidden, num_valid, *attention fields,
    *mtp_tensor_names)."""
    fields = LAYER_FIELDS["full_attention"]

    def run(embeds: torch.Tensor, hidden: torch.Tensor, num_valid: torch.Tensor, *args: torch.Tensor):
        given = dict(zip(fields, args, strict=True))
        step_inputs = StepInputs(**{f.name: given.get(f.name) for f in dataclasses.fields(StepInputs)})
        return model.mtp_output(embeds, hidden, num_valid, step_inputs)

    return _TensorsAsInputs(model, run, mtp_tensor_names(model))


def _dims(
    step: str, inputs: StepInputs, max_rows: int, shapes: StepShapes
) -> dict[str, dict[int, Any] | None]:
    """Dynamic dimensions of the region arguments, by StepInputs field ("hidden" too). Left dynamic:
    - the number of KV blocks, so the same graphs serve any block pool (e.g. prefix caching's larger one);
    - the block table width, 2..max_blocks (`base.MIN_TABLE_BLOCKS`), so attention reads only the blocks
      in use (`blocks_in_use`), not the whole compiled sequence_length;
    - the batched steps' batch, 2..max_rows rows (`base.MIN_BATCH_ROWS`), so only the active rows are
      computed;
    - with `shapes.any_prefill_tokens`, a packed prefill's tokens, 2..chunk (`base.MIN_PREFILL_TOKENS`;
      2..chunk + max_rows with `shapes.decode_rows_in_prefill`), so a chunk computes its valid tokens only
      (`blocks_in_use`), and its
      sequences, 2..max_rows + 1 (every running request and an empty one: `base.packed_prefill_args`); and
      the MTP step's tokens.
    No dynamic dimension starts at 1: Inductor compiles a dynamic size for 2 and up (a size of 1 would be
    a different program), and after the compile workers' save / load a range of [1, 2] is compiled as the
    constant 2. A range that would hold one size only stays static."""
    max_blocks = inputs.block_tables.shape[1]
    blocks = torch.export.Dim("num_kv_blocks", min=2)
    wide = max_blocks > MIN_TABLE_BLOCKS
    width = torch.export.Dim("blocks_per_row", min=MIN_TABLE_BLOCKS, max=max_blocks) if wide else None
    batched = step in BATCHED_STEPS and max_rows > MIN_BATCH_ROWS
    batch = torch.export.Dim("batch", min=MIN_BATCH_ROWS, max=max_rows) if batched else None
    # The MTP step runs a prefill chunk's positions, a verify step's, or (padded) one per row.
    packed = step == "prefill_chunk" and shapes.any_prefill_tokens
    many_tokens = step in MTP_STEPS or packed
    max_tokens = inputs.cos.shape[1] + (max_rows if packed and shapes.decode_rows_in_prefill else 0)
    tokens = torch.export.Dim("tokens", min=MIN_PREFILL_TOKENS, max=max_tokens) if many_tokens else None
    rows = _dynamic({0: batch, 1: tokens})
    dims = {
        "hidden": rows,
        "embeds": rows,
        "num_valid": _dynamic({0: batch}),
        "cos": rows,
        "sin": rows,
        "write_slots": rows,
        "valid": rows,
        "block_tables": _dynamic({0: batch, 1: width}),
        "positions": rows,
        "key_cache": {1: blocks},
        "value_cache": {1: blocks},
        "slots": _dynamic({0: batch}),
    }
    if packed:  # per sequence instead of per row
        many = max_rows + 1 > MIN_PACKED_SEQUENCES
        sequences = None
        if many:
            sequences = torch.export.Dim("sequences", min=MIN_PACKED_SEQUENCES, max=max_rows + 1)
        per_sequence = _dynamic({0: sequences})
        dims.update(
            block_tables=_dynamic({0: sequences, 1: width}),
            slots=per_sequence,
            cu_seqlens=_dynamic({0: sequences + 1 if many else None}),
            conv_heads=per_sequence,
            conv_taps=per_sequence,
            conv_tail=per_sequence,
            head=per_sequence,
        )
    return dims


def _dynamic(dims: dict[int, Any]) -> dict[int, Any] | None:
    """A dynamic_shapes entry without its static (None) dimensions; None when all are static."""
    return {axis: dim for axis, dim in dims.items() if dim is not None} or None


def _traced_as(step: str, region: str, shapes: StepShapes) -> str:
    """The step whose linear layers' tracing a region takes: prefill's head computes one row as decode_row
    does, or (packed) a few rows as decode_step does."""
    if (step, region) != ("prefill_chunk", HEAD):
        return step
    return "decode_step" if shapes.any_prefill_tokens else "decode_row"


def export_step(
    model: Qwen36ForCausalLM,
    step: str,
    step_args: tuple[torch.Tensor, ...],
    out_dir: Path,
    tracing_mode_of: Callable[[str], TorchFunctionMode | None] = lambda step: None,
    shapes: StepShapes = StepShapes(),
) -> Iterator[tuple[torch.export.ExportedProgram, Path]]:
    """Export the regions of `step` with its example arguments, one at a time, each with its package path
    out_dir/<step>.<region>.pt2 (see `compile_regions`; `_dims` for `shapes`). Prefill's head, one row, is
    traced as decode_row's would be (its linears as one-row products)."""
    if step in MTP_STEPS:
        regions = [_mtp_region_args(model, step, step_args)]
    else:
        regions = _layer_and_head_region_args(model, step, step_args, shapes)
    for region, module, args, dynamic in regions:
        start = time.perf_counter()
        mode = tracing_mode_of(_traced_as(step, region, shapes))
        program = export_method(module, "forward", args, dynamic_shapes=dynamic, tracing_mode=mode)
        logger.info("Exported %s in %.1f s", region_file(step, region), time.perf_counter() - start)
        yield program, out_dir / region_file(step, region)


def compile_regions(
    model: Qwen36ForCausalLM,
    steps: Mapping[str, tuple[torch.Tensor, ...]],
    out_dir: Path,
    tracing_mode_of: Callable[[str], TorchFunctionMode | None],
    shapes: StepShapes,
) -> dict[str, torch.Tensor]:
    """Export and compile the regions of each step (name -> example arguments) into out_dir, each step
    traced within `tracing_mode_of(step)`. The graphs compile side by side as they are exported
    (`compile_workers.CompilePool`). Returns the tensors the traced code made itself that must be bound at
    load, as "<file>/<name>"."""
    files = {file for step in steps for file in step_files(model, step, shapes)}
    paths: list[Path] = []
    with CompilePool(default_workers(len(files)), total=len(files)) as pool:
        for step, args in steps.items():
            exported = export_step(model, step, args, out_dir, tracing_mode_of, shapes)
            for program, path in exported:
                pool.submit(program, path)
                paths.append(path)
        bound = pool.finish()
    return {
        f"{path.name}/{name}": t.contiguous()
        for path, constants in zip(paths, bound, strict=True)
        for name, t in constants.items()
    }


def _layer_and_head_region_args(
    model: Qwen36ForCausalLM, step: str, step_args: tuple[torch.Tensor, ...], shapes: StepShapes
) -> list[tuple[str, nn.Module, tuple[torch.Tensor, ...], list[Any]]]:
    with torch.no_grad():
        hidden, inputs = getattr(model, INPUTS_OF[step])(*step_args)
    # A batched step's rows; a prefill step's sequences are the running requests (one per row slot).
    rows = inputs.conv_state.shape[1] - 1 - shapes.prefill_snapshots
    max_rows = rows if step == "prefill_chunk" else step_args[0].shape[0]
    dims = _dims(step, inputs, max_rows=max_rows, shapes=shapes)
    regions: list[tuple[str, nn.Module, tuple[torch.Tensor, ...], list[Any]]] = []
    for kind in layer_kinds(model):
        fields = layer_fields(kind.layer_type, step, shapes)
        tail = layer_arguments(model.model.layers[kind.layers[0]], kind, hidden.device)
        args = (hidden, *(getattr(inputs, field) for field in fields), *tail)
        dynamic = [dims["hidden"], *(dims.get(field) for field in fields), *[None] * len(tail)]
        regions.append((kind.name, layer_region(model, kind, step, shapes), args, dynamic))
    if step in HEAD_FUNCTION_OF and head_step(step, shapes) == step:
        head_hidden, head_dim = hidden, dims["hidden"]
        if step == "prefill_chunk":  # each sequence's last valid token
            head_hidden, head_dim = model.last_valid(hidden, inputs), dims.get("head")
        head_args = (head_hidden, *model_weights(model, HEAD_WEIGHTS))
        regions.append((HEAD, head_region(model, step), head_args, [head_dim, None, None]))
    return regions


def _mtp_region_args(
    model: Qwen36ForCausalLM, step: str, step_args: tuple[torch.Tensor, ...]
) -> tuple[str, nn.Module, tuple[torch.Tensor, ...], list[Any]]:
    input_ids, hidden, start_pos, num_valid, block_tables, key_cache, value_cache = step_args
    with torch.no_grad():
        embeds, inputs = model.mtp_inputs(
            input_ids, start_pos, num_valid, block_tables, key_cache, value_cache
        )
    dims = _dims(step, inputs, max_rows=input_ids.shape[0], shapes=StepShapes())
    fields = LAYER_FIELDS["full_attention"]
    names = mtp_tensor_names(model)
    args = (embeds, hidden, num_valid, *(getattr(inputs, f) for f in fields), *model_weights(model, names))
    dynamic = [
        dims["embeds"],
        dims["hidden"],
        dims["num_valid"],
        *(dims.get(f) for f in fields),
        *[None] * len(names),
    ]
    return MTP, mtp_region(model), args, dynamic
