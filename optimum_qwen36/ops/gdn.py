"""The gated delta rule over the GDN cache, updating the rows' recurrent states in place: a decode step and
a prefill chunk, each as a PyTorch form and a native CPU op.

recurrent_state is the cache's whole float32 [L, slots, HV, K, V] tensor, of which entry `cache_idx`, slot
slots[b] is row b's state; q and k are L2-normalised first (as `use_qk_l2norm_in_kernel=True`), q scaled.

- decode step: q, k [B, H, K], v [B, HV, V], g (log decay) and beta [B, HV]; returns o [B, HV, V]. A row
  whose slot is negative is padding: the native op neither reads nor writes a state for it (its o is zeros),
  the PyTorch form computes it in the last slot (the cache's scratch slot).
- prefill chunk: q, k [1, T, H, K], v [1, T, HV, V], g and beta [1, T, HV], slots [S], cu_seqlens [S + 1] or
  None: sequence s is tokens cu_seqlens[s]..cu_seqlens[s + 1] (a packed prefill step), in slot slots[s]; None
  is one sequence (S = 1) of all T tokens. Tokens past a sequence's real ones carry g = 0 and beta = 0, so
  they leave its state as it is. Returns o [1, T, HV, V] (zeros after the last sequence). Packed, it may
  also take snapshots (snapshot_ends, snapshot_slots [P]): the state of the sequence s with cu_seqlens[s] <
  snapshot_ends[p] < cu_seqlens[s + 1] after its tokens before snapshot_ends[p] is also written to slot
  snapshot_slots[p] (a prefix cache checkpoint inside a chunk); ends inside no sequence are ignored.
- verify step (MTP speculative decoding): T tokens per row, q, k [B, T, H, K], v [B, T, HV, V], g and beta
  [B, T, HV], each advanced as a decode step would; the slots' states are only read, and the state after
  token t goes to spec_recurrent_state [L, slots, T, HV, K, V] at [cache_idx, slots[b], t]. Returns
  o [B, T, HV, V].

The PyTorch forms gather the states, run `nki.fused_recurrent_gated_delta_rule` /
`nki.chunk_gated_delta_rule` (their PyTorch twins, or the NKI kernels on neuron) and scatter the new states
back with one index_put_. The native ops (`optimum_qwen36::gdn_decode_step`, `gdn_verify_step`,
`gdn_prefill_chunk`: csrc/gdn_decode.cpp, csrc/gdn_prefill.cpp) read and write the states where they lie.
Outputs are in v's dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..nki import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from .native import layer_index
from .varlen import sequence_spans

# (q, k, v, g, beta, recurrent_state, cache_idx, slots, scale) -> o
GDNStep = Callable[..., torch.Tensor]
# (q, k, v, g, beta, recurrent_state, cache_idx, slots, cu_seqlens, scale[, snapshot_ends,
#  snapshot_slots]) -> o
GDNChunk = Callable[..., torch.Tensor]


def scratch_for_padding(slots: torch.Tensor, slot_count: int) -> torch.Tensor:
    """A decode step's slots with each negative one (a padding row) replaced by the last slot, the cache's
    scratch slot: the PyTorch forms compute a padding row there (the native ops skip it)."""
    return torch.where(slots < 0, slot_count - 1, slots)


def gdn_decode_step_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent_state: torch.Tensor,
    cache_idx: int | torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    slots = scratch_for_padding(slots, recurrent_state.shape[1])
    state = recurrent_state[cache_idx, slots]
    o, new_state = fused_recurrent_gated_delta_rule(
        q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1), beta.unsqueeze(1), scale,
        initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    _write_states(recurrent_state, cache_idx, slots, new_state)
    return o.squeeze(1)


def _write_states(
    recurrent_state: torch.Tensor, cache_idx: int | torch.Tensor, slots: torch.Tensor, states: torch.Tensor
) -> None:
    # One index_put_ on the whole state tensor: compiled backends update it in place only in this form.
    recurrent_state.index_put_((torch.zeros_like(slots) + cache_idx, slots), states)


def gdn_decode_step_native(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent_state: torch.Tensor,
    cache_idx: int | torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The native op (load it first: `ops.native.load_native_ops()`)."""
    op = torch.ops.optimum_qwen36.gdn_decode_step
    return op(q, k, v, g, beta, recurrent_state, layer_index(cache_idx, q.device), slots, scale)


