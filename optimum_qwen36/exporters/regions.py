"""Regional compilation: a step runs as one graph per distinct decoder-layer kind, called once per layer.

Compiling a whole-model step makes Inductor generate (and the C++ compiler build) every layer again, so
export time grows with the layer count. All GDN layers of a Qwen3.5/3.6 model compute the same function of
different weights, and so do all attention layers. So each step (`prefill_chunk`, `decode_row`,
`decode_step`) is cut where the model's code is:

- its inputs (embedding, rotary tables, cache slots, mask: `model.prefill_inputs` / `model.decode_inputs`),
  run eagerly: a few small ops;
- one graph per layer kind, whose inputs include the layer's weights and cache index, so one compiled graph
  serves every layer of its kind; the caches are updated in place as in a whole-model graph;
- the head (final norm, lm_head: `model.decode_logits`). A prefill chunk's logits are those of each
  sequence's last valid token (`model.last_valid`, eager): prefill's head graph takes those rows. Where the
  prefill graphs take one sequence (static shapes), that is one row, and decode_row (a batch-1 export's
  decode) runs the same graph (`head_step`); packed prefill graphs (`StepShapes.any_prefill_tokens`) take
  2..batch + 1 sequences and have a head of their own.

With MTP speculative decoding, `verify_step` is cut the same way (its GDN layers also write the speculative
state tensors; its head, `model.verify_logits`, gives every position's logits and normed hidden state), and
`mtp_step` is one graph: the MTP layer and the lm_head at each row's last position (`model.mtp_output`),
after its eager inputs (`model.mtp_inputs`), taking 2..chunk positions (a single one is padded). As for
decode, one row has its own graphs (`verify_row`, `mtp_row`) and 2..batch rows theirs.

Layers are of one kind when their type, modules and tensor shapes / dtypes agree (an FP8 checkpoint that
keeps some layer's MLP unquantized gives that layer a kind of its own).
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

from ..network.model import Qwen36DecoderLayer, Qwen36ForCausalLM, StepInputs
from .aoti import CompiledGraph, export_method
from .base import MIN_BATCH_ROWS, MIN_PACKED_SEQUENCES, MIN_PREFILL_TOKENS, MIN_TABLE_BLOCKS
from .compile_workers import CompilePool, default_workers

logger = logging.getLogger(__name__)

# The StepInputs fields each mixer reads (the others are None in its graph); decode steps have no
# valid / num_valid.
LAYER_FIELDS = {
    "full_attention": ("cos", "sin", "write_slots", "block_tables", "positions", "key_cache", "value_cache"),
    "linear_attention": ("slots", "valid", "num_valid", "conv_state", "recurrent_state"),
}
PREFILL_ONLY_FIELDS = ("valid", "num_valid")
# A packed prefill step's layers read where its sequences start instead of which tokens are valid.
PACKED_FIELDS = {
    "full_attention": ("cu_seqlens",),
    "linear_attention": ("cu_seqlens", "conv_heads", "conv_taps", "conv_tail"),
}
SNAPSHOT_FIELDS = ("snapshot_ends", "snapshot_slots", "snapshot_tail")
VERIFY_FIELDS = ("spec_conv_state", "spec_recurrent_state")
HEAD = "head"
HEAD_WEIGHTS = ("model.norm.weight", "lm_head.weight")
# The steps with a head graph of their own, and what it computes (prefill's: the logits of its last valid
# token, one row).
HEAD_FUNCTION_OF = {
    "prefill_chunk": "decode_logits",
    "decode_row": "decode_logits",
    "decode_step": "decode_logits",
    "verify_row": "verify_logits",
    "verify_step": "verify_logits",
}
INPUTS_OF = {
    "prefill_chunk": "prefill_inputs",
    "decode_row": "decode_inputs",
    "decode_step": "decode_inputs",
    "verify_row": "verify_inputs",
    "verify_step": "verify_inputs",
}
VERIFY_STEPS = ("verify_row", "verify_step")
MTP_STEPS, MTP = ("mtp_row", "mtp_step"), "mtp"
# Steps of 2..batch rows (one row runs the *_row step).
BATCHED_STEPS = ("decode_step", "verify_step", "mtp_step")


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """What the graphs take beyond their example shapes. `any_prefill_tokens`: the prefill graphs take
    2..chunk tokens of 2..batch + 1 sequences packed one after the other (`_dims`; a caller with one
    sequence adds an empty one, `base.packed_prefill_args`). `decode_rows_in_prefill`: and up to batch
    tokens more, so a step's decode rows (one-token sequences) ride along beside a whole chunk.
    `prefill_snapshots`: and that many GDN state snapshots inside its sequences (`StepInputs`; always
    passed, `base.no_snapshots` where fewer are wanted), the cache's snapshot slots."""

    any_prefill_tokens: bool = False
    decode_rows_in_prefill: bool = False
    prefill_snapshots: int = 0


