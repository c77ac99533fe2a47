"""Tensor parallelism: a model split over 2 processes (gloo, fp32; the eager backend, and the cpu backend's
compiled graphs with the collectives inside) gives the tokens of one process and logits within 1e-5 of the
largest, on a configuration that exercises the awkward cases (one KV head for 2 ranks: replicated; 6 GDN
value heads over 2 key heads: HV / H = 3; a vocabulary 2 does not divide: padded), through generate() and
the engine, with prefix caching on; the sharding plan's checks; saving and loading; a killed worker."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import add_random_mtp_weights, save_tiny_checkpoint, tiny_text_config
from fp8_checkpoints import write_official_fp8
from helpers import FailsInOneProcess, export_eager, free_port, left_padded_prompts, recording_drafts
from safetensors.torch import load_file
from transformers import Qwen3_5TextConfig
from transformers.generation.logits_process import LogitsProcessorList

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.distributed.group import TensorParallelWorkerError
from optimum_qwen36.engine import EngineRequest, SamplingParams
from optimum_qwen36.exporters.artifact import MANIFEST_NAME
from optimum_qwen36.network.model import Qwen36ForCausalLM
from optimum_qwen36.network.quantization import Fp8Quantization, linear_module_names
from optimum_qwen36.network.sharding import (
    TensorParallelError,
    check_tp_degree,
    shard_config,
    shard_scale,
    shard_tensor,
    unshard_scale,
    unshard_tensor,
    valid_degrees,
)
from optimum_qwen36.network.weights import check_quantized_sharding
from optimum_qwen36.ops.fp8 import dequantize_fp8, quantize_fp8

AWKWARD = dict(num_key_value_heads=1, linear_num_value_heads=6)
# FP8 scale blocks that every rank's slice of the AWKWARD model's weights is made of, at tp=2.
FP8_BLOCK = (16, 16)
SETTINGS = dict(batch_size=3, sequence_length=256, prefill_chunk_size=32)
VOCAB = 512
# A fine-tuned checkpoint's vocabulary with added tokens: at tp=2 each rank holds 516 rows, rank 1's last
# one padding.
ODD_VOCAB = 1031
# The module's checkpoint: the awkward heads, and a vocabulary 2 does not divide (the `two` fixture's
# compiled graphs are tp=2 with it).
SPLIT_MODEL = dict(AWKWARD, vocab_size=ODD_VOCAB)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory, _ = save_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "ckpt", seed=3, **SPLIT_MODEL)
    add_random_mtp_weights(directory, tiny_text_config(**SPLIT_MODEL), seed=3)
    return directory


@pytest.fixture(scope="module")
def one(checkpoint: Path) -> NeuronQwen36ForCausalLM:
    return export_eager(checkpoint, prefix_caching=True, **SETTINGS)


@pytest.fixture(scope="module", params=["eager", "cpu"])
def two(
    request: pytest.FixtureRequest, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> NeuronQwen36ForCausalLM:
    """tp=2 on the eager backend, and on the cpu backend: each rank's AOTInductor graphs with the
    collectives inside (and the verify / draft graphs of MTP speculative decoding, which the engine then
    runs)."""
    if request.param == "eager":
        return export_eager(checkpoint, prefix_caching=True, tp_degree=2, **SETTINGS)
    cache = tmp_path_factory.mktemp("tp-compile-cache")
    return export_eager(
        checkpoint,
        backend="cpu",
        compile_cache_dir=cache,
        num_speculative_tokens=2,
        prefix_caching=True,
        tp_degree=2,
        **SETTINGS,
    )


def assert_logits_close(reference: torch.Tensor, other: torch.Tensor) -> None:
    scale = reference.abs().max()
    assert (reference - other).abs().max() <= 1e-5 * scale


@pytest.mark.parametrize(
    "overrides",
    [AWKWARD, {"tie_word_embeddings": True}, {"vocab_size": ODD_VOCAB}],
    ids=["kv-replicated", "tied", "odd-vocab"],
)
def test_sharding_plan_splits_and_joins_every_tensor(overrides: dict) -> None:
    config = tiny_text_config(**overrides)
    torch.manual_seed(0)
    model = Qwen36ForCausalLM(config, mtp=True)
    local = shard_config(config, 2)
    local_shapes = {n: p.shape for n, p in Qwen36ForCausalLM(local, mtp=True).named_parameters()}
    for name, tensor in model.named_parameters():
        shards = [shard_tensor(config, name, tensor, rank, 2) for rank in range(2)]
        assert all(s.shape == local_shapes[name] for s in shards), name
        assert torch.equal(unshard_tensor(config, name, shards, 2), tensor), name
    if config.vocab_size % 2:  # rank 1's last row pads the vocabulary
        head = shard_tensor(config, "lm_head.weight", model.lm_head.weight, 1, 2)
        assert torch.equal(head[-1], torch.zeros(config.hidden_size))
    if config.num_key_value_heads == 1:  # the replicated KV head is the one both ranks' query heads read
        k_proj = model.model.layers[3].self_attn.k_proj.weight
        k_name = "model.layers.3.self_attn.k_proj.weight"
        assert torch.equal(shard_tensor(config, k_name, k_proj, 1, 2), k_proj)


def qwen36_27b_shapes() -> Qwen3_5TextConfig:
    """Qwen3.6-27B's widths and head counts (4 layers)."""
    return tiny_text_config(
        hidden_size=5120,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        intermediate_size=17408,
        vocab_size=248320,
    )


