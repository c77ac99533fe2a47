"""The GDN NKI kernels, run through ``nki.simulate`` (the numpy interpreter unless the AWS ``nki`` package
is installed), against the float64 recurrence and the PyTorch twins."""

from __future__ import annotations

import pytest
import torch
from gdn_reference import make_gdn_inputs, max_rel_error, reference_gated_delta_rule
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from optimum_qwen36.nki.interpreter import nki_modules
from optimum_qwen36.nki.kernels import chunk_gated_delta_rule as chunk_module
from optimum_qwen36.nki.kernels import fused_recurrent_gated_delta_rule as recurrent_module
from optimum_qwen36.nki.kernels.chunk_gated_delta_rule_torch import chunk_gated_delta_rule_torch

nki, _, _ = nki_modules()
CHUNK = chunk_module.CHUNK
PREFILL_TOL = 1e-4
TWIN_TOL = 1e-5  # kernel and twin run the same scheme: they differ by float32 rounding only
DECODE_TOL = 1e-5
# Weak decays, strongly correlated keys and beta near 1 (as in tests/test_gdn_ops.py): the worst-conditioned
# intra-chunk system, where 16x16 nilpotent doubling exceeds PREFILL_TOL.
HARD = {"a_log_max": -1.0, "softplus_max": -3.0, "key_correlation": 0.95, "beta_range": (0.8, 1.0)}


def run_chunk(inputs: dict, **kwargs: object) -> tuple[torch.Tensor, ...]:
    launch = nki.simulate(chunk_module.chunk_gated_delta_rule_kernel)
    return chunk_module.chunk_gated_delta_rule(**inputs, **kwargs, launch=launch)


def run_recurrent(inputs: dict, **kwargs: object) -> tuple[torch.Tensor, ...]:
    launch = nki.simulate(recurrent_module.fused_recurrent_gated_delta_rule_kernel)
    return recurrent_module.fused_recurrent_gated_delta_rule(**inputs, **kwargs, launch=launch)


def initial_state(inputs: dict, seed: int = 1) -> torch.Tensor:
    batch, _, num_v_heads, v_dim = inputs["v"].shape
    k_dim = inputs["k"].shape[-1]
    return torch.randn(batch, num_v_heads, k_dim, v_dim, generator=torch.Generator().manual_seed(seed))


def check_prefill(inputs: dict, tol: float = PREFILL_TOL, l2norm: bool = False, state: bool = True) -> None:
    state0 = initial_state(inputs) if state else None
    o, final, chunk_states = run_chunk(
        inputs, initial_state=state0, output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
        output_chunk_states=True,
    )  # fmt: skip
    seq_len = inputs["v"].shape[1]
    ends = [min(end, seq_len) - 1 for end in range(CHUNK, seq_len + CHUNK, CHUNK)]
    ref_o, ref_states = reference_gated_delta_rule(
        **inputs, initial_state=state0, use_qk_l2norm=l2norm, state_positions=ends
    )
    assert o.shape == inputs["v"].shape and o.dtype == inputs["v"].dtype
    assert chunk_states.shape == (o.shape[0], len(ends), *ref_states.shape[2:])
    assert max_rel_error(o, ref_o) <= tol
    assert max_rel_error(final, ref_states[:, -1]) <= tol
    assert max_rel_error(chunk_states, ref_states) <= tol


@pytest.mark.parametrize("seq_len", [1, 63, 64, 65, 200])
@pytest.mark.parametrize(("num_k_heads", "num_v_heads"), [(1, 2), (1, 3), (2, 2)])
def test_prefill_matches_float64_recurrence(seq_len: int, num_k_heads: int, num_v_heads: int) -> None:
    inputs = make_gdn_inputs(2 if seq_len == 1 else 1, seq_len, num_k_heads, num_v_heads, seed=seq_len)
    check_prefill(inputs)


def test_prefill_strong_decays_and_correlated_keys() -> None:
    # exp(A_log) up to 16 and softplus up to ~20 give log decays down to about -320 per token.
    inputs = make_gdn_inputs(1, 150, 1, 2, seed=3, a_log_max=2.77, softplus_max=20.0, key_correlation=0.9)
    inputs["g"][:, 70:75] = -300.0
    assert inputs["g"].min() < -250
    check_prefill(inputs)


