"""4-bit weights: GPTQ (v1 / v2, symmetric / asymmetric, group sizes 32 / 64 / 128 / per channel, desc_act),
AWQ GEMM and compressed-tensors pack-quantized checkpoints load and match transformers on the dequantized
weights (fp32 compute); compressed-tensors against transformers' own loader; bf16 / fp32 checkpoints are
quantized at export for the modules `int4_modules` names and saved as compressed-tensors, which
transformers loads; bad layouts fail with errors naming the field or tensor; the native kernel equals its
PyTorch twin and is batch-invariant.

The checkpoints are written by `int4_checkpoints.write_int4`, independent of the package's readers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import edit_config, export_eager, left_padded_prompts, rewrite_tensors
from int4_checkpoints import write_int4

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.network.int4 import Int4Linear
from optimum_qwen36.network.quantization import linear_module_names
from optimum_qwen36.ops.int4 import (
    BLOCK_HIGH,
    BLOCK_LOW,
    dequantize_int4,
    int4_linear,
    int4_linear_torch,
    kernel_group_size,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from optimum_qwen36.ops.native import load_native_ops

NEW_TOKENS = 24


def assert_matches(model, reference: torch.nn.Module, lengths: list[int] = [5, 16, 37]) -> None:  # noqa: B006
    """Same greedy tokens as the reference, fp32 logits within 1e-4 of the largest."""
    input_ids, mask = left_padded_prompts(lengths[: model.neuron_config.batch_size], seed=1)
    settings = dict(
        max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True, output_logits=True
    )
    ours = model.generate(input_ids, attention_mask=mask, **settings)
    theirs = reference.generate(input_ids, attention_mask=mask, pad_token_id=0, **settings)
    assert torch.equal(ours.sequences, theirs.sequences)
    for step, (a, b) in enumerate(zip(ours.logits, theirs.logits, strict=True)):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 1e-4 * scale, f"step {step}"


def int4_modules(model: NeuronQwen36ForCausalLM) -> dict[str, Int4Linear]:
    return {name: m for name, m in model.model.named_modules() if isinstance(m, Int4Linear)}


def dequantized(module: Int4Linear) -> torch.Tensor:
    """The module's weight in natural input order, float32."""
    weight = dequantize_int4(
        module.packed_weight,
        module.scales,
        module.zeros,
        module.group_size,
        module.in_features,
        torch.float32,
    )
    if module.input_order is None:
        return weight
    natural = torch.empty_like(weight)
    natural[:, module.input_order] = weight
    return natural


def expected_quantized(config, int4_modules_name: str = "linear") -> set[str]:
    return set(linear_module_names(config, int4_modules_name))


# ---------------------------------------------------------------------------------------------- layout


def test_packed_layout_puts_each_vector_in_natural_order() -> None:
    """Byte b of a 128-feature block: lane L = b // 16 holds features 8L..8L+7 and 32+8L.. (low nibbles of
    its first and second 8 bytes), 64+8L.. and 96+8L.. (high nibbles): the kernel's byte unpacks then give
    features 0-31, 32-63, 64-95, 96-127 in order."""
    lane, j = torch.arange(64) // 16, torch.arange(64) % 16
    assert torch.equal(BLOCK_LOW, torch.where(j < 8, 8 * lane + j, 32 + 8 * lane + (j - 8)))
    assert torch.equal(BLOCK_HIGH, BLOCK_LOW + 64)
    codes = torch.randint(0, 16, (5, 300), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (5, 192) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed, 300), codes)
    assert (unpack_int4(packed, 384)[:, 300:] == 0).all()  # the padded tail


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_quantize_round_trip(group_size: int) -> None:
    torch.manual_seed(0)
    weight = torch.randn(40, 300) * torch.logspace(-2, 1, 300)
    held = kernel_group_size(group_size, 300)
    packed, scales, zeros = quantize_int4(weight, held)
    back = dequantize_int4(packed, scales, zeros, held, 300, torch.float32)
    span = (weight.abs().amax() * 2).item() if group_size == -1 else None
    # Round to nearest: within half a step of each group's [min, max] / 15, plus the bf16 scale's rounding
    # (2^-9 of a step, over 15 steps).
    step = scales.float().repeat_interleave(held, 1)[:, :300]
    assert ((back - weight).abs() <= step * (0.5 + 15 * 2**-8)).all()
    assert span is None or (step <= span / 15 * 1.01).all()


