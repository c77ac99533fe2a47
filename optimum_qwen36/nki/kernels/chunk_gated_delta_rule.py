"""NKI chunked-prefill kernel of the gated delta rule, and its thin torch wrapper.

Same scheme and tiling as the PyTorch twin (:mod:`optimum_qwen36.nki.kernels.chunk_gated_delta_rule_torch`
with its defaults, chunk 64 and base block 2). Per chunk of 64 tokens, with c the in-chunk cumsum of g
and S the state entering the chunk ([K, V] float32, K on the partitions, resident in SBUF):

1. A[i, j] = beta_i (k_i . k_j) exp(c_i - c_j) for j < i, attn[i, j] = (q_i . k_j) exp(c_i - c_j) for
   j <= i. Every exponent is a partial sum of g computed directly by a masked matmul
   (c_i - c_j = sum_{j<t<=i} g_t, 0 above the diagonal), never as a difference of cumsums: all exponents
   are <= 0, so no exp overflows whatever g is, and large |c| costs no precision. The upper triangle is
   zeroed after the exp.
2. T = (I + A)^-1 exactly as the twin's ``invert_unit_lower``: the 2x2 diagonal blocks give D = I - N,
   then neighbouring blocks are merged level by level (2 -> 4 -> ... -> 64) with
   [[Ta, 0], [L, Tb]]^-1 = [[Ta, 0], [-Tb (L Ta), Tb]]. On the Tensor Engine one level is
   D <- D - D (L D) with full 64x64 matmuls, L = A masked to the level's coupling blocks: exact, because
   D is block diagonal and L only couples neighbouring blocks, so the extra products are exact zeros.
   No power series anywhere (a 64-token Neumann product overflows fp32, and even 16x16 nilpotent
   doubling loses 2 digits with correlated keys: docs/GDN_KERNELS.md).
3. [U | W] = T diag(beta) [v | exp(c) k] (one matmul for both right-hand sides), delta = U - W S,
   o = q exp(c) S + attn delta, S <- exp(c_last) S + (k exp(c_last - c))^T delta.
   The twin batches steps 1-2 over all chunks; the kernel walks the chunks in order (step 3 is the twin's
   loop body, with the state read by two matmuls instead of one stacked [W; q exp(c)] matmul).

Layout: every token-major operand is one [64, n] tile at partition 0 and every chunk matrix one [64, 64]
tile, so no operand ever starts at a partition offset (matmul operands may need aligned partition
starts). Matrices used as matmul stationaries are kept transposed (T^T, A^T, attn^T, q^T); the merge
keeps D and D^T, since D is both the moving (L D) and the stationary (D X) operand. q k^T and k k^T are
computed once per key head and reused by its r value heads. All arithmetic is float32 (inputs are
widened after the DMA).

HBM inputs, arranged by :func:`chunk_gated_delta_rule` (T padded to a multiple of 64 with g = beta = 0
and zero q/k/v, which leaves the state unchanged): q, k [B, H, T, K]; v [B, HV, T, V];
g, beta [B, HV, T, 1] float32; initial_state [B, HV, K, V] float32. Outputs: o [B, HV, T, V] in v's
dtype and the state after every chunk [B, HV, T / 64, K, V] float32 (the last is the final state).
Limits: K <= 128, K + V <= 512.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from optimum_qwen36.nki.interpreter import nki_modules

nki, nl, nisa = nki_modules()

CHUNK = 64
BASE_BLOCK = 2  # the twin's DEFAULT_BASE_BLOCK: (I + N)^-1 = I - N for its 2x2 diagonal blocks N
# Merge levels: blocks of `size` are merged pairwise into blocks of 2 * size.
_MERGE_SIZES = [BASE_BLOCK << level for level in range((CHUNK // BASE_BLOCK).bit_length() - 1)]  # 2..32
L2NORM_EPS = 1e-6
_PMAX = 128


def sbuf_tile(shape: tuple[int, ...], dtype: object = None) -> object:
    return nl.ndarray(shape, dtype=dtype or nl.float32, buffer=nl.sbuf)


def evict(psum_tile: object) -> object:
    """Copy a PSUM tile to a new float32 SBUF tile (frees the PSUM bank for the next instruction)."""
    out = sbuf_tile(psum_tile.shape)
    nisa.tensor_copy(dst=out, src=psum_tile)
    return out


def matmul_to_sbuf(stationary: object, moving: object) -> object:
    """stationary.T @ moving into a new SBUF tile."""
    acc = nl.ndarray((stationary.shape[1], moving.shape[1]), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(acc, stationary, moving, accumulate=False)
    return evict(acc)


def transpose_to_sbuf(tile: object) -> object:
    """tile.T (SBUF, float32) through the Tensor Engine."""
    acc = nl.ndarray((tile.shape[1], tile.shape[0]), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(acc, tile, engine=nisa.engine.tensor)
    return evict(acc)


def load_rows(src: object) -> object:
    """DMA an HBM [rows, n] slice into SBUF and widen it to float32."""
    staged = sbuf_tile(src.shape, src.dtype)
    nisa.dma_copy(dst=staged, src=src)
    if src.dtype == nl.float32:
        return staged
    wide = sbuf_tile(src.shape)
    nisa.tensor_copy(dst=wide, src=staged)
    return wide


def scale_rows(rows: object, factor: float, l2norm: bool) -> object:
    """rows * factor, each row first L2-normalised (x * rsqrt(sum x^2 + eps)) when l2norm."""
    out = sbuf_tile(rows.shape)
    if not l2norm:
        nisa.tensor_scalar(out, rows, op0=nl.multiply, operand0=factor)
        return out
    squares = sbuf_tile(rows.shape)
    nisa.tensor_tensor(squares, rows, rows, op=nl.multiply)
    sum_sq = sbuf_tile((rows.shape[0], 1))
    nisa.tensor_reduce(sum_sq, op=nl.add, data=squares, axis=1)
    inv_norm = sbuf_tile((rows.shape[0], 1))
    nisa.activation(dst=inv_norm, op=nl.rsqrt, data=sum_sq, bias=L2NORM_EPS)
    nisa.tensor_scalar(out, rows, op0=nl.multiply, operand0=inv_norm, op1=nl.multiply, operand1=factor)
    return out


def store_rows(dst: object, rows: object) -> object:
    """Cast a float32 SBUF tile to dst's dtype and DMA it to HBM."""
    if dst.dtype != nl.float32:
        narrow = sbuf_tile(rows.shape, dst.dtype)
        nisa.tensor_copy(dst=narrow, src=rows)
        rows = narrow
    nisa.dma_copy(dst=dst, src=rows)


