"""PyTorch twin of the chunked (prefill) gated delta rule kernel.

Chunked WY/UT form, written so that it is stable for any decay and maps onto NKI tiling (K = V = 128:
per tile and head every matmul contracts over <= 128; the NKI kernel uses 64-token chunks, this twin
32-token tiles by default, which CPUs run faster; `tile_size=64` gives the kernel's exact tiling):

* Decays only enter as pairwise differences exp(c_i - c_j) (c = in-tile cumsum of g) for j <= i, plus
  exp(c_i), all <= 1. Nothing can overflow. c_i - c_j is summed directly over the tokens between j and
  i, not subtracted (cancellation with strong decays); the exponent is masked to 0 above the diagonal
  before the exp; the causal mask of QK^T drops those entries, and the inverse never reads A's diagonal
  or upper triangle.
* The unit-lower-triangular system (I + A) is inverted exactly and stably: the base_block diagonal
  blocks are nilpotent ((I + N)^-1 = I - N for 2x2 blocks), then neighbouring blocks are merged level
  by level (block forward substitution, all pairs of a level at once). No long power series:
  a full-chunk Neumann product reaches 1e13+ in fp32 with real gates, and even 16x16 nilpotent doubling
  loses 2 digits with correlated keys (docs/GDN_KERNELS.md has the measurements).
* The state is kept grouped by key head, [H, K, r, V], so that the r value heads of a key head are
  read by one [2C, K] @ [K, r V] matmul: [k S; scale q S] for all of them (k and q are never
  repeat_interleave'd or scaled per value head; the per-value-head decays e^c scale the rows of the
  product instead). Per tile: v_new = T diag(beta) (v - e^c k S), o = e^c scale q S + attn v_new,
  S <- e^(c_last) S + k^T (e^(c_last - c) v_new), the last again one matmul per key head.
* QK^T and KK^T are computed once per key head and broadcast over its r value heads.
* Tiles are processed in blocks of BLOCK_TOKENS tokens (the state-independent work of a block batched,
  then its tiles in sequence): the intermediates stay small (cache-resident, and below glibc's mmap
  threshold, whose fresh pages cost a page fault each), so the cost per token does not grow with T.
  Sequences of a batch are processed one after the other (prefill is one sequence in the model).
* The per-tile loop is 8 ATen calls and no views: its products are written (out=) into buffers allocated
  once per call, whose views are made once, and o straight into token-major views of the output. On CPU
  the loop costs Python dispatch per call, and the reused buffers stay cache-resident.

Inputs are assumed validated by :mod:`optimum_qwen36.nki`; all arithmetic and states are float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from optimum_qwen36.nki.kernels.fused_recurrent_gated_delta_rule_torch import inverse_l2_norm

DEFAULT_BASE_BLOCK = 2
# Tokens per tile of the chunked form on CPU. 32 needs 12% fewer multiply-adds per token than 64 (the
# intra-tile products grow with the tile) and halves the tile-sized work before the loop: measured ~20%
# faster than 64 at T = 4096 on one core (docs/GDN_KERNELS.md). The NKI kernel keeps 64-token chunks
# (128-partition tiles); the two agree to rounding.
DEFAULT_TILE = 32
# Tokens per block of tiles: the state-independent work of a block is batched, then its tiles run in
# sequence. Measured best of 256..2048 (1 thread, 27B per-rank shapes).
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


def unit_lower_inverse_masks(
    chunk: int, base_block: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The constant masks of :func:`invert_unit_lower` for chunk x chunk systems, [1 + levels, d, d] with d
    its dense block size: the strictly lower part of the base_block diagonal blocks (their nilpotent part),
    then for each merge level s = base_block, 2 base_block, ... < d the lower-left s x s block of a pair."""
    base = min(base_block, chunk)
    dense = min(max(DENSE_BLOCK, base), chunk)
    pos = torch.arange(dense, device=device)
    rows, cols = pos.unsqueeze(-1), pos
    masks = [(rows // base == cols // base) & (rows > cols)]
    masks += [(rows // (2 * s) == cols // (2 * s)) & (rows // s > cols // s) for s in _levels(base, dense)]
    return torch.stack(masks).to(dtype)


def _levels(base: int, size: int) -> list[int]:
    """Merge levels base, 2 base, ... < size."""
    return [base << i for i in range((size // base).bit_length() - 1)]


def invert_unit_lower(
    a: torch.Tensor, base_block: int = DEFAULT_BASE_BLOCK, masks: torch.Tensor | None = None
) -> torch.Tensor:
    """(I + A)^-1 for A the strictly lower triangle of a [..., C, C] (any strides; the diagonal and above are
    never read); C and base_block powers of two. masks: unit_lower_inverse_masks(C, base_block, ...), if the
    caller has them.

    The base_block diagonal blocks N of A are nilpotent (N^base_block = 0), so their inverse is the
    exact product (I - N)(I + N^2)...(I + N^(base_block/2)) (just I - N for the default 2x2 blocks).
    Neighbouring blocks are then merged level by level, all pairs of a level at once:
    [[Ta, 0], [L, Tb]]^-1 = [[Ta, 0], [-Tb L Ta, Tb]] (block forward substitution). Levels inside the
    DENSE_BLOCK diagonal blocks use the equivalent masked form D <- D - D (L D) on compact copies of
    those blocks (exact, since (D L)^2 = 0), as the NKI kernel
    (:mod:`optimum_qwen36.nki.kernels.chunk_gated_delta_rule`) does on the full chunk.
    """
    chunk = a.shape[-1]
    base = min(base_block, chunk)
    if masks is None:
        masks = unit_lower_inverse_masks(chunk, base_block, a.dtype, a.device)
    dense = masks.shape[-1]
    blocks = _diagonal_blocks(a, dense)  # [..., chunk / dense, dense, dense], a view
    # One pass: the nilpotent parts and every level's couplings, each level's a contiguous [M, dense, dense].
    parts = torch.mul(blocks, masks.view(-1, *[1] * (blocks.dim() - 2), dense, dense))
    nilpotent, *couplings = parts.view(masks.shape[0], -1, dense, dense).unbind()
    inverse = torch.eye(dense, dtype=a.dtype, device=a.device) - nilpotent  # I - N
    power = nilpotent
    for _ in range(base.bit_length() - 2):  # log2(base_block) - 1 doubling rounds
        power = torch.bmm(power, power)
        inverse = torch.baddbmm(inverse, inverse, power)
    for coupling in couplings:
        inverse = torch.baddbmm(inverse, inverse, torch.bmm(coupling, inverse), alpha=-1)
    inverse = inverse.view(blocks.shape)
    for size in _levels(dense, chunk):  # pairs of size x size diagonal blocks, as plain slices
        pairs = inverse.unflatten(-3, (-1, 2))  # [..., n, 2, size, size]
        upper, lower = pairs.unbind(-3)
        merged = torch.empty(*pairs.shape[:-3], 2 * size, 2 * size, dtype=a.dtype, device=a.device)
        merged[..., :size, :size] = upper
        merged[..., :size, size:] = 0
        merged[..., size:, size:] = lower
        merged[..., size:, :size] = torch.matmul(lower, _lower_left_blocks(a, size) @ upper).neg_()
        inverse = merged
    return inverse.view(a.shape)


def _lower_left_blocks(a: torch.Tensor, size: int) -> torch.Tensor:
    """The lower-left size x size block of each pair of size x size diagonal blocks of a [..., C, C], as a
    view [..., C / (2 size), size, size]."""
    num = a.shape[-1] // (2 * size)
    pairs = a.unflatten(-1, (num, 2, size)).unflatten(-4, (num, 2, size))  # [..., n, 2, size, n, 2, size]
    return torch.diagonal(pairs[..., :, 1, :, :, 0, :], dim1=-4, dim2=-2).movedim(-1, -3)


def _tile_keys_queries(
    q: torch.Tensor, k: torch.Tensor, size: int, scale: float, use_qk_l2norm: bool
) -> torch.Tensor:
    """[k; scale q] per tile and key head, float32 [T / size, H, 2 size, K], L2-normalised first if asked
    (T a multiple of size): normalised and scaled on the way into the tile layout, one pass each."""
    seq_len, num_k_heads, k_dim = k.shape
    num_tiles = seq_len // size
    kq = torch.empty(num_tiles, num_k_heads, 2 * size, k_dim, dtype=torch.float32, device=k.device)
    halves = kq.view(num_tiles, num_k_heads, 2, size, k_dim).unbind(2)
    for half, x, x_scale in zip(halves, (k, q), (1.0, scale), strict=True):
        x = x.float().view(num_tiles, size, num_k_heads, k_dim)  # no copy for float32 inputs
        factor = inverse_l2_norm(x) * x_scale if use_qk_l2norm else x_scale
        torch.mul(x, factor, out=half.transpose(1, 2))
    return kq


def _chunk_one_sequence(
    o: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    state: torch.Tensor,
    tile: int,
    base_block: int,
    chunk_states: list[torch.Tensor] | None,
    tiles_per_chunk: int,
) -> None:
    """One sequence: q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV], any float dtype.

    Writes o [T, HV, V]; `state` is the float32 state grouped by key head, [H, K, r, V], updated in place;
    appends the [HV, K, V] state after every tiles_per_chunk tiles (and after the last) to chunk_states.
    """
    seq_len, num_k_heads, k_dim = k.shape
    num_v_heads, v_dim = v.shape[-2:]
    group = num_v_heads // num_k_heads
    size = tile
    num_tiles = -(-seq_len // size)
    block_tiles = max(1, BLOCK_TOKENS // size)
    f32, device = torch.float32, q.device

    pos = torch.arange(size, device=device)
    strictly_causal = (pos.unsqueeze(-1) > pos).to(f32)
    causal = (pos.unsqueeze(-1) >= pos).to(f32)
    inverse_masks = unit_lower_inverse_masks(size, base_block, f32, device)
    # [K, r V]: one [2C, K] @ [K, r V] matmul reads the states of all r value heads of a key head.
    state_mat = state.view(num_k_heads, k_dim, group * v_dim)
    # Per-tile buffers, reused by every tile (written with out=: no allocations, and they stay in cache), with
    # their views made once: [k S; scale q S] [H, 2C, r V]; v - e^c k S, v_new, attn v_new [HV, C, V]; and
    # e^(c_last - c) v_new [H, C, r V].
    reads = torch.empty(num_k_heads, 2 * size, group * v_dim, dtype=f32, device=device)
    k_reads = reads[:, :size].view(num_k_heads, size, group, v_dim).transpose(1, 2)  # [H, r, C, V]
    q_reads = reads[:, size:].view(num_k_heads, size, group, v_dim)  # [H, C, r, V]
    v_res, v_new, attn_v = (torch.empty(num_v_heads, size, v_dim, dtype=f32, device=device) for _ in range(3))
    v_res_grouped = v_res.view(num_k_heads, group, size, v_dim)  # [H, r, C, V]
    v_new_grouped, attn_v_grouped = (
        x.view(num_k_heads, group, size, v_dim).transpose(1, 2) for x in (v_new, attn_v)
    )  # [H, C, r, V]
    v_decayed = torch.empty(num_k_heads, size, group * v_dim, dtype=f32, device=device)
    v_decayed_grouped = v_decayed.view(num_k_heads, size, group, v_dim)
    for first in range(0, num_tiles, block_tiles):
        nb = min(block_tiles, num_tiles - first)
        start, stop = first * size, min((first + nb) * size, seq_len)
        qb, kb, vb, gb, bb = (x[start:stop] for x in (q, k, v, g, beta))
        pad = (first + nb) * size - stop
        if pad:  # padded tokens: g = 0, beta = 0, k = 0, so they leave the state untouched
            qb, kb, vb = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (qb, kb, vb))
            gb, bb = (F.pad(x, (0, 0, 0, pad)) for x in (gb, bb))
        # [k; scale q] per tile and key head [nb, H, 2C, K]: scale rides on QK^T and on q S. Normalised per
        # block, like everything else: no whole-sequence float32 copies of q and k.
        kq = _tile_keys_queries(qb, kb, size, scale, use_qk_l2norm)
        keys = kq[:, :, :size]
        # Value-head tensors [nb, H, r, ...]; key-head ones broadcast over r (never repeat_interleave'd).
        bb = bb.view(nb, size, num_k_heads, group).permute(0, 2, 3, 1).to(f32)
        gb = gb.view(nb, size, num_k_heads, group).permute(0, 2, 3, 1).to(f32) * LOG2E
        cum = gb.cumsum(-1)  # c_i (base 2), <= 0: only exponentiated directly, never differenced
        # c_i - c_j summed directly as sum_{j < t <= i} g_t (a cumsum down the rows of g_t [t > j]): the
        # difference of two fp32 cumsums loses ~|c| * 6e-8 absolutely, ~1e-3 with strong decays (|c| ~ 1e4).
        # The exponent is 0 on and above the diagonal, so nothing can overflow.
        decay = (gb.unsqueeze(-1) * strictly_causal).cumsum(-2).exp2_()  # exp(c_i - c_j) for j <= i
        kqk = torch.matmul(kq, keys.transpose(-1, -2)).unsqueeze(2)  # [KK^T; scale QK^T] once per key head
        # A = diag(beta) (KK^T o Gamma); its diagonal and above are never read by the inverse
        a = torch.mul(kqk[..., :size, :], decay).mul_(bb.unsqueeze(-1))
        attn = (kqk[..., size:, :] * causal) * decay  # causal intra-tile attention, diagonal included
        t_beta = invert_unit_lower(a, base_block, inverse_masks).mul_(bb.unsqueeze(-2))  # T diag(beta)
        exp_cum = cum.exp2()
        neg_exp_cum = exp_cum.neg().unsqueeze(-1)  # [nb, H, r, C, 1]: v - e^c k S
        out_coef = exp_cum.transpose(-1, -2).unsqueeze(-1)  # [nb, H, C, r, 1]: e^c scale q S
        # [nb, H, C, r, 1]: e^(c_last - c); contiguous, so that its product with v_new is [H, C, r, V]
        to_last = decay[..., -1, :].transpose(-1, -2).unsqueeze(-1).contiguous()
        tile_decay = exp_cum[..., -1].view(nb, num_k_heads, 1, group, 1)  # e^(c_last)
        t_beta, attn = (x.reshape(nb, num_v_heads, size, size) for x in (t_beta, attn))
        # [nb, H, r, C, V], a view of v (read in place, never copied)
        values = vb.view(nb, size, num_k_heads, group, v_dim).permute(0, 2, 3, 1, 4)
        # o is written in place, through token-major [nb, H, C, r, V] views of this block's rows (a partial
        # last tile goes through a scratch block).
        o_block = o[start:stop] if not pad else o.new_empty(nb * size, num_v_heads, v_dim)
        o_tiles = o_block.view(nb, size, num_k_heads, group, v_dim).transpose(1, 2)
        per_tile = (kq, values, neg_exp_cum, t_beta, attn, out_coef, o_tiles, to_last, tile_decay, keys.mT)
        for done, tile_views in enumerate(zip(*(x.unbind() for x in per_tile), strict=True), start=first + 1):
            (
                kq_n,
                values_n,
                neg_exp_cum_n,
                t_beta_n,
                attn_n,
                out_coef_n,
                o_n,
                to_last_n,
                tile_decay_n,
                keys_t_n,
            ) = tile_views
            torch.bmm(kq_n, state_mat, out=reads)  # [k S; scale q S]
            torch.addcmul(values_n, k_reads, neg_exp_cum_n, out=v_res_grouped)  # v - e^c k S
            torch.bmm(t_beta_n, v_res, out=v_new)
            torch.bmm(attn_n, v_new, out=attn_v)
            torch.addcmul(attn_v_grouped, q_reads, out_coef_n, out=o_n)  # o = attn v_new + e^c scale q S
            # S <- e^(c_last) S + k^T (e^(c_last - c) v_new), all r value heads in one matmul
            torch.mul(to_last_n, v_new_grouped, out=v_decayed_grouped)
            state.mul_(tile_decay_n)
            state_mat.baddbmm_(keys_t_n, v_decayed)
            if chunk_states is not None and (done % tiles_per_chunk == 0 or done == num_tiles):
                # a copy (clone always copies; reshape may return a view of the live state)
                snapshot = state.transpose(1, 2).clone(memory_format=torch.contiguous_format)
                chunk_states.append(snapshot.view(num_v_heads, k_dim, v_dim))
        if pad:
            o[start:stop] = o_block[: stop - start]


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
    tile_size: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """o [B, T, HV, V] (v's dtype), final state [B, HV, K, V] or None, and with output_chunk_states the
    states after each chunk [B, ceil(T / chunk_size), HV, K, V]. All states float32.

    The chunked form runs on tiles of tile_size tokens (default min(chunk_size, DEFAULT_TILE)), a power
    of two dividing chunk_size; chunk_size only sets where chunk states are taken.
    """
    batch, seq_len, num_k_heads, k_dim = k.shape
    num_v_heads, v_dim = v.shape[-2:]
    group = num_v_heads // num_k_heads
    tile = min(chunk_size, DEFAULT_TILE) if tile_size is None else tile_size
    if tile < 1 or tile & (tile - 1) or chunk_size % tile:
        raise ValueError(f"tile_size must be a power of two dividing chunk_size={chunk_size}, got {tile}")
    o = torch.empty(batch, seq_len, num_v_heads, v_dim, dtype=v.dtype, device=q.device)
    finals, states = [], []
    for row in range(batch):  # sequences are independent; one at a time keeps every view a plain view
        state = torch.zeros(num_k_heads, k_dim, group, v_dim, dtype=torch.float32, device=q.device)
        if initial_state is not None:  # a copy: the caller's state is never written
            state.copy_(initial_state[row].view(num_k_heads, group, k_dim, v_dim).transpose(1, 2))
        row_states = [] if output_chunk_states else None
        _chunk_one_sequence(
            o[row], q[row], k[row], v[row], g[row], beta[row], scale, use_qk_l2norm_in_kernel, state, tile,
            base_block, row_states, chunk_size // tile,
        )  # fmt: skip
        if output_final_state:
            finals.append(state.transpose(1, 2).reshape(num_v_heads, k_dim, v_dim))
        if row_states is not None:
            states.append(torch.stack(row_states))
    final = torch.stack(finals) if output_final_state else None
    if not output_chunk_states:
        return o, final
    return o, final, torch.stack(states)
