"""FP8 weights: Qwen's official block-scaled layout loads and matches transformers on the dequantized
weights (fp32 compute, eager and the compiled cpu backend, saved and loaded again); bf16 checkpoints are
quantized at export for exactly the modules `fp8_modules` names; bad layouts fail with clear errors; the
native kernel equals its PyTorch twin.

The official-layout checkpoints are written by `fp8_checkpoints.write_official_fp8`, independent of the
package's quantizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fp8_checkpoints import BLOCK, dequantize_blocks, write_official_fp8
from helpers import edit_config, engine_storage, export_eager, left_padded_prompts, rewrite_tensors
from safetensors import safe_open

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.exporters.compile_cache import compile_key
from optimum_qwen36.network.quantization import Fp8Linear, linear_module_names
from optimum_qwen36.network.weights import CheckpointError
from optimum_qwen36.ops.fp8 import (
    DEFAULT_BLOCK_SIZE,
    E4M3_MAX,
    NEURON_E4M3_MAX,
    dequantize_fp8,
    fp8_linear,
    fp8_linear_torch,
    quantize_fp8,
    requantize_fp8,
)
from optimum_qwen36.ops.native import load_native_ops

NEW_TOKENS = 24


def reference_generate(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor):
    return model.generate(
        input_ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0,
        return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip


def assert_matches(model, reference: torch.nn.Module, lengths: list[int] = [5, 16, 37]) -> None:  # noqa: B006
    """Same greedy tokens as the reference, fp32 logits within 1e-4 of the largest."""
    input_ids, mask = left_padded_prompts(lengths[: model.neuron_config.batch_size], seed=1)
    ours = model.generate(
        input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
        return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    theirs = reference_generate(reference, input_ids, mask)
    assert torch.equal(ours.sequences, theirs.sequences)
    for step, (a, b) in enumerate(zip(ours.logits, theirs.logits, strict=True)):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 1e-4 * scale, f"step {step}"


def fp8_modules(model: NeuronQwen36ForCausalLM) -> set[str]:
    return {name for name, m in model.model.named_modules() if isinstance(m, Fp8Linear)}


@pytest.fixture(scope="module")
def official(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return write_official_fp8(tmp_path_factory.mktemp("fp8") / "official")


# ---------------------------------------------------------------------------------------------- ops


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20])
@pytest.mark.parametrize(
    "shape,block", [((300, 200), (128, 128)), ((257, 129), (64, 32)), ((64, 64), (128, 128))]
)
def test_fp8_linear_equals_dequantized_linear(
    rows: int, shape: tuple[int, int], block: tuple[int, int]
) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(shape)
    q, scale = quantize_fp8(weight, block)
    x = torch.randn(2, rows, shape[1])  # leading dimensions are kept
    reference = fp8_linear_torch(x.double(), q, scale, block)
    out = fp8_linear(x, q, scale, block)
    assert out.shape == (2, rows, shape[0]) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference, atol=1e-4, rtol=1e-5)
    # bf16: the twin's semantics (weights dequantized to bf16) computed exactly, against ours (float32
    # accumulation, output rounded to bf16; above 8 rows bf16 tiles, up to 8 rows float32 weights streamed).
    bf16 = fp8_linear(x.bfloat16(), q, scale, block)
    assert bf16.dtype == torch.bfloat16
    exact = torch.nn.functional.linear(
        x.bfloat16().double(), dequantize_fp8(q, scale, block, torch.bfloat16).double()
    )
    bound = 2**-7 * exact.abs().max().item()
    torch.testing.assert_close(bf16.double(), exact, atol=bound, rtol=2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape,block", [((301, 2100), (128, 128)), ((257, 320), (64, 64)), ((66, 96), (64, 32))]
)
def test_fp8_linear_rows_do_not_depend_on_the_batch(
    dtype: torch.dtype, shape: tuple[int, int], block: tuple[int, int]
) -> None:
    """Up to 8 rows (decode and verify steps, which stream the weight once), a row's output is bitwise the
    same alone and with the others: blocks of weight rows and their remainder, whole 64-value slices and a
    scalar tail, the bf16 byte-table path and the float32 one. Batch invariance of FP8 decode rests on it."""
    assert load_native_ops(), "the native CPU kernel should build on this machine"
    generator = torch.Generator().manual_seed(shape[0])
    q, scale = quantize_fp8(torch.randn(shape, generator=generator), block)
    x = torch.randn(8, shape[1], generator=generator).to(dtype)
    alone = torch.cat([fp8_linear(row[None], q, scale, block) for row in x])
    for rows in range(2, 9):
        assert torch.equal(fp8_linear(x[:rows], q, scale, block), alone[:rows]), f"{rows} rows"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_takes_zero_rows(dtype: torch.dtype) -> None:
    assert load_native_ops(), "the native CPU kernel should build on this machine"
    q, scale = quantize_fp8(torch.randn(256, 128), (128, 128))
    out = torch.ops.optimum_qwen36.fp8_linear(torch.empty(2, 0, 128, dtype=dtype), q, scale, 128, 128)
    assert out.shape == (2, 0, 256) and out.dtype == dtype


@pytest.mark.parametrize("rows", [1, 9])  # the streaming paths and the dequantizing one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_widens_every_e4m3_value_exactly(rows: int, dtype: torch.dtype) -> None:
    assert load_native_ops(), "the native CPU kernel should build on this machine"
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = values[~values.isnan()]  # subnormals, zeros of both signs, normals up to +-448
    # output i is value i; 256 columns, so bf16's byte-table path converts every value in whole 64-byte slices
    weight = torch.zeros(len(finite), 256)
    weight[range(len(finite)), range(len(finite))] = finite
    x = torch.ones(rows, 256, dtype=dtype)
    out = torch.ops.optimum_qwen36.fp8_linear(x, weight.to(torch.float8_e4m3fn), torch.ones(1, 1), 1024, 1024)
    assert out.dtype == dtype and torch.equal(out.float(), finite.expand(rows, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape,block",
    [
        ((300, 200), (128, 128)),
        ((257, 129), (64, 32)),
        ((1100, 200), (128, 128)),  # 200 rows of x: two tiles of output features
        ((1100, 300), (128, 128)),  # 300 rows: the whole weight in one product
    ],
)
def test_native_dequantized_tiles_equal_the_reference(
    dtype: torch.dtype, shape: tuple[int, int], block: tuple[int, int]
) -> None:
    """Prefill's path (more than 8 rows) multiplies tiles dequantized natively; x = the identity reads them
    back exactly (one nonzero product per output), to compare bit for bit with dequantize_fp8."""
    assert load_native_ops(), "the native CPU kernel should build on this machine"
    torch.manual_seed(1)
    q, scale = quantize_fp8(torch.randn(shape) * torch.logspace(-3, 1, shape[1]), block)
    scale = scale.bfloat16().float()  # as Qwen's files store them
    out = torch.ops.optimum_qwen36.fp8_linear(torch.eye(shape[1], dtype=dtype), q, scale, *block)
    assert torch.equal(out.t(), dequantize_fp8(q, scale, block, dtype))


def test_native_kernel_splits_a_weight_too_large_for_one_product() -> None:
    """From 256 rows of x the weight is dequantized whole for one product, up to 16M values; a larger one
    (here 4224 x 4096) goes in several parts, each a whole number of scale blocks."""
    assert load_native_ops(), "the native CPU kernel should build on this machine"
    generator = torch.Generator().manual_seed(3)
    q, scale = quantize_fp8(torch.randn(4224, 4096, generator=generator))
    x = torch.randn(256, 4096, generator=generator)
    reference = fp8_linear_torch(x.double(), q, scale, DEFAULT_BLOCK_SIZE)
    torch.testing.assert_close(
        fp8_linear(x, q, scale, DEFAULT_BLOCK_SIZE).double(), reference, atol=1e-3, rtol=1e-5
    )


def test_quantize_round_trip_and_neuron_range() -> None:
    torch.manual_seed(0)
    weight = torch.randn(300, 200) * torch.logspace(-3, 1, 200)  # per-column magnitudes over four decades
    q, scale = quantize_fp8(weight, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.bfloat16 and scale.shape == (3, 2)
    back = dequantize_fp8(q, scale, (128, 128), torch.float32)
    block_max = back.abs().amax()
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, plus the subnormal floor of each block.
    assert ((back - weight).abs() <= weight.abs() * 2**-4 + block_max * 2**-9 / E4M3_MAX * 2).all()
    q240, scale240 = requantize_fp8(q, scale, (128, 128), NEURON_E4M3_MAX)
    assert q240.float().abs().max() <= NEURON_E4M3_MAX
    back240 = dequantize_fp8(q240, scale240, (128, 128), torch.float32)
    assert ((back240 - back).abs() <= back.abs() * 2**-4 + block_max * 2**-8).all()


# ------------------------------------------------------------------------ the official FP8 layout


def test_official_layout_matches_transformers_on_dequantized_weights(official) -> None:
    path, reference = official
    model = export_eager(path)
    assert (model.neuron_config.quantization, model.neuron_config.fp8_modules) == ("fp8", "linear")
    assert fp8_modules(model) == set(linear_module_names(model.config, "linear"))
    linear = model.model.model.layers[0].linear_attn
    assert isinstance(linear.in_proj_a, torch.nn.Linear) and linear.in_proj_a.weight.dtype == torch.float32
    assert linear.in_proj_qkv.weight.dtype == torch.float8_e4m3fn
    assert linear.in_proj_qkv.weight_scale_inv.dtype == torch.bfloat16  # as stored
    assert_matches(model, reference)


@pytest.mark.slow
def test_official_layout_compiled_saved_and_loaded(official, tmp_path: Path) -> None:
    """The cpu backend (the native kernel inside the AOTInductor graphs: a prefill chunk of 16 rows and the
    one-row decode) matches transformers; the saved artifact keeps the official layout, which transformers
    loads too. Batch 1 keeps it to two graphs: the kernel's 2..8-row path is the same op (tested above)."""
    path, reference = official
    settings = dict(backend="cpu", batch_size=1, sequence_length=128, prefill_chunk_size=16, dtype="float32")
    model = NeuronQwen36ForCausalLM.from_pretrained(path, export=True, use_compile_cache=False, **settings)
    assert_matches(model, reference, lengths=[37])  # three prefill chunks
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == list(BLOCK)
    assert "model.layers.0.linear_attn.in_proj_a" in config["quantization_config"]["modules_to_not_convert"]
    with safe_open(tmp_path / "saved" / "model.safetensors", framework="pt") as f:
        weight = f.get_tensor("model.layers.0.mlp.up_proj.weight")
        scale = f.get_tensor("model.layers.0.mlp.up_proj.weight_scale_inv")
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.bfloat16
        assert f.get_tensor("model.layers.0.linear_attn.in_proj_b.weight").dtype == torch.float32
    expected = reference.model.language_model.layers[0].mlp.up_proj.weight
    assert torch.equal(dequantize_blocks(weight, scale, BLOCK), expected)
    loaded = NeuronQwen36ForCausalLM.from_pretrained(tmp_path / "saved")
    assert fp8_modules(loaded) == fp8_modules(model)
    assert_matches(loaded, reference, lengths=[21])
    # transformers reads the same files (dequantizing them: FP8 compute needs a GPU there).
    from transformers import FineGrainedFP8Config, Qwen3_5ForCausalLM

    theirs = Qwen3_5ForCausalLM.from_pretrained(
        tmp_path / "saved", quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32
    )
    assert_matches(loaded, theirs, lengths=[21])