def _causal_mask(dst: object, values: object, strict: bool) -> None:
    """dst[i, j] = values[i, j] if j < i (strict) or j <= i else 0, for a [64, 64] chunk matrix."""
    nisa.affine_select(
        dst,
        pattern=[[-1, values.shape[1]]],
        offset=-1 if strict else 0,
        channel_multiplier=1,
        on_true_tile=values,
        on_false_value=0.0,
        cmp_op=nl.greater_equal,
    )


def _upper_triangle(dst: object, values: object) -> None:
    """dst[t, j] = values[t, j] if t <= j else 0, for a [64, 64] chunk matrix."""
    nisa.affine_select(
        dst,
        pattern=[[1, CHUNK]],
        offset=0,
        channel_multiplier=-1,
        on_true_tile=values,
        on_false_value=0.0,
        cmp_op=nl.greater_equal,
    )


def _block_diagonal_mask(ones: object, size: int) -> object:
    """[64, 64] 0/1 mask of the size x size diagonal blocks, as E E^T with the block indicator E.

    E^T[b, f] = 1 iff b * size <= f < (b + 1) * size: two affine selects over a [64 / size, 64] tile (block
    membership itself is not affine in the partition index, so it cannot be one select on [64, 64]).
    """
    num_blocks = CHUNK // size
    lower_bound = sbuf_tile((num_blocks, CHUNK))  # f - size * b >= 0
    nisa.affine_select(
        lower_bound,
        pattern=[[1, CHUNK]],
        offset=0,
        channel_multiplier=-size,
        on_true_tile=ones[nl.ds(0, num_blocks), nl.ds(0, CHUNK)],
        on_false_value=0.0,
        cmp_op=nl.greater_equal,
    )
    indicator_t = sbuf_tile((num_blocks, CHUNK))  # and size * b + size - 1 - f >= 0
    nisa.affine_select(
        indicator_t,
        pattern=[[-1, CHUNK]],
        offset=size - 1,
        channel_multiplier=size,
        on_true_tile=lower_bound,
        on_false_value=0.0,
        cmp_op=nl.greater_equal,
    )
    return matmul_to_sbuf(indicator_t, indicator_t)