def test_degrees_are_checked_against_every_head_count(tmp_path: Path) -> None:
    qwen36_27b = qwen36_27b_shapes()
    assert valid_degrees(qwen36_27b, 16) == [1, 2, 4, 8]
    with pytest.raises(TensorParallelError, match="linear_num_key_heads=16"):
        check_tp_degree(qwen36_27b, 3)
    with pytest.raises(TensorParallelError, match="num_attention_heads=24"):
        check_tp_degree(qwen36_27b, 16)
    odd_kv = tiny_text_config(num_attention_heads=6, num_key_value_heads=3, intermediate_size=132)
    with pytest.raises(TensorParallelError, match="num_key_value_heads=3"):
        check_tp_degree(odd_kv, 2)
    directory, _ = save_tiny_checkpoint(tmp_path / "ckpt")
    with pytest.raises(TensorParallelError, match=r"tp_degree=3 does not divide num_attention_heads=4"):
        NeuronQwen36ForCausalLM.get_neuron_config(directory, tp_degree=3, backend="eager")


def test_fp8_scales_split_and_join_with_their_weights() -> None:
    """A rank's FP8 weight and scale dequantize to exactly its slice of the whole weight, in blocks several
    to a slice; the scales join back; a split through a block is refused, naming the degrees that work."""
    config = tiny_text_config(**AWKWARD)
    model = Qwen36ForCausalLM(config)
    for module in linear_module_names(config, "linear"):
        name = f"{module}.weight"
        weight = torch.randn(model.get_submodule(module).weight.shape, generator=torch.Generator())
        q, scale = quantize_fp8(weight, FP8_BLOCK)
        whole = dequantize_fp8(q, scale, FP8_BLOCK, torch.float32)
        scales = []
        for rank in range(2):
            local_q = shard_tensor(config, name, q, rank, 2)
            scales.append(shard_scale(config, name, scale, tuple(q.shape), FP8_BLOCK, rank, 2))
            local = dequantize_fp8(local_q, scales[-1], FP8_BLOCK, torch.float32)
            assert torch.equal(local, shard_tensor(config, name, whole, rank, 2)), name
        assert torch.equal(unshard_scale(config, name, scales, tuple(q.shape), FP8_BLOCK), scale), name
    names = tuple(linear_module_names(config, "linear"))
    fp8 = Fp8Quantization(names, block_size=(32, 32), prequantized=True)
    check_quantized_sharding(config, fp8, 1)
    # The 96 value rows of in_proj_qkv split 48 a rank: a local block of 32 would cross two of the whole's.
    pattern = r"scale blocks of model\.layers\.0\.linear_attn\.in_proj_qkv: its 160 rows .* among \[1\]"
    with pytest.raises(TensorParallelError, match=pattern):
        check_quantized_sharding(config, fp8, 2)
    qwen36_27b = qwen36_27b_shapes()
    blocks = Fp8Quantization(tuple(linear_module_names(qwen36_27b, "linear")), prequantized=True)  # 128 x 128
    for degree in (1, 2, 4, 8):
        check_quantized_sharding(qwen36_27b, blocks, degree)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen's FP8 layout with scale blocks of 16 x 16 (several blocks to each rank's slice), its MTP layer in
    FP8 too (`fc` included)."""
    root = tmp_path_factory.mktemp("tp-fp8")
    reference = root / "dequantized"
    return write_official_fp8(root / "ckpt", seed=4, block=FP8_BLOCK, mtp_reference=reference, **AWKWARD)[0]


def assert_two_processes_match_one(
    directory: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    prompts: tuple[torch.Tensor, torch.Tensor],
    served_prompts: list[list[int]],
    backend: str,
    **settings: Any,
) -> tuple[dict[str, torch.Tensor], list]:
    """Export `directory` with `settings` at tp=1 (eager) and at tp=2 on `backend`, and assert that tp=2
    gives tp=1's greedy tokens and logits (within 1e-5) for `prompts` (input_ids, attention_mask), and the
    engine's tokens and MTP drafts of tp=1 for `served_prompts`; that saved, its weights (and FP8 scales)
    join back into exactly the tensors tp=1 saves; and that the saved model loads at tp=2 and gives the same
    tokens and logits. Returns tp=2's saved tensors and tp=1's drafts."""
    drafts = recording_drafts(monkeypatch)
    compiled = {"backend": backend, "compile_cache_dir": tmp_path / "cache"} if backend == "cpu" else {}
    input_ids, attention_mask = prompts
    kwargs = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_logits=True)
    outputs, served, saved = [], [], []
    for degree in (1, 2):
        distributed = compiled if degree == 2 else {}
        model = export_eager(directory, tp_degree=degree, **settings, **distributed, **SETTINGS)
        outputs.append(model.generate(input_ids, attention_mask=attention_mask, **kwargs))
        engine = model.create_engine()
        params = SamplingParams(max_tokens=12, temperature=0.0)
        ids = [engine.add_request(EngineRequest(prompt, params)) for prompt in served_prompts]
        done = engine.run()
        served.append(([done[i].output_ids for i in ids], list(drafts)))
        drafts.clear()
        del engine
        model.save_pretrained(tmp_path / f"tp{degree}")
        saved.append(load_file(tmp_path / f"tp{degree}" / "model.safetensors"))
        del model
        gc.collect()  # the workers leave before the next group starts
    assert torch.equal(outputs[0].sequences, outputs[1].sequences)
    assert_logits_close(torch.stack(outputs[0].logits), torch.stack(outputs[1].logits))
    assert served[0] == served[1]
    assert saved[0].keys() == saved[1].keys()
    for name, tensor in saved[0].items():
        assert torch.equal(saved[1][name].view(torch.uint8), tensor.view(torch.uint8)), name
    loaded = NeuronQwen36ForCausalLM.from_pretrained(tmp_path / "tp2")
    assert loaded.neuron_config.tp_degree == 2
    again = loaded.generate(input_ids, attention_mask=attention_mask, **kwargs)
    assert torch.equal(again.sequences, outputs[0].sequences)
    assert_logits_close(torch.stack(outputs[0].logits), torch.stack(again.logits))
    return saved[1], served[0][1]


@pytest.mark.parametrize(
    "source,backend,speculative",
    [("fp8-checkpoint", "cpu", 0), ("fp8-checkpoint", "eager", 2), ("quantized-at-export", "eager", 2)],
    ids=["fp8-cpu", "fp8-mtp-eager", "bf16-mtp-eager"],
)
def test_fp8_matches_one_process_and_saves_the_same_weights(
    source: str,
    backend: str,
    speculative: int,
    fp8_checkpoint: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FP8 weights at tp=2 (an FP8 checkpoint's, in the cpu backend's compiled graphs with the native FP8
    kernel and the collectives inside, or with its FP8 MTP layer drafting; or a bf16 one's quantized whole
    at export in 128 x 128 blocks, then split, its MTP layer's too) give the tokens of one process and
    logits within 1e-5, and the MTP layer's drafts of one process; saved, the ranks' weights and scales
    join back into exactly the weights one process saves, and that artifact loads at tp=2."""
    if source == "fp8-checkpoint":
        directory, quantize = fp8_checkpoint, {}
    else:  # 2 KV heads, 4 GDN value heads: the 128-row blocks split evenly
        directory, _ = save_tiny_checkpoint(tmp_path / "bf16", seed=6)
        add_random_mtp_weights(directory, tiny_text_config(), seed=6)
        quantize = {"quantization": "fp8", "fp8_modules": "linear"}
    prompts = left_padded_prompts([40, 21, 9], VOCAB, seed=3)
    served_prompts = [[3, 1, 4, 1, 5] * n for n in (1, 7)]
    saved, drafts = assert_two_processes_match_one(
        directory, tmp_path, monkeypatch, prompts, served_prompts, backend,
        num_speculative_tokens=speculative, **quantize,
    )  # fmt: skip
    assert bool(drafts) == bool(speculative)
    assert any(tensor.dtype == torch.float8_e4m3fn for tensor in saved.values())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_vocabulary_the_degree_does_not_divide_is_padded(
    tied: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vocabulary of 1031 tokens at tp=2 (516 rows a rank, rank 1's last one zero; the gathered logits cut
    back to 1031) gives tp=1's tokens and logits [.., 1031], with prompts holding the last token of each
    rank; MTP drafting (its own lm_head call) too; it saves tp=1's [1031, hidden] tensors, tied or not, and
    loads again. The cpu backend's graphs: the module's checkpoint has this vocabulary (`two`)."""
    overrides = dict(vocab_size=ODD_VOCAB, tie_word_embeddings=tied, **AWKWARD)
    directory, _ = save_tiny_checkpoint(tmp_path / "ckpt", seed=7, **overrides)
    add_random_mtp_weights(directory, tiny_text_config(**overrides), seed=7)
    input_ids, attention_mask = left_padded_prompts([30, 12], ODD_VOCAB, seed=4)
    input_ids[:, -2:] = torch.tensor([515, ODD_VOCAB - 1])  # rank 0's last token, rank 1's
    served_prompts = [[ODD_VOCAB - 1, 515, 516, 3] * n for n in (1, 6)]
    saved, drafts = assert_two_processes_match_one(
        directory, tmp_path, monkeypatch, (input_ids, attention_mask), served_prompts, "eager",
        num_speculative_tokens=2,
    )  # fmt: skip
    assert drafts
    hidden = tiny_text_config().hidden_size
    assert saved["model.embed_tokens.weight"].shape == (ODD_VOCAB, hidden)
    assert ("lm_head.weight" in saved) == (not tied)


def test_fp8_blocks_a_split_would_cut_are_refused_before_any_worker_starts(tmp_path: Path) -> None:
    directory, _ = write_official_fp8(tmp_path / "ckpt", block=(32, 32), **AWKWARD)
    with pytest.raises(TensorParallelError, match=r"rows are scaled in blocks of 32 .* among \[1\]"):
        export_eager(directory, tp_degree=2, **SETTINGS)


def test_generate_matches_one_process(one, two) -> None:
    input_ids, attention_mask = left_padded_prompts([70, 41, 9], ODD_VOCAB, seed=1)
    input_ids[:, -2:] = torch.tensor([515, ODD_VOCAB - 1])  # rank 0's last token, rank 1's (padded) last
    kwargs = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_logits=True)
    for _ in range(2):  # the second call reuses the prompts' prefixes on every rank
        reference = one.generate(input_ids, attention_mask=attention_mask, **kwargs)
        split = two.generate(input_ids, attention_mask=attention_mask, **kwargs)
        assert torch.equal(reference.sequences, split.sequences)
        assert_logits_close(torch.stack(reference.logits), torch.stack(split.logits))
    assert split.cached_tokens.tolist() == reference.cached_tokens.tolist()
    assert split.cached_tokens[0] == 64  # granularity 64: the 70-token prompt reuses one block


def test_sampling_agrees_on_every_rank(two) -> None:
    """Unseeded sampling: the driver's RNG state reaches the workers (a divergence would raise)."""
    input_ids, attention_mask = left_padded_prompts([20, 33], ODD_VOCAB, seed=2)
    out = two.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=True, top_k=50)
    assert out.shape == (2, 43)


