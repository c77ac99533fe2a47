"""How a model is cut into compiled regions (backends/regions.py): one graph per distinct layer kind.

The compiled regions themselves are checked against eager and transformers wherever a cpu model is
exported (test_export_cpu.py, test_export_configs.py, test_fp8.py)."""

from __future__ import annotations

import torch
from conftest import tiny_text_config

from optimum_qwen36.backends.regions import StepShapes, layer_kinds, step_files
from optimum_qwen36.network.model import Qwen36ForCausalLM
from optimum_qwen36.network.quantization import Fp8Quantization, replace_with_fp8_linears

LINEAR, FULL = "linear_attention", "full_attention"


def tiny_model(**overrides: object) -> Qwen36ForCausalLM:
    with torch.device("meta"):
        return Qwen36ForCausalLM(tiny_text_config(**overrides))


def test_layers_of_one_type_share_one_region() -> None:
    model = tiny_model(num_hidden_layers=6, layer_types=[LINEAR, FULL, LINEAR, LINEAR, LINEAR, FULL])
    kinds = layer_kinds(model)
    assert [(kind.name, kind.layers) for kind in kinds] == [(LINEAR, (0, 2, 3, 4)), (FULL, (1, 5))]
    for packed in (False, True):
        shapes = StepShapes(any_prefill_tokens=packed)
        assert step_files(model, "prefill_chunk", shapes) == [
            f"prefill_chunk.{LINEAR}.pt2",
            f"prefill_chunk.{FULL}.pt2",
            "prefill_chunk.head.pt2",
        ]
        assert step_files(model, "decode_step", shapes)[-1] == "decode_step.head.pt2"
    # decode_row (a batch of one row) runs the one-sequence prefill's one-row head, not a packed one's
    assert step_files(model, "decode_row", StepShapes())[-1] == "prefill_chunk.head.pt2"
    assert step_files(model, "decode_row", StepShapes(any_prefill_tokens=True))[-1] == "decode_row.head.pt2"
    gdn = kinds[0].tensor_names
    assert "linear_attn.in_proj_qkv.weight" in gdn and "mlp.down_proj.weight" in gdn
    assert not any(name.startswith("self_attn.") for name in gdn)


def test_a_layer_built_differently_gets_its_own_region() -> None:
    """An FP8 checkpoint that keeps one layer's MLP unquantized: that layer computes something else."""
    model = tiny_model(num_hidden_layers=4)  # GDN, GDN, GDN, attention
    mlp = ("gate_proj", "up_proj", "down_proj")
    quantized = [f"model.layers.{i}.mlp.{p}" for i in (0, 2, 3) for p in mlp]
    replace_with_fp8_linears(model, Fp8Quantization(tuple(quantized), block_size=(32, 32)))
    kinds = layer_kinds(model)
    assert [(kind.name, kind.layers) for kind in kinds] == [
        (LINEAR, (0, 2)),
        (f"{LINEAR}-2", (1,)),
        (FULL, (3,)),
    ]
    assert "mlp.down_proj.weight_scale_inv" in kinds[0].tensor_names
    assert "mlp.down_proj.weight_scale_inv" not in kinds[1].tensor_names