# (q, k, v, g, beta, recurrent_state, spec_recurrent_state, cache_idx, slots, scale) -> o
GDNVerify = Callable[..., torch.Tensor]


def gdn_verify_step_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent_state: torch.Tensor,
    spec_recurrent_state: torch.Tensor,
    cache_idx: int | torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    state = recurrent_state[cache_idx, slots]
    outputs, states = [], []
    for t in range(q.shape[1]):  # one token at a time, as decode steps: the same arithmetic
        o, state = fused_recurrent_gated_delta_rule(
            q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1], beta[:, t : t + 1], scale,
            initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        outputs.append(o)
        states.append(state)
    _write_states(spec_recurrent_state, cache_idx, slots, torch.stack(states, 1))
    return torch.cat(outputs, dim=1)


def gdn_verify_step_native(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent_state: torch.Tensor,
    spec_recurrent_state: torch.Tensor,
    cache_idx: int | torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The native op (load it first: `ops.native.load_native_ops()`)."""
    op = torch.ops.optimum_qwen36.gdn_verify_step
    layer = layer_index(cache_idx, q.device)
    return op(q, k, v, g, beta, recurrent_state, spec_recurrent_state, layer, slots, scale)


def gdn_prefill_chunk_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent_state: torch.Tensor,
    cache_idx: int | torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    snapshot_ends: torch.Tensor | None = None,
    snapshot_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed sequences (cu_seqlens given) run one at a time, each in parts ending at its snapshots: eager
    only, it reads cu_seqlens' values."""
    if cu_seqlens is None:
        return _chunk_torch(q, k, v, g, beta, recurrent_state, cache_idx, slots, scale)
    snapshots = []
    if snapshot_ends is not None:
        snapshots = sorted(zip(snapshot_ends.tolist(), snapshot_slots.tolist(), strict=True))
    out = torch.zeros_like(v)
    for s, tokens in sequence_spans(cu_seqlens):
        first = tokens.start
        cuts = [(end, slot) for end, slot in snapshots if tokens.start < end < tokens.stop]
        for end, target in [*cuts, (tokens.stop, None)]:
            part = slice(first, end)
            out[:, part] = _chunk_torch(
                q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], recurrent_state,
                cache_idx, slots[s : s + 1], scale,
            )  # fmt: skip
            if target is not None:
                state = recurrent_state[cache_idx, slots[s : s + 1]]
                _write_states(recurrent_state, cache_idx, slots.new_tensor([target]), state)
            first = end
    return out


def _chunk_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent_state: torch.Tensor,
    cache_idx: int | torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    state = recurrent_state[cache_idx, slots]
    o, new_state = chunk_gated_delta_rule(
        q, k, v, g, beta, scale, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    _write_states(recurrent_state, cache_idx, slots, new_state)
    return o


def native_chunk_supported(k_dim: int, v_dim: int) -> bool:
    """Whether `gdn_prefill_chunk_native` runs the native op for these head sizes (multiples of 16: its
    register blocks are 16 floats wide at least) rather than the PyTorch form."""
    return k_dim % 16 == 0 and v_dim % 16 == 0


def gdn_prefill_chunk_native(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent_state: torch.Tensor,
    cache_idx: int | torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    snapshot_ends: torch.Tensor | None = None,
    snapshot_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """The native op (load it first: `ops.native.load_native_ops()`); head sizes that are not multiples of
    its 16-float vectors run the PyTorch form."""
    args = (q, k, v, g, beta, recurrent_state)
    if not native_chunk_supported(q.shape[-1], v.shape[-1]):
        return gdn_prefill_chunk_torch(
            *args, cache_idx, slots, cu_seqlens, scale, snapshot_ends, snapshot_slots
        )  # fmt: skip
    if cu_seqlens is None:
        cu_seqlens = torch.stack([torch.zeros_like(slots[0]), torch.zeros_like(slots[0]) + q.shape[1]])
    op = torch.ops.optimum_qwen36.gdn_prefill_chunk
    layer = layer_index(cache_idx, q.device)
    return op(*args, layer, slots, cu_seqlens, scale, snapshot_ends, snapshot_slots)
