"""One-row decode graphs trace their linear layers as matrix-vector products (exporters/matvec.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.exporters.aoti import _MethodAsForward
from optimum_qwen36.exporters.backends import AOTIBackend, example_step_args
from optimum_qwen36.exporters.matvec import MatrixVectorLinears, matrix_vector_linear


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


def test_mode_rewrites_only_one_row_linears() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    one, two = torch.randn(1, 1, 16), torch.randn(2, 1, 16)
    with MatrixVectorLinears():
        one_out, two_out = layer(one), layer(two)
    assert torch.equal(one_out, matrix_vector_linear(one, layer.weight, layer.bias))
    assert torch.equal(two_out, F.linear(two, layer.weight, layer.bias))


def _linear_calls(program: torch.export.ExportedProgram) -> int:
    return sum(node.target is torch.ops.aten.linear.default for node in program.graph.nodes)


def test_one_row_decode_traces_no_linear(tiny_checkpoint) -> None:
    """decode_row, traced under the mode, has no linear left; the same step traced plainly has one per
    projection. (The exported graphs themselves are compared with eager in test_export_cpu.py.)"""
    checkpoint, _ = tiny_checkpoint()
    model = NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint, export=True, backend="eager", batch_size=2, sequence_length=64, prefill_chunk_size=16
    )
    args = example_step_args(model.neuron_config, model.new_cache())["decode_row"]
    assert args[0].shape == (1, 1)
    step = _MethodAsForward(model.model, "decode_step")
    with torch.no_grad():
        plain = torch.export.export(step, args, strict=False)
        with MatrixVectorLinears():
            rows = torch.export.export(step, args, strict=False)
    assert _linear_calls(plain) > 4 * model.config.num_hidden_layers
    assert _linear_calls(rows) == 0


def test_one_row_runs_decode_row_and_more_rows_decode_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from optimum_qwen36.exporters import backends

    monkeypatch.setattr(backends, "blocks_in_use", lambda method, args: args)
    backend = AOTIBackend.__new__(AOTIBackend)
    backend.device = "cpu"
    ran: list[tuple[str, int]] = []
    backend.graphs = {
        graph: lambda *args, graph=graph: ran.append((graph, args[0].shape[0])) or torch.zeros(1)
        for graph in ("prefill_chunk", "decode_row", "decode_step")
    }
    for rows in (1, 2):
        backend.decode_step(torch.zeros(rows, 1, dtype=torch.long), torch.zeros(rows, dtype=torch.long))
    assert ran == [("decode_row", 1), ("decode_step", 2)]


def test_a_compiled_directory_without_its_graphs_is_refused(tiny_checkpoint, tmp_path) -> None:
    checkpoint, _ = tiny_checkpoint()
    model = NeuronQwen36ForCausalLM.from_pretrained(checkpoint, export=True, backend="eager")
    (tmp_path / "decode_row.head.pt2").write_bytes(b"")
    message = (
        r"found: decode_row\.head\.pt2; needed: prefill_chunk\.linear_attention\.pt2, "
        r"prefill_chunk\.full_attention\.pt2, decode_row\.head\.pt2, decode_row\.linear_attention\.pt2, "
        r"decode_row\.full_attention\.pt2 and"
    )
    with pytest.raises(FileNotFoundError, match=message):
        AOTIBackend(tmp_path, model.model, "cpu")