def test_prefill_hard_inputs_at_per_rank_shapes() -> None:
    # Qwen3.6-27B per-rank GDN heads at TP=4: 4 key heads, 12 value heads, K = V = 128.
    inputs = make_gdn_inputs(1, 200, 4, 12, seed=3, **HARD)
    state0 = 0.1 * initial_state(inputs)
    o, final = run_chunk(inputs, initial_state=state0, output_final_state=True)
    ref_o, ref_states = reference_gated_delta_rule(**inputs, initial_state=state0)
    twin_o, twin_final = chunk_gated_delta_rule_torch(
        **inputs,
        scale=inputs["k"].shape[-1] ** -0.5,
        initial_state=state0,
        output_final_state=True,
        tile_size=64,
    )
    hf_o = torch_chunk_gated_delta_rule(*inputs.values(), initial_state=state0)[0]
    err, hf_err = max_rel_error(o, ref_o), max_rel_error(hf_o, ref_o)
    # "No worse than transformers": within a factor 2 of its error, as for the twin in test_gdn_ops.
    assert err <= PREFILL_TOL and err <= 2 * hf_err, (err, hf_err)
    assert max_rel_error(final, ref_states[:, -1]) <= PREFILL_TOL
    assert max_rel_error(o, twin_o) <= TWIN_TOL and max_rel_error(final, twin_final) <= TWIN_TOL


def test_prefill_l2norm_in_kernel_without_initial_state() -> None:
    check_prefill(make_gdn_inputs(1, 100, 2, 2, seed=4, normalize_qk=False), l2norm=True, state=False)


def test_prefill_bfloat16_inputs() -> None:
    inputs = make_gdn_inputs(1, 80, 1, 2, seed=5, dtype=torch.bfloat16)
    check_prefill(inputs, tol=1e-2)  # o is rounded to bf16 (2^-8 relative)


def test_prefill_matches_pytorch_twin() -> None:
    inputs = make_gdn_inputs(1, 130, 1, 3, seed=6, normalize_qk=False)
    state0 = initial_state(inputs)
    kwargs = dict(initial_state=state0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  output_chunk_states=True)  # fmt: skip
    ours = run_chunk(inputs, **kwargs)
    twin = chunk_gated_delta_rule_torch(**inputs, scale=inputs["k"].shape[-1] ** -0.5, tile_size=64, **kwargs)
    for actual, expected in zip(ours, twin, strict=True):
        assert max_rel_error(actual, expected) <= TWIN_TOL


def test_prefill_optional_outputs_and_chunk_size() -> None:
    inputs = make_gdn_inputs(1, 10, 1, 2, seed=7)
    o, final = run_chunk(inputs)
    assert final is None and o.shape == inputs["v"].shape
    with pytest.raises(ValueError, match="chunk_size=64"):
        run_chunk(inputs, chunk_size=32)


@pytest.mark.parametrize(
    ("num_k_heads", "num_v_heads", "seq_len"), [(1, 2, 1), (1, 3, 1), (2, 2, 1), (1, 2, 3)]
)
def test_decode_matches_float64_recurrence(num_k_heads: int, num_v_heads: int, seq_len: int) -> None:
    inputs = make_gdn_inputs(2, seq_len, num_k_heads, num_v_heads, seed=10 + seq_len, normalize_qk=False)
    state0 = initial_state(inputs)
    kwargs = dict(initial_state=state0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, final = run_recurrent(inputs, **kwargs)
    ref_o, ref_states = reference_gated_delta_rule(**inputs, initial_state=state0, use_qk_l2norm=True)
    assert max_rel_error(o, ref_o) <= DECODE_TOL
    assert max_rel_error(final, ref_states[:, -1]) <= DECODE_TOL


def test_decode_strong_decay_bfloat16_and_no_state() -> None:
    inputs = make_gdn_inputs(2, 1, 1, 2, seed=11, dtype=torch.bfloat16)
    inputs["g"][0] = -300.0  # the state is wiped: o depends on this token only
    o, final = run_recurrent(inputs)
    ref_o, _ = reference_gated_delta_rule(**inputs)
    assert final is None and o.dtype == torch.bfloat16
    assert max_rel_error(o, ref_o) <= 1e-2  # bf16 output rounding
    state0 = initial_state(inputs)
    o, final = run_recurrent(inputs, initial_state=state0, output_final_state=True)
    ref_o, ref_states = reference_gated_delta_rule(**inputs, initial_state=state0)
    assert max_rel_error(final, ref_states[:, -1]) <= DECODE_TOL
