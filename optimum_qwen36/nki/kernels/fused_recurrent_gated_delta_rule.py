"""NKI recurrent (decode) kernel of the gated delta rule, and its thin torch wrapper.

Per value head the float32 state S [K, V] sits in SBUF with K on the partitions; each token applies
the recurrence of the PyTorch twin (:mod:`optimum_qwen36.nki.kernels.fused_recurrent_gated_delta_rule_torch`):

    S <- exp(g) S;  delta = beta (v - k^T S);  S <- S + k delta^T;  o = q^T S   (q pre-scaled)

mapped onto the engines as: exp(g) broadcast to all K partitions by a contraction-1 matmul
(ones[1, K]^T @ g[1, 1]), k^T S and q^T S as [K, 1]-stationary matmuls giving [1, V] rows, and the
rank-1 update k delta^T as a contraction-1 matmul (k row [1, K] stationary, delta [1, V] moving).
q and k arrive as rows [1, K] (L2 norm is a free-axis reduction there) and are transposed to columns
on the Tensor Engine. q/k are prepared once per key head and reused by its r value heads.

HBM inputs, arranged by :func:`fused_recurrent_gated_delta_rule`: q, k [B, H, T, K]; v [B, HV, T, V];
g, beta [B, HV, T, 1] float32; initial_state [B, HV, K, V] float32. Outputs: o [B, HV, T, V] in v's
dtype, final state [B, HV, K, V] float32. Limits: K <= 128, V <= 512. Heads are processed one after
another (a faster decode kernel would pack several heads' states along the moving free axis).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from optimum_qwen36.nki.interpreter import nki_modules
from optimum_qwen36.nki.kernels.chunk_gated_delta_rule import (
    evict,
    load_rows,
    matmul_to_sbuf,
    sbuf_tile,
    scale_rows,
    store_rows,
    transpose_to_sbuf,
)

nki, nl, nisa = nki_modules()


@nki.jit
def fused_recurrent_gated_delta_rule_kernel(
    q: object,
    k: object,
    v: object,
    g: object,
    beta: object,
    initial_state: object,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[object, object]:
    """Token-by-token gated delta rule over pre-arranged HBM tensors (see the module docstring)."""
    batch, num_k_heads, seq_len, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1], v.shape[3]
    group = num_v_heads // num_k_heads
    assert k_dim <= 128 and v_dim <= 512, "unsupported shape"

    o = nl.ndarray((batch, num_v_heads, seq_len, v_dim), dtype=v.dtype, buffer=nl.shared_hbm)
    final_state = nl.ndarray((batch, num_v_heads, k_dim, v_dim), dtype=nl.float32, buffer=nl.shared_hbm)
    ones_row = sbuf_tile((1, k_dim))
    nisa.memset(ones_row, 1.0)

    for b in range(batch):
        states = []
        for hv in range(num_v_heads):
            state = sbuf_tile((k_dim, v_dim))
            nisa.dma_copy(dst=state, src=initial_state[b, hv])
            states.append(state)
        for t in range(seq_len):
            token = nl.ds(t, 1)
            for h in range(num_k_heads):
                q_row = scale_rows(load_rows(q[b, h, token, :]), scale, use_qk_l2norm)  # [1, K]
                q_col = transpose_to_sbuf(q_row)
                k_row = scale_rows(load_rows(k[b, h, token, :]), 1.0, use_qk_l2norm)  # [1, K]
                k_col = transpose_to_sbuf(k_row)
                for hv in range(h * group, (h + 1) * group):
                    state = states[hv]
                    g_val, beta_val = sbuf_tile((1, 1)), sbuf_tile((1, 1))
                    nisa.dma_copy(dst=g_val, src=g[b, hv, token, :])
                    nisa.dma_copy(dst=beta_val, src=beta[b, hv, token, :])
                    decay = sbuf_tile((k_dim, 1))  # exp(g) on every partition
                    nisa.activation(dst=decay, op=nl.exp, data=matmul_to_sbuf(ones_row, g_val))
                    nisa.tensor_scalar(state, state, op0=nl.multiply, operand0=decay)

                    read = nl.ndarray((1, v_dim), dtype=nl.float32, buffer=nl.psum)
                    nisa.nc_matmul(read, k_col, state, accumulate=False)  # k^T S
                    delta = sbuf_tile((1, v_dim))
                    nisa.tensor_tensor(delta, load_rows(v[b, hv, token, :]), read, op=nl.subtract)
                    nisa.tensor_scalar(delta, delta, op0=nl.multiply, operand0=beta_val)

                    update = nl.ndarray((k_dim, v_dim), dtype=nl.float32, buffer=nl.psum)
                    nisa.nc_matmul(update, k_row, delta, accumulate=False)  # k delta^T
                    nisa.tensor_tensor(state, state, update, op=nl.add)

                    out = nl.ndarray((1, v_dim), dtype=nl.float32, buffer=nl.psum)
                    nisa.nc_matmul(out, q_col, state, accumulate=False)  # q^T S
                    store_rows(o[b, hv, token, :], evict(out))
        for hv in range(num_v_heads):
            nisa.dma_copy(dst=final_state[b, hv], src=states[hv])
    return o, final_state


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
    *,
    launch: Callable[..., tuple[torch.Tensor, torch.Tensor]] = fused_recurrent_gated_delta_rule_kernel,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The public fused_recurrent_gated_delta_rule contract (FLA layout) on top of the kernel.

    ``launch(q, k, v, g, beta, initial_state, scale, use_qk_l2norm)`` runs the kernel (see
    :func:`optimum_qwen36.nki.kernels.chunk_gated_delta_rule.chunk_gated_delta_rule`).
    """
    batch, _, _, k_dim = k.shape
    num_v_heads, v_dim = v.shape[-2:]
    scale = k_dim**-0.5 if scale is None else scale
    q_, k_, v_ = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    g_, beta_ = (x.float().transpose(1, 2).unsqueeze(-1).contiguous() for x in (g, beta))
    if initial_state is None:
        state = torch.zeros(batch, num_v_heads, k_dim, v_dim, dtype=torch.float32, device=v.device)
    else:
        state = initial_state.float().contiguous()
    o, final = launch(q_, k_, v_, g_, beta_, state, float(scale), bool(use_qk_l2norm_in_kernel))
    return o.transpose(1, 2), (final if output_final_state else None)
