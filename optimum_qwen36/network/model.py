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

The cache tensors' layout is step_inputs.py's; the decoder layers are layers.py's, the MTP layer mtp.py's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

from ..ops.attention import PagedAttention, PagedAttentionVarlen
from ..ops.conv import DecodeConv, VarlenConv
from ..ops.gdn import GDNChunk, GDNStep, GDNVerify
from .config import FULL_ATTENTION, LINEAR_ATTENTION, rotary_dim
from .layers import Qwen36Attention, Qwen36DecoderLayer, Qwen36GatedDeltaNet, Qwen36RMSNorm
from .mtp import Qwen36MultiTokenPredictor
from .step_inputs import StepInputs, cache_slots, packed_positions, row_positions, step_inputs
from .vision import mrope_axes


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


class Qwen36ForCausalLM(nn.Module):
    """The static-shape model. Parameter names are those of transformers' `Qwen3_5ForCausalLM`, and
    `mtp.*` those of the checkpoints' multi-token-prediction layer (built with `mtp=True`).

    Each entry point embeds its tokens and builds what its layers read (its `*_inputs` method, which
    exporters/regions.py also calls with the entry point's arguments), runs the decoder layers, then its
    head (`*_logits`, `mtp_output`)."""

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
        self.register_buffer("mrope_axes", self.mrope_axes_for(config), persistent=False)

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

    @staticmethod
    def mrope_axes_for(config: PretrainedConfig) -> torch.Tensor:
        """Which multimodal rotary position (temporal, height, width) turns each rotated frequency."""
        return mrope_axes(config, rotary_dim(config) // 2)

    # ------------------------------------------------------------------ entry points
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
        rope_positions: torch.Tensor | None = None,
        vision_embeds: torch.Tensor | None = None,
        vision_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run prefill chunks of S sequences, packed one after the other in input_ids [1, C].

        Sequence s has num_valid[s] tokens at positions start_pos[s].., its GDN state in cache slot slots[s]
        and its blocks in block_tables[s] (start_pos, num_valid, slots [S] int64; block_tables [S,
        max_blocks]). One sequence (S = 1) may be right-padded (num_valid < C; it may also pass int64 scalars
        and a [max_blocks] table); packed ones (S > 1) fill the row exactly (sum(num_valid) == C).
        `snapshot_ends` / `snapshot_slots` [P] (unpadded calls only): the GDN state of the sequence holding
        packed token snapshot_ends[p] - 1, after that token, is also written to slot snapshot_slots[p] (a
        prefix cache checkpoint inside a chunk; an end at a sequence's start or end is ignored).
        Images (network/vision.py): `rope_positions` [3, 1, C] the tokens' rotary
        positions, `vision_embeds` [1, C, hidden] the image features standing in for the embeddings of the
        tokens where `vision_mask` [1, C] is set.
        Returns the float32 logits of each sequence's last token, [S, vocab]."""
        hidden, step = self.prefill_inputs(
            input_ids, start_pos, num_valid, slots, block_tables, key_cache, value_cache, conv_state,
            recurrent_state, snapshot_ends, snapshot_slots,
            rope_positions=rope_positions, vision_embeds=vision_embeds, vision_mask=vision_mask,
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
        rope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One token for each of B rows: input_ids [B, 1], positions [B] (int64), slots [B] (int64: the GDN
        state slot of each row, distinct), block_tables [B, max_blocks]; `rope_positions` [3, B, 1] their
        multimodal rotary positions, where a row's prompt had images. Returns float32 logits [B, vocab]."""
        hidden, step = self.decode_inputs(
            input_ids,
            positions,
            slots,
            block_tables,
            key_cache,
            value_cache,
            conv_state,
            recurrent_state,
            rope_positions=rope_positions,
        )
        return self.decode_logits(self.decoder(hidden, step))

    # Speculative decoding (mtp=True).
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
        rope_positions: torch.Tensor | None = None,
        vision_embeds: torch.Tensor | None = None,
        vision_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`prefill_chunk`, also returning the normed hidden state of every position [1, C, hidden] (what
        the MTP layer reads)."""
        hidden, step = self.prefill_inputs(
            input_ids, start_pos, num_valid, slots, block_tables, key_cache, value_cache, conv_state,
            recurrent_state,
            rope_positions=rope_positions, vision_embeds=vision_embeds, vision_mask=vision_mask,
        )  # fmt: skip
        normed = self.model.norm(self.decoder(hidden, step))
        return self.lm_head(self.last_valid(normed, step)).float().squeeze(1), normed

    def position_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """float32 logits [B, T, vocab] at every position of normed hidden states [B, T, hidden] (a prompt's
        log-probabilities)."""
        return self.lm_head(normed).float()

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
        rope_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """T tokens for each of B rows at positions start_pos[b].., the first num_valid[b] of them real:
        input_ids [B, T]; start_pos, num_valid, slots [B] (int64); block_tables [B, max_blocks]. The rows'
        K/V are written at those positions (padding: the null block); their GDN states are only read, and
        the state after each position t goes to spec_*_state[:, slots[b], t]. Returns float32 logits
        [B, T, vocab] and the normed hidden states [B, T, hidden]. `rope_positions` [3, B, T]: as
        decode_step's."""
        hidden, step = self.verify_inputs(
            input_ids, start_pos, num_valid, slots, block_tables, key_cache, value_cache, conv_state,
            recurrent_state, spec_conv_state, spec_recurrent_state, rope_positions=rope_positions,
        )  # fmt: skip
        return self.verify_logits(self.decoder(hidden, step))

    def mtp_step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        start_pos: torch.Tensor,
        num_valid: torch.Tensor,
        block_tables: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        rope_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer at T positions per row: input_ids [B, T] are the tokens after those positions,
        hidden [B, T, hidden] the (normed) hidden states at them; start_pos, num_valid [B]. Writes the MTP
        layer's K/V entry. Returns the float32 draft logits [B, vocab] and the MTP output [B, 1, hidden] at
        each row's last real position."""
        caches = (key_cache, value_cache)
        embeds, step = self.mtp_inputs(
            input_ids, start_pos, num_valid, block_tables, *caches, rope_positions=rope_positions
        )
        return self.mtp_output(embeds, hidden, num_valid, step)

    # ------------------------------------------------------------------ what the layers read
    def prefill_inputs(
        self, *args: torch.Tensor | None, **multimodal: torch.Tensor | None
    ) -> tuple[torch.Tensor, StepInputs]:
        """The embedded tokens [1, C, hidden] of a prefill chunk and what its layers read, from
        `prefill_chunk`'s arguments: one sequence's, or packed sequences' when there are several or
        snapshots."""
        input_ids, start_pos, num_valid, slots, block_tables, *tensors = args
        # The four cache tensors, then snapshot_ends and snapshot_slots where the caller passes them.
        caches, snapshots = tensors[:4], [tensor for tensor in tensors[4:] if tensor is not None]
        start_pos, num_valid, slots = start_pos.reshape(-1), num_valid.reshape(-1), slots.reshape(-1)
        block_tables = block_tables.reshape(slots.shape[0], -1)
        if slots.shape[0] == 1 and not snapshots:
            return self._rows_inputs(
                input_ids, start_pos, num_valid, block_tables, caches, slots=slots, one_sequence=True,
                **multimodal,
            )  # fmt: skip
        block_size, width = caches[0].shape[2], self.config.linear_conv_kernel_dim
        positions, write_slots, packing = packed_positions(
            start_pos, num_valid, input_ids.shape[1], block_tables, block_size, width, snapshots
        )
        return self._inputs(
            input_ids, positions, write_slots, block_tables, caches, slots=slots, **packing, **multimodal
        )

    def decode_inputs(
        self, *args: torch.Tensor, rope_positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, StepInputs]:
        """The embedded tokens [B, 1, hidden] of a decode step and what its layers read, from `decode_step`'s
        arguments."""
        input_ids, positions, slots, block_tables, *caches = args
        positions = positions.unsqueeze(1)
        write_slots = cache_slots(positions, block_tables, caches[0].shape[2])
        rows = dict(slots=slots, rope_positions=rope_positions)
        return self._inputs(input_ids, positions, write_slots, block_tables, caches, **rows)

    def verify_inputs(
        self, *args: torch.Tensor, rope_positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, StepInputs]:
        """The embedded tokens [B, T, hidden] of a verify step and what its layers read, from `verify_step`'s
        arguments."""
        input_ids, start_pos, num_valid, slots, block_tables, *caches = args
        return self._rows_inputs(
            input_ids, start_pos, num_valid, block_tables, caches, slots=slots, rope_positions=rope_positions
        )

    def mtp_inputs(
        self, *args: torch.Tensor, rope_positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, StepInputs]:
        """The embedded tokens [B, T, hidden] of an MTP step and what its attention layer reads, from
        `mtp_step`'s arguments without `hidden`."""
        if self.mtp is None:
            raise RuntimeError("this model was built without its MTP layer (Qwen36ForCausalLM(mtp=True)).")
        input_ids, start_pos, num_valid, block_tables, *caches = args
        return self._rows_inputs(
            input_ids, start_pos, num_valid, block_tables, caches, rope_positions=rope_positions
        )

    def _rows_inputs(
        self,
        input_ids: torch.Tensor,
        start_pos: torch.Tensor,
        num_valid: torch.Tensor,
        block_tables: torch.Tensor,
        caches: Sequence[torch.Tensor],
        slots: torch.Tensor | None = None,
        one_sequence: bool = False,
        **multimodal: torch.Tensor | None,
    ) -> tuple[torch.Tensor, StepInputs]:
        """T tokens per row at start_pos[b].., the first num_valid[b] of them real. `one_sequence`: a prefill
        chunk of one sequence, whose GDN layers also read which of its tokens are real."""
        positions, valid, write_slots = row_positions(
            start_pos, num_valid, input_ids.shape[1], block_tables, caches[0].shape[2]
        )
        prefill = dict(valid=valid, num_valid=num_valid) if one_sequence else {}
        return self._inputs(
            input_ids, positions, write_slots, block_tables, caches, slots=slots, **prefill, **multimodal
        )

    def _inputs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        block_tables: torch.Tensor,
        caches: Sequence[torch.Tensor],
        rope_positions: torch.Tensor | None = None,
        vision_embeds: torch.Tensor | None = None,
        vision_mask: torch.Tensor | None = None,
        **fields: torch.Tensor | None,
    ) -> tuple[torch.Tensor, StepInputs]:
        """The embedded tokens (image features where `vision_mask` is set) and the StepInputs of a step
        (`step_inputs`; multimodal rotary positions where given)."""
        embeds = self.model.embed_tokens(input_ids)
        if vision_embeds is not None:
            embeds = torch.where(vision_mask.unsqueeze(-1), vision_embeds.to(embeds.dtype), embeds)
        rotary = (self.inv_freq, embeds.dtype)
        rope = None if rope_positions is None else (rope_positions, self.mrope_axes)
        return embeds, step_inputs(*rotary, positions, write_slots, block_tables, caches, rope, **fields)

    # ------------------------------------------------------------------ the layers and the heads
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

    def verify_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 logits [B, T, vocab] and normed hidden states [B, T, hidden] of every position (hidden:
        the last layer's output)."""
        normed = self.model.norm(hidden)
        return self.lm_head(normed).float(), normed

    def mtp_output(
        self, embeds: torch.Tensor, hidden: torch.Tensor, num_valid: torch.Tensor, step: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over the step's positions; its float32 logits [B, vocab] and output [B, 1, hidden]
        at each row's last real position."""
        out = self.mtp(embeds, hidden.to(embeds.dtype), step)
        last = out[torch.arange(out.shape[0], device=out.device), num_valid - 1].unsqueeze(1)
        return self.lm_head(last).float().squeeze(1), last
