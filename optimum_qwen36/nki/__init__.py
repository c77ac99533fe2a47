"""Gated DeltaNet ops (flash-linear-attention layout) with a PyTorch twin and a Neuron (NKI) dispatch.

Shapes: q, k [B, T, H, K]; v [B, T, HV, V] with HV % H == 0 (key head h serves value heads
h*r .. h*r+r-1, r = HV // H, repeat_interleave order); g (log decay, <= 0) and beta [B, T, HV];
recurrent states [B, HV, K, V] float32. o has v's dtype.

Tensors on the ``neuron`` device go to the NKI kernels through ``optimum_qwen36.nki.neuron_ops``
(needs torch-neuronx + nki; :func:`load_neuron_ops` imports it, which the neuron backend does before
compiling); everything else runs the PyTorch twins, which are written to compile through Inductor /
torch.export (static shapes, no data-dependent control flow).
Kernels and twins live in :mod:`optimum_qwen36.nki.kernels` (``x.py`` beside ``x_torch.py``).
See docs/GDN_KERNELS.md for the algorithm and its accuracy.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import torch

from optimum_qwen36.nki.kernels.causal_conv1d_torch import ACTIVATIONS, causal_conv1d_torch
from optimum_qwen36.nki.kernels.chunk_gated_delta_rule_torch import chunk_gated_delta_rule_torch
from optimum_qwen36.nki.kernels.fused_recurrent_gated_delta_rule_torch import (
    fused_recurrent_gated_delta_rule_torch,
)

__all__ = [
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "load_neuron_ops",
]

_NEURON_OPS = "optimum_qwen36.nki.neuron_ops"


def load_neuron_ops() -> ModuleType:
    """Import ``optimum_qwen36.nki.neuron_ops``, which registers the NKI kernels as torch custom ops
    (``torch_neuronx.nki_op``); needs the Neuron SDK.

    Call it before ``torch.compile`` traces code that runs these ops on the ``neuron`` device (the neuron
    backend does). Otherwise the first import, with its SDK imports and op registrations, happens as a side
    effect in the middle of Dynamo's trace, and a failure there surfaces as an opaque "observed exception"
    (``importlib.import_module`` itself is refused in a ``fullgraph=True`` trace)."""
    try:
        return importlib.import_module(_NEURON_OPS)
    except ImportError as err:
        raise RuntimeError(
            "Gated DeltaNet ops on the 'neuron' device need the Neuron SDK (torch-neuronx + nki, from the "
            "AWS Neuron pip repository, not PyPI)."
        ) from err


def _neuron_ops() -> ModuleType:
    module = sys.modules.get(_NEURON_OPS)
    if module is not None:
        return module
    if torch.compiler.is_compiling():
        # Dynamo reports this as an "observed exception" and shows this line, hence the message on it.
        raise RuntimeError("call optimum_qwen36.nki.load_neuron_ops() before torch.compile on neuron")
    return load_neuron_ops()  # eager: importing on first use is fine


def _check_gdn_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    batch, seq_len, num_k_heads, k_dim = k.shape
    if v.dim() != 4 or v.shape[:2] != (batch, seq_len):
        raise ValueError(f"v must be [B={batch}, T={seq_len}, HV, V], got {tuple(v.shape)}")
    num_v_heads, v_dim = v.shape[2:]
    if num_v_heads % num_k_heads:
        raise ValueError(f"value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (batch, seq_len, num_v_heads):
            raise ValueError(
                f"{name} must be [B, T, HV] = {(batch, seq_len, num_v_heads)}, got {tuple(t.shape)}"
            )
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if initial_state is not None:
        if initial_state.shape != (batch, num_v_heads, k_dim, v_dim):
            raise ValueError(
                f"initial_state must be [B, HV, K, V] = {(batch, num_v_heads, k_dim, v_dim)}, "
                f"got {tuple(initial_state.shape)}"
            )
        # A bf16 state silently loses the recurrence's precision (it flips greedy tokens): refuse it.
        if initial_state.dtype != torch.float32:
            raise ValueError(f"initial_state must be float32, got {initial_state.dtype}")


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
    output_chunk_states: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Chunked (prefill) gated delta rule.

    Returns (o, final_state or None), plus chunk_states [B, ceil(T / chunk_size), HV, K, V] when
    output_chunk_states (entry i = state after min((i + 1) * chunk_size, T) tokens). T need not be a
    multiple of chunk_size; chunk_size must be a power of two.
    """
    _check_gdn_inputs(q, k, v, g, beta, initial_state)
    # The intra-chunk inverse merges blocks pairwise, level by level.
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    args = (
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        use_qk_l2norm_in_kernel,
        chunk_size,
        output_chunk_states,
    )
    if q.device.type == "neuron":
        return _neuron_ops().chunk_gated_delta_rule(*args)
    return chunk_gated_delta_rule_torch(*args)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token (decode) gated delta rule: (o, final_state or None)."""
    _check_gdn_inputs(q, k, v, g, beta, initial_state)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)
    if q.device.type == "neuron":
        return _neuron_ops().fused_recurrent_gated_delta_rule(*args)
    return fused_recurrent_gated_delta_rule_torch(*args)


def _check_conv_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    state: torch.Tensor | None,
    state_name: str,
) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be [B, D, T], got {tuple(x.shape)}")
    batch, channels, _ = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(f"weight must be [D={channels}, W], got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (channels,):
        raise ValueError(f"bias must be [D={channels}], got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    state_shape = (batch, channels, weight.shape[1] - 1)
    if state is not None and state.shape != state_shape:
        raise ValueError(f"{state_name} must be [B, D, W-1] = {state_shape}, got {tuple(state.shape)}")


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_state: torch.Tensor | None = None,
    valid_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d over x [B, D, T] (prefill).

    Returns (out [B, D, T] in x's dtype, final_state [B, D, W-1]): the last W-1 inputs (zeros or
    initial_state before the first token) ending at valid_length (LongTensor [B], values in 0..T) if
    given, else at T. final_state has initial_state's dtype when given, else x's dtype.
    """
    _check_conv_inputs(x, weight, bias, activation, initial_state, "initial_state")
    if valid_length is not None and (valid_length.shape != (x.shape[0],) or valid_length.is_floating_point()):
        raise ValueError(
            f"valid_length must be an integer tensor [B={x.shape[0]}], got {valid_length.dtype} "
            f"{tuple(valid_length.shape)}"
        )
    return causal_conv1d_torch(x, weight, bias, activation, initial_state, valid_length)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step: x [B, D, 1] -> (out [B, D, 1], new_conv_state [B, D, W-1] in conv_state's dtype).

    Functional: conv_state is not modified.
    """
    if x.dim() != 3 or x.shape[-1] != 1:
        raise ValueError(f"x must be [B, D, 1], got {tuple(x.shape)}")
    _check_conv_inputs(x, weight, bias, activation, conv_state, "conv_state")
    return causal_conv1d_torch(x, weight, bias, activation, conv_state)
