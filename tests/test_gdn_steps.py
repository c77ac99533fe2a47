"""The in-place GDN steps (ops/gdn.py), decode step and prefill chunk: the native ops and the PyTorch forms
against the float64 token-by-token reference, on the cache's slots."""

from __future__ import annotations

import platform

import pytest
import torch
from gdn_reference import make_gdn_inputs, max_rel_error, reference_gated_delta_rule

from optimum_qwen36.ops.gdn import (
    gdn_decode_step_native,
    gdn_decode_step_torch,
    gdn_prefill_chunk_native,
    gdn_prefill_chunk_torch,
    gdn_verify_step_native,
    gdn_verify_step_torch,
)
from optimum_qwen36.ops.native import load_native_ops

STEPS = {"torch": gdn_decode_step_torch}
CHUNKS = {"torch": gdn_prefill_chunk_torch}
VERIFIES = {"torch": gdn_verify_step_torch}
if load_native_ops():
    STEPS["native"] = gdn_decode_step_native
    CHUNKS["native"] = gdn_prefill_chunk_native
    VERIFIES["native"] = gdn_verify_step_native


def _step_inputs(shape: tuple[int, int, int, int, int], dtype: torch.dtype, strong_decay: bool, seed: int):
    """One token per row (not normalised: the step normalises q and k), a cache of 3 layers x 7 slots."""
    batch, k_heads, v_heads, k_dim, v_dim = shape
    inputs = make_gdn_inputs(
        batch, 1, k_heads, v_heads, k_dim, v_dim, dtype=dtype, seed=seed, normalize_qk=False,
        a_log_max=4.0 if strong_decay else 1.0, softplus_max=12.0 if strong_decay else 3.0,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(seed + 1)
    states = torch.randn(3, 7, v_heads, k_dim, v_dim, generator=generator)
    slots = torch.randperm(7, generator=generator)[:batch]
    return inputs, states, slots


@pytest.mark.parametrize("name", list(STEPS))
@pytest.mark.parametrize(
    "shape", [(3, 2, 6, 32, 48), (2, 4, 4, 16, 16), (1, 2, 4, 128, 128)], ids=["group3", "group1", "qwen"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strong_decay", [False, True])
def test_decode_step_updates_the_rows_slots_like_the_reference(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, strong_decay: bool
) -> None:
    inputs, states, slots = _step_inputs(shape, dtype, strong_decay, seed=sum(shape))
    layer = 1
    expected_o, expected_state = reference_gated_delta_rule(
        **inputs, initial_state=states[layer, slots], use_qk_l2norm=True
    )
    cache = states.clone()
    args = (inputs[n][:, 0] for n in ("q", "k", "v", "g", "beta"))
    o = STEPS[name](*args, cache, layer, slots, shape[3] ** -0.5)
    assert o.shape == inputs["v"][:, 0].shape and o.dtype == dtype
    # float32 arithmetic: the output rounded once to the input dtype, the state to float32
    assert max_rel_error(o, expected_o[:, 0]) <= (1e-5 if dtype == torch.float32 else 2**-8)
    assert max_rel_error(cache[layer, slots], expected_state[:, 0]) <= 1e-5
    untouched = torch.ones(3, 7, dtype=torch.bool)
    untouched[layer, slots] = False
    assert torch.equal(cache[untouched], states[untouched])


@pytest.mark.skipif("native" not in STEPS, reason="the native CPU kernels cannot be built here")
def test_native_and_torch_steps_agree_over_many_steps() -> None:
    """Fifty steps in a row on the same slots: the two forms stay within float32 rounding of each other."""
    _, states, slots = _step_inputs((2, 2, 4, 32, 32), torch.float32, False, seed=5)
    native, torch_form = states.clone(), states.clone()
    for step in range(50):
        inputs = make_gdn_inputs(2, 1, 2, 4, 32, 32, seed=100 + step, normalize_qk=False)
        args = [inputs[n][:, 0] for n in ("q", "k", "v", "g", "beta")]
        o_native = gdn_decode_step_native(*args, native, torch.tensor([2]), slots, 32**-0.5)
        o_torch = gdn_decode_step_torch(*args, torch_form, 2, slots, 32**-0.5)
        torch.testing.assert_close(o_native, o_torch, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(native, torch_form, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif("native" not in STEPS, reason="the native CPU kernels cannot be built here")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the flush is x86's MXCSR mode")
@pytest.mark.parametrize("step", ["decode", "verify", "prefill"])
def test_native_ops_flush_denormals_in_their_workers_only(step: str) -> None:
    """A state of denormal values (1e-39, below float32's 1.2e-38) reads as zero inside each native GDN op,
    as the denormals a strong decay produces: computed with them, the Intel cores' microcode assists ran a
    prefill 2-3x slower. Without the flush, q S would be about 6e-39 here, not 0 (the PyTorch form, which
    does not flush, gets it). The caller's thread keeps its own mode: denormal arithmetic still works after
    the call."""
    heads, dim = 2, 32
    rows, tokens = {"decode": (2, 1), "verify": (2, 3), "prefill": (1, 64)}[step]
    shape = (rows, tokens, heads)
    q, k, v = torch.ones(*shape, dim), torch.ones(*shape, dim), torch.zeros(*shape, dim)
    g, beta = torch.zeros(shape), torch.zeros(shape)  # no decay, no write: the state is only read
    states = torch.full((1, rows, heads, dim, dim), 1e-39)
    spec = torch.zeros(1, rows, tokens, heads, dim, dim)
    slots = torch.arange(rows)

    def run(form: str) -> torch.Tensor:
        if step == "decode":
            return STEPS[form](q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], states.clone(), 0, slots, 1.0)
        if step == "verify":
            return VERIFIES[form](q, k, v, g, beta, states.clone(), spec.clone(), 0, slots, 1.0)
        return CHUNKS[form](q, k, v, g, beta, states.clone(), 0, slots, None, 1.0)

    flushed, unflushed = run("native"), run("torch")
    assert flushed.shape == unflushed.shape and not flushed.any()
    assert (unflushed > 0).all()
    tiny = torch.tensor([1e-39])
    assert (tiny * 2).item() > 0 and (tiny + tiny).item() == pytest.approx(2e-39, rel=1e-3)


@pytest.mark.parametrize("name", list(STEPS))
def test_a_padding_row_leaves_the_real_rows_and_slots_as_they_are(name: str) -> None:
    """Rows 1 and 3 are padding (slot -1, `PADDING_SLOT`): the real rows get bitwise what they get without
    them. The native op moves no state for a padding row (every slot but the real rows' is left as it is,
    the scratch slot too; its output is zeros); the PyTorch form computes it in the last slot."""
    inputs, states, _ = _step_inputs((4, 2, 4, 16, 16), torch.float32, False, seed=3)
    args = [inputs[n][:, 0] for n in ("q", "k", "v", "g", "beta")]
    slots = torch.tensor([2, -1, 0, -1])
    real = torch.tensor([0, 2])
    alone_cache, padded_cache = states.clone(), states.clone()
    alone = STEPS[name](*(a[real] for a in args), alone_cache, 1, slots[real], 0.25)
    padded = STEPS[name](*args, padded_cache, 1, slots, 0.25)
    assert torch.equal(padded[real], alone)
    scratch = torch.zeros(3, 7, dtype=torch.bool)
    scratch[1, -1] = True
    assert torch.equal(padded_cache[~scratch], alone_cache[~scratch])
    if name == "native":
        assert torch.equal(padded_cache, alone_cache) and not padded[[1, 3]].any()


@pytest.mark.skipif("native" not in STEPS, reason="the native CPU kernels cannot be built here")
def test_native_step_refuses_a_slot_outside_the_cache() -> None:
    inputs, states, _ = _step_inputs((1, 2, 4, 16, 16), torch.float32, False, seed=0)
    args = [inputs[n][:, 0] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(RuntimeError, match="slot 7 out of range"):
        gdn_decode_step_native(*args, states, 0, torch.tensor([7]), 0.25)


@pytest.mark.parametrize("name", list(VERIFIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_step_equals_decode_steps_and_leaves_the_slots_alone(name: str, dtype: torch.dtype) -> None:
    """Three rows of 4 tokens each (a verify step of k = 3): the output and the state after each token are
    those of 4 decode steps of the same form (bitwise: the same arithmetic), within float32 rounding of the
    float64 reference; the slots' own states and every other speculative state are untouched."""
    batch, tokens, k_heads, v_heads, k_dim, v_dim = 3, 4, 2, 6, 32, 48
    inputs = make_gdn_inputs(
        batch, tokens, k_heads, v_heads, k_dim, v_dim, dtype=dtype, seed=11, normalize_qk=False,
        a_log_max=4.0, softplus_max=12.0,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(12)
    states = torch.randn(3, 7, v_heads, k_dim, v_dim, generator=generator)
    spec = torch.randn(3, 7, tokens, v_heads, k_dim, v_dim, generator=generator)
    slots, layer = torch.tensor([5, 0, 2]), 1
    cache, spec_cache = states.clone(), spec.clone()
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    o = VERIFIES[name](*args, cache, spec_cache, layer, slots, k_dim**-0.5)
    assert o.shape == inputs["v"].shape and o.dtype == dtype
    assert torch.equal(cache, states)
    untouched = torch.ones(3, 7, dtype=torch.bool)
    untouched[layer, slots] = False
    assert torch.equal(spec_cache[untouched], spec[untouched])
    stepped = states.clone()
    for t in range(tokens):
        o_t = STEPS[name](*(a[:, t] for a in args), stepped, layer, slots, k_dim**-0.5)
        assert torch.equal(o[:, t], o_t)
        assert torch.equal(spec_cache[layer, slots, t], stepped[layer, slots])
    initial = states[layer, slots]
    expected_o, _ = reference_gated_delta_rule(**inputs, initial_state=initial, use_qk_l2norm=True)
    assert max_rel_error(o, expected_o) <= (1e-5 if dtype == torch.float32 else 2**-8)


@pytest.mark.parametrize("name", list(CHUNKS))
@pytest.mark.parametrize(
    "shape",
    [(100, 2, 6, 32, 48), (256, 4, 4, 128, 128), (7, 1, 3, 32, 32), (64, 2, 2, 16, 16), (70, 2, 2, 24, 20)],
    ids=["group3-partial-chunk", "qwen", "few-tokens", "one-chunk", "head-sizes-not-multiples-of-16"],
)
@pytest.mark.parametrize("hard", [False, True], ids=["plain", "strong-decay-correlated-keys"])
def test_prefill_chunk_updates_the_slot_like_the_reference(
    name: str, shape: tuple[int, ...], hard: bool
) -> None:
    tokens, k_heads, v_heads, k_dim, v_dim = shape
    inputs = make_gdn_inputs(
        1, tokens, k_heads, v_heads, k_dim, v_dim, seed=tokens, normalize_qk=False,
        a_log_max=4.0 if hard else 1.0, softplus_max=12.0 if hard else 3.0,
        key_correlation=0.9 if hard else 0.0,
    )  # fmt: skip
    states = torch.randn(3, 5, v_heads, k_dim, v_dim, generator=torch.Generator().manual_seed(1))
    slot, layer = torch.tensor([3]), 2
    expected_o, expected_state = reference_gated_delta_rule(
        **inputs, initial_state=states[layer, slot], use_qk_l2norm=True
    )
    cache = states.clone()
    args = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
    o = CHUNKS[name](*args, cache, layer, slot, None, k_dim**-0.5)
    assert max_rel_error(o, expected_o) <= 1e-5
    assert max_rel_error(cache[layer, slot], expected_state[:, 0]) <= 1e-5
    untouched = torch.ones(3, 5, dtype=torch.bool)
    untouched[layer, slot] = False
    assert torch.equal(cache[untouched], states[untouched])


@pytest.mark.parametrize("name", list(CHUNKS))
def test_prefill_chunk_padding_leaves_the_state_at_the_last_real_token(name: str) -> None:
    """A chunk of 80 positions of which 50 are real (the rest with g = 0, beta = 0 and arbitrary q, k, v, as
    the model pads them): the state is the one after token 50, and the real outputs are those of 50 tokens."""
    inputs = make_gdn_inputs(1, 80, 2, 4, 32, 32, seed=3, normalize_qk=False)
    real = {n: t[:, :50] for n, t in inputs.items()}
    padded = dict(inputs)
    padded["g"] = torch.cat([inputs["g"][:, :50], torch.zeros_like(inputs["g"][:, 50:])], 1)
    padded["beta"] = torch.cat([inputs["beta"][:, :50], torch.zeros_like(inputs["beta"][:, 50:])], 1)
    states = torch.randn(1, 2, 4, 32, 32, generator=torch.Generator().manual_seed(2))
    slot = torch.tensor([1])
    expected_o, expected_state = reference_gated_delta_rule(
        **real, initial_state=states[0, slot], use_qk_l2norm=True
    )
    o = CHUNKS[name](*(padded[n] for n in ("q", "k", "v", "g", "beta")), states, 0, slot, None, 32**-0.5)
    assert max_rel_error(o[:, :50], expected_o) <= 1e-5
    assert max_rel_error(states[0, slot], expected_state[:, 0]) <= 1e-5


@pytest.mark.skipif("native" not in CHUNKS, reason="the native CPU kernels cannot be built here")
@pytest.mark.parametrize("real", [5, 17, 50, 64 + 20])
def test_native_partial_chunk_equals_the_chunk_padded_to_full_bitwise(real: int) -> None:
    """The native op computes a partial last chunk of n tokens on n rounded up to 16 rows: its outputs and
    state equal, bitwise, those of the same tokens followed by zero-gate padding to whole chunks (which
    it computes on every row), whatever q, k, v the padding carries."""
    padded_length = (real + 63) // 64 * 64
    inputs = make_gdn_inputs(1, padded_length, 2, 4, 128, 128, seed=real, normalize_qk=False, a_log_max=4.0)
    padded = dict(inputs)
    for name in ("g", "beta"):
        padded[name] = torch.cat([inputs[name][:, :real], torch.zeros_like(inputs[name][:, real:])], 1)
    states = torch.randn(1, 2, 4, 128, 128, generator=torch.Generator().manual_seed(5))
    short_states, slot = states.clone(), torch.tensor([1])
    names = ("q", "k", "v", "g", "beta")
    o_padded = CHUNKS["native"](*(padded[n] for n in names), states, 0, slot, None, 0.1)
    o_short = CHUNKS["native"](*(inputs[n][:, :real] for n in names), short_states, 0, slot, None, 0.1)
    assert torch.equal(o_short, o_padded[:, :real])
    assert torch.equal(short_states, states)


@pytest.mark.parametrize("name", list(CHUNKS))
def test_prefill_chunk_reads_slices_of_the_conv_output_in_place(name: str) -> None:
    """q, k, v as the model passes them (bf16 slices of the channel-major conv output): the same output and
    state as from contiguous copies."""
    inputs = make_gdn_inputs(1, 90, 2, 4, 32, 32, dtype=torch.bfloat16, seed=4, normalize_qk=False)
    # channel-major, as the conv output [1, channels, T] transposed
    mixed = (
        torch.cat([inputs[n].flatten(2) for n in ("q", "k", "v")], -1)
        .transpose(1, 2)
        .contiguous()
        .transpose(1, 2)
    )
    q, k, v = mixed.split([64, 64, 128], dim=-1)
    sliced = (q.view(1, 90, 2, 32), k.view(1, 90, 2, 32), v.view(1, 90, 4, 32))
    assert sliced[0].stride(1) == 1
    states = torch.randn(1, 2, 4, 32, 32, generator=torch.Generator().manual_seed(3))
    copies = states.clone()
    slot = torch.tensor([0])
    o = CHUNKS[name](*sliced, inputs["g"], inputs["beta"], states, 0, slot, None, 32**-0.5)
    contiguous = (x.contiguous() for x in sliced)
    expected = CHUNKS[name](*contiguous, inputs["g"], inputs["beta"], copies, 0, slot, None, 32**-0.5)
    assert torch.equal(o, expected) and torch.equal(states, copies)


@pytest.mark.parametrize("name", list(CHUNKS))
@pytest.mark.parametrize("shape", [(2, 6, 32, 48), (4, 4, 128, 128)], ids=["group3", "qwen"])
def test_packed_prefill_equals_each_sequence_alone(name: str, shape: tuple[int, ...]) -> None:
    """Sequences of 70, 1, 0, 130 and 3 tokens packed in one call (cu_seqlens), each in its own slot: each
    one's output and state are those of the float64 reference on that sequence alone; other slots and
    tokens after the last sequence (o = 0) are untouched."""
    k_heads, v_heads, k_dim, v_dim = shape
    lengths = [70, 1, 0, 130, 3]
    inputs = make_gdn_inputs(
        1, sum(lengths) + 5, k_heads, v_heads, k_dim, v_dim, seed=11, normalize_qk=False, a_log_max=4.0,
        softplus_max=12.0,
    )  # fmt: skip
    states = torch.randn(2, 7, v_heads, k_dim, v_dim, generator=torch.Generator().manual_seed(4))
    slots = torch.tensor([4, 0, 6, 2, 5])
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    cache = states.clone()
    args = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
    o = CHUNKS[name](*args, cache, 1, slots, cu_seqlens, k_dim**-0.5)
    for s, (first, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True)):
        if end == first:
            assert torch.equal(cache[1, slots[s]], states[1, slots[s]])
            continue
        own = {n: t[:, first:end] for n, t in inputs.items()}
        expected_o, expected_state = reference_gated_delta_rule(
            **own, initial_state=states[1, slots[s : s + 1]], use_qk_l2norm=True
        )
        assert max_rel_error(o[:, first:end], expected_o) <= 1e-5
        assert max_rel_error(cache[1, slots[s]], expected_state[0, 0]) <= 1e-5
    assert torch.equal(o[:, sum(lengths) :], torch.zeros_like(o[:, sum(lengths) :]))
    untouched = torch.ones(2, 7, dtype=torch.bool)
    untouched[1, slots] = False
    assert torch.equal(cache[untouched], states[untouched])


@pytest.mark.parametrize("name", list(CHUNKS))
def test_packed_prefill_snapshots_states_inside_its_sequences(name: str) -> None:
    """Snapshots at tokens 64 and 100 of a 150-token sequence and 5 tokens into a 70-token one: each snapshot
    slot holds the float64 reference's state after that sequence's tokens before the end; outputs and final
    states are the reference's on whole sequences; ends at a sequence's start or end or inside none leave
    their slot alone."""
    k_heads, v_heads, k_dim, v_dim = 2, 4, 32, 32
    lengths = [150, 1, 70]
    inputs = make_gdn_inputs(
        1, sum(lengths), k_heads, v_heads, k_dim, v_dim, seed=5, normalize_qk=False, a_log_max=4.0,
        softplus_max=12.0,
    )  # fmt: skip
    states = torch.randn(2, 12, v_heads, k_dim, v_dim, generator=torch.Generator().manual_seed(6))
    slots = torch.tensor([4, 0, 2])
    cu_seqlens = torch.tensor([0, 150, 151, 221])
    ends = torch.tensor([100, 156, 64, 0, 150, 151])
    targets = torch.tensor([7, 8, 9, 10, 11, 3])
    cache = states.clone()
    args = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
    o = CHUNKS[name](*args, cache, 1, slots, cu_seqlens, k_dim**-0.5, ends, targets)

    def reference(first: int, end: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        own = {n: t[:, first:end] for n, t in inputs.items()}
        out, state = reference_gated_delta_rule(
            **own, initial_state=states[1, slot].unsqueeze(0), use_qk_l2norm=True
        )
        return out, state[0]

    for s, (first, end) in enumerate([(0, 150), (150, 151), (151, 221)]):
        expected_o, expected_state = reference(first, end, int(slots[s]))
        assert max_rel_error(o[:, first:end], expected_o) <= 1e-5
        assert max_rel_error(cache[1, slots[s]], expected_state) <= 1e-5
    for (first, end, slot), target in zip([(0, 100, 4), (151, 156, 2), (0, 64, 4)], [7, 8, 9], strict=True):
        assert max_rel_error(cache[1, target], reference(first, end, slot)[1]) <= 1e-5
    for slot in (10, 11, 3):
        assert torch.equal(cache[1, slot], states[1, slot])
    assert torch.equal(cache[0], states[0])
    if name == "native":  # a snapshot written while another sequence runs in that slot is refused
        args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
        with pytest.raises(RuntimeError, match="own slot"):
            CHUNKS[name](*args, cache, 1, slots, cu_seqlens, k_dim**-0.5, ends[:1], slots[2:])
