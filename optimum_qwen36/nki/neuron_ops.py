"""TorchNeuron registration of the Gated DeltaNet NKI kernels.

Importing this module needs the AWS Neuron SDK (``torch-neuronx`` and ``nki`` from the Neuron pip
repository); without it the import raises :class:`ImportError`. The kernels are registered as PyTorch
custom ops with ``torch_neuronx.nki_op`` so they work in eager mode and inside
``torch.compile(backend="neuron")``; the public functions below keep the flash-linear-attention
signatures of :mod:`optimum_qwen36.nki` and do the (cheap, traceable) layout changes around the ops.

Nothing here has run on Neuron hardware yet (see docs/NKI.md).
"""

from __future__ import annotations

import torch

try:  # the PyPI packages named torch-neuronx / nki are placeholders that raise on import
    import nki  # noqa: F401  (torch-neuronx needs it; imported here so a missing nki fails early)
    from torch_neuronx import nki_op
except Exception as err:
    raise ImportError(
        "optimum_qwen36.nki.neuron_ops needs the AWS Neuron SDK: install torch-neuronx and nki from the "
        "AWS Neuron pip repository (https://pip.repos.neuron.amazonaws.com), not the PyPI placeholders."
    ) from err

from optimum_qwen36.nki.interpreter import real_nki_available
from optimum_qwen36.nki.kernels import chunk_gated_delta_rule as _chunk
from optimum_qwen36.nki.kernels import fused_recurrent_gated_delta_rule as _recurrent

if not real_nki_available():  # e.g. OPTIMUM_QWEN36_NKI_INTERPRETER=1: the kernels were built for numpy
    raise ImportError("the NKI kernels are bound to the numpy interpreter (OPTIMUM_QWEN36_NKI_INTERPRETER=1)")

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]


@nki_op("optimum_qwen36::chunk_gated_delta_rule", mutates_args=())
def _chunk_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _chunk.chunk_gated_delta_rule_kernel(q, k, v, g, beta, initial_state, scale, use_qk_l2norm)


@nki_op("optimum_qwen36::fused_recurrent_gated_delta_rule", mutates_args=())
def _recurrent_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _recurrent.fused_recurrent_gated_delta_rule_kernel(
        q, k, v, g, beta, initial_state, scale, use_qk_l2norm
    )


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
    chunk_size: int = _chunk.CHUNK,
    output_chunk_states: bool = False,
) -> tuple[torch.Tensor, ...]:
    """:func:`optimum_qwen36.nki.chunk_gated_delta_rule` on Neuron tensors (chunk_size must be 64)."""
    return _chunk.chunk_gated_delta_rule(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, chunk_size,
        output_chunk_states, launch=_chunk_op,
    )  # fmt: skip


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
    """:func:`optimum_qwen36.nki.fused_recurrent_gated_delta_rule` on Neuron tensors."""
    return _recurrent.fused_recurrent_gated_delta_rule(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        launch=_recurrent_op,
    )  # fmt: skip