def head_step(step: str, shapes: StepShapes) -> str:
    """Whose head graph `step` runs: decode_row's is the one-sequence prefill's, the same one-row program
    (compiled once: two processes compiling one program at once would race on Inductor's cache)."""
    return "prefill_chunk" if step == "decode_row" and not shapes.any_prefill_tokens else step


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """Layers that one compiled graph serves: `name` (its region's name), their indices, and the names of
    the tensors each of them passes to the graph (in the graph's argument order)."""

    name: str
    layer_type: str
    layers: tuple[int, ...]
    tensor_names: tuple[str, ...]


def layer_tensors(layer: nn.Module) -> dict[str, torch.Tensor]:
    tensors = dict(layer.named_parameters())
    tensors.update(layer.named_buffers())
    return {name: t.detach() for name, t in tensors.items()}


def layer_arguments(
    layer: Qwen36DecoderLayer, kind: LayerKind, device: torch.device | str
) -> list[torch.Tensor]:
    """The trailing arguments of a layer's call to its kind's graph: its cache index, then its tensors."""
    tensors = layer_tensors(layer)
    cache_idx = torch.tensor([layer.cache_idx], device=device)
    return [cache_idx, *(tensors[name] for name in kind.tensor_names)]


def model_weights(model: Qwen36ForCausalLM, names: Sequence[str]) -> list[torch.Tensor]:
    """The model's tensors of these names (tied weights under each of their names)."""
    own = dict(model.named_parameters(remove_duplicate=False))
    return [own[name].detach() for name in names]


def layer_kinds(model: Qwen36ForCausalLM) -> list[LayerKind]:
    """The model's layers grouped by what they compute: type, module structure, tensor shapes and dtypes."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for index, layer in enumerate(model.model.layers):
        tensors = layer_tensors(layer)
        signature = (
            layer.layer_type,
            repr(layer),
            tuple((name, tuple(t.shape), t.dtype) for name, t in tensors.items()),
        )
        groups.setdefault(signature, []).append(index)
    kinds, count = [], {}
    for (layer_type, _, tensors), layers in groups.items():
        count[layer_type] = count.get(layer_type, 0) + 1
        name = layer_type if count[layer_type] == 1 else f"{layer_type}-{count[layer_type]}"
        kinds.append(LayerKind(name, layer_type, tuple(layers), tuple(name for name, _, _ in tensors)))
    return kinds


def region_file(step: str, region: str) -> str:
    """The package of one region of one step, e.g. `decode_row.linear_attention.pt2`."""
    return f"{step}.{region}.pt2"


def step_files(model: Qwen36ForCausalLM, step: str, shapes: StepShapes) -> list[str]:
    """The packages a step runs: its layer kinds' and its head's (or its MTP graph)."""
    if step in MTP_STEPS:
        return [region_file(step, MTP)]
    layers = [region_file(step, kind.name) for kind in layer_kinds(model)]
    return [*layers, region_file(head_step(step, shapes), HEAD)]


def layer_fields(layer_type: str, step: str, shapes: StepShapes) -> tuple[str, ...]:
    fields = LAYER_FIELDS[layer_type]
    if step == "prefill_chunk" and not shapes.any_prefill_tokens:
        return fields
    fields = tuple(f for f in fields if f not in PREFILL_ONLY_FIELDS)
    if step == "prefill_chunk":
        snapshots = SNAPSHOT_FIELDS if shapes.prefill_snapshots and layer_type == "linear_attention" else ()
        return fields + PACKED_FIELDS[layer_type] + snapshots
    return fields + VERIFY_FIELDS if step in VERIFY_STEPS and layer_type == "linear_attention" else fields


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


def mtp_tensor_names(model: Qwen36ForCausalLM) -> tuple[str, ...]:
    """The tensors the MTP graph takes: the MTP layer's and the lm_head's."""
    return (*(f"mtp.{name}" for name in layer_tensors(model.mtp)), "lm_head.weight")


def mtp_region(model: Qwen36ForCausalLM) -> nn.Module:
    """A module running the MTP layer and lm_head: arguments (embeds, hidden, num_valid, *attention fields,
    *mtp_tensor_names)."""
    fields = LAYER_FIELDS["full_attention"]

    def run(embeds: torch.Tensor, hidden: torch.Tensor, num_valid: torch.Tensor, *args: torch.Tensor):
        given = dict(zip(fields, args, strict=True))
        step_inputs = StepInputs(**{f.name: given.get(f.name) for f in dataclasses.fields(StepInputs)})
        return model.mtp_output(embeds, hidden, num_valid, step_inputs)

    return _TensorsAsInputs(model, run, mtp_tensor_names(model))


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor viewed with row-major strides on every dimension: a graph may give a size-1
    dimension of its output any stride, and the next graph's input check (`aoti.CompiledGraph`) compares
    strides as compiled."""
    strides, step = [], 1
    for size in reversed(tensor.shape):
        strides.append(step)
        step *= size
    return tensor.as_strided(tensor.shape, strides[::-1]) if tensor.is_contiguous() else tensor.contiguous()


