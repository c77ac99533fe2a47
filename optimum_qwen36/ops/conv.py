"""The GDN layers' depthwise causal conv1d over sequences packed along the tokens (a packed prefill step).

Each sequence convolves its own tokens after its own conv state (the last W - 1 inputs before them), as
`nki.causal_conv1d_fn` does for one sequence. Packed (token-major, [N, D]), a token whose W taps all lie in
its own sequence is an ordinary shifted multiply-add over the stream of tokens (static slices, which
compile to vector loops); only the first W - 1 tokens of each sequence reach into its conv state, so only
those are recomputed, from taps gathered out of one small source of rows (the S conv states' W - 1 rows
each, then the N tokens). Gathering every token's taps instead reads each value through an index the
compiled graph checks one by one, several times slower. The indices depend only on where the sequences
start and end, so a step computes them once for all its GDN layers (`varlen_conv_indices`).

`causal_conv1d_varlen` is the PyTorch form, `causal_conv1d_varlen_native` the native CPU op
(`optimum_qwen36::causal_conv1d_varlen`, csrc/causal_conv.cpp) with the same inputs and outputs, which reads
each token once instead of materialising padded float32 copies of the step.

A decode step's conv (one token per row) reads and updates the rows' conv states where they lie in the cache:
`causal_conv1d_decode` (PyTorch: gather, `nki.causal_conv1d_update`, one index_put_) and
`causal_conv1d_decode_native` (`optimum_qwen36::causal_conv1d_decode`, in place, each row computed as the
varlen op computes a packed token).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..nki import causal_conv1d_update
from .gdn import scratch_for_padding
from .native import layer_index

# (x, weight, conv_state, head_tokens, head_taps, conv_tail) -> (SiLU(conv) [N, D], new conv states)
VarlenConv = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# (x [B, D], weight [D, W], conv_state [L, slots, D, W - 1], cache_idx, slots [B]) -> SiLU(conv) [B, D]
DecodeConv = Callable[..., torch.Tensor]


def varlen_conv_indices(
    cu_seqlens: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For S sequences of N tokens in all (sequence s is tokens cu_seqlens[s]..cu_seqlens[s + 1]) and a conv
    of `width` taps: the first width - 1 tokens of each sequence [S, width - 1] (N where a sequence is
    shorter: a row nobody reads), the source row of each of their taps [S, width - 1, width], and the
    source rows of each sequence's new conv state [S, width - 1] (its last width - 1 inputs, state included).
    Source rows: the S conv states' width - 1 rows each, then the N tokens."""
    history = width - 1
    num_sequences = cu_seqlens.shape[0] - 1
    device = cu_seqlens.device
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    owners = torch.arange(num_sequences, device=device).unsqueeze(1)
    taps = torch.arange(width, device=device)
    local = taps[:history].expand(num_sequences, history)  # the first tokens' places in their sequences
    real = local < lengths.unsqueeze(1)
    total = cu_seqlens[-1:]
    head_tokens = torch.where(real, cu_seqlens[:-1].unsqueeze(1) + local, total)
    # A token's window: its sequence's W - 1 state rows, then its tokens; tap j of local token i is at i + j.
    window = local.unsqueeze(-1) + taps
    head_taps = _source_row(window, owners.unsqueeze(-1), cu_seqlens, num_sequences, history)
    head_taps = torch.where(real.unsqueeze(-1), head_taps, 0)  # a token that does not exist reads row 0
    tail = lengths.unsqueeze(1) + taps[:history]
    conv_tail = _source_row(tail, owners, cu_seqlens, num_sequences, history)
    return head_tokens, head_taps, conv_tail


def snapshot_conv_tail(cu_seqlens: torch.Tensor, snapshot_ends: torch.Tensor, width: int) -> torch.Tensor:
    """The source rows [P, width - 1] of the conv state before packed token snapshot_ends[p] (the last
    width - 1 inputs of its sequence up to there, state rows included): the conv state at a prefix cache
    checkpoint inside a sequence. An end of 0 reads the first sequence's state rows (a padding entry)."""
    history = width - 1
    num_sequences = cu_seqlens.shape[0] - 1
    owners = torch.searchsorted(cu_seqlens[1:], snapshot_ends - 1, right=True).clamp(max=num_sequences - 1)
    taps = torch.arange(history, device=cu_seqlens.device)
    window = (snapshot_ends - cu_seqlens[owners]).unsqueeze(1) + taps
    return _source_row(window, owners.unsqueeze(1), cu_seqlens, num_sequences, history)


