"""The model runner: runs one step on a backend over one cache, for the engine's steps (generate() included:
it is a client of the engine), so the step arguments are built in one place.

- `prefill`: a chunk of one sequence, right-padded to the compiled chunk, in the sequence's GDN slot.
- `prefill_packed`: chunks of several sequences in one call (backends that `packs_prefill`), at most one
  compiled chunk of tokens in all (and one token per batch row more where the backend takes
  `decodes_in_prefill`: decode rows are one-token chunks), each in its own slot: one pass over the weights
  for all of them. Where the backend takes `prefill_snapshots`, the call also keeps the GDN states at
  positions inside its chunks (`PackedChunk.snapshots`, then `snapshot_state`): prefix cache checkpoints
  that need no chunk of their own.
- `decode`: one token for each of some slots; a backend with a static batch (or fewer rows than its
  `min_step_rows`) gets the rows beyond the caller's as dummy tokens in the cache's scratch slot and the
  null block, and their logits are dropped. `verify` and `draft` are padded the same way.
- `prefill_positions`: `prefill` with the logits after every token of the chunk (prompt log-probabilities).
- MTP speculative decoding: `prefill` with the chunk's hidden states, `verify` (several tokens per slot,
  the GDN state after each kept apart until `keep_verified_state`), and `draft` (the MTP layer).

Prompts with images: a prefill chunk also carries its `ChunkImages` (the tokens' multimodal rotary positions
and the image features of its image tokens), and a decode step its rows' `rope_deltas`; a call passes them
to the backend as soon as one of its sequences has them (the others' rotary positions are their indices).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..backends.base import StepBackend
from ..network.cache import PADDING_SLOT, CacheStorage


@dataclass
class ChunkImages:
    """What a prefill chunk of a prompt with images reads besides its tokens: each token's rotary positions
    [3, n] (network/vision.py), and the image features [n, hidden] that stand in for the embeddings of the
    tokens where `mask` [n] is set."""

    rope_positions: torch.Tensor
    features: torch.Tensor
    mask: torch.Tensor


@dataclass
class PackedChunk:
    """One sequence's chunk of a prefill (alone, or part of a packed one): its tokens at positions start..,
    its GDN slot, its block table [max_blocks], the positions inside it (start < p < start + len(tokens))
    after which its GDN state is kept (in the call's order: `ModelRunner.snapshot_state`), and its images."""

    tokens: Sequence[int] | torch.Tensor
    start: int
    slot: int
    block_table: torch.Tensor
    snapshots: Sequence[int] = ()
    images: ChunkImages | None = None


class ModelRunner:
    def __init__(self, backend: StepBackend, cache: CacheStorage, prefill_chunk_size: int) -> None:
        self.backend = backend
        self.cache = cache
        self.prefill_chunk_size = prefill_chunk_size
        # The most tokens one packed prefill call takes.
        self.max_packed_tokens = prefill_chunk_size + (cache.batch_size if backend.decodes_in_prefill else 0)

    def prefill(self, chunk: PackedChunk) -> torch.Tensor:
        """Compute one sequence's `chunk` (at most `prefill_chunk_size` tokens); returns the logits after its
        last token, [1, vocab]."""
        return self.backend.prefill_chunk(
            *self._prefill_args(chunk), **self._chunk_images([chunk], self.prefill_chunk_size)
        )

    def prefill_packed(self, chunks: Sequence[PackedChunk]) -> torch.Tensor:
        """Compute several sequences' chunks (distinct slots, at most `max_packed_tokens` in all, at most
        the backend's `prefill_snapshots` snapshots) in one call; returns the logits after each one's last
        token, [len(chunks), vocab]. The state after the i-th snapshot position (chunk by chunk, in
        position order) is then `snapshot_state(i)`, until the next call."""
        if not self.backend.packs_prefill:
            raise ValueError(f"the {self.backend.name} backend prefills one sequence per call")
        tokens = [torch.as_tensor(chunk.tokens, dtype=torch.long) for chunk in chunks]
        total = sum(len(t) for t in tokens)
        if not 0 < total <= self.max_packed_tokens or any(len(t) == 0 for t in tokens):
            raise ValueError(
                f"a packed prefill holds 1..{self.max_packed_tokens} tokens in non-empty chunks, got "
                f"{[len(t) for t in tokens]}"
            )
        ends = []  # each snapshot's end in the packed tokens
        first = 0
        for chunk, chunk_tokens in zip(chunks, tokens, strict=True):
            for position in sorted(chunk.snapshots):
                if not chunk.start < position < chunk.start + len(chunk_tokens):
                    raise ValueError(
                        f"a snapshot at position {position} is not inside its chunk (positions "
                        f"{chunk.start}..{chunk.start + len(chunk_tokens)})"
                    )
                ends.append(first + position - chunk.start)
            first += len(chunk_tokens)
        if len(ends) > self.cache.snapshot_slots:
            raise ValueError(
                f"a packed prefill takes {self.cache.snapshot_slots} snapshots (the {self.backend.name} "
                f"backend's prefill_snapshots), got {len(ends)}"
            )
        snapshots = {}
        if ends:
            slots = [self.cache.snapshot_slot(i) for i in range(len(ends))]
            snapshots = {"snapshot_ends": torch.tensor(ends), "snapshot_slots": torch.tensor(slots)}
        return self.backend.prefill_chunk(
            torch.cat(tokens).unsqueeze(0),
            torch.tensor([chunk.start for chunk in chunks]),
            torch.tensor([len(t) for t in tokens]),
            torch.tensor([chunk.slot for chunk in chunks]),
            torch.stack([chunk.block_table for chunk in chunks]),
            *self.cache.step_tensors(),
            **snapshots,
            **self._chunk_images(chunks, total),
        )

    def prefill_hidden(self, chunk: PackedChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """`prefill`, also returning the normed hidden states of the (padded) chunk, [1, chunk, hidden]."""
        return self.backend.prefill_chunk_hidden(
            *self._prefill_args(chunk), **self._chunk_images([chunk], self.prefill_chunk_size)
        )

    def prefill_positions(self, chunk: PackedChunk) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`prefill_hidden`, also returning the float32 logits after each of its tokens [len(tokens), vocab]
        (prompt log-probabilities)."""
        logits, hidden = self.prefill_hidden(chunk)
        return logits, hidden, self.backend.position_logits(hidden[:, : len(chunk.tokens)])[0]

    def _prefill_args(self, chunk: PackedChunk) -> tuple[torch.Tensor, ...]:
        """A one-sequence prefill call's arguments: its tokens right-padded to the compiled chunk."""
        tokens = torch.as_tensor(chunk.tokens, dtype=torch.long)
        if not 0 < len(tokens) <= self.prefill_chunk_size:
            raise ValueError(f"a prefill chunk holds 1..{self.prefill_chunk_size} tokens, got {len(tokens)}")
        padded = torch.zeros((1, self.prefill_chunk_size), dtype=torch.long)
        padded[0, : len(tokens)] = tokens
        return (
            padded,
            torch.tensor(chunk.start),
            torch.tensor(len(tokens)),
            torch.tensor(chunk.slot),
            chunk.block_table,
            *self.cache.step_tensors(),
        )

    def _chunk_images(self, chunks: Sequence[PackedChunk], width: int) -> dict[str, torch.Tensor]:
        """The image keyword arguments of a prefill call over `chunks` (packed one after the other in
        `width` tokens, the rest padding): none unless a chunk has images; the others' rotary positions are
        their indices, their tokens text."""
        if all(chunk.images is None for chunk in chunks):
            return {}
        rope = torch.zeros((3, width), dtype=torch.long)
        hidden = next(chunk.images.features for chunk in chunks if chunk.images is not None)
        features = hidden.new_zeros((width, hidden.shape[-1]))
        mask = torch.zeros(width, dtype=torch.bool)
        first = 0
        for chunk in chunks:
            end = first + len(chunk.tokens)
            if chunk.images is None:
                rope[:, first:end] = torch.arange(chunk.start, chunk.start + len(chunk.tokens))
            else:
                rope[:, first:end] = chunk.images.rope_positions
                features[first:end] = chunk.images.features
                mask[first:end] = chunk.images.mask
            first = end
        return {
            "rope_positions": rope.unsqueeze(1),
            "vision_embeds": features.unsqueeze(0),
            "vision_mask": mask.unsqueeze(0),
        }

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        rope_deltas: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Feed tokens[i] at positions[i] to the sequence in slots[i] (distinct), whose blocks are
        block_tables[i]; returns the logits [len(tokens), vocab]. `rope_deltas` [B]: how far each row's
        rotary position lies from its position (a prompt with images; see network/vision.py)."""
        batch = len(tokens)
        rows = self._step_rows(batch)
        tables = torch.zeros((batch, self.cache.max_blocks_per_row), dtype=torch.long)
        tables[:, : block_tables.shape[1]] = block_tables
        positions = self._padded_rows(positions.to(torch.long), rows=rows)
        logits = self.backend.decode_step(
            self._padded_rows(tokens.to(torch.long), rows=rows).unsqueeze(1),
            positions,
            self._padded_rows(slots.to(torch.long), PADDING_SLOT, rows=rows),
            self._padded_rows(tables, rows=rows),
            *self.cache.step_tensors(),
            **self._rows_rope(positions.unsqueeze(1), rope_deltas),
        )
        return logits[:batch]

    def _rows_rope(
        self, positions: torch.Tensor, rope_deltas: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """The rotary positions [3, rows, T] of a step's rows at `positions` [rows, T], shifted by each row's
        `rope_deltas` (fewer than rows: the dummy rows' are 0); none without deltas."""
        if rope_deltas is None:
            return {}
        shift = self._padded_rows(rope_deltas.to(torch.long), rows=len(positions))
        return {"rope_positions": (positions + shift.unsqueeze(1)).expand(3, -1, -1)}

    def verify(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        num_valid: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed tokens[i, :num_valid[i]] ([B, k + 1], padded) at positions[i].. to the sequence in slots[i];
        the slots' GDN states are not changed (see `keep_verified_state`). Returns the logits after each
        token [B, k + 1, vocab] and the normed hidden states [B, k + 1, hidden]."""
        batch = len(tokens)
        rows = self._step_rows(batch)
        logits, hidden = self.backend.verify_step(
            self._padded_rows(tokens, rows=rows),
            self._padded_rows(positions, rows=rows),
            self._padded_rows(num_valid, 1, rows=rows),
            self._padded_rows(slots, self.cache.scratch_slot, rows=rows),
            self._padded_rows(block_tables, rows=rows),
            *self.cache.step_tensors(),
            *self.cache.spec_tensors(),
        )
        return logits[:batch], hidden[:batch]

    def draft(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        num_valid: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer at positions[i].. (num_valid[i] of them) of row i: tokens [B, T] are the tokens after
        those positions, hidden [B, T, hidden] the hidden states at them. Returns the draft logits [B, vocab]
        and the MTP output [B, 1, hidden] at each row's last position."""
        batch = len(tokens)
        rows = self._step_rows(batch)
        logits, out = self.backend.mtp_step(
            self._padded_rows(tokens, rows=rows),
            self._padded_rows(hidden, rows=rows),
            self._padded_rows(positions, rows=rows),
            self._padded_rows(num_valid, 1, rows=rows),
            self._padded_rows(block_tables, rows=rows),
            self.cache.key_cache,
            self.cache.value_cache,
        )
        return logits[:batch], out[:batch]

    def _step_rows(self, batch: int) -> int:
        """The rows a decode, verify or MTP call of `batch` rows takes: the exported batch where the backend's
        steps have static shapes."""
        return batch if self.backend.decodes_any_batch else self.cache.batch_size

    def _padded_rows(self, values: torch.Tensor, fill: int = 0, rows: int = 0) -> torch.Tensor:
        """`values` (a row each, contiguous) with dummy rows of `fill` up to `rows` and at least the
        backend's `min_step_rows` (a dummy row runs at position 0 of the null block, in the scratch slot or,
        decoding, with `PADDING_SLOT`)."""
        missing = max(rows, self.backend.min_step_rows) - len(values)
        if missing <= 0:
            return values.contiguous()
        return torch.cat([values, values.new_full((missing, *values.shape[1:]), fill)])

    def verified_state(self, slot: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv and recurrent states of `slot` after the verify step's token `position` (views)."""
        spec_conv, spec_recurrent = self.cache.spec_tensors()
        return spec_conv[:, slot, position], spec_recurrent[:, slot, position]

    def keep_verified_state(self, slot: int, position: int) -> None:
        """The slot continues from its state after the last verify step's token `position`."""
        conv, recurrent = self.verified_state(slot, position)
        self.cache.conv_state[:, slot].copy_(conv)
        self.cache.recurrent_state[:, slot].copy_(recurrent)

    def reset_slot(self, slot: int) -> None:
        """A new sequence starts from zero GDN state, whatever the slot held before."""
        self.cache.conv_state[:, slot].zero_()
        self.cache.recurrent_state[:, slot].zero_()

    def snapshot_state(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv and recurrent states of the last packed prefill's `index`-th snapshot (views)."""
        return self.slot_state(self.cache.snapshot_slot(index))

    def slot_state(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's conv and recurrent states, as views (written in place by the steps)."""
        return self.cache.slot_state(slot)