# ---------------------------------------------------------------------------------------------- kernel


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20])
@pytest.mark.parametrize("shape", [(70, 200), (300, 1024), (64, 64)])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_int4_linear_equals_dequantized_linear(rows: int, shape: tuple[int, int], group_size: int) -> None:
    """float32: the reference within float32 summation; bf16: the twin's semantics (weights dequantized to
    bf16) computed exactly, against ours (float32 accumulation rounded to bf16; up to 8 rows the 4-bit weight
    streamed, above bf16 tiles). Scales as the formats store them: bf16, float16, float32."""
    assert load_native_ops(), "the native CPU kernel should build on this machine"
    generator = torch.Generator().manual_seed(rows)
    held = kernel_group_size(group_size, shape[1])
    packed, scales, zeros = quantize_int4(torch.randn(shape, generator=generator), held)
    x = torch.randn(2, rows, shape[1], generator=generator)  # leading dimensions are kept
    for scale_dtype in (torch.bfloat16, torch.float16, torch.float32):
        s = scales.to(scale_dtype)
        reference = int4_linear_torch(x.double(), packed, s, zeros, held)
        out = int4_linear(x, packed, s, zeros, held)
        assert out.shape == (2, rows, shape[0]) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), reference, atol=1e-4, rtol=1e-5)
        bf16 = int4_linear(x.bfloat16(), packed, s, zeros, held)
        weight = dequantize_int4(packed, s, zeros, held, shape[1], torch.bfloat16)
        exact = torch.nn.functional.linear(x.bfloat16().double(), weight.double())
        bound = 2**-7 * exact.abs().max().item()
        torch.testing.assert_close(bf16.double(), exact, atol=bound, rtol=2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape,group_size", [((301, 2100), 128), ((257, 320), 32), ((66, 96), 64), ((40, 200), 256)]
)
def test_int4_linear_rows_do_not_depend_on_the_batch(
    dtype: torch.dtype, shape: tuple[int, int], group_size: int
) -> None:
    """Up to 8 rows (decode and verify steps, which stream the weight once), a row's output is bitwise the
    same alone and with the others: every group size path, padded tails, the bf16 and float32 paths."""
    assert load_native_ops(), "the native CPU kernel should build on this machine"
    generator = torch.Generator().manual_seed(shape[0])
    held = kernel_group_size(group_size, shape[1])
    packed, scales, zeros = quantize_int4(torch.randn(shape, generator=generator), held)
    x = torch.randn(8, shape[1], generator=generator).to(dtype)
    alone = torch.cat([int4_linear(row[None], packed, scales, zeros, held) for row in x])
    for rows in range(2, 9):
        assert torch.equal(int4_linear(x[:rows], packed, scales, zeros, held), alone[:rows]), f"{rows} rows"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,group_size", [((300, 200), 64), ((1100, 300), 128), ((70, 130), 32)])
def test_native_dequantized_tiles_equal_the_reference(
    dtype: torch.dtype, shape: tuple[int, int], group_size: int
) -> None:
    """Prefill's path (more than 8 rows) multiplies tiles dequantized natively; x = the identity reads them
    back exactly, to compare bit for bit with dequantize_int4. Also: zero rows."""
    assert load_native_ops(), "the native CPU kernel should build on this machine"
    torch.manual_seed(1)
    held = kernel_group_size(group_size, shape[1])
    packed, scales, zeros = quantize_int4(torch.randn(shape) * torch.logspace(-3, 1, shape[1]), held)
    out = torch.ops.optimum_qwen36.int4_linear(torch.eye(shape[1], dtype=dtype), packed, scales, zeros, held)
    assert torch.equal(out.t(), dequantize_int4(packed, scales, zeros, held, shape[1], dtype))
    empty = torch.ops.optimum_qwen36.int4_linear(
        torch.empty(2, 0, shape[1], dtype=dtype), packed, scales, zeros, held
    )
    assert empty.shape == (2, 0, shape[0]) and empty.dtype == dtype


