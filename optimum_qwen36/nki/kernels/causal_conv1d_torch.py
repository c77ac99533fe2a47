"""PyTorch twin of the depthwise causal conv1d (prefill and single-token update) used by GDN layers.

Both entry points share one core: the update is the prefill on one token with the cached window as
initial state, so prefill and decode agree exactly. Accumulation is float32 whatever the dtypes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "swish", None)


def causal_conv1d_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_state: torch.Tensor | None = None,
    valid_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, D, T] in x's dtype; final_state [B, D, W-1] = the last W-1 inputs ending at valid_length
    (or T), in initial_state's dtype when given, else x's dtype."""
    batch, channels, seq_len = x.shape
    width = weight.shape[-1]
    if initial_state is None:
        initial_state = torch.zeros(batch, channels, width - 1, dtype=x.dtype, device=x.device)
    window = torch.cat((initial_state, x.to(initial_state.dtype)), dim=-1)  # [B, D, W-1+T]

    xs, w = window.float(), weight.float()
    # W shifted multiply-adds: fuses into one pass under Inductor and maps onto vector engines.
    out = xs[..., :seq_len] * w[:, :1]
    for tap in range(1, width):
        out = out + xs[..., tap : tap + seq_len] * w[:, tap : tap + 1]
    if bias is not None:
        out = out + bias.float().unsqueeze(-1)
    if activation is not None:
        out = F.silu(out)

    if valid_length is None:
        final_state = window[..., seq_len:]
    else:
        # Window positions valid_length .. valid_length+W-2 hold the last W-1 inputs before valid_length.
        index = valid_length.to(device=x.device, dtype=torch.long).view(batch, 1, 1)
        index = index + torch.arange(width - 1, device=x.device)
        final_state = window.gather(-1, index.expand(batch, channels, width - 1))
    return out.to(x.dtype), final_state
