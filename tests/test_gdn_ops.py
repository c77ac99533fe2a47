"""Gated DeltaNet ops (optimum_qwen36.nki) against a float64 token-by-token recurrence."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from gdn_reference import make_gdn_inputs, max_rel_error, reference_causal_conv1d, reference_gated_delta_rule
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from optimum_qwen36.nki import (
    causal_conv1d_fn,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
)
from optimum_qwen36.nki.kernels import chunk_gated_delta_rule_torch as chunk_twin

# (B, T, H, HV, K, V): 27B per-rank heads (TP=4) and awkward small ones (K != V, r = 2 and 3).
PER_RANK = (1, 4, 12, 128, 128)
SHAPES = [
    (1, 1, *PER_RANK[1:]),
    (1, 65, *PER_RANK[1:]),
    (2, 63, 2, 4, 32, 48),
    (1, 64, 1, 3, 16, 8),
    (2, 65, 2, 6, 24, 40),
]
# Weak decays, strongly correlated keys and beta near 1: the hard case for the intra-chunk solve.
HARD = {"a_log_max": -1.0, "softplus_max": -3.0, "key_correlation": 0.95, "beta_range": (0.8, 1.0)}
# Strong decays: exp(A_log) up to 16 and softplus input up to +20 -> g down to about -320 per token.
STRONG = {"a_log_max": math.log(16.0), "softplus_max": 20.0}


def _inputs(shape: tuple[int, ...], **kwargs: object) -> dict[str, torch.Tensor]:
    batch, seq_len, num_k_heads, num_v_heads, k_dim, v_dim = shape
    return make_gdn_inputs(batch, seq_len, num_k_heads, num_v_heads, k_dim, v_dim, **kwargs)


def _state(inputs: dict[str, torch.Tensor], seed: int = 1) -> torch.Tensor:
    batch, _, num_v_heads, v_dim = inputs["v"].shape
    k_dim = inputs["k"].shape[-1]
    gen = torch.Generator().manual_seed(seed)
    return 0.1 * torch.randn(batch, num_v_heads, k_dim, v_dim, generator=gen)


def _hf_chunk(inputs: dict[str, torch.Tensor], **kwargs: object) -> torch.Tensor:
    return torch_chunk_gated_delta_rule(*inputs.values(), **kwargs)[0]


CASES = [(shape, regime) for shape in SHAPES for regime in ("random", "hard", "strong")]
CASES += [((1, 200, *PER_RANK[1:]), "hard"), ((1, 1000, 1, 3, 16, 32), "random")]  # few big ones


@pytest.mark.parametrize(("shape", "regime"), CASES, ids=str)
def test_chunk_and_recurrent_match_float64(shape: tuple[int, ...], regime: str) -> None:
    extra = {"random": {}, "hard": HARD, "strong": STRONG}[regime]
    inputs = _inputs(shape, seed=3, **extra)
    init = _state(inputs)
    ref_o, ref_states = reference_gated_delta_rule(**inputs, initial_state=init)

    o, final = chunk_gated_delta_rule(**inputs, initial_state=init, output_final_state=True)
    assert o.dtype == inputs["v"].dtype and final.dtype == torch.float32
    err = max_rel_error(o, ref_o)
    hf_err = max_rel_error(_hf_chunk(inputs, initial_state=init), ref_o)
    # "No worse than transformers": within a factor 2 of its error (both are ~1e-7..1e-5 here).
    assert err <= 1e-4 and err <= max(2 * hf_err, 1e-6), (err, hf_err)
    assert max_rel_error(final, ref_states[:, -1]) <= 1e-4

    o, final = fused_recurrent_gated_delta_rule(**inputs, initial_state=init, output_final_state=True)
    assert max_rel_error(o, ref_o) <= 1e-6
    assert max_rel_error(final, ref_states[:, -1]) <= 1e-6


@pytest.mark.parametrize("beta_range", [(0.0, 0.02), (0.98, 1.0)], ids=["beta~0", "beta~1"])
def test_extreme_gates_stay_finite_and_accurate(beta_range: tuple[float, float]) -> None:
    inputs = _inputs((1, 130, 2, 6, 32, 32), seed=5, beta_range=beta_range, **STRONG)
    assert inputs["g"].min() < -250  # really strong decays
    ref_o, ref_states = reference_gated_delta_rule(**inputs)
    o, final = chunk_gated_delta_rule(**inputs, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert max_rel_error(o, ref_o) <= 1e-4
    assert max_rel_error(final, ref_states[:, -1]) <= 1e-4


def _seed_ut_system(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, factored: bool) -> torch.Tensor:
    """Strictly lower A of one chunk (k [C, K], g/beta [C]), decay either as pairwise differences or
    factored as exp(c_i) * exp(-c_j) (the exp(+cumsum) form that overflows)."""
    cum = g.cumsum(0)
    if factored:
        a = (k * (beta * cum.exp())[:, None]) @ (k * (-cum).exp()[:, None]).T
    else:
        a = (k @ k.T) * beta[:, None] * (cum[:, None] - cum[None, :]).tril(-1).exp()
    return a.tril(-1)


def _neumann_power_doubling(a: torch.Tensor) -> torch.Tensor:
    """The previous project's inverse: (I + A)^-1 = (I - A)(I + A^2)(I + A^4)... over the whole chunk."""
    inverse = torch.eye(a.shape[-1]) - a
    power = a
    for _ in range(int(math.log2(a.shape[-1])) - 1):
        power = power @ power
        inverse = inverse + inverse @ power
    return inverse