class RegionalStep:
    """One step of the model run as its regions: the inputs eagerly, then each layer's graph with that
    layer's tensors, then the head. Called with the step's arguments, as the whole-model method would be."""

    def __init__(
        self,
        model: Qwen36ForCausalLM,
        step: str,
        layer_graphs: dict[str, CompiledGraph],
        head_graph: CompiledGraph,
        device: str,
        shapes: StepShapes,
    ) -> None:
        self.step = step
        self._inputs = getattr(model, INPUTS_OF[step])
        self._last_valid = model.last_valid if step == "prefill_chunk" else None
        self.layer_graphs = layer_graphs
        self.head_graph = head_graph
        kind_of = {index: kind for kind in layer_kinds(model) for index in kind.layers}
        # Per layer, in order: its graph, the StepInputs fields it reads, and its trailing arguments.
        self._layers: list[tuple[CompiledGraph, tuple[str, ...], list[torch.Tensor]]] = []
        for index, layer in enumerate(model.model.layers):
            kind = kind_of[index]
            tail = layer_arguments(layer, kind, device)
            self._layers.append((layer_graphs[kind.name], layer_fields(kind.layer_type, step, shapes), tail))
        self._head_weights = model_weights(model, HEAD_WEIGHTS)

    @torch.no_grad()
    def __call__(self, *args: torch.Tensor) -> Any:
        hidden, inputs = self.decoder_output(*args)
        if self._last_valid is not None:
            hidden = self._last_valid(hidden, inputs)
        return self.head(hidden)

    @torch.no_grad()
    def decoder_output(self, *args: torch.Tensor) -> tuple[torch.Tensor, StepInputs]:
        """The last layer's output for the step's arguments, and the step's inputs."""
        hidden, inputs = self._inputs(*args)
        for graph, fields, tail in self._layers:
            hidden = graph(dense(hidden), *(getattr(inputs, field) for field in fields), *tail)
        return hidden, inputs

    def head(self, hidden: torch.Tensor) -> Any:
        out = self.head_graph(dense(hidden), *self._head_weights)
        return tuple(out) if isinstance(out, list) else out


class MTPStep:
    """`model.mtp_step` run as its eager inputs and one graph (the MTP layer and the lm_head)."""

    def __init__(self, model: Qwen36ForCausalLM, graph: CompiledGraph) -> None:
        self._inputs = model.mtp_inputs
        self.graph = graph
        self._tensors = model_weights(model, mtp_tensor_names(model))

    @torch.no_grad()
    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`model.mtp_step`'s arguments: input_ids, hidden, start_pos, num_valid, block_tables, caches."""
        input_ids, hidden, start_pos, num_valid, *tables_and_caches = args
        embeds, inputs = self._inputs(input_ids, start_pos, num_valid, *tables_and_caches)
        fields = (getattr(inputs, field) for field in LAYER_FIELDS["full_attention"])
        return tuple(self.graph(embeds, hidden, num_valid, *fields, *self._tensors))


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


def load_step(
    model: Qwen36ForCausalLM,
    step: str,
    load: Callable[[str], CompiledGraph],
    device: str,
    shapes: StepShapes,
) -> RegionalStep | MTPStep:
    """The step's region graphs (compiled for `shapes`), each loaded by `load(file name)`, bound to `model`
    (on `device`)."""
    if step in MTP_STEPS:
        return MTPStep(model, load(region_file(step, MTP)))
    layer_graphs = {kind.name: load(region_file(step, kind.name)) for kind in layer_kinds(model)}
    head = load(region_file(head_step(step, shapes), HEAD))
    return RegionalStep(model, step, layer_graphs, head, device, shapes)
