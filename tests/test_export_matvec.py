"""Decode graphs trace their linear layers as exporters/matvec.py says: the native bf16 kernel, or, on one
row, matrix-vector products."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import engine_storage
from torch import nn

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.backends.aoti import AOTIBackend
from optimum_qwen36.exporters.aoti import _MethodAsForward
from optimum_qwen36.exporters.compile_aoti import graphs_to_compile, linears_mode
from optimum_qwen36.exporters.example_args import example_step_args
from optimum_qwen36.exporters.matvec import (
    DecodeLinears,
    matrix_vector_linear,
    weight_major_linear,
    widened_linear,
)
from optimum_qwen36.network.neuron_config import Qwen36NeuronConfig
from optimum_qwen36.ops.native import bf16_linear_vectorized, load_native_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matrix_vector_linear_equals_linear(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 300, generator=generator).to(dtype)
    weight = torch.randn(70, 300, generator=generator).to(dtype)
    bias = torch.randn(70, generator=generator).to(dtype)
    exact = F.linear(x.double(), weight.double(), bias.double())
    # float32 accumulation, rounded once to the input dtype: as close to the float64 product as that rounding
    tolerance = 1e-5 if dtype == torch.float32 else 2**-8 * exact.abs().max().item()
    assert (matrix_vector_linear(x, weight, bias).double() - exact).abs().max() <= tolerance
    assert matrix_vector_linear(x, weight, None).dtype == dtype


def test_weight_major_linear_equals_linear() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 300, generator=generator)
    weight = torch.randn(70, 300, generator=generator)
    bias = torch.randn(70, generator=generator)
    for b in (None, bias):
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        got = weight_major_linear(x, weight, b)
        assert got.shape == (3, 2, 70) and got.dtype == torch.float32
        assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max()


def test_mode_rewrites_one_row_and_float32_linears() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    bf16_layer = copy.deepcopy(layer).bfloat16()
    one, two = torch.randn(1, 1, 16), torch.randn(2, 1, 16)
    with DecodeLinears(native_bf16=False, static_rows=True):
        one_out, two_out, bf16_out = layer(one), layer(two), bf16_layer(two.bfloat16())
    assert torch.equal(one_out, matrix_vector_linear(one, layer.weight, layer.bias))
    assert torch.equal(two_out, weight_major_linear(two, layer.weight, layer.bias))
    # bf16 without the native kernel: BLAS reads the weight once per row in either orientation
    assert torch.equal(bf16_out, F.linear(two.bfloat16(), bf16_layer.weight, bf16_layer.bias))


needs_native = pytest.mark.skipif(not load_native_ops(), reason="the native CPU kernels cannot be built here")


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 17, 40])
@pytest.mark.parametrize(
    "features",
    [
        *[(70, 300), (33, 1024), (9, 8), (9, 16), (9, 17), (1100, 1001), (13, 2048), (10, 2100)],
        *[(48, 96), (40, 2048), (16, 32)],  # AMX tiles
    ],
)
def test_bf16_linear_equals_float64_product(rows: int, features: tuple[int, int]) -> None:
    """Every row count (the streamed groups of 4 and their remainders, ATen's path above 16 rows: on AVX2
    the weight widened in tiles of 4 MB: 1100 rows of 1001 are two tiles) and feature counts below, at and
    past one vector (16 values with AVX2, 32 with AVX-512) and not multiples of it, and weights that go
    through AMX tiles (rows of a multiple of 32 values: 3 tiles of 16 weight rows, 2 tiles and 8 rows of
    dot products): float32 accumulation rounded once to bf16, so within one bf16 rounding of the float64
    product of the same bf16 values."""
    out_features, in_features = features
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16()
    for b in (None, bias):
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        got = torch.ops.optimum_qwen36.bf16_linear(x.view(rows, 1, in_features), weight, b)
        assert got.shape == (rows, 1, out_features) and got.dtype == torch.bfloat16
        error = (got.view(rows, out_features).double() - exact).abs()
        # one rounding to bf16 (2^-8 relative) plus float32 summation of the exact products
        assert (error <= exact.abs() * 2**-8 + 1e-4 * exact.abs().max()).all()


@needs_native
@pytest.mark.parametrize("features", [(70, 300), (13, 2048), (9, 2100), (40, 2048), (48, 96), (16, 32)])
def test_bf16_linear_rows_do_not_depend_on_the_batch(features: tuple[int, int]) -> None:
    """A row's output is bitwise the same alone and with up to 15 others (each streamed group of x rows,
    each block of weight rows and its remainder, short and long weight rows, AMX tiles of 16 weight rows
    and the rows past them): batch invariance of every decode and verify step rests on it."""
    out_features, in_features = features
    generator = torch.Generator().manual_seed(out_features)
    x = torch.randn(16, in_features, generator=generator).bfloat16()
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    alone = torch.cat([torch.ops.optimum_qwen36.bf16_linear(row[None], weight, None) for row in x])
    for rows in range(2, 17):
        assert torch.equal(torch.ops.optimum_qwen36.bf16_linear(x[:rows], weight, None), alone[:rows])


def test_tile_flags_only_where_the_compiler_assembles_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an AMX CPU the extension is built with the tile flags only where the compiler takes them: an old
    toolchain that rejects them must not cost every native op its build."""
    from optimum_qwen36.ops import native

    amx_cpu = {*native.VECTOR_FLAGS, *native.BF16_FLAGS, *native.TILE_FLAGS}
    monkeypatch.setattr(native, "cpu_flags", lambda: amx_cpu)
    monkeypatch.setattr(native, "compiles", lambda source, flags: True)
    assert set(native.TILE_FLAGS.values()) <= set(native.build_flags())
    monkeypatch.setattr(native, "compiles", lambda source, flags: False)
    flags = native.build_flags()
    assert not set(native.TILE_FLAGS.values()) & set(flags) and "-mavx512bf16" in flags
    assert not native.compiles("this is not C++", ())


