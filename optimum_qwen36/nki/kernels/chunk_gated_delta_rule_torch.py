"""PyTorch twin of the chunked (prefill) gated delta rule kernel.

Chunked WY/UT form, written so that it is stable for any decay and maps onto NKI tiling (chunk 64,
K = V = 128: per chunk and head every matmul contracts over <= 128 with <= 128 output rows):

* Decays only enter as pairwise differences exp(c_i - c_j) (c = in-chunk cumsum of g), masked to -inf
  before the exp where i < j, plus exp(c_i), all <= 1. Nothing can overflow. c_i - c_j is summed
  directly over the tokens between j and i, not subtracted (cancellation with strong decays).
* The unit-lower-triangular system (I + A) is inverted exactly and stably: the base_block diagonal
  blocks are nilpotent ((I + N)^-1 = I - N for 2x2 blocks), then neighbouring blocks are merged level
  by level (block forward substitution, all pairs of a level at once). No long power series:
  a full-chunk Neumann product reaches 1e13+ in fp32 with real gates, and even 16x16 nilpotent doubling
  loses 2 digits with correlated keys (docs/GDN_KERNELS.md has the measurements).
* Everything that does not depend on the carried state is batched over all chunks: one matmul
  T diag(beta) @ [v | e^c k] = [U | W] solves both right-hand sides. The sequential loop per chunk is
  then three matmuls: [W; q e^c] S ([2C, K] @ [K, V]); v_new = U - W S; o = q e^c S + attn v_new;
  S <- e^(c_last) S + (k e^(c_last - c))^T v_new.
* QK^T and KK^T are computed once per key head and broadcast over its r value heads; repeat_interleave'd
  q/k are never materialised.

Inputs are assumed validated by :mod:`optimum_qwen36.nki`; all arithmetic and states are float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from optimum_qwen36.nki.kernels.fused_recurrent_gated_delta_rule_torch import prepare_qk

DEFAULT_BASE_BLOCK = 2


def _diagonal_blocks(a: torch.Tensor, size: int, offset: int = 0) -> torch.Tensor:
    """Blocks on block-diagonal `offset` of a [..., C, C], as [..., C/size - abs(offset), size, size]."""
    num = a.shape[-1] // size
    blocks = a.unflatten(-1, (num, size)).unflatten(-3, (num, size))  # [..., num, size, num, size]
    return torch.diagonal(blocks, offset=offset, dim1=-4, dim2=-2).movedim(-1, -3)


def _small_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x @ y for tiny blocks (<= 4 wide), where a broadcast multiply-sum beats per-matrix GEMM calls."""
    return (x.unsqueeze(-1) * y.unsqueeze(-3)).sum(-2)


