"""One decode step of the gated delta rule over the GDN cache, updating the rows' recurrent states in place:
the PyTorch form and the native CPU op.

q, k [B, H, K], v [B, HV, V], g (log decay) and beta [B, HV]; recurrent_state is the cache's whole float32
[L, slots, HV, K, V] tensor, of which entry `cache_idx`, slot slots[b] is row b's state. q and k are
L2-normalised first (as `use_qk_l2norm_in_kernel=True`). Returns o [B, HV, V] in v's dtype.

- `gdn_decode_step_torch`: gathers the states, runs `nki.fused_recurrent_gated_delta_rule` (its PyTorch
  twin, or the NKI kernel on neuron) and scatters them back with one index_put_.
- `gdn_decode_step_native`: `optimum_qwen36::gdn_decode_step` (csrc/gdn_decode.cpp), which reads each state
  once and rewrites it where it lies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..nki import fused_recurrent_gated_delta_rule

GDNDecodeStep = Callable[..., torch.Tensor]


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
    state = recurrent_state[cache_idx, slots]
    o, new_state = fused_recurrent_gated_delta_rule(
        q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1), beta.unsqueeze(1), scale,
        initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    # One index_put_ on the whole state tensor: compiled backends update it in place only in this form.
    recurrent_state.index_put_((torch.zeros_like(slots) + cache_idx, slots), new_state)
    return o.squeeze(1)


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
    if isinstance(cache_idx, int):
        cache_idx = torch.tensor([cache_idx], device=q.device)
    op = torch.ops.optimum_qwen36.gdn_decode_step
    return op(q, k, v, g, beta, recurrent_state, cache_idx, slots, scale)