@needs_native
@pytest.mark.parametrize("features", [(9, 17), (48, 96)])
def test_bf16_linear_of_no_rows(features: tuple[int, int]) -> None:
    """An empty x (no tile of zero columns is ever configured) gives an empty output of the right shape."""
    out_features, in_features = features
    weight = torch.ones(out_features, in_features, dtype=torch.bfloat16)
    x = torch.empty(0, in_features, dtype=torch.bfloat16)
    out = torch.ops.optimum_qwen36.bf16_linear(x, weight, None)
    assert out.shape == (0, out_features) and out.dtype == torch.bfloat16


@needs_native
def test_bf16_linear_of_a_non_contiguous_input() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=generator).bfloat16().t()  # [3, 64], strided
    weight = torch.randn(10, 64, generator=generator).bfloat16()
    expected = torch.ops.optimum_qwen36.bf16_linear(x.contiguous(), weight, None)
    assert torch.equal(torch.ops.optimum_qwen36.bf16_linear(x, weight, None), expected)


@pytest.mark.skipif(
    not bf16_linear_vectorized(), reason="bf16_linear has no vector path here: bf16 decode keeps F.linear"
)
def test_bf16_decode_traces_the_native_kernel(tiny_checkpoint) -> None:
    """Where bf16_linear has a vector path, the batched bf16 decode step calls the kernel for every
    projection (prefill's linears: test_bf16_prefill_without_bf16_matmul_multiplies_in_float32)."""
    checkpoint, _ = tiny_checkpoint()
    model = NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint, export=True, backend="eager", batch_size=2, sequence_length=64, dtype="bfloat16"
    )
    args = example_step_args(model.neuron_config, engine_storage(model))["decode_step"]
    step = _MethodAsForward(model.model, "decode_step")
    mode = linears_mode("decode_step", native_bf16=True, bf16_matmul=True)
    assert linears_mode("prefill_chunk", native_bf16=True, bf16_matmul=True) is None
    with torch.no_grad(), mode:
        program = torch.export.export(step, args, strict=False)
    assert _linear_calls(program) == 0
    assert _native_calls(program) > 4 * model.config.num_hidden_layers


def test_float32_batched_decode_multiplies_weight_major(tiny_checkpoint) -> None:
    """A float32 model's batched decode step has no F.linear left: each projection is weight @ x.T."""
    checkpoint, _ = tiny_checkpoint()
    model = NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint, export=True, backend="eager", batch_size=2, sequence_length=64, prefill_chunk_size=16
    )
    args = example_step_args(model.neuron_config, engine_storage(model))["decode_step"]
    step = _MethodAsForward(model.model, "decode_step")
    mode = linears_mode("decode_step", native_bf16=False, bf16_matmul=True)
    assert linears_mode("prefill_chunk", native_bf16=False, bf16_matmul=True) is None
    with torch.no_grad(), mode:
        program = torch.export.export(step, args, strict=False)
    matrix_products = sum(node.target is torch.ops.aten.mm.default for node in program.graph.nodes)
    assert _linear_calls(program) == 0
    assert matrix_products > 4 * model.config.num_hidden_layers


def _linear_calls(program: torch.export.ExportedProgram) -> int:
    return sum(node.target is torch.ops.aten.linear.default for node in program.graph.nodes)


def _native_calls(program: torch.export.ExportedProgram) -> int:
    kernel = torch.ops.optimum_qwen36.bf16_linear.default
    return sum(node.target is kernel for node in program.graph.nodes)


def test_one_row_decode_traces_no_linear(tiny_checkpoint) -> None:
    """decode_row, traced under the mode, has no linear left; the same step traced plainly has one per
    projection. (The exported graphs themselves are compared with eager in test_export_cpu.py.)"""
    checkpoint, _ = tiny_checkpoint()
    model = NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint, export=True, backend="eager", batch_size=2, sequence_length=64, prefill_chunk_size=16
    )
    args = example_step_args(model.neuron_config, engine_storage(model))["decode_row"]
    assert args[0].shape == (1, 1)
    step = _MethodAsForward(model.model, "decode_step")
    with torch.no_grad():
        plain = torch.export.export(step, args, strict=False)
        with DecodeLinears(native_bf16=False, static_rows=True):
            rows = torch.export.export(step, args, strict=False)
    assert _linear_calls(plain) > 4 * model.config.num_hidden_layers
    assert _linear_calls(rows) == 0