def test_engine_matches_one_process(one, two) -> None:
    prompts = [
        torch.randint(1, ODD_VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (90, 17, 50, 33)
    ]
    results = []
    for model in (one, two):
        engine = model.create_engine()
        ids = [
            engine.add_request(EngineRequest(p, SamplingParams(max_tokens=10, temperature=0.0)))
            for p in prompts
        ]
        sampled = engine.add_request(
            EngineRequest(prompts[0], SamplingParams(max_tokens=10, temperature=1.0))
        )
        done = engine.run()
        results.append([done[i].output_ids for i in ids])
        assert len(done[sampled].output_ids) == 10  # unseeded: each rank was given the driver's seed
        assert engine.stats()["prefix_cache"]["hit_tokens"] > 0
    assert results[0] == results[1]


def test_checkpoints_snapshotted_inside_a_chunk_match_one_process(checkpoint: Path) -> None:
    """tp=2 (eager) with 256-token chunks: a 200-token prompt's checkpoints at 128 (its history) and 192
    are taken inside its one prefill call on every rank; the follow-up hits 128 and gets tp=1's tokens."""
    history = torch.randint(1, ODD_VOCAB, (190,), generator=torch.Generator().manual_seed(7)).tolist()
    prompt, follow_up = history + [5] * 10, history + [9] * 40
    params = SamplingParams(max_tokens=6, temperature=0.0)
    outputs = []
    for degree in (1, 2):
        model = export_eager(
            checkpoint, prefix_caching=True, tp_degree=degree, batch_size=2, sequence_length=512,
            prefill_chunk_size=256,
        )  # fmt: skip
        engine = model.create_engine()
        engine.add_request(EngineRequest(prompt, params, reusable_prefix=190))
        engine.run()
        assert engine.stats()["prefix_cache"]["checkpoints_stored"] == 2
        request_id = engine.add_request(EngineRequest(follow_up, params))
        done = engine.run()[request_id]
        assert done.cached_prompt_tokens == 128
        outputs.append(done.output_ids)
        del engine, model
        gc.collect()  # the workers leave before the next group starts
    assert outputs[0] == outputs[1]


def test_bad_input_leaves_the_model_usable(two) -> None:
    with pytest.raises(ValueError, match="not a token of this model's vocabulary"):
        two.generate(torch.tensor([[1, 2, ODD_VOCAB]]), max_new_tokens=2)
    assert two.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False).shape == (1, 5)