# ------------------------------------------------------------------------ quantizing at export


@pytest.mark.parametrize("fp8_modules_name", ["mlp", "linear"])
def test_quantization_at_export_selects_exactly_the_named_modules(
    tiny_checkpoint, fp8_modules_name: str
) -> None:
    path, reference = tiny_checkpoint("causal", seed=2)
    model = export_eager(path, quantization="fp8", fp8_modules=fp8_modules_name)
    quantized = fp8_modules(model)
    config = model.config
    expected = {
        f"model.layers.{i}.{module}"
        for i, kind in enumerate(config.layer_types)
        for module in (
            ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
            + (
                []
                if fp8_modules_name == "mlp"
                else ["linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj"]
                if kind == "linear_attention"
                else ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
            )
        )
    }
    assert quantized == expected
    for name, parameter in model.model.named_parameters():
        module = name.rsplit(".", 1)[0]
        if module not in quantized:  # embeddings, lm_head, norms, conv1d, in_proj_a/b, A_log, dt_bias
            assert parameter.dtype == torch.float32, name
    cache = engine_storage(model)
    assert cache.recurrent_state.dtype == torch.float32 and cache.key_cache.dtype == torch.float32
    # The quantized model is exactly the reference on its dequantized weights.
    state = reference.state_dict()
    for module in quantized:
        fp8 = model.model.get_submodule(module)
        state[module + ".weight"] = dequantize_fp8(
            fp8.weight, fp8.weight_scale_inv, fp8.block_size, torch.float32
        )
    reference.load_state_dict(state)
    assert_matches(model, reference)


