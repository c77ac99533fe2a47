"""PyTorch twin of the chunked (prefill) gated delta rule kernel.

Chunked WY/UT form, written so that it is stable for any decay and maps onto NKI tiling (chunk 64,
K = V = 128: per chunk and head every matmul contracts over <= 128 with <= 128 output rows):

* Decays only enter as pairwise differences exp(c_i - c_j) (c = in-chunk cumsum of g) for j <= i, plus
  exp(c_i), all <= 1. Nothing can overflow. c_i - c_j is summed directly over the tokens between j and
  i, not subtracted (cancellation with strong decays); the exponent is masked to 0 above the diagonal
  before the exp, and those entries are then dropped by the causal masks of KK^T and QK^T.
* The unit-lower-triangular system (I + A) is inverted exactly and stably: the base_block diagonal
  blocks are nilpotent ((I + N)^-1 = I - N for 2x2 blocks), then neighbouring blocks are merged level
  by level (block forward substitution, all pairs of a level at once). No long power series:
  a full-chunk Neumann product reaches 1e13+ in fp32 with real gates, and even 16x16 nilpotent doubling
  loses 2 digits with correlated keys (docs/GDN_KERNELS.md has the measurements).
* The sequential loop per chunk is four matmuls on [B*HV] batches and no other pass over the state
  but its decay: [v - W' S; q' S] = [v; 0] + [-k'; q'] S in one [2C, K] @ [K, V] matmul (k' = e^c k,
  q' = scale e^c q), v_new = T diag(beta) (v - W' S), o = q' S + attn v_new,
  S <- e^(c_last) S + (k e^(c_last - c))^T v_new.
* QK^T and KK^T are computed once per key head and broadcast over its r value heads; repeat_interleave'd
  q/k are never materialised.
* Chunks are processed in blocks of BLOCK_TOKENS tokens (the state-independent work of a block batched,
  then its chunks in sequence): the intermediates stay small (cache-resident, and below glibc's mmap
  threshold, whose fresh pages cost a page fault each), so the cost per token does not grow with T.

Inputs are assumed validated by :mod:`optimum_qwen36.nki`; all arithmetic and states are float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from optimum_qwen36.nki.kernels.fused_recurrent_gated_delta_rule_torch import l2norm

DEFAULT_BASE_BLOCK = 2
# Tokens per block of chunks: measured best of 128..1024 (1 thread, 27B per-rank shapes).
BLOCK_TOKENS = 512
# Merge levels inside DENSE_BLOCK x DENSE_BLOCK diagonal blocks run as masked dense matmuls on compact
# copies of those blocks (few, contiguous ops); larger levels merge their pairs as plain slices.
DENSE_BLOCK = 16
# torch.exp2 is ~4x faster than torch.exp on CPU; decays are therefore carried in base 2 (g * log2(e),
# one rounding per token, the same order as the fp32 summation itself).
LOG2E = 1 / math.log(2)


def _diagonal_blocks(a: torch.Tensor, size: int) -> torch.Tensor:
    """Diagonal size x size blocks of a [..., C, C], as a view [..., C/size, size, size]."""
    num = a.shape[-1] // size
    blocks = a.unflatten(-1, (num, size)).unflatten(-3, (num, size))  # [..., num, size, num, size]
    return torch.diagonal(blocks, dim1=-4, dim2=-2).movedim(-1, -3)


def _level_coupling_mask(size: int, level: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[size, size] mask of the blocks L that level `level` merges: [[Ta, 0], [L, Tb]] pairs of
    level x level blocks."""
    pos = torch.arange(size, device=device)
    rows, cols = pos.unsqueeze(-1), pos
    return ((rows // (2 * level) == cols // (2 * level)) & (rows // level != cols // level)).to(dtype)


def invert_unit_lower(a: torch.Tensor, base_block: int = DEFAULT_BASE_BLOCK) -> torch.Tensor:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C]; C and base_block powers of two.

    The base_block diagonal blocks N of A are nilpotent (N^base_block = 0), so their inverse is the
    exact product (I - N)(I + N^2)...(I + N^(base_block/2)) (just I - N for the default 2x2 blocks).
    Neighbouring blocks are then merged level by level, all pairs of a level at once:
    [[Ta, 0], [L, Tb]]^-1 = [[Ta, 0], [-Tb L Ta, Tb]] (block forward substitution). Levels inside the
    DENSE_BLOCK diagonal blocks use the equivalent masked form D <- D - D (L D) on those blocks (exact,
    since (D L)^2 = 0), as the NKI kernel (:mod:`optimum_qwen36.nki.kernels.chunk_gated_delta_rule`)
    does on the full chunk.
    """
    chunk = a.shape[-1]
    pos = torch.arange(chunk, device=a.device)
    same_base_block = (pos.unsqueeze(-1) // base_block == pos // base_block).to(a.dtype)
    eye = torch.eye(chunk, dtype=a.dtype, device=a.device)
    inverse = torch.addcmul(eye, a, same_base_block, value=-1.0)  # I - N on the base blocks
    power = _diagonal_blocks(a, base_block)
    for _ in range(base_block.bit_length() - 2):  # log2(base_block) - 1 doubling rounds
        power = power @ power
        blocks = _diagonal_blocks(inverse, base_block)
        blocks.copy_(blocks + blocks @ power)
    size = base_block
    dense = min(DENSE_BLOCK, chunk)
    if size < dense:
        couplings = _diagonal_blocks(a, dense)
        d = _diagonal_blocks(inverse, dense).contiguous()
        while size < dense:
            d = d - d @ ((couplings * _level_coupling_mask(dense, size, a.dtype, a.device)) @ d)
            size *= 2
        _diagonal_blocks(inverse, dense).copy_(d)
    while size < chunk:
        for lo in range(0, chunk, 2 * size):
            mid, hi = lo + size, lo + 2 * size
            merged = inverse[..., mid:hi, mid:hi] @ (a[..., mid:hi, lo:mid] @ inverse[..., lo:mid, lo:mid])
            inverse[..., mid:hi, lo:mid] = merged.neg_()
        size *= 2
    return inverse


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
    heads = batch * num_v_heads
    size = chunk_size
    base_block = min(base_block, size)
    num_chunks = -(-seq_len // size)
    block_chunks = max(1, BLOCK_TOKENS // size)
    f32, device = torch.float32, q.device

    pos = torch.arange(size, device=device)
    strictly_causal = (pos.unsqueeze(-1) > pos).to(f32)
    causal_scaled = (pos.unsqueeze(-1) >= pos).to(f32) * scale  # q is never scaled: scale rides on QK^T
    o = torch.empty(batch, seq_len, num_v_heads, v_dim, dtype=v.dtype, device=device)
    if initial_state is None:
        state = torch.zeros(heads, k_dim, v_dim, dtype=f32, device=device)
    else:
        state = initial_state.float().reshape(heads, k_dim, v_dim)
    states = []
    for first in range(0, num_chunks, block_chunks):
        nb = min(block_chunks, num_chunks - first)
        start, stop = first * size, min((first + nb) * size, seq_len)
        qb, kb, vb, gb, bb = (x[:, start:stop] for x in (q, k, v, g, beta))
        if use_qk_l2norm_in_kernel:
            qb, kb = l2norm(qb.float()), l2norm(kb.float())
        pad = (first + nb) * size - stop
        if pad:  # padded tokens: g = 0, beta = 0, k = 0, so they leave the state untouched
            qb, kb, vb = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (qb, kb, vb))
            gb, bb = (F.pad(x, (0, 0, 0, pad)) for x in (gb, bb))
        # Key-head tensors [nb, B, H, 1, ., K] (the 1 broadcasts over the r value heads of a key head);
        # value-head tensors [nb, B, H, r, ...]. Chunk first so that the loop slices are contiguous.
        kq = torch.stack([x.view(batch, nb, size, num_k_heads, k_dim).transpose(2, 3) for x in (kb, qb)], 3)
        kq = kq.transpose(0, 1).to(f32).view(nb, batch, num_k_heads, 1, 2 * size, k_dim)  # [k; q]
        kb = kq[..., :size, :]
        # [v; 0]: the addend of the one matmul per chunk that reads the state for both v_new and o.
        v0 = vb.view(batch, nb, size, num_v_heads, v_dim).permute(1, 0, 3, 2, 4)
        v0 = F.pad(v0, (0, 0, 0, size)).to(f32)
        gb, bb = (
            x.view(batch, nb, size, num_k_heads, group)
            .permute(1, 0, 3, 4, 2)
            .to(f32, memory_format=torch.contiguous_format)
            for x in (gb, bb)
        )
        gb = gb * LOG2E
        cum = gb.cumsum(-1)  # c_i (base 2), <= 0: only exponentiated directly, never differenced
        # c_i - c_j summed directly as sum_{j < t <= i} g_t (a cumsum down the rows of g_t [t > j]): the
        # difference of two fp32 cumsums loses ~|c| * 6e-8 absolutely, ~1e-3 with strong decays (|c| ~ 1e4).
        # The exponent is 0 on and above the diagonal, so nothing can overflow.
        decay = (gb.unsqueeze(-1) * strictly_causal).cumsum(-2).exp2_()  # exp(c_i - c_j) for j <= i
        kqk = kq @ kb.transpose(-1, -2)  # [KK^T; QK^T] once per key head
        a = (kqk[..., :size, :] * strictly_causal) * decay
        a.mul_(bb.unsqueeze(-1))
        attn = (kqk[..., size:, :] * causal_scaled) * decay  # causal intra-chunk attention, diagonal included
        t_beta = invert_unit_lower(a, base_block).mul_(bb.unsqueeze(-2))  # T diag(beta)
        exp_cum = cum.exp2()
        coef = torch.cat((-exp_cum, exp_cum * scale), dim=-1).unsqueeze(-1)
        kq_state = kq * coef  # [-e^c k; scale e^c q]
        k_last = kb * decay[..., -1, :].unsqueeze(-1)  # k exp(c_last - c)
        chunk_decay = exp_cum[..., -1].reshape(nb, heads, 1, 1)
        kq_state, v0, t_beta, attn, k_last = (
            x.reshape(nb, heads, *x.shape[-2:]) for x in (kq_state, v0, t_beta, attn, k_last)
        )
        k_last_t = k_last.transpose(-1, -2)
        for n in range(nb):  # the only sequential part
            reads = torch.baddbmm(v0[n], kq_state[n], state)  # [v - e^c k S; scale e^c q S]
            v_new = torch.bmm(t_beta[n], reads[:, :size])
            chunk_o = torch.baddbmm(reads[:, size:], attn[n], v_new).view(batch, num_v_heads, size, v_dim)
            state = torch.baddbmm(state * chunk_decay[n], k_last_t[n], v_new)
            if output_chunk_states:
                states.append(state)
            lo = start + n * size  # written straight into o: no stacked copy of the block's outputs
            o[:, lo : min(lo + size, seq_len)] = chunk_o.transpose(1, 2)[:, : seq_len - lo]

    final = state.view(batch, num_v_heads, k_dim, v_dim) if output_final_state else None
    if not output_chunk_states:
        return o, final
    chunk_states = torch.stack(states).view(num_chunks, batch, num_v_heads, k_dim, v_dim).transpose(0, 1)
    return o, final, chunk_states  # contiguous for B = 1
