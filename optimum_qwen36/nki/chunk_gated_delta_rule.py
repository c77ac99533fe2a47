"""NKI chunked-prefill kernel of the gated delta rule, and its thin torch wrapper.

Tiling (the same scheme as the PyTorch twin, :mod:`optimum_qwen36.nki.chunk_gated_delta_rule_torch`):
chunks of 64 tokens, each split into four 16-token sub-blocks. Per chunk, with c the in-chunk cumsum
of g and S the state entering the chunk (K on partitions, [K, V] float32, resident in SBUF):

1. A[i, j] = beta_i (k_i . k_j) exp(c_i - c_j) for j < i. Every exponent is a partial sum of g computed
   directly by a masked matmul (c_i - c_j = sum_{j<t<=i} g_t, which is 0 above the diagonal), never as
   a difference of cumsums: all exponents are <= 0, so no exp overflows whatever g is, and large |c|
   costs no precision. The upper triangle is zeroed after the exp.
2. [W | U] = (I + A)^-1 [beta exp(c) k | beta v], one solve for both right-hand sides: block forward
   substitution over the sub-blocks, X_b = D_b (R_b - sum_{j<b} A_bj X_j), with the 16x16 diagonal
   inverse applied exactly as (I + M)(I + M^2)(I + M^4)(I + M^8), M = -A_bb (strictly lower, so
   M^16 = 0: four rounds are exact and the powers stay bounded; no power series over 64 tokens).
3. delta = U - W S;  o = q exp(c) S + (causal (q k^T) * exp(c_i - c_j)) delta;
   S <- exp(c_last) S + (k exp(c_last - c))^T delta.
   The twin batches all chunks and runs the chunk recurrence as S <- (exp(c_last) I - Kd^T W) S + Kd^T U;
   the kernel walks the chunks in order, so it uses the equivalent delta form (one [16, V] delta per
   sub-block, shared by the output and the state update).

Layout: every token-major operand is a 16-row tile at partition 0 (sub-block rows never sit at a
partition offset, which matmul operands may not allow); K-major copies (q^T, k^T, W^T) come from
Tensor Engine transposes. q^T k and k^T k are computed once per key head and reused by its r value
heads. All arithmetic is float32 (inputs are widened after the DMA).

HBM inputs, arranged by :func:`chunk_gated_delta_rule` (T padded to a multiple of 64 with g = beta = 0
and zero q/k/v, which leaves the state unchanged): q, k [B, H, T, K]; v [B, HV, T, V];
g, beta [B, HV, T, 1] float32; initial_state [B, HV, K, V] float32. Outputs: o [B, HV, T, V] in v's
dtype and the state after every chunk [B, HV, T / 64, K, V] float32 (the last is the final state).
Limits: 16 <= K <= 128, K + V <= 512.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from optimum_qwen36.nki.interpreter import nki_modules

nki, nl, nisa = nki_modules()

CHUNK = 64
SUB_BLOCK = 16
_BLOCKS = CHUNK // SUB_BLOCK
_DOUBLING_ROUNDS = int(math.log2(SUB_BLOCK))  # (I + M)...(I + M^8) is exact for a 16x16 nilpotent M
L2NORM_EPS = 1e-6


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


def _causal_mask(dst: object, values: object, first_row: int, strict: bool) -> None:
    """dst[r, j] = values[r, j] if j < (strict) or <= first_row + r else 0, for a [16, 64] row tile."""
    nisa.affine_select(
        dst,
        pattern=[[-1, values.shape[1]]],
        offset=first_row - 1 if strict else first_row,
        channel_multiplier=1,
        on_true_tile=values,
        on_false_value=0.0,
        cmp_op=nl.greater_equal,
    )


def _solve_diagonal_block(a_block: object, rhs: object) -> object:
    """(I + A_bb)^-1 rhs, A_bb strictly lower 16x16: apply (I + M)(I + M^2)(I + M^4)(I + M^8), M = -A_bb."""
    power = sbuf_tile(a_block.shape)
    nisa.tensor_scalar(power, a_block, op0=nl.multiply, operand0=-1.0)
    power_t = transpose_to_sbuf(power)
    x = rhs
    for round_index in range(_DOUBLING_ROUNDS):
        acc = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc, power_t, x, accumulate=False)  # M^(2^round) @ x
        updated = sbuf_tile(x.shape)
        nisa.tensor_tensor(updated, x, acc, op=nl.add)
        x = updated
        if round_index + 1 < _DOUBLING_ROUNDS:  # square M; the transposed square needs its own matmul
            power, power_t = matmul_to_sbuf(power_t, power), matmul_to_sbuf(power, power_t)
    return x


def _key_head_tiles(q: object, k: object, b: int, h: int, t0: int, scale: float, l2norm: bool) -> dict:
    """Per chunk and key head: k rows per sub-block, q^T and k^T [K, 64], q k^T and k k^T row blocks."""
    k_dim = k.shape[3]
    q_t, k_t = sbuf_tile((k_dim, CHUNK)), sbuf_tile((k_dim, CHUNK))
    k_rows = []
    for blk in range(_BLOCKS):
        rows = nl.ds(t0 + blk * SUB_BLOCK, SUB_BLOCK)
        q_blk = scale_rows(load_rows(q[b, h, rows, :]), scale, l2norm)
        k_blk = scale_rows(load_rows(k[b, h, rows, :]), 1.0, l2norm)
        cols = nl.ds(blk * SUB_BLOCK, SUB_BLOCK)
        nisa.tensor_copy(dst=q_t[:, cols], src=transpose_to_sbuf(q_blk))
        nisa.tensor_copy(dst=k_t[:, cols], src=transpose_to_sbuf(k_blk))
        k_rows.append(k_blk)
    blocks = [nl.ds(blk * SUB_BLOCK, SUB_BLOCK) for blk in range(_BLOCKS)]
    return {
        "k_rows": k_rows,
        "q_t": q_t,
        "qk": [matmul_to_sbuf(q_t[:, cols], k_t) for cols in blocks],  # [16, 64] rows of q k^T
        "kk": [matmul_to_sbuf(k_t[:, cols], k_t) for cols in blocks],  # [16, 64] rows of k k^T
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
    rows_all = nl.ds(t0, CHUNK)
    g_col = sbuf_tile((CHUNK, 1))
    nisa.dma_copy(dst=g_col, src=g[b, hv, rows_all, :])
    # g along the free axis: g_bcast[t, p] = g_t. Then c along the free axis on every partition:
    # cum_rows[p, j] = c_j = sum_{t <= j} g_t, and c_last on every partition.
    g_bcast = sbuf_tile((CHUNK, k_dim))
    nisa.tensor_scalar(g_bcast, consts["ones"], op0=nl.multiply, operand0=g_col)
    cum_rows = matmul_to_sbuf(g_bcast, consts["upper"])  # [K, 64]
    exp_last = sbuf_tile((k_dim, 1))
    nisa.activation(dst=exp_last, op=nl.exp, data=cum_rows[:, nl.ds(CHUNK - 1, 1)])

    blocks = []
    for blk in range(_BLOCKS):
        rows = nl.ds(t0 + blk * SUB_BLOCK, SUB_BLOCK)
        cols = nl.ds(blk * SUB_BLOCK, SUB_BLOCK)
        beta_col = sbuf_tile((SUB_BLOCK, 1))
        nisa.dma_copy(dst=beta_col, src=beta[b, hv, rows, :])
        # Log-decays as direct partial sums, never as differences of cumsums (c reaches -1e4 with
        # strong gates, where c_i - c_j would lose the few ulps that matter):
        #   log_decay[r, j] = sum_{j < t <= i} g_t (i = token of row r; 0 when j >= i, masked below),
        #   c_i = sum_{t <= i} g_t, c_last - c_i = sum_{t > i} g_t. All are <= 0: exp never overflows.
        g_upto_row = sbuf_tile((CHUNK, SUB_BLOCK))  # [t, r] = g_t if t <= i
        nisa.affine_select(
            g_upto_row,
            pattern=[[1, SUB_BLOCK]],
            offset=blk * SUB_BLOCK,
            channel_multiplier=-1,
            on_true_tile=g_bcast[:, nl.ds(0, SUB_BLOCK)],
            on_false_value=0.0,
            cmp_op=nl.greater_equal,
        )
        decay = sbuf_tile((SUB_BLOCK, CHUNK))
        nisa.activation(dst=decay, op=nl.exp, data=matmul_to_sbuf(g_upto_row, consts["strict_lower"]))
        exp_c = sbuf_tile((SUB_BLOCK, 1))
        nisa.activation(dst=exp_c, op=nl.exp, data=matmul_to_sbuf(consts["upper"][:, cols], g_col))
        to_end = sbuf_tile((SUB_BLOCK, 1))
        nisa.activation(dst=to_end, op=nl.exp, data=matmul_to_sbuf(consts["strict_lower"][:, cols], g_col))

        a_full = sbuf_tile((SUB_BLOCK, CHUNK))
        nisa.tensor_tensor(a_full, tiles["kk"][blk], decay, op=nl.multiply)
        nisa.tensor_scalar(a_full, a_full, op0=nl.multiply, operand0=beta_col)
        a_rows = sbuf_tile((SUB_BLOCK, CHUNK))
        _causal_mask(a_rows, a_full, blk * SUB_BLOCK, strict=True)
        attn_full = sbuf_tile((SUB_BLOCK, CHUNK))
        nisa.tensor_tensor(attn_full, tiles["qk"][blk], decay, op=nl.multiply)
        attn_rows = sbuf_tile((SUB_BLOCK, CHUNK))
        _causal_mask(attn_rows, attn_full, blk * SUB_BLOCK, strict=False)

        # rhs = [k beta exp(c) | v beta]
        rhs = sbuf_tile((SUB_BLOCK, k_dim + v_dim))
        nisa.tensor_scalar(
            rhs[:, nl.ds(0, k_dim)],
            tiles["k_rows"][blk],
            op0=nl.multiply,
            operand0=exp_c,
            op1=nl.multiply,
            operand1=beta_col,
        )
        nisa.tensor_scalar(
            rhs[:, nl.ds(k_dim, v_dim)], load_rows(v[b, hv, rows, :]), op0=nl.multiply, operand0=beta_col
        )
        if blk:  # block forward substitution: rhs -= sum_{j < blk} A[blk, j] X_j
            acc = nl.ndarray(rhs.shape, dtype=nl.float32, buffer=nl.psum)
            for prev in range(blk):
                a_t = transpose_to_sbuf(a_rows[:, nl.ds(prev * SUB_BLOCK, SUB_BLOCK)])
                nisa.nc_matmul(acc, a_t, blocks[prev]["x"], accumulate=prev > 0)
            nisa.tensor_tensor(rhs, rhs, acc, op=nl.subtract)
        x = _solve_diagonal_block(a_rows[:, nl.ds(blk * SUB_BLOCK, SUB_BLOCK)], rhs)
        blocks.append({"x": x, "attn": attn_rows, "to_end": to_end})

    # q exp(c): exp(c_j) is constant along each partition of cum_rows, so scale q^T column-wise.
    exp_cum = sbuf_tile((k_dim, CHUNK))
    nisa.activation(dst=exp_cum, op=nl.exp, data=cum_rows)
    q_decayed_t = sbuf_tile((k_dim, CHUNK))
    nisa.tensor_tensor(q_decayed_t, tiles["q_t"], exp_cum, op=nl.multiply)

    for block in blocks:  # delta = U - W S (uses the state entering the chunk)
        w_s = nl.ndarray((SUB_BLOCK, v_dim), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(w_s, transpose_to_sbuf(block["x"][:, nl.ds(0, k_dim)]), state, accumulate=False)
        delta = sbuf_tile((SUB_BLOCK, v_dim))
        nisa.tensor_tensor(delta, block["x"][:, nl.ds(k_dim, v_dim)], w_s, op=nl.subtract)
        block["delta"] = delta

    for blk, block in enumerate(blocks):  # o = q exp(c) S + attn delta
        out = nl.ndarray((SUB_BLOCK, v_dim), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(out, q_decayed_t[:, nl.ds(blk * SUB_BLOCK, SUB_BLOCK)], state, accumulate=False)
        for prev in range(blk + 1):
            attn_t = transpose_to_sbuf(block["attn"][:, nl.ds(prev * SUB_BLOCK, SUB_BLOCK)])
            nisa.nc_matmul(out, attn_t, blocks[prev]["delta"], accumulate=True)
        store_rows(o[b, hv, nl.ds(t0 + blk * SUB_BLOCK, SUB_BLOCK), :], evict(out))

    # S <- exp(c_last) S + sum_j (k_j exp(c_last - c_j))^T delta_j
    update = nl.ndarray((k_dim, v_dim), dtype=nl.float32, buffer=nl.psum)
    for blk, block in enumerate(blocks):
        k_decayed = sbuf_tile((SUB_BLOCK, k_dim))
        nisa.tensor_scalar(k_decayed, tiles["k_rows"][blk], op0=nl.multiply, operand0=block["to_end"])
        nisa.nc_matmul(update, k_decayed, block["delta"], accumulate=blk > 0)
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
    assert seq_len % CHUNK == 0 and SUB_BLOCK <= k_dim <= 128 and k_dim + v_dim <= 512, "unsupported shape"

    o = nl.ndarray((batch, num_v_heads, seq_len, v_dim), dtype=v.dtype, buffer=nl.shared_hbm)
    chunk_states = nl.ndarray(
        (batch, num_v_heads, num_chunks, k_dim, v_dim), dtype=nl.float32, buffer=nl.shared_hbm
    )

    ones = sbuf_tile((CHUNK, k_dim))
    nisa.memset(ones, 1.0)
    upper = sbuf_tile((CHUNK, CHUNK))  # upper[t, j] = 1 if t <= j: (g^T upper)_j = c_j
    nisa.affine_select(
        upper,
        pattern=[[1, CHUNK]],
        offset=0,
        channel_multiplier=-1,
        on_true_tile=ones[:, nl.ds(0, CHUNK)],
        on_false_value=0.0,
        cmp_op=nl.greater_equal,
    )
    strict_lower = sbuf_tile((CHUNK, CHUNK))  # strict_lower[t, j] = 1 if t > j
    nisa.affine_select(
        strict_lower,
        pattern=[[-1, CHUNK]],
        offset=-1,
        channel_multiplier=1,
        on_true_tile=ones[:, nl.ds(0, CHUNK)],
        on_false_value=0.0,
        cmp_op=nl.greater_equal,
    )
    consts = {"ones": ones, "upper": upper, "strict_lower": strict_lower}

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