def _constants() -> dict:
    """Masks shared by every chunk and head (built once per kernel)."""
    ones = sbuf_tile((CHUNK, _PMAX))
    nisa.memset(ones, 1.0)
    square_ones = ones[:, nl.ds(0, CHUNK)]
    upper = sbuf_tile((CHUNK, CHUNK))  # upper[t, j] = 1 if t <= j: (upper^T g)_j = c_j
    _upper_triangle(upper, square_ones)
    strict_lower = sbuf_tile((CHUNK, CHUNK))  # strict_lower[t, j] = 1 if t > j
    _causal_mask(strict_lower, square_ones, strict=True)
    identity = sbuf_tile((CHUNK, CHUNK))
    nisa.affine_select(
        identity,
        pattern=[[-1, CHUNK]],
        offset=0,
        channel_multiplier=1,
        on_true_tile=square_ones,
        on_false_value=0.0,
        cmp_op=nl.equal,
    )
    # coupling[level][i, j] = 1 iff i, j are in the same block of 2 * size but not of size: the blocks
    # L that one merge level couples. All masks are symmetric, so they mask A and A^T alike.
    base_blocks = inner = _block_diagonal_mask(ones, BASE_BLOCK)
    coupling = []
    for size in _MERGE_SIZES:
        outer = _block_diagonal_mask(ones, 2 * size)
        mask = sbuf_tile((CHUNK, CHUNK))
        nisa.tensor_tensor(mask, outer, inner, op=nl.subtract)
        coupling.append(mask)
        inner = outer
    return {
        "ones": ones,
        "upper": upper,
        "strict_lower": strict_lower,
        "identity": identity,
        "base_blocks": base_blocks,
        "coupling": coupling,
    }