def invert_unit_lower(a: torch.Tensor, base_block: int = DEFAULT_BASE_BLOCK) -> torch.Tensor:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C]; C and base_block powers of two.

    The base_block diagonal blocks N of A are nilpotent (N^base_block = 0), so their inverse is the
    exact product (I - N)(I + N^2)...(I + N^(base_block/2)) (just I - N for the default 2x2 blocks).
    Neighbouring blocks are then merged level by level, all pairs of a level at once:
    [[Ta, 0], [L, Tb]]^-1 = [[Ta, 0], [-Tb L Ta, Tb]] (block forward substitution). On a matmul
    engine the same merge is D - D L D with full-size masked matmuls (exact, since (D L)^2 = 0): that
    is how the NKI kernel (:mod:`optimum_qwen36.nki.kernels.chunk_gated_delta_rule`) runs it.
    """
    chunk = a.shape[-1]
    n = _diagonal_blocks(a, base_block)  # [..., C/base, base, base]
    inverse = torch.eye(base_block, dtype=a.dtype, device=a.device) - n
    power = n
    for _ in range(base_block.bit_length() - 2):  # log2(base_block) - 1 doubling rounds
        power = power @ power
        inverse = inverse + inverse @ power
    size = base_block
    while size < chunk:
        matmul = _small_matmul if size <= 4 else torch.matmul
        upper, lower = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        coupling = _diagonal_blocks(a, size, offset=-1)[..., 0::2, :, :]
        top = torch.cat((upper, torch.zeros_like(upper)), dim=-1)
        bottom = torch.cat((-matmul(lower, matmul(coupling, upper)), lower), dim=-1)
        inverse = torch.cat((top, bottom), dim=-2)
        size *= 2
    return inverse.squeeze(-3)


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
    output_chunk_states: bool = False,
    base_block: int = DEFAULT_BASE_BLOCK,
) -> tuple[torch.Tensor, ...]:
    """o [B, T, HV, V] (v's dtype), final state [B, HV, K, V] or None, and with output_chunk_states the
    states after each chunk [B, ceil(T / chunk_size), HV, K, V]. All states float32."""
    batch, seq_len, num_k_heads, k_dim = k.shape
    num_v_heads, v_dim = v.shape[-2:]
    group = num_v_heads // num_k_heads
    out_dtype = v.dtype
    base_block = min(base_block, chunk_size)
    num_chunks = -(-seq_len // chunk_size)
    pad = num_chunks * chunk_size - seq_len
    chunked = (num_chunks, batch, num_k_heads)  # leading dims: chunk first so the loop slices are contiguous

    q, k = prepare_qk(q, k, scale, use_qk_l2norm_in_kernel)
    # Padded tokens get g = 0 and beta = 0 (and k = 0): they leave the state untouched.
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    # Key-head tensors [N, B, H, C, K]; value-head tensors [N, B, H, r, C, ...].
    q, k = (x.view(batch, num_chunks, chunk_size, num_k_heads, k_dim).permute(1, 0, 3, 2, 4) for x in (q, k))
    q, k = q.contiguous(), k.contiguous()
    v = v.view(batch, num_chunks, chunk_size, num_k_heads, group, v_dim).permute(1, 0, 3, 4, 2, 5)
    g, beta = (
        x.view(batch, num_chunks, chunk_size, num_k_heads, group).permute(1, 0, 3, 4, 2).contiguous()
        for x in (g, beta)
    )

    cum = g.cumsum(-1)  # c_i, <= 0: only exponentiated directly, never differenced
    pos = torch.arange(chunk_size, device=q.device)
    causal, strictly_causal = pos.unsqueeze(-1) >= pos, pos.unsqueeze(-1) > pos
    # c_i - c_j summed directly as sum_{j < t <= i} g_t (a cumsum down the rows of g_t [t > j]): the
    # difference of two fp32 cumsums loses ~|c| * 6e-8 absolutely, ~1e-3 with strong decays (|c| ~ 1e4).
    # -inf above the diagonal before the exp, so nothing can overflow.
    log_decay = g.unsqueeze(-1).masked_fill(~strictly_causal, 0.0).cumsum(-2)
    decay = log_decay.masked_fill(~causal, float("-inf")).exp()  # exp(c_i - c_j), j <= i
    k_t = k.transpose(-1, -2)
    # KK^T and QK^T once per key head, broadcast over its r value heads.
    a = ((k @ k_t).unsqueeze(3) * decay * beta.unsqueeze(-1)).masked_fill(~strictly_causal, 0.0)
    attn = (q @ k_t).unsqueeze(3) * decay  # causal intra-chunk attention, diagonal included
    t_beta = invert_unit_lower(a, base_block) * beta.unsqueeze(-2)  # T diag(beta)
    exp_cum = cum.exp()
    # One solve for both right-hand sides: [U | W] = T diag(beta) [v | e^c k].
    u_w = t_beta @ torch.cat((v, (k.unsqueeze(3) * exp_cum.unsqueeze(-1))), dim=-1)
    u = u_w[..., :v_dim]
    # [W; q e^c] stacked so that one matmul per chunk reads the state for v_new and for the output.
    w_q = torch.cat((u_w[..., v_dim:], q.unsqueeze(3) * exp_cum.unsqueeze(-1)), dim=-2)
    k_decayed_t = (k.unsqueeze(3) * decay[..., -1, :].unsqueeze(-1)).transpose(-1, -2)  # k exp(c_last - c)
    chunk_decay = cum[..., -1].exp()

    heads = batch * num_v_heads
    u, w_q, attn, k_decayed_t = (
        x.reshape(num_chunks, heads, *x.shape[-2:]) for x in (u, w_q, attn, k_decayed_t)
    )
    chunk_decay = chunk_decay.reshape(num_chunks, heads, 1, 1)
    if initial_state is None:
        state = torch.zeros(heads, k_dim, v_dim, dtype=torch.float32, device=q.device)
    else:
        state = initial_state.float().reshape(heads, k_dim, v_dim)
    outputs, states = [], []
    for n in range(num_chunks):  # the only sequential part
        reads = w_q[n] @ state  # [W S; q e^c S]
        v_new = u[n] - reads[:, :chunk_size]
        outputs.append(torch.baddbmm(reads[:, chunk_size:], attn[n], v_new))
        state = torch.baddbmm(state * chunk_decay[n], k_decayed_t[n], v_new)
        if output_chunk_states:
            states.append(state)

    o = torch.stack(outputs).view(*chunked, group, chunk_size, v_dim).permute(1, 0, 4, 2, 3, 5)
    o = o.reshape(batch, num_chunks * chunk_size, num_v_heads, v_dim)[:, :seq_len].to(out_dtype)
    final = state.view(batch, num_v_heads, k_dim, v_dim) if output_final_state else None
    if not output_chunk_states:
        return o, final
    chunk_states = torch.stack(states).view(num_chunks, batch, num_v_heads, k_dim, v_dim).transpose(0, 1)
    return o, final, chunk_states  # contiguous for B = 1
