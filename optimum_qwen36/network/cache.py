"""The cache's storage: paged attention KV for the full-attention layers, per-slot state for the GDN layers.

State and KV are separate, explicit groups (as in vLLM's hybrid KV cache manager): there is no dummy KV for
GDN layers and no recurrent state for attention layers. All tensors are allocated once, with static shapes,
and updated in place by the compiled steps. Which sequence holds which slot and blocks is its owner's to
know (the engine's scheduler, or the rows of a transformers cache).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PretrainedConfig

from ..ops import huge_pages
from .config import FULL_ATTENTION, LINEAR_ATTENTION
from .neuron_config import Qwen36NeuronConfig

# The slot of a decode step's padding row (ops.gdn.scratch_for_padding).
PADDING_SLOT = -1


class CacheStorage:
    """The tensors the compiled steps read and update in place.

    - `key_cache`, `value_cache`: [n_attention_layers, num_blocks, block_size, n_kv_heads, head_dim]; a
      sequence's position p lives in block `block_table[p // block_size]` of its table. Block 0 is the null
      block, which no sequence owns (padding positions write there).
    - `conv_state`: [n_gdn_layers, slots, conv_dim, conv_kernel - 1] in the model dtype.
    - `recurrent_state`: [n_gdn_layers, slots, HV, K, V], float32. Slots: `batch_size` for sequences, then
      `snapshot_slots` (where a packed prefill call writes the states a prefix cache checkpoints inside its
      chunks: `snapshot_slot(i)`), then `scratch_slot`, the last, which belongs to no sequence: a
      static-batch backend decodes its padding rows there. A decode step's padding rows pass
      `PADDING_SLOT`, which the PyTorch forms take as the scratch slot and the native cpu ops skip.
    - With `num_speculative_tokens` k > 0 (MTP speculative decoding): one more attention entry in the KV
      tensors, the MTP layer's, and `spec_conv_state` / `spec_recurrent_state` [n_gdn_layers, slots, k + 1,
      ...]: a verify step's GDN state after each of its k + 1 positions, per slot.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        batch_size: int,
        sequence_length: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        num_blocks: int | None = None,
        num_speculative_tokens: int = 0,
        snapshot_slots: int = 0,
    ) -> None:
        self.layer_types = list(config.layer_types)
        self.batch_size = batch_size
        self.sequence_length = sequence_length
        self.block_size = block_size
        self.max_blocks_per_row = -(-sequence_length // block_size)
        # By default every row owns a sequence's worth of blocks (`row_block_tables`).
        num_blocks = num_blocks or 1 + batch_size * self.max_blocks_per_row
        n_attention = self.layer_types.count(FULL_ATTENTION)
        n_gdn = self.layer_types.count(LINEAR_ATTENTION)
        self.num_speculative_tokens = num_speculative_tokens
        mtp_layers = 1 if num_speculative_tokens else 0
        kv_heads, head_dim = config.num_key_value_heads, config.head_dim
        kv_shape = (n_attention + mtp_layers, num_blocks, block_size, kv_heads, head_dim)
        # Decode steps stream the KV and the GDN states: in huge pages where the CPU holds them.
        zeros = huge_pages.zeros
        self.key_cache = zeros(kv_shape, dtype, device)
        self.value_cache = zeros(kv_shape, dtype, device)
        conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + (
            config.linear_num_value_heads * config.linear_value_head_dim
        )
        self.snapshot_slots = snapshot_slots
        self.scratch_slot = batch_size + snapshot_slots
        slots = self.scratch_slot + 1
        self.conv_state = zeros((n_gdn, slots, conv_dim, config.linear_conv_kernel_dim - 1), dtype, device)
        state_shape = (
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
        )
        self.recurrent_state = zeros((n_gdn, slots, *state_shape), torch.float32, device)
        self.spec_conv_state: torch.Tensor | None = None
        self.spec_recurrent_state: torch.Tensor | None = None
        if num_speculative_tokens:
            positions = num_speculative_tokens + 1
            conv_shape = (*self.conv_state.shape[:2], positions, *self.conv_state.shape[2:])
            self.spec_conv_state = zeros(conv_shape, dtype, device)
            self.spec_recurrent_state = zeros((n_gdn, slots, positions, *state_shape), torch.float32, device)
        # Index of each model layer within its group (attention layers or GDN layers).
        self.group_index = [self.layer_types[:i].count(t) for i, t in enumerate(self.layer_types)]

    @classmethod
    def for_settings(
        cls,
        config: PretrainedConfig,
        neuron_config: Qwen36NeuronConfig,
        device: torch.device | str = "cpu",
        num_blocks: int | None = None,
        snapshot_slots: int = 0,
    ) -> CacheStorage:
        """The storage an engine of a model exported with `neuron_config` runs in; the compiled graphs are
        traced with its shapes (the KV block count is a dynamic dimension: `num_blocks` changes nothing
        compiled; `snapshot_slots` is the backend's `prefill_snapshots`). With prefix caching, as many
        blocks again as the rows own, for the cached prefixes."""
        blocks = (
            1 + 2 * neuron_config.batch_size * neuron_config.max_blocks_per_sequence
            if neuron_config.prefix_caching
            else None
        )
        return cls(
            config,
            neuron_config.batch_size,
            neuron_config.sequence_length,
            neuron_config.kv_block_size,
            neuron_config.torch_dtype,
            device=device,
            num_blocks=num_blocks or blocks,
            num_speculative_tokens=neuron_config.num_speculative_tokens,
            snapshot_slots=snapshot_slots,
        )

    @property
    def num_blocks(self) -> int:
        return self.key_cache.shape[1]

    @property
    def device(self) -> torch.device:
        return self.key_cache.device

    def row_block_tables(self) -> torch.Tensor:
        """[batch_size, max_blocks_per_row]: row b owning blocks 1 + b * max_blocks_per_row onwards, the
        layout of a storage of the default size (the null block is never handed out)."""
        blocks = 1 + torch.arange(self.batch_size * self.max_blocks_per_row, device=self.device)
        return blocks.view(self.batch_size, self.max_blocks_per_row)

    def snapshot_slot(self, index: int) -> int:
        """The slot of the `index`-th state a packed prefill call snapshots."""
        if not 0 <= index < self.snapshot_slots:
            raise IndexError(f"snapshot slot {index} of a cache with {self.snapshot_slots}")
        return self.batch_size + index

    def step_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The four tensors the compiled steps take, in their argument order."""
        return self.key_cache, self.value_cache, self.conv_state, self.recurrent_state

    def spec_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The speculative state tensors a verify step writes (after the four of `step_tensors`)."""
        if self.spec_conv_state is None or self.spec_recurrent_state is None:
            raise RuntimeError("this cache was built without speculative state (num_speculative_tokens=0).")
        return self.spec_conv_state, self.spec_recurrent_state

    def slot_state(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's conv and recurrent states, as views (written in place by the steps)."""
        return self.conv_state[:, slot], self.recurrent_state[:, slot]

    def copy_sequence(
        self,
        source: CacheStorage,
        source_slot: int,
        source_blocks: Sequence[int],
        slot: int,
        blocks: Sequence[int],
    ) -> None:
        """Copy one sequence from `source` into this storage: its GDN state from `source_slot` into `slot`,
        and the KV of its blocks, in order, into `blocks`. The attention layers both storages hold are
        copied (a storage without the MTP layer's KV entry gives none of it)."""
        if len(source_blocks) != len(blocks):
            raise ValueError(f"{len(source_blocks)} source blocks for {len(blocks)} blocks")
        layers = min(self.key_cache.shape[0], source.key_cache.shape[0])
        src = torch.as_tensor(list(source_blocks), dtype=torch.long, device=source.device)
        dst = torch.as_tensor(list(blocks), dtype=torch.long, device=self.device)
        pairs = ((self.key_cache, source.key_cache), (self.value_cache, source.value_cache))
        for cache, source_cache in pairs:
            cache[:layers, dst] = source_cache[:layers, src].to(self.device)
        for state, source_state in zip(self.slot_state(slot), source.slot_state(source_slot), strict=True):
            state.copy_(source_state)
