"""A step as regions, and running it as them: a step runs as one graph per distinct decoder-layer kind,
called once per layer (exporters/regions.py compiles them).

All GDN layers of a Qwen3.5/3.6 model compute the same function of different weights, and so do all
attention layers. So each step (`prefill_chunk`, `decode_row`, `decode_step`) is cut where the model's
code is:

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
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..network.model import Qwen36DecoderLayer, Qwen36ForCausalLM, StepInputs
from .compiled_graph import CompiledGraph

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
# What computes each step's inputs (the eager part before its layers).
INPUTS_OF = {
    "prefill_chunk": "prefill_inputs",
    "decode_row": "decode_inputs",
    "decode_step": "decode_inputs",
    "verify_row": "verify_inputs",
    "verify_step": "verify_inputs",
}
VERIFY_STEPS = ("verify_row", "verify_step")
MTP_STEPS, MTP = ("mtp_row", "mtp_step"), "mtp"


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """What the graphs take beyond their example shapes. `any_prefill_tokens`: the prefill graphs take
    2..chunk tokens of 2..batch + 1 sequences packed one after the other (`exporters/regions._dims`; a
    caller with one sequence adds an empty one, `base.packed_prefill_args`). `decode_rows_in_prefill`: and
    up to batch tokens more, so a step's decode rows (one-token sequences) ride along beside a whole chunk.
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


def mtp_tensor_names(model: Qwen36ForCausalLM) -> tuple[str, ...]:
    """The tensors the MTP graph takes: the MTP layer's and the lm_head's."""
    return (*(f"mtp.{name}" for name in layer_tensors(model.mtp)), "lm_head.weight")


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor viewed with row-major strides on every dimension: a graph may give a size-1
    dimension of its output any stride, and the next graph's input check (`CompiledGraph`) compares strides
    as compiled."""
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
    def __call__(self, *args: torch.Tensor, **images: torch.Tensor) -> Any:
        """`images`: the step's image keyword arguments (network/model.py), read by its eager inputs."""
        hidden, inputs = self.decoder_output(*args, **images)
        if self._last_valid is not None:
            hidden = self._last_valid(hidden, inputs)
        return self.head(hidden)

    @torch.no_grad()
    def decoder_output(self, *args: torch.Tensor, **images: torch.Tensor) -> tuple[torch.Tensor, StepInputs]:
        """The last layer's output for the step's arguments, and the step's inputs."""
        hidden, inputs = self._inputs(*args, **images)
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