def test_unpicklable_argument_is_refused_and_the_model_still_works(two) -> None:
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="sent to every worker process"):
        two.generate(prompt, max_new_tokens=2, logits_processor=LogitsProcessorList([lambda ids, s: s]))
    assert two.generate(prompt, max_new_tokens=2, do_sample=False).shape == (1, 5)


def test_split_kv_heads_tied_embeddings_and_an_engine_outliving_its_model(tmp_path: Path) -> None:
    directory, _ = save_tiny_checkpoint(tmp_path / "tied", seed=5, tie_word_embeddings=True)  # 2 KV heads
    prompt = [7, 3, 9, 1, 4] * 5
    outputs = []
    for degree in (1, 2):
        engine = export_eager(directory, tp_degree=degree, **SETTINGS).create_engine()
        gc.collect()  # only the engine refers to the model now
        request_id = engine.add_request(EngineRequest(prompt, SamplingParams(max_tokens=8, temperature=0.0)))
        outputs.append(engine.run()[request_id].output_ids)
    assert outputs[0] == outputs[1]


def test_closing_the_model_lets_every_worker_leave_before_rank_0(checkpoint: Path) -> None:
    """Rank 0 holds the store: it waits until each worker has released its group and said so, and the
    workers end by themselves (exit code 0) instead of being terminated."""
    model = export_eager(checkpoint, tp_degree=2, **SETTINGS)
    model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=2, do_sample=False)
    group = model.tensor_parallel.group
    del model
    gc.collect()
    assert [worker.returncode for worker in group.workers] == [0]
    assert group.store.check(["left/1"])


