"""One static-shape definition of the Qwen3.5/3.6 hybrid language model, for every backend.

Module and parameter names follow transformers' `modeling_qwen3_5.py`, so checkpoint keys map one to one.
Two entry points, both with static shapes and the cache tensors passed in and updated in place:

- `prefill_chunk`: C tokens of one sequence starting at any position (the last chunk of a prompt is
  right-padded; `num_valid` says how many tokens are real), or of several sequences packed one after the
  other (each at its own position, in its own GDN slot, with its own block table: a packed prefill step).
- `decode_step`: one token for each of the B rows, each row at its own position and in its own GDN state
  slot, so any subset of the cache's slots decodes together.

With the multi-token-prediction layer (`mtp`, speculative decoding), two more:

- `verify_step`: T tokens for each of B rows (the last sampled token and its drafts); the rows' GDN
  states are read, never written: the state after each of the T positions goes to the speculative state
  tensors, and the engine keeps the one at the last accepted position.
- `mtp_step`: the MTP layer over T positions of B rows (the trunk's normed hidden state at a position and
  the token after it), writing its own KV entry; returns the draft logits at each row's last position.

Attention KV is paged: `key_cache`/`value_cache` are [n_attention_layers, num_blocks, block_size, n_kv_heads,
head_dim] and a row's positions map to blocks through its block table. Block 0 is the null block: writes of
padding positions land there and it is never read as valid. GDN layers keep, per cache slot, a conv state
[conv_dim, kernel - 1] (model dtype) and a recurrent state [HV, K, V] (always float32).
"""

from __future__ import annotations

from dataclasses import dataclass

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
from ..ops.conv import (
    DecodeConv,
    VarlenConv,
    causal_conv1d_decode,
    causal_conv1d_varlen,
    snapshot_conv_tail,
    varlen_conv_indices,
)
from ..ops.gdn import (
    GDNChunk,
    GDNStep,
    GDNVerify,
    gdn_decode_step_torch,
    gdn_prefill_chunk_torch,
    gdn_verify_step_torch,
)
from .config import FULL_ATTENTION, LINEAR_ATTENTION, rotary_dim

NULL_BLOCK = 0
# A layer's entry in its kind's cache tensors: an int, or an int64 tensor [1] in a graph shared by layers
# (indexing with a 0-d tensor would read its value while tracing).
CacheIndex = int | torch.Tensor


@dataclass
class StepInputs:
    """What every layer of one step reads, built once per step by the entry point.

    Attention: rotary cos / sin [B, T, rot], the flat cache slot each new K/V goes to [B, T], the rows'
    block tables [B, max_blocks] and each query's position [B, T] (it sees the keys at 0..position). GDN:
    the state slot of each row [B]; for a prefill chunk of one sequence also which of its positions are real
    (`valid` [1, C]) and how many (`num_valid`), None for a decode step. Then the four cache tensors,
    updated in place (an MTP step has no GDN layer: no slots or GDN states). A verify step also has the
    speculative state tensors [n_gdn_layers, slots, T, ...]: its GDN layers write the state after each
    position there instead of the slot.

    A packed prefill step (S sequences one after the other in one row of N tokens, every token real) has
    `cu_seqlens` [S + 1] (sequence s is tokens cu_seqlens[s]..cu_seqlens[s + 1]), block tables and slots
    per sequence [S, ...], and the conv indices of `ops.conv.varlen_conv_indices` (`conv_heads` [S, W - 1],
    `conv_taps` [S, W - 1, W], `conv_tail` [S, W - 1]); no `valid` / `num_valid`. It may also snapshot
    GDN states inside its sequences for the prefix cache: the state before packed token `snapshot_ends` [P]
    goes to slot `snapshot_slots` [P] (`ops.gdn`), its conv state from the source rows `snapshot_tail`
    [P, W - 1] (`ops.conv.snapshot_conv_tail`)."""

    cos: torch.Tensor
    sin: torch.Tensor
    write_slots: torch.Tensor
    block_tables: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor | None
    valid: torch.Tensor | None
    num_valid: torch.Tensor | None
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    conv_state: torch.Tensor | None
    recurrent_state: torch.Tensor | None
    spec_conv_state: torch.Tensor | None = None
    spec_recurrent_state: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    conv_heads: torch.Tensor | None = None
    conv_taps: torch.Tensor | None = None
    conv_tail: torch.Tensor | None = None
    snapshot_ends: torch.Tensor | None = None
    snapshot_slots: torch.Tensor | None = None
    snapshot_tail: torch.Tensor | None = None


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