def test_fp8_modules_change_the_compile_key(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("causal", seed=1)
    keys = {}
    for name in ("mlp", "linear"):
        neuron_config = NeuronQwen36ForCausalLM.get_neuron_config(
            path, backend="cpu", quantization="fp8", fp8_modules=name
        )
        _, text_config, _ = NeuronQwen36ForCausalLM.model_config(str(path), neuron_config)
        keys[name] = compile_key(text_config.to_dict(), neuron_config.to_dict(), "cpu")
    plain = NeuronQwen36ForCausalLM.get_neuron_config(path, backend="cpu")
    _, text_config, _ = NeuronQwen36ForCausalLM.model_config(str(path), plain)
    keys["none"] = compile_key(text_config.to_dict(), plain.to_dict(), "cpu")
    assert len(set(keys.values())) == 3


# ------------------------------------------------------------------------ bad layouts


SCALE = "model.language_model.layers.1.mlp.down_proj.weight_scale_inv"
BAD_LAYOUTS = {
    "missing scale": (lambda t: t.pop(SCALE), None, "without their scales"),
    "mis-shaped scale": (lambda t: t.update({SCALE: t[SCALE][:, :1].contiguous()}), None, "needs"),
    "no quantization_config": (None, lambda c: c.pop("quantization_config"), "no quantization_config"),
    "e5m2": (None, lambda c: c["quantization_config"].update(fmt="e5m2"), "only e4m3"),
    "per-tensor scales": (
        None,
        lambda c: c["quantization_config"].pop("weight_block_size"),
        "weight_block_size",
    ),
    "fp8 in modules_to_not_convert": (
        None,
        lambda c: c["quantization_config"]["modules_to_not_convert"].append(
            "model.language_model.layers.2.mlp"
        ),
        "modules_to_not_convert",
    ),
    "fp8 embedding": (
        lambda t: t.update(
            {
                "model.language_model.embed_tokens.weight": t["model.language_model.embed_tokens.weight"].to(
                    torch.float8_e4m3fn
                )
            }
        ),
        None,
        "embed_tokens",
    ),
}


@pytest.mark.parametrize("name", list(BAD_LAYOUTS))
def test_bad_fp8_layouts_are_refused_clearly(tmp_path: Path, name: str) -> None:
    path, _ = write_official_fp8(tmp_path / "ckpt")
    edit_tensors, edit_json, message = BAD_LAYOUTS[name]
    if edit_tensors:
        rewrite_tensors(path, edit_tensors)
    if edit_json:
        edit_config(path, edit_json)
    with pytest.raises((CheckpointError, ValueError), match=message):
        export_eager(path)


def test_requested_modules_must_match_an_fp8_checkpoint(official) -> None:
    path, _ = official
    with pytest.raises(ValueError, match="already quantized with fp8_modules='linear'"):
        export_eager(path, fp8_modules="mlp")
    assert export_eager(path, quantization="fp8", fp8_modules="linear").neuron_config.fp8_modules == "linear"


def test_fp8_settings_are_checked(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("causal")
    with pytest.raises(ValueError, match="needs quantization='fp8'"):
        export_eager(path, fp8_modules="mlp")
    with pytest.raises(ValueError, match="Unknown quantization"):
        export_eager(path, quantization="int2")
    with pytest.raises(ValueError, match="not an FP8 checkpoint"):
        export_eager(path, quantization="fp8", fp8_modules="checkpoint")