def test_save_and_load(two, checkpoint: Path, tmp_path: Path) -> None:
    directory = tmp_path / "saved"
    two.save_pretrained(directory)
    original = {**load_file(checkpoint / "model.safetensors"), **load_file(checkpoint / "mtp.safetensors")}
    saved = load_file(directory / "model.safetensors")
    assert all(torch.equal(saved[name], original[name]) for name in saved)
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    qkv = "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert manifest["sharding_plan"][qkv] == "qkv"
    assert manifest["sharding_plan"]["model.layers.0.mlp.down_proj.weight"] == "columns"
    loaded = NeuronQwen36ForCausalLM.from_pretrained(directory)
    assert loaded.neuron_config.tp_degree == 2
    prompt = torch.tensor([[5, 6, 7, 8]])
    expected = two.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(loaded.generate(prompt, max_new_tokens=6, do_sample=False), expected)
    with pytest.raises(ValueError, match="tp_degree"):
        NeuronQwen36ForCausalLM.from_pretrained(directory, tp_degree=1)
    if two.neuron_config.backend != "cpu":
        return
    # The loaded graphs run the collectives: a killed worker fails the next one, with a clear error.
    os.kill(loaded.tensor_parallel.group.workers[0].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TensorParallelWorkerError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        loaded.generate(prompt, max_new_tokens=4)
    assert time.monotonic() - start < 30
    # Graphs compiled for another plan's local shapes are refused.
    manifest["sharding_plan"][qkv] = "rows"
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(TensorParallelError, match=f"another sharding plan \\({qkv}: split as 'rows'"):
        NeuronQwen36ForCausalLM.from_pretrained(directory)


def test_speculative_decoding_matches_one_process(checkpoint: Path) -> None:
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 4, [2, 7, 1, 8, 2, 8]]
    outputs = []
    for degree in (1, 2):
        model = export_eager(checkpoint, tp_degree=degree, num_speculative_tokens=2, **SETTINGS)
        engine = model.create_engine()
        ids = [
            engine.add_request(EngineRequest(p, SamplingParams(max_tokens=12, temperature=0.0)))
            for p in prompts
        ]
        done = engine.run()
        outputs.append([done[i].output_ids for i in ids])
    assert outputs[0] == outputs[1]