def _invert_unit_lower_t(a: object, a_t: object, consts: dict) -> object:
    """((I + A)^-1)^T for the strictly lower A [64, 64] (a_t = A^T), by the twin's level-by-level merge.

    D starts as the exact inverses I - N of the 2x2 diagonal blocks. Level `size`: D holds the inverses
    of the size x size diagonal blocks; L = A on the coupling blocks; D <- D - D (L D) gives the inverses
    of the 2 * size blocks. Only D^T is needed after the last level (it is the stationary of the solve).
    """
    d, d_t = sbuf_tile((CHUNK, CHUNK)), sbuf_tile((CHUNK, CHUNK))
    for dst, src in ((d, a), (d_t, a_t)):
        nisa.tensor_tensor(dst, src, consts["base_blocks"], op=nl.multiply)  # N (A is strictly lower)
        nisa.tensor_tensor(dst, consts["identity"], dst, op=nl.subtract)
    for level, size in enumerate(_MERGE_SIZES):
        l_t = sbuf_tile((CHUNK, CHUNK))
        nisa.tensor_tensor(l_t, a_t, consts["coupling"][level], op=nl.multiply)
        x = matmul_to_sbuf(l_t, d)  # L D (= L Ta on the coupling blocks, 0 elsewhere)
        correction_t = nl.ndarray((CHUNK, CHUNK), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(correction_t, x, d_t, accumulate=False)  # (D L D)^T = X^T D^T
        new_d_t = sbuf_tile((CHUNK, CHUNK))
        nisa.tensor_tensor(new_d_t, d_t, correction_t, op=nl.subtract)
        if 2 * size < CHUNK:  # D itself is the moving operand of the next level
            correction = nl.ndarray((CHUNK, CHUNK), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(correction, d_t, x, accumulate=False)  # D L D
            new_d = sbuf_tile((CHUNK, CHUNK))
            nisa.tensor_tensor(new_d, d, correction, op=nl.subtract)
            d = new_d
        d_t = new_d_t
    return d_t


def _key_head_tiles(q: object, k: object, b: int, h: int, t0: int, scale: float, l2norm: bool) -> dict:
    """Per chunk and key head: q, k rows [64, K] (normalised, q scaled) and q k^T, k k^T [64, 64]."""
    rows = nl.ds(t0, CHUNK)
    q_rows = scale_rows(load_rows(q[b, h, rows, :]), scale, l2norm)
    k_rows = scale_rows(load_rows(k[b, h, rows, :]), 1.0, l2norm)
    q_t, k_t = transpose_to_sbuf(q_rows), transpose_to_sbuf(k_rows)
    return {
        "q_rows": q_rows,
        "k_rows": k_rows,
        "qk": matmul_to_sbuf(q_t, k_t),
        "kk": matmul_to_sbuf(k_t, k_t),
    }


def _value_head_chunk(
    tiles: dict,
    state: object,
    v: object,
    g: object,
    beta: object,
    b: int,
    hv: int,
    t0: int,
    consts: dict,
    o: object,
) -> None:
    """One chunk of one value head: writes o rows and updates state ([K, V] SBUF) in place."""
    k_dim, v_dim = state.shape
    rows = nl.ds(t0, CHUNK)
    g_col, beta_col = sbuf_tile((CHUNK, 1)), sbuf_tile((CHUNK, 1))
    nisa.dma_copy(dst=g_col, src=g[b, hv, rows, :])
    nisa.dma_copy(dst=beta_col, src=beta[b, hv, rows, :])

    # Log-decays as direct partial sums of g, never as differences of cumsums (c reaches -1e4 with
    # strong gates, where c_i - c_j would lose the few ulps that matter); all are <= 0:
    #   log_decay[i, j] = sum_{j < t <= i} g_t (0 when j >= i, masked below) = (G^T strict_lower)[i, j]
    #   with G[t, i] = g_t if t <= i;  c_i = sum_{t <= i} g_t;  c_last - c_i = sum_{t > i} g_t.
    g_bcast = sbuf_tile((CHUNK, CHUNK))  # g_bcast[t, i] = g_t
    nisa.tensor_scalar(g_bcast, consts["ones"][:, nl.ds(0, CHUNK)], op0=nl.multiply, operand0=g_col)
    g_upto = sbuf_tile((CHUNK, CHUNK))
    _upper_triangle(g_upto, g_bcast)
    decay = sbuf_tile((CHUNK, CHUNK))
    nisa.activation(dst=decay, op=nl.exp, data=matmul_to_sbuf(g_upto, consts["strict_lower"]))
    exp_c = sbuf_tile((CHUNK, 1))
    nisa.activation(dst=exp_c, op=nl.exp, data=matmul_to_sbuf(consts["upper"], g_col))
    to_end = sbuf_tile((CHUNK, 1))
    nisa.activation(dst=to_end, op=nl.exp, data=matmul_to_sbuf(consts["strict_lower"], g_col))
    exp_last = sbuf_tile((k_dim, 1))  # exp(c_last) on each of the K state partitions
    nisa.activation(dst=exp_last, op=nl.exp, data=matmul_to_sbuf(consts["ones"][:, nl.ds(0, k_dim)], g_col))

    a_full = sbuf_tile((CHUNK, CHUNK))
    nisa.tensor_tensor(a_full, tiles["kk"], decay, op=nl.multiply)
    nisa.tensor_scalar(a_full, a_full, op0=nl.multiply, operand0=beta_col)
    a = sbuf_tile((CHUNK, CHUNK))
    _causal_mask(a, a_full, strict=True)
    attn_full = sbuf_tile((CHUNK, CHUNK))
    nisa.tensor_tensor(attn_full, tiles["qk"], decay, op=nl.multiply)
    attn = sbuf_tile((CHUNK, CHUNK))
    _causal_mask(attn, attn_full, strict=False)

    # [U | W] = T diag(beta) [v | exp(c) k]; row j of T^T scaled by beta_j is (T diag(beta))^T.
    t_beta_t = sbuf_tile((CHUNK, CHUNK))
    nisa.tensor_scalar(
        t_beta_t, _invert_unit_lower_t(a, transpose_to_sbuf(a), consts), op0=nl.multiply, operand0=beta_col
    )
    rhs = sbuf_tile((CHUNK, v_dim + k_dim))
    nisa.tensor_copy(dst=rhs[:, nl.ds(0, v_dim)], src=load_rows(v[b, hv, rows, :]))
    nisa.tensor_scalar(rhs[:, nl.ds(v_dim, k_dim)], tiles["k_rows"], op0=nl.multiply, operand0=exp_c)
    u_w = matmul_to_sbuf(t_beta_t, rhs)

    # delta = U - W S (the state entering the chunk)
    w_s = nl.ndarray((CHUNK, v_dim), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(w_s, transpose_to_sbuf(u_w[:, nl.ds(v_dim, k_dim)]), state, accumulate=False)
    delta = sbuf_tile((CHUNK, v_dim))
    nisa.tensor_tensor(delta, u_w[:, nl.ds(0, v_dim)], w_s, op=nl.subtract)

    # o = q exp(c) S + attn delta
    q_decayed = sbuf_tile((CHUNK, k_dim))
    nisa.tensor_scalar(q_decayed, tiles["q_rows"], op0=nl.multiply, operand0=exp_c)
    out = nl.ndarray((CHUNK, v_dim), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(out, transpose_to_sbuf(q_decayed), state, accumulate=False)
    nisa.nc_matmul(out, transpose_to_sbuf(attn), delta, accumulate=True)
    store_rows(o[b, hv, rows, :], evict(out))

    # S <- exp(c_last) S + (k exp(c_last - c))^T delta
    k_decayed = sbuf_tile((CHUNK, k_dim))
    nisa.tensor_scalar(k_decayed, tiles["k_rows"], op0=nl.multiply, operand0=to_end)
    update = nl.ndarray((k_dim, v_dim), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(update, k_decayed, delta, accumulate=False)
    nisa.tensor_scalar(state, state, op0=nl.multiply, operand0=exp_last)
    nisa.tensor_tensor(state, state, update, op=nl.add)


@nki.jit
def chunk_gated_delta_rule_kernel(
    q: object,
    k: object,
    v: object,
    g: object,
    beta: object,
    initial_state: object,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[object, object]:
    """Chunked gated delta rule over pre-arranged HBM tensors (see the module docstring)."""
    batch, num_k_heads, seq_len, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1], v.shape[3]
    group = num_v_heads // num_k_heads
    num_chunks = seq_len // CHUNK
    assert seq_len % CHUNK == 0 and k_dim <= _PMAX and k_dim + v_dim <= 512, "unsupported shape"

    o = nl.ndarray((batch, num_v_heads, seq_len, v_dim), dtype=v.dtype, buffer=nl.shared_hbm)
    chunk_states = nl.ndarray(
        (batch, num_v_heads, num_chunks, k_dim, v_dim), dtype=nl.float32, buffer=nl.shared_hbm
    )
    consts = _constants()

    for b in range(batch):
        states = []
        for hv in range(num_v_heads):
            state = sbuf_tile((k_dim, v_dim))
            nisa.dma_copy(dst=state, src=initial_state[b, hv])
            states.append(state)
        for chunk in range(num_chunks):
            t0 = chunk * CHUNK
            for h in range(num_k_heads):
                tiles = _key_head_tiles(q, k, b, h, t0, scale, use_qk_l2norm)
                for hv in range(h * group, (h + 1) * group):
                    _value_head_chunk(tiles, states[hv], v, g, beta, b, hv, t0, consts, o)
                    nisa.dma_copy(dst=chunk_states[b, hv, chunk], src=states[hv])
    return o, chunk_states


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
    chunk_size: int = CHUNK,
    output_chunk_states: bool = False,
    *,
    launch: Callable[..., tuple[torch.Tensor, torch.Tensor]] = chunk_gated_delta_rule_kernel,
) -> tuple[torch.Tensor, ...]:
    """The public chunk_gated_delta_rule contract (FLA layout) on top of the kernel.

    ``launch(q, k, v, g, beta, initial_state, scale, use_qk_l2norm)`` runs the kernel: the jitted kernel
    itself on Neuron tensors, the registered custom op, or ``nki.simulate(kernel)`` on CPU.
    """
    if chunk_size != CHUNK:
        raise ValueError(f"the NKI kernel is tiled for chunk_size={CHUNK}, got {chunk_size}")
    batch, seq_len, _, k_dim = k.shape
    num_v_heads, v_dim = v.shape[-2:]
    scale = k_dim**-0.5 if scale is None else scale
    num_chunks = -(-seq_len // CHUNK)
    pad = num_chunks * CHUNK - seq_len
    # [B, T, heads, D] -> [B, heads, T_padded, D]; padded tokens have g = beta = 0 and zero q/k/v.
    q_, k_, v_ = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2).contiguous() for x in (q, k, v))
    g_, beta_ = (
        F.pad(x.float(), (0, 0, 0, pad)).transpose(1, 2).unsqueeze(-1).contiguous() for x in (g, beta)
    )
    if initial_state is None:
        state = torch.zeros(batch, num_v_heads, k_dim, v_dim, dtype=torch.float32, device=v.device)
    else:
        state = initial_state.float().contiguous()
    o, chunk_states = launch(q_, k_, v_, g_, beta_, state, float(scale), bool(use_qk_l2norm_in_kernel))
    o = o.transpose(1, 2)[:, :seq_len]
    chunk_states = chunk_states.transpose(1, 2)  # [B, N, HV, K, V]
    final = chunk_states[:, -1] if output_final_state else None
    return (o, final, chunk_states) if output_chunk_states else (o, final)