class Qwen36TextModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        counts = {LINEAR_ATTENTION: 0, FULL_ATTENTION: 0}
        layers = []
        for layer_type in config.layer_types:
            layers.append(Qwen36DecoderLayer(config, layer_type, counts[layer_type]))
            counts[layer_type] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = Qwen36RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Qwen36MultiTokenPredictor(nn.Module):
    """Qwen3.5/3.6's multi-token-prediction layer (checkpoint keys `mtp.*`; transformers drops them).

    At position i it reads the trunk's normed hidden state h_i and the embedding of the token after it,
    x_{i+1}: `fc(cat(pre_fc_norm_embedding(embed(x_{i+1})), pre_fc_norm_hidden(h_i)))`, one full-attention
    decoder layer with its own KV cache entry, then `norm`; the shared `lm_head` gives the logits of x_{i+2}.
    Its normed output stands in for h at the next position when it drafts further."""

    def __init__(self, config: PretrainedConfig, cache_idx: int) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen36RMSNorm(size, eps=eps)
        self.pre_fc_norm_hidden = Qwen36RMSNorm(size, eps=eps)
        self.fc = nn.Linear(2 * size, size, bias=False)
        self.layers = nn.ModuleList([Qwen36DecoderLayer(config, FULL_ATTENTION, cache_idx)])
        self.norm = Qwen36RMSNorm(size, eps=eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, step: StepInputs) -> torch.Tensor:
        mixed = torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), dim=-1)
        out = self.fc(mixed)
        for layer in self.layers:
            out = layer(out, step)
        return self.norm(out)