def test_cpu_tensor_parallelism_needs_the_graph_runner(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the runner that releases the GIL, a rank's graphs could deadlock on their collectives."""
    from optimum_qwen36.backends import compiled_graph

    monkeypatch.setattr(compiled_graph, "graph_runner_module", lambda: None)
    with pytest.raises(RuntimeError, match="needs the graph runner extension"):
        NeuronQwen36ForCausalLM.from_pretrained(
            checkpoint, export=True, backend="cpu", tp_degree=2, **SETTINGS
        )


def test_killed_worker_ends_the_model_with_a_clear_error(checkpoint: Path) -> None:
    model = export_eager(checkpoint, tp_degree=2, **SETTINGS)
    worker = model.tensor_parallel.group.workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TensorParallelWorkerError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    assert time.monotonic() - start < 30
    with pytest.raises(TensorParallelWorkerError, match="cannot run any more"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4)


@pytest.mark.parametrize("here", [True, False], ids=["rank-0", "worker"])
def test_a_rank_failing_alone_ends_the_model_at_once_with_its_error(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, here: bool
) -> None:
    """The others are then waiting at the next step's lockstep check (not stuck in a collective)."""
    tests = str(Path(__file__).parent)  # the workers unpickle the processor from tests/helpers.py
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    model = export_eager(checkpoint, tp_degree=2, **SETTINGS)
    processors = LogitsProcessorList([FailsInOneProcess(here)])
    failed = r"rank 0 failed alone \(RuntimeError" if here else r"worker rank 1 failed \(RuntimeError"
    start = time.monotonic()
    with pytest.raises(TensorParallelWorkerError, match=f"{failed}: failing on purpose"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, logits_processor=processors)
    assert time.monotonic() - start < 5


def test_diverged_ranks_end_the_model_with_a_clear_error(checkpoint: Path) -> None:
    """Ranks that plan different steps (here rank 0's engine has one GDN slot fewer, so it admits fewer
    requests) are stopped before their collectives mismatch (gloo would abort the process or hang)."""
    engine = export_eager(checkpoint, tp_degree=2, **SETTINGS).create_engine()
    engine._engine.scheduler._free_slots.pop()  # rank 0's engine only
    for length in (40, 20, 30):
        engine.add_request(
            EngineRequest(list(range(1, length)), SamplingParams(max_tokens=4, temperature=0.0))
        )
    start = time.monotonic()
    diverged = r"ranks diverged \(both at prefill_chunk .* with different inputs"
    with pytest.raises(TensorParallelWorkerError, match=diverged):
        engine.run()
    assert time.monotonic() - start < 5
    with pytest.raises(TensorParallelWorkerError, match="cannot run any more"):
        engine.add_request(EngineRequest([1, 2, 3], SamplingParams(max_tokens=2)))


@pytest.mark.parametrize("nodes", [1, 2])
def test_torchrun_launch(checkpoint: Path, one, tmp_path: Path, nodes: int) -> None:
    """One torchrun on one node with 2 processes, and the documented multi-node launch as 2 nodes of one
    process each (two torchrun launchers meeting at a c10d rendezvous endpoint, here both on this host)."""
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import gc
            import torch
            from optimum_qwen36 import NeuronQwen36ForCausalLM
            model = NeuronQwen36ForCausalLM.from_pretrained(
                {str(checkpoint)!r}, export=True, backend="eager", dtype="float32", tp_degree=2,
                batch_size=3, sequence_length=256, prefill_chunk_size=32,
            )
            tokens = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=6, do_sample=False)
            print("TOKENS", tokens.tolist())
            del model
            gc.collect()
            # the group it initialized is destroyed with the model (left to interpreter teardown, gloo can
            # abort the process)
            print("GROUP DESTROYED", not torch.distributed.is_initialized())
            """
        )
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if nodes == 1:
        result = subprocess.run(
            [*torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), str(script)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    else:
        endpoint = f"127.0.0.1:{free_port()}"
        multi_node = [
            *torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "test", str(script),
        ]  # fmt: skip
        second = subprocess.Popen(multi_node, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            result = subprocess.run(multi_node, capture_output=True, text=True, timeout=300)
            second_out, second_err = second.communicate(timeout=60)
        finally:
            second.kill()  # never left running when the first launcher fails or times out
        # either launcher's failure can surface in the other (its agent loses the rendezvous): show both
        both = f"first launcher:\n{result.stderr[-3000:]}\nsecond launcher:\n{second_err[-3000:]}"
        assert (result.returncode, second.returncode) == (0, 0), both
        # rank 0 (which prints) runs under one launcher or the other
        result.stdout += second_out
    assert result.returncode == 0, result.stderr[-3000:]
    expected = one.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=6, do_sample=False).tolist()
    assert f"TOKENS {expected}" in result.stdout
    assert "GROUP DESTROYED True" in result.stdout
