"""The native paged attention op (ops/csrc/paged_attention.cpp) against a float32 reference and its PyTorch
twin, and its use by the cpu backend's graphs."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import engine_storage, needs_bf16_kernels

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.exporters.aoti import _MethodAsForward
from optimum_qwen36.exporters.example_args import example_step_args
from optimum_qwen36.network.model import Qwen36Attention
from optimum_qwen36.ops.attention import (
    paged_attention_native,
    paged_attention_torch,
    paged_attention_varlen_native,
    paged_attention_varlen_torch,
)
from optimum_qwen36.ops.conv import (
    causal_conv1d_decode,
    causal_conv1d_decode_native,
    causal_conv1d_varlen,
    causal_conv1d_varlen_native,
)
from optimum_qwen36.ops.gdn import (
    gdn_decode_step_native,
    gdn_decode_step_torch,
    gdn_prefill_chunk_native,
    gdn_prefill_chunk_torch,
    gdn_verify_step_native,
    gdn_verify_step_torch,
)
from optimum_qwen36.ops.native import load_native_ops

needs_native = pytest.mark.skipif(not load_native_ops(), reason="the native CPU kernels cannot be built here")


def _case(
    batch: int, tokens: int, heads: int, kv_heads: int, dim: int, block_size: int, max_blocks: int,
    starts: list[int], dtype: torch.dtype, seed: int = 0,
) -> tuple:  # fmt: skip
    """Random caches of 3 layers (layer 1 read), each row's blocks scattered over the pool, queries at
    positions starts[b] + t."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = batch * max_blocks + 3
    shape = (3, num_blocks, block_size, kv_heads, dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    pool = torch.randperm(num_blocks - 1, generator=generator) + 1
    block_tables = pool[: batch * max_blocks].view(batch, -1)
    query = (3 * torch.randn(batch, tokens, heads, dim, generator=generator)).to(dtype)
    positions = torch.tensor(starts).view(batch, 1) + torch.arange(tokens)
    return query, key_cache, value_cache, 1, block_tables, positions, dim**-0.5


CASES = {
    # batch, tokens, heads, kv_heads, dim, block_size, max_blocks, starts
    "prefill chunk, GQA 4, D 256": (1, 96, 8, 2, 256, 16, 24, [200]),
    "first chunk": (1, 70, 8, 2, 128, 16, 8, [0]),
    "decode rows of different lengths": (3, 1, 4, 4, 32, 4, 40, [0, 17, 130]),
    "verify rows, GQA 3": (2, 4, 6, 2, 64, 8, 40, [3, 250]),
    "positions past the table": (2, 7, 6, 2, 64, 8, 20, [0, 150]),
    "head size not a multiple of 32": (2, 5, 4, 2, 48, 8, 10, [0, 33]),
}


@needs_native
@pytest.mark.parametrize("case", CASES)
def test_bf16_native_is_as_close_to_float32_as_the_twin(case: str) -> None:
    """bf16 inputs: the op (flash kernel with AVX-512 BF16, else ATen's attention) is within the error of
    the bf16 twin, both measured against float32 attention over the same bf16 values."""
    args = _case(*CASES[case], dtype=torch.bfloat16)
    query, key_cache, value_cache, *rest = args
    exact = paged_attention_torch(query.float(), key_cache.float(), value_cache.float(), *rest)
    native = paged_attention_native(*args)
    twin = paged_attention_torch(*args)
    assert native.shape == query.shape and native.dtype == torch.bfloat16 and native.is_contiguous()
    twin_error = (twin.float() - exact).abs().max().item()
    assert (native.float() - exact).abs().max().item() <= 1.5 * twin_error + 1e-3


@needs_native
@pytest.mark.parametrize("case", CASES)
def test_float32_native_equals_twin(case: str) -> None:
    args = _case(*CASES[case], dtype=torch.float32)
    expected = paged_attention_torch(*args)
    torch.testing.assert_close(paged_attention_native(*args), expected, atol=1e-5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_keys_a_query_cannot_see_change_nothing(dtype: torch.dtype) -> None:
    """Huge values in every cache slot past each row's last position (and in other rows' blocks and other
    layers) leave the output bit for bit unchanged: masked keys get exactly zero weight."""
    query, key_cache, value_cache, layer, block_tables, positions, scale = _case(
        2, 40, 8, 2, 128, 16, 12, [9, 100], dtype=dtype
    )
    out = paged_attention_native(query, key_cache, value_cache, layer, block_tables, positions, scale)
    block_size = key_cache.shape[2]
    noisy_keys, noisy_values = key_cache.clone(), value_cache.clone()
    for row in range(2):
        seen = int(positions[row].max()) + 1
        for j in range(seen, block_tables.shape[1] * block_size):
            block, slot = block_tables[row, j // block_size], j % block_size
            noisy_keys[layer, block, slot] = 1e4
            noisy_values[layer, block, slot] = -1e4
    noisy_keys[0], noisy_values[2] = 1e4, 1e4
    noisy = paged_attention_native(query, noisy_keys, noisy_values, layer, block_tables, positions, scale)
    assert torch.equal(out, noisy)


@needs_native
@needs_bf16_kernels
def test_a_query_alone_equals_it_among_a_prefills_queries_bitwise() -> None:
    """bf16: keys are packed once for a sequence whose queries fill several work items (a prefill chunk) and
    block by block for one of a single item (a decode row); both read the same packed values, and each
    query row's products are its own, so every query of a 70-token chunk gets, bitwise, what it gets as
    the one token of a decode step over the same keys."""
    query, key_cache, value_cache, layer, block_tables, positions, scale = _case(
        1, 70, 8, 2, 256, 16, 24, [230], dtype=torch.bfloat16, seed=7
    )
    chunk = paged_attention_native(query, key_cache, value_cache, layer, block_tables, positions, scale)
    for t in (0, 15, 16, 47, 69):
        alone = paged_attention_native(
            query[:, t : t + 1], key_cache, value_cache, layer, block_tables, positions[:, t : t + 1], scale
        )
        assert torch.equal(alone, chunk[:, t : t + 1])


def _packed_case(dtype: torch.dtype) -> tuple:
    """Sequences of 70, 1, 0, 33 and 1 queries at their own positions over their own scattered blocks, packed
    along the tokens, plus 3 tokens after the last sequence."""
    lengths, starts = [70, 1, 0, 33, 1], [0, 130, 5, 200, 9]
    query, key_cache, value_cache, layer, block_tables, _, scale = _case(
        len(lengths), 1, 8, 2, 128, 16, 24, starts, dtype=dtype, seed=3
    )
    generator = torch.Generator().manual_seed(5)
    query = (3 * torch.randn(1, sum(lengths) + 3, 8, 128, generator=generator)).to(dtype)
    positions = torch.cat([torch.arange(n) + start for n, start in zip(lengths, starts, strict=True)])
    positions = torch.cat([positions, torch.zeros(3, dtype=torch.long)]).unsqueeze(0)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return query, key_cache, value_cache, layer, block_tables, cu_seqlens, positions, scale


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_sequences_attend_as_each_alone(dtype: torch.dtype) -> None:
    """The varlen op on packed sequences (one of them empty) gives each sequence the batched op's output on
    that sequence alone (bitwise: the same kernel per sequence), the twin's within rounding; tokens after
    the last sequence get zeros."""
    args = _packed_case(dtype)
    query, key_cache, value_cache, layer, block_tables, cu_seqlens, positions, scale = args
    native = paged_attention_varlen_native(*args)
    twin = paged_attention_varlen_torch(*args)
    bounds = cu_seqlens.tolist()
    for s, (first, end) in enumerate(itertools.pairwise(bounds)):
        if end > first:
            alone = paged_attention_native(
                query[:, first:end], key_cache, value_cache, layer, block_tables[s : s + 1],
                positions[:, first:end], scale,
            )  # fmt: skip
            assert torch.equal(native[:, first:end], alone)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(native.float(), twin.float(), atol=tol, rtol=tol)
    assert torch.equal(native[:, bounds[-1] :], torch.zeros_like(native[:, bounds[-1] :]))


@needs_native
def test_cpu_graphs_call_the_op_and_the_model_keeps_its_twin(tiny_checkpoint) -> None:
    """The cpu backend traces attention as the native op (every step, any dtype); after compiling, the
    model's attention layers are back on the PyTorch twin (eager runs stay the reference)."""
    checkpoint, _ = tiny_checkpoint()
    model = NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint, export=True, backend="cpu", batch_size=2, sequence_length=64, prefill_chunk_size=16
    )
    attention = [m for m in model.model.modules() if isinstance(m, Qwen36Attention)]
    assert attention and all(m.paged_attention is paged_attention_torch for m in attention)

    args = example_step_args(model.neuron_config, engine_storage(model))["prefill_chunk"]
    model.model.set_kernels(
        paged_attention_native,
        paged_attention_varlen_native,
        gdn_decode_step_native,
        gdn_prefill_chunk_native,
        gdn_verify_step_native,
        causal_conv1d_varlen_native,
        causal_conv1d_decode_native,
    )
    try:
        with torch.no_grad():
            program = torch.export.export(_MethodAsForward(model.model, "prefill_chunk"), args, strict=False)
    finally:
        model.model.set_kernels(
            paged_attention_torch,
            paged_attention_varlen_torch,
            gdn_decode_step_torch,
            gdn_prefill_chunk_torch,
            gdn_verify_step_torch,
            causal_conv1d_varlen,
            causal_conv1d_decode,
        )
    op = torch.ops.optimum_qwen36.paged_attention.default
    calls = sum(node.target is op for node in program.graph.nodes)
    assert calls == len(attention)
