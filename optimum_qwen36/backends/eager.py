"""The `eager` backend: the model's own PyTorch code, uncompiled (the reference the compiled ones match)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..network.model import Qwen36ForCausalLM
from .base import PREFILL_SNAPSHOTS, blocks_in_use, fit_chunk_images, rows_blocks_in_use


class EagerBackend:
    """The reference backend: the model's own PyTorch code, uncompiled."""

    name = "eager"
    decodes_any_batch = True
    min_step_rows = 1
    packs_prefill = True
    decodes_in_prefill = True
    prefill_snapshots = PREFILL_SNAPSHOTS
    per_rank_graphs = False  # no graphs
    takes_images = True

    def __init__(self, model: Qwen36ForCausalLM) -> None:
        self.model = model
        self.device = str(next(model.parameters()).device)

    @torch.no_grad()
    def prefill_chunk(
        self,
        *args: torch.Tensor,
        snapshot_ends: torch.Tensor | None = None,
        snapshot_slots: torch.Tensor | None = None,
        **images: torch.Tensor,
    ) -> torch.Tensor:
        used = blocks_in_use("prefill_chunk", args)
        images = fit_chunk_images(images, used[0].shape[1])
        return self.model.prefill_chunk(*used, snapshot_ends, snapshot_slots, **images)

    @torch.no_grad()
    def decode_step(self, *args: torch.Tensor, rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.decode_step(*blocks_in_use("decode_step", args), rope_positions=rope_positions)

    @torch.no_grad()
    def prefill_chunk_hidden(
        self, *args: torch.Tensor, **images: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        used = blocks_in_use("prefill_chunk", args)
        return self.model.prefill_chunk_hidden(*used, **fit_chunk_images(images, used[0].shape[1]))

    @torch.no_grad()
    def position_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.model.position_logits(normed)

    @torch.no_grad()
    def verify_step(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, start_pos, num_valid, slots, block_tables, key_cache, *states = args
        tables = rows_blocks_in_use(start_pos, num_valid, block_tables, key_cache.shape[2])
        return self.model.verify_step(input_ids, start_pos, num_valid, slots, tables, key_cache, *states)

    @torch.no_grad()
    def mtp_step(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, hidden, start_pos, num_valid, block_tables, key_cache, value_cache = args
        tables = rows_blocks_in_use(start_pos, num_valid, block_tables, key_cache.shape[2])
        return self.model.mtp_step(input_ids, hidden, start_pos, num_valid, tables, key_cache, value_cache)

    def save(self, directory: Path) -> None:
        """Nothing compiled: the weights and settings the model saves are all it needs."""
