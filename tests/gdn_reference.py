"""Float64 token-by-token gated delta rule / causal conv references and GDN input generators for tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    state_positions: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 recurrence. Returns (o [B, T, HV, V], states [B, P, HV, K, V]): the states after tokens
    state_positions (0-based; default: only the last token, keeping all of them costs T states)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    batch, seq_len, num_k_heads, k_dim = k.shape
    num_v_heads, v_dim = v.shape[-2:]
    if use_qk_l2norm:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * (k_dim**-0.5 if scale is None else scale)
    group = num_v_heads // num_k_heads
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    state = torch.zeros(batch, num_v_heads, k_dim, v_dim, dtype=torch.float64)
    if initial_state is not None:
        state = initial_state.double().clone()
    keep = {seq_len - 1} if state_positions is None else set(state_positions)
    outputs, states = [], {}
    for t in range(seq_len):
        state = state * g[:, t].exp()[..., None, None]
        kv_mem = (k[:, t].unsqueeze(-2) @ state).squeeze(-2)
        delta = beta[:, t, :, None] * (v[:, t] - kv_mem)
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outputs.append((q[:, t].unsqueeze(-2) @ state).squeeze(-2))
        if t in keep:
            states[t] = state
    return torch.stack(outputs, 1), torch.stack([states[t] for t in sorted(keep)], 1)


def reference_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    silu: bool = True,
) -> torch.Tensor:
    """Float64 depthwise causal conv of cat(initial_state or zeros, x) through F.conv1d."""
    width = weight.shape[-1]
    x = x.double()
    if initial_state is None:
        initial_state = torch.zeros(*x.shape[:2], width - 1, dtype=torch.float64)
    xs = torch.cat((initial_state.double(), x), -1)
    bias = None if bias is None else bias.double()
    out = F.conv1d(xs, weight.double().unsqueeze(1), bias, groups=x.shape[1])
    return F.silu(out) if silu else out


def make_gdn_inputs(
    batch: int = 1,
    seq_len: int = 64,
    num_k_heads: int = 4,
    num_v_heads: int = 12,
    k_dim: int = 128,
    v_dim: int = 128,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    a_log_max: float = 1.0,
    softplus_max: float = 3.0,
    beta_range: tuple[float, float] = (0.0, 1.0),
    key_correlation: float = 0.0,
    normalize_qk: bool = True,
) -> dict[str, torch.Tensor]:
    """Random GDN inputs built the way Qwen3.5/3.6 builds them.

    g = -exp(A_log) * softplus(a) with exp(A_log) up to exp(a_log_max) and a up to softplus_max;
    beta uniform in beta_range; keys share a common direction with weight key_correlation (0 = iid,
    close to 1 = nearly parallel keys, the hard case for the intra-chunk solve); q, k are L2-normalised
    unless normalize_qk is False (then use the kernel's l2norm flag).
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    def uniform(low: float, high: float, *shape: int) -> torch.Tensor:
        return low + (high - low) * torch.rand(*shape, generator=gen)

    q = randn(batch, seq_len, num_k_heads, k_dim)
    common = randn(1, 1, num_k_heads, k_dim)
    k = key_correlation * common + (1 - key_correlation) * randn(batch, seq_len, num_k_heads, k_dim)
    if normalize_qk:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = randn(batch, seq_len, num_v_heads, v_dim)
    a_log = uniform(-2.0, a_log_max, num_v_heads)
    a = uniform(-6.0, softplus_max, batch, seq_len, num_v_heads)
    g = -a_log.exp() * F.softplus(a)
    beta = uniform(*beta_range, batch, seq_len, num_v_heads)
    out = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    return {name: t.to(dtype) if name in ("q", "k", "v") else t for name, t in out.items()}


def max_rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| relative to max |expected| (inf when actual is not finite)."""
    actual, expected = actual.double(), expected.double()
    if not torch.isfinite(actual).all():
        return float("inf")
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