# ---------------------------------------------------------------------------------------------- loading

GPTQ_CASES = {
    "v1 sym g128": dict(checkpoint_format="gptq", symmetric=True, group_size=128),
    "v1 sym g32 desc_act": dict(checkpoint_format="gptq", symmetric=True, group_size=32, act_order=True),
    "v2 asym g32": dict(checkpoint_format="gptq_v2", group_size=32),
    "v2 asym g64 desc_act": dict(checkpoint_format="gptq_v2", group_size=64, act_order=True),
    "v2 asym per channel": dict(checkpoint_format="gptq_v2", group_size=-1),
}


@pytest.mark.parametrize("case", list(GPTQ_CASES))
def test_gptq_matches_transformers_on_dequantized_weights(tmp_path: Path, case: str) -> None:
    path, reference = write_int4(tmp_path / "gptq", "gptq", **GPTQ_CASES[case])
    model = export_eager(path)
    assert (model.neuron_config.quantization, model.neuron_config.int4_modules) == ("int4", "checkpoint")
    modules = int4_modules(model)
    assert set(modules) == expected_quantized(model.config)
    permuted = {name for name, m in modules.items() if m.input_order is not None}
    assert bool(permuted) == GPTQ_CASES[case].get("act_order", False)
    state = reference.state_dict()
    for name, module in modules.items():
        assert torch.equal(dequantized(module), state[name + ".weight"]), name
    assert_matches(model, reference)


@pytest.mark.parametrize("group_size", [32, 128])
def test_awq_matches_transformers_on_dequantized_weights(tmp_path: Path, group_size: int) -> None:
    path, reference = write_int4(tmp_path / "awq", "awq", group_size=group_size)
    model = export_eager(path)
    state = reference.state_dict()
    for name, module in int4_modules(model).items():
        assert torch.equal(dequantized(module), state[name + ".weight"]), name
    assert_matches(model, reference)


@pytest.mark.parametrize(
    "settings",
    [
        dict(group_size=32, layout="conditional"),  # model.language_model. names, `re:` ignores
        dict(group_size=-1, symmetric=True),  # channel strategy, no zero points
    ],
    ids=["group32-multimodal", "channel-symmetric"],
)
def test_compressed_tensors_match_transformers_own_loader(tmp_path: Path, settings: dict) -> None:
    """transformers decompresses the checkpoint with the compressed-tensors library (float32 scales: its
    dequantization is exact) into the reference model; ours reads the packed tensors itself."""
    from transformers import AutoModelForImageTextToText, CompressedTensorsConfig, Qwen3_5ForCausalLM

    path, written = write_int4(tmp_path / "ct", "compressed-tensors", **settings)
    loader = AutoModelForImageTextToText if settings.get("layout") == "conditional" else Qwen3_5ForCausalLM
    theirs = loader.from_pretrained(
        path, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32
    ).eval()
    up_proj = next(key for key in written.state_dict() if ".mlp.up_proj" in key)
    assert torch.equal(theirs.state_dict()[up_proj], written.state_dict()[up_proj])
    model = export_eager(path)
    assert set(int4_modules(model)) == expected_quantized(model.config)
    assert_matches(model, theirs)


def test_compressed_tensors_activation_order(tmp_path: Path) -> None:
    """`weight_g_idx` with actorder "group" (what vLLM reads; the compressed-tensors library behind
    transformers' loader has dropped it), against the written checkpoint's dequantized weights."""
    path, reference = write_int4(tmp_path / "ct", "compressed-tensors", group_size=64, act_order=True)
    model = export_eager(path)
    for module in int4_modules(model).values():  # one group of 64 is no permutation
        assert (module.input_order is not None) == (module.in_features > 64)
    assert_matches(model, reference)