def test_bf16_prefill_without_bf16_matmul_multiplies_in_float32(tiny_checkpoint) -> None:
    """On a CPU without bf16 matrix instructions, prefill's bf16 linears are traced as float32 products of
    the widened values (ATen's bf16 product is several times slower there), through the native kernel where
    it builds; with them, as they are."""
    checkpoint, _ = tiny_checkpoint()
    model = NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint, export=True, backend="eager", sequence_length=64, prefill_chunk_size=16, dtype="bfloat16"
    )
    args = example_step_args(model.neuron_config, engine_storage(model))["prefill_chunk"]
    step = _MethodAsForward(model.model, "prefill_chunk")
    assert linears_mode("prefill_chunk", native_bf16=True, bf16_matmul=True) is None
    with torch.no_grad(), linears_mode("prefill_chunk", native_bf16=False, bf16_matmul=False):
        program = torch.export.export(step, args, strict=False)
    linears = [node for node in program.graph.nodes if node.target is torch.ops.aten.linear.default]
    assert len(linears) > 4 * model.config.num_hidden_layers
    assert all(node.args[1].meta["val"].dtype == torch.float32 for node in linears)
    if load_native_ops():  # the native kernel takes them, widening the weights itself
        with torch.no_grad(), linears_mode("prefill_chunk", native_bf16=True, bf16_matmul=False):
            program = torch.export.export(step, args, strict=False)
        assert _linear_calls(program) == 0
        assert _native_calls(program) > 4 * model.config.num_hidden_layers


def test_widened_linear_is_the_float32_product_rounded_once() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 300, generator=generator).bfloat16()
    weight = torch.randn(70, 300, generator=generator).bfloat16()
    bias = torch.randn(70, generator=generator).bfloat16()
    got = widened_linear(x, weight, bias)
    exact = F.linear(x.double(), weight.double(), bias.double())
    assert got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4 * exact.abs().max()).all()


@pytest.mark.parametrize("graphs", [("decode_row",), ("decode_step",)])
def test_decode_runs_the_compiled_step_and_refuses_too_few_rows(
    monkeypatch: pytest.MonkeyPatch, graphs: tuple[str, ...]
) -> None:
    from optimum_qwen36.backends import aoti

    monkeypatch.setattr(aoti, "blocks_in_use", lambda method, args, cut_tokens: args)
    backend = AOTIBackend.__new__(AOTIBackend)
    backend.packs_prefill = False
    backend.device = "cpu"
    backend.min_step_rows = 1 if "decode_row" in graphs else 2
    ran: list[tuple[str, int]] = []
    backend.graphs = {
        graph: lambda *args, graph=graph: ran.append((graph, args[0].shape[0])) or torch.zeros(1)
        for graph in ("prefill_chunk", *graphs)
    }

    def decode(rows: int) -> None:
        backend.decode_step(torch.zeros(rows, 1, dtype=torch.long), torch.zeros(rows, dtype=torch.long))

    if graphs == ("decode_row",):  # a batch of one row
        decode(1)
        assert ran == [("decode_row", 1)]
    else:
        with pytest.raises(ValueError, match="takes 2 rows or more, got 1: pad the call"):
            decode(1)
        decode(2)
        assert ran == [("decode_step", 2)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("batch_size", [1, 2, 4])
def test_one_decode_step_is_compiled(dtype: str, batch_size: int) -> None:
    """decode_row for a batch of one row, else decode_step alone (one row runs padded to two, so a row's
    decode does not depend on what else decodes with it)."""
    config = Qwen36NeuronConfig(backend="cpu", batch_size=batch_size, sequence_length=512, dtype=dtype)
    decode = {graph for graph in graphs_to_compile(config) if graph.startswith("decode")}
    assert decode == ({"decode_row"} if batch_size == 1 else {"decode_step"})


def test_a_compiled_directory_without_its_graphs_is_refused(tiny_checkpoint, tmp_path) -> None:
    checkpoint, _ = tiny_checkpoint()
    model = NeuronQwen36ForCausalLM.from_pretrained(checkpoint, export=True, backend="eager")
    (tmp_path / "decode_step.head.pt2").write_bytes(b"")
    message = (
        r"found: decode_step\.head\.pt2; needed: prefill_chunk\.linear_attention\.pt2, "
        r"prefill_chunk\.full_attention\.pt2, prefill_chunk\.head\.pt2, "
        r"decode_step\.linear_attention\.pt2, decode_step\.full_attention\.pt2, decode_step\.head\.pt2, "
        r"or the decode_row ones"
    )
    with pytest.raises(FileNotFoundError, match=message):
        AOTIBackend(tmp_path, model.model, "cpu")
