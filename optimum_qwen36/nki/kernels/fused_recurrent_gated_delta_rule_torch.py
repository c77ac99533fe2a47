"""PyTorch twin of the token-by-token (decode) gated delta rule kernel.

Inputs are assumed validated by :mod:`optimum_qwen36.nki`. All arithmetic and the state are float32.
Grouped value heads are handled by viewing the HV value heads as [H, r] (repeat_interleave order), so
q/k are never materialised r times.
"""

from __future__ import annotations

import torch


def inverse_l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rsqrt(sum(x^2) + eps) over the last dim (keepdim): the factor of the flash-linear-attention /
    transformers l2norm."""
    return torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * inverse_l2_norm(x)


def prepare_qk(
    q: torch.Tensor, k: torch.Tensor, scale: float, use_qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 q (scaled) and k, optionally L2-normalised first; shared by both twins."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * scale, k


def fused_recurrent_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """o [B, T, HV, V] (v's dtype) and the final state [B, HV, K, V] float32 (or None)."""
    batch, seq_len, num_k_heads, k_dim = k.shape
    num_v_heads, v_dim = v.shape[-2:]
    group = num_v_heads // num_k_heads
    out_dtype = v.dtype
    q, k = prepare_qk(q, k, scale, use_qk_l2norm_in_kernel)
    v, g, beta = v.float(), g.float(), beta.float()

    state_shape = (batch, num_k_heads, group, k_dim, v_dim)
    if initial_state is None:
        state = torch.zeros(state_shape, dtype=torch.float32, device=v.device)
    else:
        state = initial_state.float().reshape(state_shape)

    # [B, T, H, 1, 2, K]: k and q share one matmul against the (not yet decayed) state.
    kq = torch.stack((k, q), dim=-2).unsqueeze(3)
    qk_dot = (q * k).sum(-1)[..., None, None]  # [B, T, H, 1, 1]
    decay = g.exp().view(batch, seq_len, num_k_heads, group, 1)
    beta = beta.view(batch, seq_len, num_k_heads, group, 1)
    v = v.view(batch, seq_len, num_k_heads, group, v_dim)
    k_col = k.view(batch, seq_len, num_k_heads, 1, k_dim, 1)

    outputs = []
    for t in range(seq_len):
        # S' = exp(g) S, so k^T S' and q^T S' are exp(g) * (k^T S, q^T S): the state is read once.
        reads = (kq[:, t] @ state) * decay[:, t].unsqueeze(-1)  # [B, H, r, 2, V]
        delta = beta[:, t] * (v[:, t] - reads[..., 0, :])
        # q^T (S' + k delta^T) = q^T S' + (q.k) delta
        outputs.append(reads[..., 1, :] + qk_dot[:, t] * delta)
        state = state * decay[:, t, ..., None] + k_col[:, t] * delta.unsqueeze(-2)

    o = torch.stack(outputs, dim=1).reshape(batch, seq_len, num_v_heads, v_dim).to(out_dtype)
    final = state.reshape(batch, num_v_heads, k_dim, v_dim) if output_final_state else None
    return o, final