def test_exclusions_with_and_without_the_multimodal_prefix(tmp_path: Path) -> None:
    """GPTQ's `dynamic` "-:" patterns and modules_to_not_convert entries (prefixed or not) name modules the
    checkpoint keeps in the model dtype; a quantized module that they name is a contradiction."""
    excluded = ("layers.0.mlp.", "layers.3.self_attn.o_proj.")
    config = dict(
        quant_method="gptq", bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2",
        dynamic={r"-:model\.language_model\.layers\.0\.mlp\..*": {}},
        modules_to_not_convert=["model.language_model.layers.3.self_attn.o_proj"],
    )  # fmt: skip
    path, reference = write_int4(
        tmp_path / "ckpt", "gptq", layout="conditional", excluded=excluded, quantization_config=config
    )
    model = export_eager(path)
    quantized = set(int4_modules(model))
    assert quantized == expected_quantized(model.config) - {
        "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj",
        "model.layers.3.self_attn.o_proj",
    }  # fmt: skip
    assert_matches(model, reference)
    config["modules_to_not_convert"].append("model.language_model.layers.1.mlp")
    edit_config(path, lambda c: c.update(quantization_config=config))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp.* excludes them"):
        export_eager(path)


# ------------------------------------------------------------------------ bad layouts


MODULE = "model.layers.1.mlp.down_proj"
BAD_LAYOUTS = {
    "gptq bits 8": ("gptq", None, lambda c: c["quantization_config"].update(bits=8), "bits=8"),
    "gptq bits 3": ("gptq", None, lambda c: c["quantization_config"].update(bits=3), "bits=3"),
    "gptq marlin": (
        "gptq", None, lambda c: c["quantization_config"].update(checkpoint_format="marlin"), "marlin",
    ),
    "missing qzeros": ("gptq", lambda t: t.pop(MODULE + ".qzeros"), None, f"{MODULE}.qzeros is missing"),
    "mis-shaped scales": (
        "gptq", lambda t: t.update({MODULE + ".scales": t[MODULE + ".scales"][:1].contiguous()}), None,
        f"{MODULE}.scales has shape",
    ),
    "mis-shaped qweight": (
        "gptq", lambda t: t.update({MODULE + ".qweight": t[MODULE + ".qweight"][:, :8].contiguous()}), None,
        f"{MODULE}.qweight has shape",
    ),
    "awq gemv": ("awq", None, lambda c: c["quantization_config"].update(version="gemv"), "version='gemv'"),
    "compressed 8 bits": (
        "compressed-tensors", None,
        lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=8),
        "num_bits=8",
    ),
    "compressed missing scale": (
        "compressed-tensors", lambda t: t.pop(MODULE + ".weight_scale"), None,
        f"{MODULE}.weight_scale is missing",
    ),
    "config without 4-bit weights": (
        "gptq", lambda t: [t.pop(k) for k in [k for k in t if k.endswith(("qweight", "qzeros", "scales"))]],
        None,
        "no tensor is a packed 4-bit weight",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD_LAYOUTS))
def test_bad_int4_layouts_are_refused_clearly(tmp_path: Path, name: str) -> None:
    method, edit_tensors, edit_json, message = BAD_LAYOUTS[name]
    path, _ = write_int4(tmp_path / "ckpt", method)
    if edit_tensors:
        rewrite_tensors(path, edit_tensors)
    if edit_json:
        edit_config(path, edit_json)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        export_eager(path)


