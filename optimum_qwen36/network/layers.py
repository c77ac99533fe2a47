"""The decoder layers of Qwen3.5/3.6: a token mixer (Gated DeltaNet or gated attention) and the MLP, each
with its pre-norm and residual. Module and parameter names follow transformers' `modeling_qwen3_5.py`.

The mixers read the step's inputs (`StepInputs`) and update the cache tensors in place; their kernels are
the PyTorch forms of ops/, which backends may swap for native ones (`Qwen36ForCausalLM.set_kernels`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ..nki import causal_conv1d_fn, causal_conv1d_update
from ..ops.attention import (
    PagedAttention,
    PagedAttentionVarlen,
    paged_attention_torch,
    paged_attention_varlen_torch,
)
from ..ops.conv import DecodeConv, VarlenConv, causal_conv1d_decode, causal_conv1d_varlen
from ..ops.gdn import (
    GDNChunk,
    GDNStep,
    GDNVerify,
    gdn_decode_step_torch,
    gdn_prefill_chunk_torch,
    gdn_verify_step_torch,
)
from .config import LINEAR_ATTENTION
from .step_inputs import CacheIndex, StepInputs


class Qwen36RMSNorm(nn.Module):
    """RMSNorm with the (1 + weight) scale Qwen3.5 uses for its layer, final and q/k norms."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Qwen36GatedRMSNorm(nn.Module):
    """The GDN output norm: plain weight, then multiplied by SiLU(gate)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (self.weight * normed * F.silu(gate.float())).to(dtype)


class Qwen36MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of each head; x: [B, T, heads, D], cos/sin: [B, T, rot]."""
    rot = cos.shape[-1]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