@pytest.mark.parametrize("regime", ["hard", "strong"])
def test_neumann_power_doubling_breaks_but_blocked_inverse_does_not(regime: str) -> None:
    extra = HARD if regime == "hard" else {**STRONG, "beta_range": (0.9, 1.0)}
    inputs = _inputs((1, 64, 1, 1, 128, 128), seed=7, **extra)
    k, g, beta = inputs["k"][0, :, 0], inputs["g"][0, :, 0], inputs["beta"][0, :, 0]
    a = _seed_ut_system(k, g, beta, factored=False)
    exact = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + _seed_ut_system(k, g, beta, False).double())
    ours = chunk_twin.invert_unit_lower(a)
    assert max_rel_error(ours, exact) <= 1e-5
    if regime == "hard":  # correlated keys: the powers grow combinatorially and cancel catastrophically
        assert max_rel_error(_neumann_power_doubling(a), exact) > 1e-2
    else:  # strong decays: the factored decay overflows before the series even starts
        assert not torch.isfinite(_neumann_power_doubling(_seed_ut_system(k, g, beta, True))).all()


@pytest.mark.parametrize(("chunk", "base_block"), [(16, 2), (32, 2), (32, 4), (64, 2), (128, 8)])
def test_inverse_reads_only_the_strict_lower_triangle(chunk: int, base_block: int) -> None:
    """The twin hands invert_unit_lower the unmasked beta (K K^T o Gamma): its diagonal and upper triangle
    must not matter."""
    gen = torch.Generator().manual_seed(chunk + base_block)
    strict = 0.1 * torch.randn(3, 2, chunk, chunk, generator=gen).tril(-1)
    exact = torch.linalg.inv(torch.eye(chunk, dtype=torch.float64) + strict.double())
    upper = torch.randn(3, 2, chunk, chunk, generator=gen).triu()  # the diagonal and above
    for a in (strict, strict + upper):
        assert max_rel_error(chunk_twin.invert_unit_lower(a, base_block), exact) <= 1e-6


def test_full_chunk_power_series_is_unusable_in_the_twin() -> None:
    """base_block = tile_size turns the twin's solve into the Neumann product: it must be far worse."""
    inputs = _inputs((1, 128, 2, 6, 64, 64), seed=11, **HARD)
    ref_o, _ = reference_gated_delta_rule(**inputs)
    one_tile = {"scale": 64**-0.5, "tile_size": 64}
    ours = chunk_twin.chunk_gated_delta_rule_torch(**inputs, **one_tile)[0]
    neumann = chunk_twin.chunk_gated_delta_rule_torch(**inputs, **one_tile, base_block=64)[0]
    assert max_rel_error(ours, ref_o) <= 1e-5
    assert max_rel_error(neumann, ref_o) > 1e-2


