"""Compile a module's method to an AOTInductor package (`.pt2`) whose weights are bound at load.

The weights are NOT compiled into the package (`aot_inductor.package_constants_in_so=False`): they stay in
safetensors files and are bound to the loaded runner (backends/compiled_graph.py), so one set of weight
tensors serves every graph of a model (prefill and decode), and the `.pt2` holds only code (about 2 MB for
the tiny test model).

Cache tensors are ordinary graph inputs that the graph mutates. Inductor writes such a mutation in place only
when the functional graph updates the input with `index_put` chains on the *whole* tensor; a mutation through
a view (`cache[layer].index_copy_`, `cache.view(...)[i] = x`) becomes "copy the viewed slice, scatter, copy
it back" on every call. `compile_method` checks this and refuses such graphs (see docs/EXPORT.md).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..backends.compiled_graph import unwrapped

logger = logging.getLogger(__name__)

# `freezing` folds weights into derived
# constants (`_frozen_param*`) that can no longer be bound from the safetensors and gave no measurable
# speed-up; max-autotune multiplies compile time. Plain Inductor with external weights is the default.
# `always_keep_tensor_constants`: without it Inductor writes the *values* of 0-d and short 1-d weights
# (`A_log`, `dt_bias` with <= 8 value heads) into the generated code, and a graph compiled for one
# checkpoint silently computes with that checkpoint's values when another one's weights are bound.
DEFAULT_INDUCTOR_CONFIGS: dict[str, Any] = {
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": None,
    "always_keep_tensor_constants": True,
    "max_autotune": False,
    "freezing": False,
}

_INPLACE_WRITE_OPS = (torch.ops.aten.index_put.default, torch.ops.aten._unsafe_index_put.default)


class _MethodAsForward(nn.Module):
    """`torch.export` traces `forward`; this makes `model.<method>` the forward of a thin wrapper (so the
    graph's constants are named "model.<name>": `compiled_graph.WRAPPED_PREFIX`)."""

    def __init__(self, model: nn.Module, method: str) -> None:
        super().__init__()
        self.model = model
        self.method = method

    def forward(self, *args: torch.Tensor) -> Any:
        return getattr(self.model, self.method)(*args)


class CopyingMutationError(ValueError):
    """A graph would copy a whole mutated input on every call instead of updating it in place."""


class BakedInTensorError(ValueError):
    """A compiled graph holds the values of some of its weights instead of taking them at load."""


def _custom_op_written_base(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor a mutating custom op (e.g. optimum_qwen36::gdn_decode_step) writes whole, if `node` is its
    new value: auto_functionalized_v2's outputs are the op's returns, then one per mutated base. A mutated
    view carries _<arg>_size / _stride / _storage_offset and is not a whole-tensor write."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    functional, index = node.args
    if getattr(functional, "target", None) is not torch.ops.higher_order.auto_functionalized_v2:
        return None
    if any(key.endswith(("_size", "_stride", "_storage_offset")) for key in functional.kwargs):
        return None
    # A custom op that returns nothing still has one (None) output before its bases.
    base = index - max(1, len(functional.args[0]._schema.returns))
    return functional.kwargs["_all_bases"][base] if base >= 0 else None


def copied_mutations(program: torch.export.ExportedProgram) -> dict[int, str]:
    """Positions of the mutated user inputs whose update is not a chain of whole-tensor writes (index_put,
    a mutating custom op on the whole tensor), with the op producing their new value. Those are written back
    by copying (Inductor re-inplaces the others)."""
    functional = program.run_decompositions({})
    placeholders = {node.name: node for node in functional.graph.nodes if node.op == "placeholder"}
    signature = functional.graph_signature
    offenders = {}
    positions = {name: i for i, name in enumerate(signature.user_inputs)}
    for output_name, input_name in signature.user_inputs_to_mutate.items():
        node = next(n for n in functional.graph.nodes if n.name == output_name)
        while True:
            if node.op == "call_function" and node.target in _INPLACE_WRITE_OPS:
                node = node.args[0]
            elif (base := _custom_op_written_base(node)) is not None:
                node = base
            else:
                break
        if node is not placeholders.get(input_name):
            offenders[positions[input_name]] = str(node.target)
    return offenders


def compile_method(
    model: nn.Module,
    method: str,
    example_args: Sequence[torch.Tensor],
    package_path: str | os.PathLike,
    *,
    inductor_configs: Mapping[str, Any] | None = None,
    allow_copying_mutations: bool = False,
    dynamic_shapes: Sequence[Any] | None = None,
    tracing_mode: TorchFunctionMode | None = None,
) -> dict[str, torch.Tensor]:
    """Export `model.<method>(*example_args)` and compile it to `package_path` (.pt2): `export_method`, then
    `package_program`, then `bound_constants`."""
    start = time.perf_counter()
    program = export_method(
        model,
        method,
        example_args,
        allow_copying_mutations=allow_copying_mutations,
        dynamic_shapes=dynamic_shapes,
        tracing_mode=tracing_mode,
    )
    package_program(program, package_path, inductor_configs)
    logger.info(
        "Compiled %s.%s to %s in %.1f s",
        type(model).__name__,
        method,
        package_path,
        time.perf_counter() - start,
    )
    return bound_constants(program, package_path)


def export_method(
    model: nn.Module,
    method: str,
    example_args: Sequence[torch.Tensor],
    *,
    allow_copying_mutations: bool = False,
    dynamic_shapes: Sequence[Any] | None = None,
    tracing_mode: TorchFunctionMode | None = None,
) -> torch.export.ExportedProgram:
    """`torch.export` of `model.<method>(*example_args)`. Shapes are static except where `dynamic_shapes`
    (one entry per argument, as for `torch.export`) says otherwise; the method is traced within
    `tracing_mode` if one is given (e.g. `matvec.DecodeLinears`).

    Raises CopyingMutationError if an input mutation would copy the whole input."""
    with torch.no_grad(), tracing_mode or contextlib.nullcontext():
        program = torch.export.export(
            _MethodAsForward(model, method),
            tuple(example_args),
            # The wrapper's forward takes *args: its one input is the tuple of arguments.
            dynamic_shapes=None if dynamic_shapes is None else (tuple(dynamic_shapes),),
            strict=False,
        )
    offenders = copied_mutations(program)
    if offenders and not allow_copying_mutations:
        params = list(inspect.signature(getattr(model, method)).parameters)
        names = ", ".join(
            f"{params[i] if i < len(params) else f'input {i}'} (written by {op})"
            for i, op in sorted(offenders.items())
        )
        raise CopyingMutationError(
            f"{type(model).__name__}.{method} mutates inputs through views: {names}. The compiled graph "
            "would copy each of them whole on every call. Write cache updates as one index_put_ on the "
            "whole tensor, e.g. cache.index_put_((layer_index, block, offset), values), not "
            "cache[layer].index_copy_(...)."
        )
    return program


def package_program(
    program: torch.export.ExportedProgram,
    package_path: str | os.PathLike,
    inductor_configs: Mapping[str, Any] | None = None,
) -> None:
    """AOTInductor-compile `program` to `package_path` (.pt2), with DEFAULT_INDUCTOR_CONFIGS under
    `inductor_configs`."""
    configs = {**DEFAULT_INDUCTOR_CONFIGS, **(inductor_configs or {})}
    Path(package_path).parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch._inductor.aoti_compile_and_package(
            program, package_path=str(package_path), inductor_configs=configs
        )


def bound_constants(
    program: torch.export.ExportedProgram, package_path: str | os.PathLike
) -> dict[str, torch.Tensor]:
    """The tensors the package compiled from `program` expects to be bound at load (weights, buffers,
    lifted constants), by the model's own names. Raises BakedInTensorError if the package holds the values
    of some parameter or buffer instead."""
    tensors = {**program.state_dict, **program.constants}
    # Parameters and buffers must be bound at load; constants the traced code made itself may be inlined.
    signature = program.graph_signature
    bindable = set(torch._inductor.aoti_load_package(str(package_path)).get_constant_fqns())
    # A tied weight is bound under one of its names.
    bound_tensors = {id(tensors[name]) for name in bindable if name in tensors}
    baked_in = sorted(
        unwrapped(name)
        for name in (*signature.parameters, *signature.buffers)
        if name not in bindable and id(tensors[name]) not in bound_tensors
    )
    if baked_in:
        raise BakedInTensorError(
            f"The compiled graph {package_path} holds the values of {baked_in[:8]} instead of taking them "
            "at load: it would compute with these values for any checkpoint. Compile with inductor config "
            "always_keep_tensor_constants=True."
        )
    return {unwrapped(name): t.detach() for name, t in tensors.items() if isinstance(t, torch.Tensor)}