class Qwen36Attention(nn.Module):
    """Gated GQA attention over the paged KV cache.

    `q_proj` holds, per head, the query and an output gate side by side:
    [h0 query | h0 gate | h1 query | ...].
    """

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen36RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen36RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.paged_attention: PagedAttention = paged_attention_torch
        self.paged_attention_varlen: PagedAttentionVarlen = paged_attention_varlen_torch

    def forward(self, hidden: torch.Tensor, step: StepInputs, cache_idx: CacheIndex) -> torch.Tensor:
        """hidden [B, T, hidden]. Writes this step's K/V into attention cache entry `cache_idx` at
        `step.write_slots`, then attends over each row's blocks (`step.block_tables`) up to each query's
        position, by `self.paged_attention` (the PyTorch twin; backends may swap in a native kernel)."""
        cos, sin, write_slots, block_tables = step.cos, step.sin, step.write_slots, step.block_tables
        key_cache, value_cache = step.key_cache, step.value_cache
        batch, seq, _ = hidden.shape
        query, gate = self.q_proj(hidden).view(batch, seq, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        query = apply_partial_rotary(self.q_norm(query), cos, sin)
        key = self.k_norm(self.k_proj(hidden).view(batch, seq, self.num_kv_heads, self.head_dim))
        key = apply_partial_rotary(key, cos, sin)
        value = self.v_proj(hidden).view(batch, seq, self.num_kv_heads, self.head_dim)

        # One index_put_ on the whole cache tensor: compiled backends update it in place only in this form
        # (a write through a view such as key_cache[layer] copies the viewed slice on every call).
        block_size = key_cache.shape[2]
        index = (
            torch.zeros_like(write_slots) + cache_idx,
            write_slots // block_size,
            write_slots % block_size,
        )
        key_cache.index_put_(index, key)
        value_cache.index_put_(index, value)
        caches, scale = (key_cache, value_cache, cache_idx), self.head_dim**-0.5
        if step.cu_seqlens is not None:
            out = self.paged_attention_varlen(
                query, *caches, block_tables, step.cu_seqlens, step.positions, scale
            )
        else:
            out = self.paged_attention(query, *caches, block_tables, step.positions, scale)
        out = out.reshape(batch, seq, -1) * torch.sigmoid(gate.reshape(batch, seq, -1))
        return self.o_proj(out)


class Qwen36GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (linear recurrent attention)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.conv_kernel_size, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = Qwen36GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, config.hidden_size, bias=False)
        self.in_proj_qkv = nn.Linear(config.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(config.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(config.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(config.hidden_size, self.num_v_heads, bias=False)
        # The delta rule of a decode step, a prefill chunk and a verify step on the cache's states, in place
        # (ops/gdn.py; backends may swap in native ops).
        self.recurrent_step: GDNStep = gdn_decode_step_torch
        self.chunk_step: GDNChunk = gdn_prefill_chunk_torch
        self.verify_step: GDNVerify = gdn_verify_step_torch
        self.varlen_conv: VarlenConv = causal_conv1d_varlen
        self.decode_conv: DecodeConv = causal_conv1d_decode

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns mixed qkv [B, conv_dim, T] (conv layout), z, beta and the log decay g (float32)."""
        beta = self.in_proj_b(hidden).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden).float() + self.dt_bias)
        return self.in_proj_qkv(hidden).transpose(1, 2), self.in_proj_z(hidden), beta, g

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, seq, _ = mixed.shape
        query, key, value = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            query.reshape(batch, seq, self.num_k_heads, self.head_k_dim),
            key.reshape(batch, seq, self.num_k_heads, self.head_k_dim),
            value.reshape(batch, seq, self.num_v_heads, self.head_v_dim),
        )

    def _output(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        batch, seq = z.shape[:2]
        z = z.reshape(batch, seq, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(core, z).reshape(batch, seq, self.value_dim))

    def forward(self, hidden: torch.Tensor, step: StepInputs, cache_idx: CacheIndex) -> torch.Tensor:
        """hidden [B, T, hidden]: a prefill chunk (B = 1, one sequence or packed ones) or a decode step
        (T = 1). Reads the states of the rows' (sequences') slots from GDN cache entry `cache_idx` and writes
        the new ones back in place."""
        if step.spec_recurrent_state is None and step.cu_seqlens is None and step.valid is None:
            return self.decode(hidden, step.conv_state, step.recurrent_state, cache_idx, step.slots)
        conv_state = step.conv_state[cache_idx, step.slots]
        index = (torch.zeros_like(step.slots) + cache_idx, step.slots)
        if step.spec_recurrent_state is not None:
            out, conv_states = self.verify(
                hidden, conv_state, step.recurrent_state, step.spec_recurrent_state, cache_idx, step.slots
            )
            step.spec_conv_state.index_put_(index, conv_states.to(step.spec_conv_state.dtype))
            return out
        if step.cu_seqlens is not None:
            out, new_conv = self.prefill_packed(hidden, step, conv_state, cache_idx)
            if step.snapshot_slots is not None:  # new_conv also holds the snapshots' conv states
                written = torch.cat((step.slots, step.snapshot_slots))
                index = (torch.zeros_like(written) + cache_idx, written)
        else:
            out, new_conv = self.prefill(
                hidden, step.valid, step.num_valid, conv_state, step.recurrent_state, cache_idx, step.slots
            )
        # One index_put_ on the whole state tensor: compiled backends update it in place only in this form.
        step.conv_state.index_put_(index, new_conv.to(step.conv_state.dtype))
        return out

    def prefill(
        self,
        hidden: torch.Tensor,
        valid: torch.Tensor,
        num_valid: torch.Tensor,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        cache_idx: CacheIndex,
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [1, C, hidden], valid [1, C] bool, the conv state of the sequence's slot ([1, ...]), the
        cache's recurrent state tensor. Returns the output and the new conv state at the valid end of the
        chunk; the slot's recurrent state is updated in place (to the one at the last valid token)."""
        mixed, z, beta, g = self._project(hidden)
        mixed, new_conv_state = causal_conv1d_fn(
            mixed,
            self.conv1d.weight.squeeze(1),
            activation="silu",
            initial_state=conv_state,
            valid_length=num_valid.reshape(1),
        )
        query, key, value = self._split_heads(mixed.transpose(1, 2))
        # Padding positions neither decay nor write the state (g = 0, beta = 0): the final state is the one
        # at the last valid token, exactly.
        beta = beta * valid.unsqueeze(-1)
        g = g * valid.unsqueeze(-1)
        core = self.chunk_step(
            query, key, value, g, beta, recurrent_state, cache_idx, slots, None, self.head_k_dim**-0.5
        )
        return self._output(core, z), new_conv_state

    def prefill_packed(
        self, hidden: torch.Tensor, step: StepInputs, conv_state: torch.Tensor, cache_idx: CacheIndex
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [1, N, hidden]: the sequences of a packed prefill step (every token real), conv_state the
        conv states of their slots [S, ...]. Returns the output and the new conv state of each sequence at
        its end (then each snapshot's); the slots' recurrent states (and snapshot slots') are written in
        place."""
        mixed, z, beta, g = self._project(hidden)
        tails = step.conv_tail
        snapshots: tuple[torch.Tensor, ...] = ()
        if step.snapshot_ends is not None:
            tails = torch.cat((tails, step.snapshot_tail))
            snapshots = (step.snapshot_ends, step.snapshot_slots)
        mixed, new_conv_state = self.varlen_conv(
            mixed[0].t(), self.conv1d.weight.squeeze(1), conv_state, step.conv_heads, step.conv_taps, tails
        )
        query, key, value = self._split_heads(mixed.unsqueeze(0))
        core = self.chunk_step(
            query, key, value, g, beta, step.recurrent_state, cache_idx, step.slots, step.cu_seqlens,
            self.head_k_dim**-0.5, *snapshots,
        )  # fmt: skip
        return self._output(core, z), new_conv_state

    def decode(
        self,
        hidden: torch.Tensor,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        cache_idx: CacheIndex,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """hidden [B, 1, hidden], the cache's conv and recurrent state tensors. Returns the output; the rows'
        states (those of their slots in entry `cache_idx`) are updated in place."""
        mixed, z, beta, g = self._project(hidden)
        mixed = self.decode_conv(mixed[..., 0], self.conv1d.weight.squeeze(1), conv_state, cache_idx, slots)
        query, key, value = self._split_heads(mixed.unsqueeze(1))
        core = self.recurrent_step(
            query[:, 0], key[:, 0], value[:, 0], g[:, 0], beta[:, 0], recurrent_state, cache_idx, slots,
            self.head_k_dim**-0.5,
        )  # fmt: skip
        return self._output(core.unsqueeze(1), z)

    def verify(
        self,
        hidden: torch.Tensor,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        spec_recurrent_state: torch.Tensor,
        cache_idx: CacheIndex,
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, T, hidden]: T tokens per row, each advanced exactly as a decode step would, from the
        conv states of the rows' slots and the cache's recurrent state tensor, which are left as they are.
        Returns the output and the conv states after each position [B, T, ...]; the recurrent state after
        each position goes to spec_recurrent_state (positions past a row's real tokens hold states nobody
        keeps)."""
        mixed, z, beta, g = self._project(hidden)
        weight = self.conv1d.weight.squeeze(1)
        convolved, conv_states = [], []
        for t in range(hidden.shape[1]):
            mixed_t, conv_state = causal_conv1d_update(
                mixed[..., t : t + 1], conv_state, weight, activation="silu"
            )
            convolved.append(mixed_t)
            conv_states.append(conv_state)
        query, key, value = self._split_heads(torch.cat(convolved, dim=-1).transpose(1, 2))
        core = self.verify_step(
            query, key, value, g, beta, recurrent_state, spec_recurrent_state, cache_idx, slots,
            self.head_k_dim**-0.5,
        )  # fmt: skip
        return self._output(core, z), torch.stack(conv_states, 1)


class Qwen36DecoderLayer(nn.Module):
    """A token mixer (GDN or gated attention) and the MLP, each with its pre-norm and residual.
    `cache_idx` is the layer's entry in its kind's cache tensors (n-th GDN layer, n-th attention layer); a
    graph compiled once for all layers of a kind takes it as an input instead (exporters/regions.py)."""

    def __init__(self, config: PretrainedConfig, layer_type: str, cache_idx: int) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.cache_idx = cache_idx
        if layer_type == LINEAR_ATTENTION:
            self.linear_attn = Qwen36GatedDeltaNet(config)
        else:
            self.self_attn = Qwen36Attention(config)
        self.mlp = Qwen36MLP(config)
        self.input_layernorm = Qwen36RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen36RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, step: StepInputs, cache_idx: CacheIndex | None = None
    ) -> torch.Tensor:
        mixer = self.linear_attn if self.layer_type == LINEAR_ATTENTION else self.self_attn
        cache_idx = self.cache_idx if cache_idx is None else cache_idx
        hidden = hidden + mixer(self.input_layernorm(hidden), step, cache_idx)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