@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128])
def test_chunk_sizes_and_chunk_states(chunk_size: int) -> None:
    inputs = _inputs((2, 150, 2, 4, 32, 16), seed=13)
    init = _state(inputs)
    ends = [min((i + 1) * chunk_size, 150) - 1 for i in range(-(-150 // chunk_size))]
    ref_o, ref_states = reference_gated_delta_rule(**inputs, initial_state=init, state_positions=ends)
    o, final, chunk_states = chunk_gated_delta_rule(
        **inputs, initial_state=init, chunk_size=chunk_size, output_chunk_states=True
    )
    assert final is None
    assert chunk_states.shape == (2, len(ends), 4, 32, 16) and chunk_states.dtype == torch.float32
    assert max_rel_error(chunk_states, ref_states) <= 1e-5
    assert max_rel_error(o, ref_o) <= 1e-5


def test_split_anywhere_and_carry_state() -> None:
    inputs = _inputs((1, 300, 4, 12, 128, 128), seed=17)
    full_o, full_state = chunk_gated_delta_rule(**inputs, output_final_state=True)
    state, pieces = None, []
    for start, stop in ((0, 37), (37, 64), (64, 250), (250, 299)):
        part = {name: t[:, start:stop] for name, t in inputs.items()}
        o, state = chunk_gated_delta_rule(**part, initial_state=state, output_final_state=True)
        pieces.append(o)
    last = {name: t[:, 299:] for name, t in inputs.items()}  # then one decode step
    o, state = fused_recurrent_gated_delta_rule(**last, initial_state=state, output_final_state=True)
    pieces.append(o)
    assert max_rel_error(torch.cat(pieces, 1), full_o) <= 1e-5
    assert max_rel_error(state, full_state) <= 1e-5


def test_l2norm_flag_and_scale() -> None:
    inputs = _inputs((1, 70, 2, 4, 32, 32), seed=19, normalize_qk=False)
    ref_o, _ = reference_gated_delta_rule(**inputs, scale=0.3, use_qk_l2norm=True)
    for op in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
        o, _ = op(**inputs, scale=0.3, use_qk_l2norm_in_kernel=True)
        assert max_rel_error(o, ref_o) <= 1e-5


def test_bf16_inputs_keep_float32_state() -> None:
    inputs = _inputs((1, 100, 4, 12, 128, 128), seed=23, dtype=torch.bfloat16)
    ref_o, ref_states = reference_gated_delta_rule(**inputs)
    for op in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
        o, final = op(**inputs, output_final_state=True)
        assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
        assert max_rel_error(o, ref_o) <= 1e-2  # bf16 output rounding
        assert max_rel_error(final, ref_states[:, -1]) <= 1e-5


def test_bad_gdn_inputs_raise() -> None:
    inputs = _inputs((1, 8, 2, 6, 16, 16))
    q, k, v, g, beta = inputs.values()
    bad_calls = [
        {"v": v[:, :, :5]},  # HV % H != 0
        {"g": g[..., :3]},
        {"beta": beta[:, :4]},
        {"k": k[..., :8]},
        {"initial_state": torch.zeros(1, 6, 16, 8)},
        {"initial_state": torch.zeros(1, 6, 16, 16, dtype=torch.bfloat16)},
        {"q": q.long()},
    ]
    for override in bad_calls:
        for op in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
            with pytest.raises(ValueError):
                op(**{**inputs, **override})
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gated_delta_rule(**inputs, chunk_size=48)


def test_neuron_dispatch_needs_the_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    nki = sys.modules["optimum_qwen36.nki"]
    monkeypatch.setitem(sys.modules, "optimum_qwen36.nki.neuron_ops", None)  # makes the import fail
    with pytest.raises(RuntimeError, match="Neuron SDK"):
        nki._neuron_ops()


def _conv_inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(29)
    x = torch.randn(2, 24, 40, generator=gen).to(dtype)
    weight = torch.randn(24, 4, generator=gen).to(dtype)
    bias = torch.randn(24, generator=gen).to(dtype)
    state = torch.randn(2, 24, 3, generator=gen).to(dtype)
    return x, weight, bias, state


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_causal_conv1d_fn_matches_reference(with_bias: bool, with_state: bool) -> None:
    x, weight, bias, state = _conv_inputs()
    bias = bias if with_bias else None
    state = state if with_state else None
    out, final = causal_conv1d_fn(x, weight, bias, initial_state=state)
    assert max_rel_error(out, reference_causal_conv1d(x, weight, bias, state)) <= 1e-6
    assert torch.equal(final, x[..., -3:])
    out, _ = causal_conv1d_fn(x, weight, bias, activation=None, initial_state=state)
    assert max_rel_error(out, reference_causal_conv1d(x, weight, bias, state, silu=False)) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_update_matches_prefill(dtype: torch.dtype) -> None:
    x, weight, bias, state = _conv_inputs(dtype)
    prefill, prefill_state = causal_conv1d_fn(x, weight, bias, initial_state=state)
    frozen = state.clone()
    steps = []
    for t in range(x.shape[-1]):
        out, new_state = causal_conv1d_update(x[..., t : t + 1], state, weight, bias)
        assert torch.equal(state, frozen)  # functional: the argument is not mutated
        steps.append(out)
        state = frozen = new_state
    assert out.dtype == dtype and new_state.dtype == dtype
    # Same arithmetic; only SIMD/FMA contraction may differ between the one- and many-token calls.
    torch.testing.assert_close(torch.cat(steps, -1), prefill, rtol=1e-6, atol=1e-6)
    assert torch.equal(state, prefill_state)


def test_causal_conv1d_valid_length() -> None:
    x, weight, bias, state = _conv_inputs()
    valid = torch.tensor([0, 2])  # right-padded prompts: row 0 has no valid token, row 1 two
    out, final = causal_conv1d_fn(x, weight, bias, initial_state=state, valid_length=valid)
    assert torch.equal(out, causal_conv1d_fn(x, weight, bias, initial_state=state)[0])
    assert torch.equal(final[0], state[0])
    assert torch.equal(final[1], torch.cat((state[1, :, -1:], x[1, :, :2]), -1))
    # A valid_length inside a longer window equals a call on the valid prefix.
    valid = torch.tensor([17, 40])
    _, final = causal_conv1d_fn(x, weight, bias, initial_state=state, valid_length=valid)
    assert torch.equal(final[0], causal_conv1d_fn(x[:1, :, :17], weight, bias, initial_state=state[:1])[1][0])
    assert torch.equal(final[1], x[1, :, -3:])


def test_bad_conv_inputs_raise() -> None:
    x, weight, bias, state = _conv_inputs()
    with pytest.raises(ValueError):
        causal_conv1d_fn(x, weight[:5])
    with pytest.raises(ValueError):
        causal_conv1d_fn(x, weight, bias[:3])
    with pytest.raises(ValueError):
        causal_conv1d_fn(x, weight, activation="relu")
    with pytest.raises(ValueError):
        causal_conv1d_fn(x, weight, initial_state=state[..., :2])
    with pytest.raises(ValueError):
        causal_conv1d_fn(x, weight, valid_length=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError):
        causal_conv1d_update(x, state, weight)  # more than one token
    with pytest.raises(ValueError):
        causal_conv1d_update(x[..., :1], state[:1], weight)


def test_ops_export() -> None:
    """The twins trace through torch.export (static shapes, no data-dependent control flow)."""

    class Ops(torch.nn.Module):
        def forward(self, q, k, v, g, beta, state, x, weight, conv_state, valid):
            o, state, chunk_states = chunk_gated_delta_rule(
                q, k, v, g, beta, initial_state=state, output_final_state=True, output_chunk_states=True
            )
            step = (t[:, -1:] for t in (q, k, v, g, beta))
            o1, state = fused_recurrent_gated_delta_rule(*step, initial_state=state, output_final_state=True)
            y, conv_state = causal_conv1d_fn(x, weight, initial_state=conv_state, valid_length=valid)
            y1, conv_state = causal_conv1d_update(x[..., -1:], conv_state, weight)
            return o, chunk_states, o1, state, y, y1, conv_state

    inputs = _inputs((1, 100, 2, 4, 32, 16))
    args = (*inputs.values(), torch.zeros(1, 4, 32, 16), *_conv_inputs()[:2], torch.zeros(2, 24, 3))
    args = (*args, torch.tensor([17, 40]))
    exported = torch.export.export(Ops(), args)
    for got, want in zip(exported.module()(*args), Ops()(*args), strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-6)


def test_reference_recurrence_is_the_delta_rule() -> None:
    """Guard the reference itself against a closed form: one token from a zero state gives
    o = (q . k) * beta * v * scale."""
    inputs = _inputs((1, 1, 1, 2, 8, 4), seed=31)
    o, _ = reference_gated_delta_rule(**inputs)
    q, k, v, beta = (inputs[n].double() for n in ("q", "k", "v", "beta"))
    expected = (q[0, 0, 0] @ k[0, 0, 0]) * beta[0, 0, :, None] * v[0, 0] * 8**-0.5
    assert torch.allclose(o[0, 0], expected)
    assert F.silu(torch.zeros(1)).item() == 0.0