class Qwen36ForCausalLM(nn.Module):
    """The static-shape model. Parameter names are those of transformers' `Qwen3_5ForCausalLM`, and
    `mtp.*` those of the checkpoints' multi-token-prediction layer (built with `mtp=True`)."""

    def __init__(self, config: PretrainedConfig, mtp: bool = False) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen36TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Its KV is one more attention entry of the cache, after the trunk's attention layers.
        n_attention = list(config.layer_types).count(FULL_ATTENTION)
        self.mtp = Qwen36MultiTokenPredictor(config, n_attention) if mtp else None
        self.register_buffer("inv_freq", self.inv_freq_for(config), persistent=False)

    def set_kernels(
        self,
        paged_attention: PagedAttention,
        paged_attention_varlen: PagedAttentionVarlen,
        recurrent_step: GDNStep,
        chunk_step: GDNChunk,
        verify_step: GDNVerify,
        varlen_conv: VarlenConv,
        decode_conv: DecodeConv,
    ) -> None:
        """Make every attention layer (the MTP layer's too) attend with `paged_attention` (packed prefill
        steps: `paged_attention_varlen`), and every GDN layer run its decode steps with `recurrent_step`
        (their conv with `decode_conv`), its prefill chunks with `chunk_step`, its verify steps with
        `verify_step` and the conv of its packed prefill steps with `varlen_conv`."""
        for module in self.modules():
            if isinstance(module, Qwen36Attention):
                module.paged_attention = paged_attention
                module.paged_attention_varlen = paged_attention_varlen
            elif isinstance(module, Qwen36GatedDeltaNet):
                module.recurrent_step, module.chunk_step = recurrent_step, chunk_step
                module.verify_step, module.varlen_conv = verify_step, varlen_conv
                module.decode_conv = decode_conv

    @staticmethod
    def inv_freq_for(config: PretrainedConfig) -> torch.Tensor:
        """RoPE frequencies of the rotated dims. Text-only positions make Qwen3.5's interleaved mRoPE (three
        sections fed the same position) identical to ordinary 1-D RoPE on those dims."""
        rot = rotary_dim(config)
        theta = config.rope_parameters["rope_theta"]
        return 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _slots(self, positions: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
        """Flat cache slot of each position: block_tables[b, pos // bs] * bs + pos % bs (bs = block_size)."""
        blocks = torch.gather(block_tables, 1, positions // block_size)
        return blocks * block_size + positions % block_size

    def _write_slots(
        self, positions: torch.Tensor, valid: torch.Tensor, block_tables: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """Cache slot of each new K/V [B, T]; positions that are not `valid` write into the null block
        (spread over its slots) instead of the row's blocks."""
        offsets = torch.arange(positions.shape[1], device=positions.device)
        null_slots = NULL_BLOCK * block_size + offsets.unsqueeze(0) % block_size
        max_pos = block_tables.shape[1] * block_size - 1
        return torch.where(
            valid, self._slots(positions.clamp(max=max_pos), block_tables, block_size), null_slots
        )

    def _row_positions(
        self, start: torch.Tensor, num_valid: torch.Tensor, tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions start[b] + t [B, T] of T tokens per row, and which are real (t < num_valid[b])."""
        offsets = torch.arange(tokens, device=start.device)
        return start.unsqueeze(1) + offsets, offsets < num_valid.unsqueeze(1)

    def prefill_inputs(
        self,
        input_ids: torch.Tensor,
        start_pos: torch.Tensor,
        num_valid: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        snapshot_ends: torch.Tensor | None = None,
        snapshot_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, StepInputs]:
        """The embedded tokens [1, C, hidden] of a prefill chunk and what its layers read (see
        `prefill_chunk`): one sequence's, or packed sequences' when there are several or snapshots."""
        block_size = key_cache.shape[2]
        start_pos, num_valid, slots = start_pos.reshape(-1), num_valid.reshape(-1), slots.reshape(-1)
        block_tables = block_tables.reshape(slots.shape[0], -1)
        hidden = self.model.embed_tokens(input_ids)
        caches = (key_cache, value_cache, conv_state, recurrent_state)
        if slots.shape[0] == 1 and snapshot_ends is None:
            positions, valid = self._row_positions(start_pos, num_valid, input_ids.shape[1])
            write_slots = self._write_slots(positions, valid, block_tables, block_size)
            cos, sin = self._rotary(positions, hidden.dtype)
            step = StepInputs(
                cos, sin, write_slots, block_tables, positions, slots, valid, num_valid, *caches
            )  # fmt: skip
            return hidden, step
        cu_seqlens = F.pad(num_valid.cumsum(0), (1, 0))
        tokens = torch.arange(input_ids.shape[1], device=input_ids.device)
        sequence = torch.searchsorted(cu_seqlens[1:], tokens, right=True)
        position = start_pos[sequence] + tokens - cu_seqlens[sequence]
        blocks = block_tables[sequence, position // block_size]
        positions = position.unsqueeze(0)
        write_slots = (blocks * block_size + position % block_size).unsqueeze(0)
        width = self.config.linear_conv_kernel_dim
        conv_heads, conv_taps, conv_tail = varlen_conv_indices(cu_seqlens, width)
        cos, sin = self._rotary(positions, hidden.dtype)
        step = StepInputs(
            cos, sin, write_slots, block_tables, positions, slots, None, None, *caches,
            cu_seqlens=cu_seqlens, conv_heads=conv_heads, conv_taps=conv_taps, conv_tail=conv_tail,
        )  # fmt: skip
        if snapshot_ends is not None:
            step.snapshot_ends, step.snapshot_slots = snapshot_ends, snapshot_slots
            step.snapshot_tail = snapshot_conv_tail(cu_seqlens, snapshot_ends, width)
        return hidden, step

    def decode_inputs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
    ) -> tuple[torch.Tensor, StepInputs]:
        """The embedded tokens [B, 1, hidden] of a decode step and what its layers read."""
        block_size = key_cache.shape[2]
        positions = positions.unsqueeze(1)
        write_slots = self._slots(positions, block_tables, block_size)

        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self._rotary(positions, hidden.dtype)
        step = StepInputs(
            cos, sin, write_slots, block_tables, positions, slots, None, None,
            key_cache, value_cache, conv_state, recurrent_state,
        )  # fmt: skip
        return hidden, step

    def decoder(self, hidden: torch.Tensor, step: StepInputs) -> torch.Tensor:
        for layer in self.model.layers:
            hidden = layer(hidden, step)
        return hidden

    @staticmethod
    def last_valid(hidden: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """The hidden states [S, 1, hidden] of each sequence's last valid token in a prefill chunk."""
        packed = step.cu_seqlens is not None
        last = step.cu_seqlens[1:] - 1 if packed else (step.num_valid - 1).reshape(1)
        return hidden[0].index_select(0, last).unsqueeze(1)

    def prefill_logits(self, hidden: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """float32 logits [S, vocab] of each sequence's last valid token (hidden: the last layer's output)."""
        return self.decode_logits(self.last_valid(hidden, step))

    def decode_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [B, vocab] of each row's token (hidden [B, 1, hidden]: the last layer's output)."""
        return self.lm_head(self.model.norm(hidden)).float().squeeze(1)

    def prefill_chunk(
        self,
        input_ids: torch.Tensor,
        start_pos: torch.Tensor,
        num_valid: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        snapshot_ends: torch.Tensor | None = None,
        snapshot_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run prefill chunks of S sequences, packed one after the other in input_ids [1, C].

        Sequence s has num_valid[s] tokens at positions start_pos[s].., its GDN state in cache slot slots[s]
        and its blocks in block_tables[s] (start_pos, num_valid, slots [S] int64; block_tables [S,
        max_blocks]). One sequence (S = 1) may be right-padded (num_valid < C; it may also pass int64 scalars
        and a [max_blocks] table); packed ones (S > 1) fill the row exactly (sum(num_valid) == C).
        `snapshot_ends` / `snapshot_slots` [P] (unpadded calls only): the GDN state of the sequence holding
        packed token snapshot_ends[p] - 1, after that token, is also written to slot snapshot_slots[p] (a
        prefix cache checkpoint inside a chunk; an end at a sequence's start or end is ignored).
        Returns the float32 logits of each sequence's last token, [S, vocab]."""
        hidden, step = self.prefill_inputs(
            input_ids, start_pos, num_valid, slots, block_tables, key_cache, value_cache, conv_state,
            recurrent_state, snapshot_ends, snapshot_slots,
        )  # fmt: skip
        return self.prefill_logits(self.decoder(hidden, step), step)

    def decode_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
    ) -> torch.Tensor:
        """One token for each of B rows: input_ids [B, 1], positions [B] (int64), slots [B] (int64: the GDN
        state slot of each row, distinct), block_tables [B, max_blocks]. Returns float32 logits [B, vocab]."""
        hidden, step = self.decode_inputs(
            input_ids, positions, slots, block_tables, key_cache, value_cache, conv_state, recurrent_state
        )
        return self.decode_logits(self.decoder(hidden, step))

    # ------------------------------------------------------------------ speculative decoding (mtp=True)
    def prefill_chunk_hidden(
        self,
        input_ids: torch.Tensor,
        start_pos: torch.Tensor,
        num_valid: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`prefill_chunk`, also returning the normed hidden state of every position [1, C, hidden] (what
        the MTP layer reads)."""
        hidden, step = self.prefill_inputs(
            input_ids, start_pos, num_valid, slots, block_tables, key_cache, value_cache, conv_state,
            recurrent_state,
        )  # fmt: skip
        normed = self.model.norm(self.decoder(hidden, step))
        return self.lm_head(self.last_valid(normed, step)).float().squeeze(1), normed

    def position_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """float32 logits [B, T, vocab] at every position of normed hidden states [B, T, hidden] (a prompt's
        log-probabilities)."""
        return self.lm_head(normed).float()

    def verify_inputs(
        self,
        input_ids: torch.Tensor,
        start_pos: torch.Tensor,
        num_valid: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        spec_conv_state: torch.Tensor,
        spec_recurrent_state: torch.Tensor,
    ) -> tuple[torch.Tensor, StepInputs]:
        """The embedded tokens [B, T, hidden] of a verify step and what its layers read."""
        states = (conv_state, recurrent_state, spec_conv_state, spec_recurrent_state)
        return self._rows_inputs(
            input_ids, start_pos, num_valid, block_tables, key_cache, value_cache, slots, states
        )

    def verify_step(
        self,
        input_ids: torch.Tensor,
        start_pos: torch.Tensor,
        num_valid: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        spec_conv_state: torch.Tensor,
        spec_recurrent_state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """T tokens for each of B rows at positions start_pos[b].., the first num_valid[b] of them real:
        input_ids [B, T]; start_pos, num_valid, slots [B] (int64); block_tables [B, max_blocks]. The rows'
        K/V are written at those positions (padding: the null block); their GDN states are only read, and
        the state after each position t goes to spec_*_state[:, slots[b], t]. Returns float32 logits
        [B, T, vocab] and the normed hidden states [B, T, hidden]."""
        hidden, step = self.verify_inputs(
            input_ids, start_pos, num_valid, slots, block_tables, key_cache, value_cache, conv_state,
            recurrent_state, spec_conv_state, spec_recurrent_state,
        )  # fmt: skip
        return self.verify_logits(self.decoder(hidden, step))

    def verify_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 logits [B, T, vocab] and normed hidden states [B, T, hidden] of every position (hidden:
        the last layer's output)."""
        normed = self.model.norm(hidden)
        return self.lm_head(normed).float(), normed

    def mtp_step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        start_pos: torch.Tensor,
        num_valid: torch.Tensor,
        block_tables: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer at T positions per row: input_ids [B, T] are the tokens after those positions,
        hidden [B, T, hidden] the (normed) hidden states at them; start_pos, num_valid [B]. Writes the MTP
        layer's K/V entry. Returns the float32 draft logits [B, vocab] and the MTP output [B, 1, hidden] at
        each row's last real position."""
        embeds, step = self.mtp_inputs(input_ids, start_pos, num_valid, block_tables, key_cache, value_cache)
        return self.mtp_output(embeds, hidden, num_valid, step)

    def mtp_inputs(
        self,
        input_ids: torch.Tensor,
        start_pos: torch.Tensor,
        num_valid: torch.Tensor,
        block_tables: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, StepInputs]:
        """The embedded tokens [B, T, hidden] of an MTP step and what its attention layer reads."""
        if self.mtp is None:
            raise RuntimeError("this model was built without its MTP layer (Qwen36ForCausalLM(mtp=True)).")
        no_gdn = (None, None, None, None)
        return self._rows_inputs(
            input_ids, start_pos, num_valid, block_tables, key_cache, value_cache, None, no_gdn
        )

    def _rows_inputs(
        self,
        input_ids: torch.Tensor,
        start_pos: torch.Tensor,
        num_valid: torch.Tensor,
        block_tables: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor | None,
        gdn_states: tuple[torch.Tensor | None, ...],
    ) -> tuple[torch.Tensor, StepInputs]:
        """The embedded tokens [B, T, hidden] of T tokens per row at start_pos[b].. (the first num_valid[b]
        real) and what the layers read; `gdn_states`: conv, recurrent, speculative conv and recurrent."""
        block_size = key_cache.shape[2]
        positions, valid = self._row_positions(start_pos, num_valid, input_ids.shape[1])
        embeds = self.model.embed_tokens(input_ids)
        cos, sin = self._rotary(positions, embeds.dtype)
        step = StepInputs(
            cos, sin, self._write_slots(positions, valid, block_tables, block_size), block_tables,
            positions, slots, None, None,
            key_cache, value_cache, *gdn_states,
        )  # fmt: skip
        return embeds, step

    def mtp_output(
        self, embeds: torch.Tensor, hidden: torch.Tensor, num_valid: torch.Tensor, step: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over the step's positions; its float32 logits [B, vocab] and output [B, 1, hidden]
        at each row's last real position."""
        out = self.mtp(embeds, hidden.to(embeds.dtype), step)
        last = out[torch.arange(out.shape[0], device=out.device), num_valid - 1].unsqueeze(1)
        return self.lm_head(last).float().squeeze(1), last