def test_int4_settings_are_checked(tmp_path: Path, tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("causal")
    with pytest.raises(ValueError, match="need quantization='int4'"):
        export_eager(path, int4_modules="mlp")
    with pytest.raises(ValueError, match="int4_group_size must be"):
        export_eager(path, quantization="int4", int4_group_size=48)
    with pytest.raises(ValueError, match="neuron backend"):
        NeuronQwen36ForCausalLM.get_neuron_config(path, backend="neuron", quantization="int4")
    with pytest.raises(ValueError, match="tensor parallelism"):  # before any worker starts
        export_eager(path, quantization="int4", tp_degree=2)
    gptq, _ = write_int4(tmp_path / "gptq", "gptq")
    with pytest.raises(ValueError, match="already quantized to 4 bits"):
        export_eager(gptq, int4_group_size=64)
    with pytest.raises(ValueError, match="holds 4-bit weights"):
        export_eager(gptq, quantization="fp8")


@pytest.mark.slow
def test_compiled_cpu_backend_matches_transformers(tmp_path: Path) -> None:
    """The cpu backend (the native kernel inside the AOTInductor graphs: a prefill chunk of 16 rows and the
    one-row decode, with an activation order's input permutation) matches transformers on a GPTQ
    desc_act checkpoint; saved and loaded again, it gives the same tokens."""
    path, reference = write_int4(tmp_path / "gptq", "gptq", group_size=32, act_order=True)
    settings = dict(backend="cpu", batch_size=1, sequence_length=128, prefill_chunk_size=16, dtype="float32")
    model = NeuronQwen36ForCausalLM.from_pretrained(path, export=True, use_compile_cache=False, **settings)
    assert_matches(model, reference, lengths=[37])  # three prefill chunks
    model.save_pretrained(tmp_path / "saved")
    loaded = NeuronQwen36ForCausalLM.from_pretrained(tmp_path / "saved")
    assert set(int4_modules(loaded)) == set(int4_modules(model))
    assert_matches(loaded, reference, lengths=[21])


# ------------------------------------------------------------------------ quantizing at export


@pytest.mark.parametrize("int4_modules_name", ["mlp", "linear"])
def test_quantization_at_export_selects_exactly_the_named_modules(
    tiny_checkpoint, int4_modules_name: str
) -> None:
    path, reference = tiny_checkpoint("causal", seed=2)
    model = export_eager(path, quantization="int4", int4_modules=int4_modules_name, int4_group_size=32)
    assert (model.neuron_config.int4_modules, model.neuron_config.int4_group_size) == (int4_modules_name, 32)
    quantized = int4_modules(model)
    assert set(quantized) == expected_quantized(model.config, int4_modules_name)
    for name, parameter in model.model.named_parameters():
        if name.rsplit(".", 1)[0] not in quantized:  # embeddings, lm_head, norms, conv1d, in_proj_a/b, ...
            assert parameter.dtype == torch.float32, name
    state = reference.state_dict()
    for name, module in quantized.items():
        assert module.group_size == 32 and module.scales.dtype == torch.bfloat16
        state[name + ".weight"] = dequantized(module)
    reference.load_state_dict(state)
    assert_matches(model, reference)


def test_saved_model_is_a_compressed_tensors_checkpoint_transformers_loads(
    tiny_checkpoint, tmp_path: Path
) -> None:
    """The saved weights are compressed-tensors pack-quantized: transformers (with the compressed-tensors
    library) dequantizes them to our weights rounded to the scales' bf16, as its dequantization computes
    them; we load the saved model back to the same weights and tokens. Per channel (the 64-feature
    inputs with a group of 128) and per group side by side."""
    from transformers import CompressedTensorsConfig, Qwen3_5ForCausalLM

    path, reference = tiny_checkpoint("causal", seed=4)
    model = export_eager(path, quantization="int4", int4_group_size=128)
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["format"]) == ("compressed-tensors", "pack-quantized")
    assert "model.layers.0.linear_attn.in_proj_a" in config["ignore"]
    theirs = Qwen3_5ForCausalLM.from_pretrained(
        tmp_path / "saved", quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32
    ).state_dict()
    modules = int4_modules(model)
    assert {m.group_size for m in modules.values()} == {128}  # down_proj / o_proj: 128 inputs, the rest 64
    for name, module in modules.items():
        assert torch.equal(theirs[name + ".weight"], dequantized(module).bfloat16().float()), name
    loaded = export_eager(tmp_path / "saved")
    assert loaded.neuron_config.int4_modules == "checkpoint"
    for name, module in int4_modules(loaded).items():
        assert torch.equal(dequantized(module), dequantized(modules[name])), name
    state = reference.state_dict()
    state.update({name + ".weight": dequantized(module) for name, module in modules.items()})
    reference.load_state_dict(state)
    assert_matches(loaded, reference, lengths=[21])
