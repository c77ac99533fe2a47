"""Packed prefill: chunks of several sequences in one prefill call (`ModelRunner.prefill_packed`) compute
exactly what one call per chunk computes: each sequence's logits, KV entries and GDN states.

The shared check (`assert_packed_equals_one_per_call`) runs here on the eager backend (the PyTorch twins, one
sequence at a time inside the call) and in test_export_cpu.py on the cpu graphs (the native varlen ops)."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import engine_storage, export_eager, left_padded_prompts

from optimum_qwen36.engine import EngineRequest, SamplingParams
from optimum_qwen36.engine.runner import ModelRunner, PackedChunk
from optimum_qwen36.nki import causal_conv1d_fn
from optimum_qwen36.ops.conv import (
    causal_conv1d_decode,
    causal_conv1d_decode_native,
    causal_conv1d_varlen,
    causal_conv1d_varlen_native,
    snapshot_conv_tail,
    varlen_conv_indices,
)
from optimum_qwen36.ops.native import load_native_ops


def _runner(model) -> ModelRunner:
    return ModelRunner(model.backend, engine_storage(model), model.neuron_config.prefill_chunk_size)


def _prompt(length: int, seed: int) -> list[int]:
    return left_padded_prompts([length], seed=seed)[0][0].tolist()


def assert_each_as_alone(model, together: dict, ids: list[str], prompts: list[list[int]], params) -> None:
    """Each request's greedy tokens are its solo run's, its log-probabilities within 1e-5."""
    for request_id, prompt in zip(ids, prompts, strict=True):
        alone = model.create_engine()
        solo_id = alone.add_request(EngineRequest(prompt, params))
        solo = alone.run()[solo_id]
        assert together[request_id].output_ids == solo.output_ids
        torch.testing.assert_close(
            torch.tensor(together[request_id].output_logprobs), torch.tensor(solo.output_logprobs),
            atol=1e-5, rtol=0,
        )  # fmt: skip


def assert_close_to_largest(got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    """Within `atol` times the largest magnitude of `want` (at least `atol`): the two forms sum in different
    orders, so their differences scale with the values summed."""
    torch.testing.assert_close(got, want, atol=atol * max(1.0, want.abs().max().item()), rtol=0)


def assert_packed_equals_one_per_call(model, atol: float) -> None:
    """Up to three sequences (as many as the batch has slots; row = slot, each with its row's block table):
    one continuing 9 already-computed tokens in slot 0 with 6 more, a fresh prompt of 7 tokens in the last
    slot, and (3 slots or more) a fresh single token in slot 1; packed in one call, then the same chunks one
    per call on a fresh cache. Logits, the sequences' KV entries and every slot's conv and recurrent states
    agree within `atol` of their largest value."""
    chunk, batch = model.neuron_config.prefill_chunk_size, model.neuron_config.batch_size
    assert chunk >= 14 and batch >= 2, "the packed chunks must fit one call"
    prefix, continued, fresh, single = _prompt(9, 1), _prompt(6, 2), _prompt(7, 3), _prompt(1, 4)
    plans = [(fresh, 0, batch - 1), (continued, 9, 0), *([(single, 0, 1)] if batch >= 3 else [])]
    results = []
    for packed in (True, False):
        runner = _runner(model)
        tables = runner.cache.row_block_tables()
        runner.prefill(PackedChunk(prefix, 0, 0, tables[0]))
        chunks = [PackedChunk(tokens, start, slot, tables[slot]) for tokens, start, slot in plans]
        logits = runner.prefill_packed(chunks) if packed else torch.cat([runner.prefill(c) for c in chunks])
        results.append((logits, runner.cache))
    (packed_logits, packed), (logits, alone) = results
    assert packed_logits.shape == (len(plans), model.config.vocab_size)
    assert_close_to_largest(packed_logits, logits, atol)
    block_size = alone.key_cache.shape[2]
    for tokens, start, slot in plans:
        blocks = alone.row_block_tables()[slot, : -(-(start + len(tokens)) // block_size)]
        for cache_tensor in ("key_cache", "value_cache"):
            got = getattr(packed, cache_tensor)[:, blocks].flatten(1, 2)[:, : start + len(tokens)]
            want = getattr(alone, cache_tensor)[:, blocks].flatten(1, 2)[:, : start + len(tokens)]
            assert_close_to_largest(got, want, atol)
    for state in ("conv_state", "recurrent_state"):  # the rows' slots (padding writes the scratch slot)
        got, want = getattr(packed, state)[:, :batch], getattr(alone, state)[:, :batch]
        assert_close_to_largest(got, want, atol)


def assert_decode_rows_ride_along(model, atol: float) -> None:
    """A whole chunk in slot 0 and a decode row (one token after a 5-token prompt) in every other slot, more
    tokens than a chunk in one packed call: logits, KV entries and every slot's GDN states agree within
    `atol` with a prefill call for the chunk and a decode step for the rows."""
    chunk, batch = model.neuron_config.prefill_chunk_size, model.neuron_config.batch_size
    long = _prompt(chunk, 1)
    prompts = {slot: _prompt(5, 10 + slot) for slot in range(1, batch)}
    fed = {slot: _prompt(1, 20 + slot) for slot in range(1, batch)}
    results = []
    for packed in (True, False):
        runner = _runner(model)
        tables = runner.cache.row_block_tables()
        for slot, prompt in prompts.items():
            runner.prefill(PackedChunk(prompt, 0, slot, tables[slot]))
        decode_rows = [PackedChunk(fed[slot], 5, slot, tables[slot]) for slot in prompts]
        if packed:
            assert chunk + len(decode_rows) <= runner.max_packed_tokens
            logits = runner.prefill_packed([PackedChunk(long, 0, 0, tables[0]), *decode_rows])
        else:
            slots = torch.tensor(list(prompts))
            tokens = torch.tensor([fed[slot][0] for slot in prompts])
            decoded = runner.decode(tokens, torch.full((batch - 1,), 5), slots, tables[slots])
            logits = torch.cat([runner.prefill(PackedChunk(long, 0, 0, tables[0])), decoded])
        results.append((logits, runner.cache))
    (packed_logits, packed), (logits, alone) = results
    assert_close_to_largest(packed_logits, logits, atol)
    # Not the null block nor the scratch slot: padding rows write there, and nobody reads them.
    blocks, slots = slice(1, None), slice(0, batch)
    for name, used in (("key_cache", blocks), ("value_cache", blocks), ("conv_state", slots)):
        got, want = getattr(packed, name)[:, used], getattr(alone, name)[:, used]
        assert_close_to_largest(got, want, atol)
    got, want = packed.recurrent_state[:, slots], alone.recurrent_state[:, slots]
    assert_close_to_largest(got, want, atol)


def assert_snapshots_equal_chunks_ending_there(model, atol: float) -> None:
    """An 11-token chunk in slot 0 continuing 3 computed tokens, snapshotted after positions 5 and 7 (the
    second one's conv window reaching back past the first), beside a 4-token chunk in slot 1: each snapshot
    slot holds the GDN state (conv and recurrent) that the sequence's slot holds after chunks ending at that
    position, within `atol` of the largest value; logits, every row slot's states and the KV agree as well.
    Snapshots outside their chunk or more than the backend takes are refused."""
    prefix, continued, other = _prompt(3, 1), _prompt(11, 2), _prompt(4, 3)
    cuts = [5, 7]
    runner = _runner(model)
    assert runner.cache.snapshot_slots == len(cuts) == model.backend.prefill_snapshots
    tables = runner.cache.row_block_tables()
    runner.prefill(PackedChunk(prefix, 0, 0, tables[0]))
    chunks = [PackedChunk(continued, 3, 0, tables[0], cuts), PackedChunk(other, 0, 1, tables[1])]
    packed_logits = runner.prefill_packed(chunks)
    snapshots = [tuple(t.clone() for t in runner.snapshot_state(i)) for i in range(len(cuts))]

    alone = _runner(model)
    alone.prefill(PackedChunk(prefix, 0, 0, tables[0]))
    expected = []
    for first, end in itertools.pairwise([3, *cuts, 14]):
        logits = alone.prefill(PackedChunk(continued[first - 3 : end - 3], first, 0, tables[0]))
        expected.append(tuple(t.clone() for t in alone.slot_state(0)))
    logits = torch.cat([logits, alone.prefill(PackedChunk(other, 0, 1, tables[1]))])
    assert_close_to_largest(packed_logits, logits, atol)
    for got, want in zip(snapshots, expected[:-1], strict=True):
        assert_close_to_largest(got[0], want[0], atol)
        assert_close_to_largest(got[1], want[1], atol)
    rows = slice(0, model.neuron_config.batch_size)
    for state in ("conv_state", "recurrent_state"):
        got, want = getattr(runner.cache, state)[:, rows], getattr(alone.cache, state)[:, rows]
        assert_close_to_largest(got, want, atol)
    for name in ("key_cache", "value_cache"):
        assert_close_to_largest(getattr(runner.cache, name)[:, 1:], getattr(alone.cache, name)[:, 1:], atol)
    with pytest.raises(ValueError, match="not inside its chunk"):
        runner.prefill_packed([PackedChunk(other, 0, 1, tables[1], [4])])
    with pytest.raises(ValueError, match="takes 2 snapshots"):
        runner.prefill_packed([PackedChunk(continued, 3, 0, tables[0], [4, 5, 6])])


def test_packed_prefill_equals_one_call_per_chunk_eager(tiny_checkpoint) -> None:
    checkpoint, _ = tiny_checkpoint(seed=3)
    model = export_eager(checkpoint, batch_size=4, sequence_length=128, prefill_chunk_size=32)
    assert_packed_equals_one_per_call(model, atol=1e-5)
    assert_decode_rows_ride_along(model, atol=1e-5)
    assert_snapshots_equal_chunks_ending_there(model, atol=1e-5)


def test_packed_prefill_refuses_what_one_call_cannot_hold(tiny_checkpoint) -> None:
    checkpoint, _ = tiny_checkpoint()
    model = export_eager(checkpoint, batch_size=2, sequence_length=128, prefill_chunk_size=16)
    runner = _runner(model)
    table = runner.cache.row_block_tables()[0]
    # A chunk of 16 tokens and one per batch row (decode rows riding along): 18 at most.
    too_many = [PackedChunk(_prompt(10, 1), 0, 0, table), PackedChunk(_prompt(9, 2), 0, 1, table)]
    with pytest.raises(ValueError, match=r"1\.\.18 tokens in non-empty chunks"):
        runner.prefill_packed(too_many)
    with pytest.raises(ValueError, match="non-empty"):
        runner.prefill_packed([PackedChunk([], 0, 0, table)])


def test_engine_packs_the_chunks_of_a_step_and_keeps_each_requests_tokens(tiny_checkpoint) -> None:
    """Four short prompts admitted together are prefilled in one call (the chunk holds all of them); each
    request's greedy tokens and log-probabilities are those of its solo run."""
    checkpoint, _ = tiny_checkpoint(seed=5)
    model = export_eager(checkpoint, batch_size=4, sequence_length=128, prefill_chunk_size=64)
    calls: list[int] = []
    prefill = model.backend.prefill_chunk

    def counting(*args: torch.Tensor, **snapshots: torch.Tensor) -> torch.Tensor:
        calls.append(args[3].numel())
        return prefill(*args, **snapshots)

    prompts = [_prompt(n, seed) for n, seed in ((5, 1), (17, 2), (1, 3), (30, 4))]
    params = SamplingParams(temperature=0, max_tokens=6)
    engine = model.create_engine()
    model.backend.prefill_chunk = counting
    try:
        ids = [engine.add_request(EngineRequest(prompt, params)) for prompt in prompts]
        together = engine.run()
    finally:
        del model.backend.prefill_chunk
    assert calls == [4], calls
    assert_each_as_alone(model, together, ids, prompts, params)


def test_a_mixed_step_is_one_packed_prefill_call_holding_the_decode_rows(tiny_checkpoint) -> None:
    """A step with decoding requests and a newly admitted prompt: one prefill call for the chunk and the
    decoding rows (one-token sequences); steps without a prefill chunk decode alone. Every request gets its
    solo run's greedy tokens, its log-probabilities within 1e-5."""
    checkpoint, _ = tiny_checkpoint(seed=6)
    model = export_eager(checkpoint, batch_size=3, sequence_length=128, prefill_chunk_size=32)
    backend = model.backend
    calls: list[tuple[str, int]] = []
    prefill, decode = backend.prefill_chunk, backend.decode_step

    def counting_prefill(*args: torch.Tensor, **snapshots: torch.Tensor) -> torch.Tensor:
        calls.append(("prefill", args[3].numel()))
        return prefill(*args, **snapshots)

    def counting_decode(*args: torch.Tensor) -> torch.Tensor:
        calls.append(("decode", len(args[0])))
        return decode(*args)

    prompts = [_prompt(n, seed) for n, seed in ((12, 1), (3, 2), (40, 3))]
    params = SamplingParams(temperature=0, max_tokens=8)
    engine = model.create_engine()
    backend.prefill_chunk, backend.decode_step = counting_prefill, counting_decode
    try:
        first = [engine.add_request(EngineRequest(prompt, params)) for prompt in prompts[:2]]
        engine.step()
        engine.step()
        calls.clear()
        late = engine.add_request(EngineRequest(prompts[2], params))  # 40 tokens: chunks of 32 and 8
        engine.step()
        engine.step()
        assert calls == [("prefill", 3), ("prefill", 3)], calls
        engine.step()
        assert calls[2:] == [("decode", 3)], calls
        together = engine.run()
    finally:
        del backend.prefill_chunk, backend.decode_step
    assert_each_as_alone(model, together, [*first, late], prompts, params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_packed_conv_equals_the_pytorch_form(dtype: torch.dtype) -> None:
    """The native op against the PyTorch form on packed sequences shorter than the conv's history, empty
    and longer, with a channel count that is not a multiple of the vector width and more tokens than one
    thread's range: the new conv states bitwise, the outputs within a float32 rounding of the SiLU (bf16:
    one bf16 rounding where the float32 values straddle a rounding boundary)."""
    if not load_native_ops():
        pytest.skip("the native ops do not build here")
    lengths, width, channels = [150, 0, 1, 2, 3, 5, 70], 4, 37
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(sum(lengths), channels, generator=generator).to(dtype)
    weight = torch.randn(channels, width, generator=generator).to(dtype)
    states = torch.randn(len(lengths), channels, width - 1, generator=generator).to(dtype)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    indices = varlen_conv_indices(cu_seqlens, width)
    out, new_states = causal_conv1d_varlen_native(x, weight, states, *indices)
    reference, reference_states = causal_conv1d_varlen(x, weight, states, *indices)
    assert out.dtype == dtype and new_states.dtype == dtype
    assert torch.equal(new_states, reference_states)
    tolerance = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(out, reference, **tolerance)
    # Row by row, whatever else is packed with it: the last sequence alone gives the same bits.
    last = sum(lengths[:-1])
    alone_indices = varlen_conv_indices(torch.tensor([0, lengths[-1]]), width)
    alone, _ = causal_conv1d_varlen_native(x[last:], weight, states[-1:], *alone_indices)
    assert torch.equal(alone, out[last:])
    head_tokens, head_taps, conv_tail = indices
    with pytest.raises(RuntimeError, match="head_taps"):  # a short index is refused, never read past
        causal_conv1d_varlen_native(x, weight, states, head_tokens, head_taps[:, :1], conv_tail)


@pytest.mark.parametrize("width", [4, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_conv_updates_the_cache_as_the_pytorch_form(dtype: torch.dtype, width: int) -> None:
    """A decode step's conv on three rows (slots 4, 0, 2 of cache entry 1; 37 channels, not a multiple of
    the vector width; Qwen's 4 taps, which have a path of their own in bf16, and 3): the native op leaves
    the cache bitwise as the PyTorch form does (only those slots of that entry change), its outputs within a
    float32 rounding of the SiLU (bf16: one bf16 rounding), and each row's output bitwise that of the varlen
    op for the same token packed after the same state."""
    if not load_native_ops():
        pytest.skip("the native ops do not build here")
    entries, num_slots, channels = 3, 5, 37
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(3, channels, generator=generator).to(dtype)
    weight = torch.randn(channels, width, generator=generator).to(dtype)
    cache = torch.randn(entries, num_slots, channels, width - 1, generator=generator).to(dtype)
    slots = torch.tensor([4, 0, 2])
    native_cache, torch_cache = cache.clone(), cache.clone()
    out = causal_conv1d_decode_native(x, weight, native_cache, 1, slots)
    reference = causal_conv1d_decode(x, weight, torch_cache, 1, slots)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(native_cache, torch_cache)
    changed = (native_cache != cache).flatten(2).any(-1).nonzero().tolist()
    assert changed == [[1, 0], [1, 2], [1, 4]]
    assert torch.equal(native_cache[1, slots, :, -1], x)
    tolerance = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(out, reference, **tolerance)
    packed, _ = causal_conv1d_varlen_native(
        x, weight, cache[1, slots], *varlen_conv_indices(torch.arange(4), width)
    )
    assert torch.equal(out, packed)
    with pytest.raises(RuntimeError, match="slot 5 outside"):  # refused, never written past the cache
        causal_conv1d_decode_native(x, weight, native_cache, 1, torch.tensor([4, 0, 5]))
    # A padding row (slot -1): no state moves for it, its output is zeros, the others' are as without it;
    # the PyTorch form computes it in the last slot (the cache's scratch slot).
    padded_slots = torch.tensor([4, -1, 2])
    native_cache, torch_cache = cache.clone(), cache.clone()
    padded = causal_conv1d_decode_native(x, weight, native_cache, 1, padded_slots)
    assert not padded[1].any() and torch.equal(padded[[0, 2]], out[[0, 2]])
    changed = (native_cache != cache).flatten(2).any(-1).nonzero().tolist()
    assert changed == [[1, 2], [1, 4]]
    causal_conv1d_decode(x, weight, torch_cache, 1, padded_slots)
    assert torch.equal(torch_cache[1, -1, :, -1], x[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_conv_equals_each_sequence_alone(dtype: torch.dtype) -> None:
    """Sequences of 10, 0, 1, 2, 3 and 5 tokens packed (shorter than the conv's history, empty, longer):
    each one's new conv state is bitwise that of `causal_conv1d_fn` on it alone, and its output the same
    float32 sums (within 1e-6: ATen's SiLU rounds its vector and scalar paths differently)."""
    lengths, width, channels = [10, 0, 1, 2, 3, 5], 4, 24
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(sum(lengths), channels, generator=generator).to(dtype)
    weight = torch.randn(channels, width, generator=generator).to(dtype)
    states = torch.randn(len(lengths), channels, width - 1, generator=generator).to(dtype)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out, new_states = causal_conv1d_varlen(x, weight, states, *varlen_conv_indices(cu_seqlens, width))
    for s, (first, end) in enumerate(itertools.pairwise(cu_seqlens.tolist())):
        if end == first:
            assert torch.equal(new_states[s], states[s])
            continue
        alone, state = causal_conv1d_fn(
            x[first:end].t().unsqueeze(0), weight, initial_state=states[s : s + 1]
        )
        torch.testing.assert_close(out[first:end], alone[0].t(), atol=1e-6, rtol=1e-6)
        assert torch.equal(new_states[s], state[0])


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_packed_conv_snapshots_the_conv_state_inside_sequences(native: bool) -> None:
    """Snapshot rows after the sequences' tails: the conv state 2 tokens into a sequence (reaching into its
    state rows) and 40 tokens in are bitwise `causal_conv1d_fn`'s on that sequence's tokens up to there; an
    end of 0 (a padding entry) reads the first sequence's state; the sequences' own new states are as
    without snapshots."""
    if native and not load_native_ops():
        pytest.skip("the native ops do not build here")
    conv = causal_conv1d_varlen_native if native else causal_conv1d_varlen
    lengths, width, channels = [5, 60], 4, 24
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(sum(lengths), channels, generator=generator)
    weight = torch.randn(channels, width, generator=generator)
    states = torch.randn(len(lengths), channels, width - 1, generator=generator)
    cu_seqlens = torch.tensor([0, 5, 65])
    heads, taps, tails = varlen_conv_indices(cu_seqlens, width)
    ends = torch.tensor([7, 45, 0])
    snapshot_tails = snapshot_conv_tail(cu_seqlens, ends, width)
    _, plain = conv(x, weight, states, heads, taps, tails)
    _, new_states = conv(x, weight, states, heads, taps, torch.cat((tails, snapshot_tails)))
    assert new_states.shape == (len(lengths) + len(ends), channels, width - 1)
    assert torch.equal(new_states[: len(lengths)], plain)
    for row, (first, end, s) in enumerate([(5, 7, 1), (5, 45, 1)]):
        _, state = causal_conv1d_fn(x[first:end].t().unsqueeze(0), weight, initial_state=states[s : s + 1])
        assert torch.equal(new_states[len(lengths) + row], state[0])
    assert torch.equal(new_states[-1], states[0])