def _source_row(
    window: torch.Tensor, owner: torch.Tensor, cu_seqlens: torch.Tensor, num_sequences: int, history: int
) -> torch.Tensor:
    state_row = owner * history + window
    token_row = num_sequences * history + cu_seqlens[owner] + window - history
    return torch.where(window < history, state_row, token_row)


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    head_tokens: torch.Tensor,
    head_taps: torch.Tensor,
    conv_tail: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] (the packed tokens, token-major as the projection gives them), weight [D, W], conv_state
    [S, D, W - 1] (the sequences'), indices from `varlen_conv_indices` (conv_tail [R, W - 1]: the
    sequences' tails, and `snapshot_conv_tail`'s rows after them where states inside sequences are wanted).
    Returns SiLU(conv) [N, D] in x's dtype and the conv states of conv_tail's rows [R, D, W - 1] in
    conv_state's dtype, with the arithmetic of `nki.causal_conv1d_fn` (float32 taps summed in order)."""
    tokens, channels = x.shape
    width = weight.shape[1]
    w = weight.float().t()  # [W, D]
    stream = F.pad(x.to(conv_state.dtype), (0, 0, width - 1, 0)).float()
    out = stream[:tokens] * w[0]
    for tap in range(1, width):
        out = out + stream[tap : tap + tokens] * w[tap]
    source = torch.cat((conv_state.transpose(1, 2).reshape(-1, channels), x.to(conv_state.dtype)), dim=0)
    taps = head_taps.reshape(-1, width)
    head = source[taps[:, 0]].float() * w[0]
    for tap in range(1, width):
        head = head + source[taps[:, tap]].float() * w[tap]
    out = torch.cat((out, out.new_zeros(1, channels))).index_put((head_tokens.reshape(-1),), head)[:tokens]
    new_state = source[conv_tail.reshape(-1)].reshape(*conv_tail.shape, channels).transpose(1, 2)
    return F.silu(out).to(x.dtype), new_state


def causal_conv1d_varlen_native(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    head_tokens: torch.Tensor,
    head_taps: torch.Tensor,
    conv_tail: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv1d_varlen` as the native op (load it first: `ops.native.load_native_ops()`), where x and
    conv_state share a dtype (the op's contract); else the PyTorch form."""
    if x.dtype != conv_state.dtype:
        return causal_conv1d_varlen(x, weight, conv_state, head_tokens, head_taps, conv_tail)
    op = torch.ops.optimum_qwen36.causal_conv1d_varlen
    return op(x, weight, conv_state, head_tokens, head_taps, conv_tail)


def causal_conv1d_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    cache_idx: int | torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One decode step: row b's token x[b] convolved after the conv state of slot slots[b] in GDN cache entry
    cache_idx, SiLU, in x's dtype; that state then becomes the row's last W - 1 inputs, in place. A padding
    row (negative slot) runs in the last slot, the cache's scratch slot (the native op skips it: zeros)."""
    slots = scratch_for_padding(slots, conv_state.shape[1])
    index = (torch.zeros_like(slots) + cache_idx, slots)
    out, new_state = causal_conv1d_update(x.unsqueeze(-1), conv_state[index], weight, activation="silu")
    # One index_put_ on the whole state tensor: compiled backends update it in place only in this form.
    conv_state.index_put_(index, new_state)
    return out.squeeze(-1)


def causal_conv1d_decode_native(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    cache_idx: int | torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """`causal_conv1d_decode` as the native op (load it first: `ops.native.load_native_ops()`), where x and
    conv_state share a dtype (the op's contract); else the PyTorch form."""
    if x.dtype != conv_state.dtype:
        return causal_conv1d_decode(x, weight, conv_state, cache_idx, slots)
    op = torch.ops.optimum_qwen36.causal_conv1d_decode
    return op(x, weight, conv_state, layer_index(cache_idx, x.device), slots)
