"""The model runner: runs one step on a backend over one cache. Every caller of a backend goes through it
(the engine's steps, and `generate()`'s rows), so the step arguments are built in one place.

- `prefill`: a chunk of one sequence, right-padded to the compiled chunk, in the sequence's GDN slot.
- `decode`: one token for each of some slots; a backend with a static batch gets the rows beyond the
  caller's as dummy tokens in the cache's scratch slot and the null block, and their logits are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..exporters.base import StepBackend
from ..modeling.cache import Qwen36HybridCache


class ModelRunner:
    def __init__(self, backend: StepBackend, cache: Qwen36HybridCache, prefill_chunk_size: int) -> None:
        self.backend = backend
        self.cache = cache
        self.prefill_chunk_size = prefill_chunk_size

    def prefill(
        self, tokens: Sequence[int] | torch.Tensor, start: int, slot: int, block_table: torch.Tensor
    ) -> torch.Tensor:
        """Compute `tokens` (at most one chunk) at positions start.. of the sequence in `slot`, whose blocks
        are `block_table` [max_blocks]; returns the logits after the last one, [1, vocab]."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        if not 0 < len(tokens) <= self.prefill_chunk_size:
            raise ValueError(f"a prefill chunk holds 1..{self.prefill_chunk_size} tokens, got {len(tokens)}")
        padded = torch.zeros((1, self.prefill_chunk_size), dtype=torch.long)
        padded[0, : len(tokens)] = tokens
        return self.backend.prefill_chunk(
            padded,
            torch.tensor(start),
            torch.tensor(len(tokens)),
            torch.tensor(slot),
            block_table,
            *self.cache.step_tensors(),
        )

    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor
    ) -> torch.Tensor:
        """Feed tokens[i] at positions[i] to the sequence in slots[i] (distinct), whose blocks are
        block_tables[i]; returns the logits [len(tokens), vocab]."""
        batch = len(tokens)
        rows = batch if self.backend.decodes_any_batch else self.cache.batch_size
        input_ids = torch.zeros((rows, 1), dtype=torch.long)
        input_ids[:batch, 0] = tokens
        all_positions = torch.zeros(rows, dtype=torch.long)
        all_positions[:batch] = positions
        all_slots = torch.full((rows,), self.cache.scratch_slot, dtype=torch.long)
        all_slots[:batch] = slots
        tables = torch.zeros((rows, self.cache.max_blocks_per_row), dtype=torch.long)
        tables[:batch, : block_tables.shape[1]] = block_tables
        caches = self.cache.step_tensors()
        return self.backend.decode_step(input_ids, all_positions, all_slots, tables, *caches)[:batch]

    def reset_slot(self, slot: int) -> None:
        """A new sequence starts from zero GDN state, whatever the slot held before."""
        self.cache.conv_state[:, slot].zero_()
        self.cache.recurrent_state[:, slot].zero_()

    def slot_state(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's conv and recurrent states, as views (written in place by the steps)."""
        return self.cache.conv_state[:, slot], self.cache.recurrent_state[:, slot]
