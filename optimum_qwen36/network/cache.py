"""The hybrid cache: paged attention KV for the full-attention layers, per-row state for the GDN layers.

State and KV are separate, explicit groups (as in vLLM's hybrid KV cache manager): there is no dummy KV for
GDN layers and no recurrent state for attention layers. All tensors are allocated once, with static shapes,
and updated in place by the compiled steps.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from ..ops import huge_pages
from .config import FULL_ATTENTION, LINEAR_ATTENTION

# The slot of a decode step's padding row (ops.gdn.scratch_for_padding).
PADDING_SLOT = -1


class Qwen36HybridCache(Cache):
    """Static cache of a `NeuronQwen36ForCausalLM`, returned by `generate()` as `past_key_values`.

    - `key_cache`, `value_cache`: [n_attention_layers, num_blocks, block_size, n_kv_heads, head_dim]; row b's
      position p lives in block `block_tables[b, p // block_size]`. Block 0 is the null block.
    - `conv_state`: [n_gdn_layers, slots, conv_dim, conv_kernel - 1] in the model dtype.
    - `recurrent_state`: [n_gdn_layers, slots, HV, K, V], float32. Slots: one per row, then
      `snapshot_slots` (where a packed prefill call writes the states a prefix cache checkpoints inside its
      chunks: `snapshot_slot(i)`), then `scratch_slot`, the last, which belongs to no row: a static-batch
      backend decodes its padding rows there. A decode step's padding rows pass `PADDING_SLOT`, which the
      PyTorch forms take as the scratch slot and the native cpu ops skip (no state is moved for them).
    - With `num_speculative_tokens` k > 0 (MTP speculative decoding): one more attention entry in the KV
      tensors, the MTP layer's, and `spec_conv_state` / `spec_recurrent_state` [n_gdn_layers, slots, k + 1,
      ...]: a verify step's GDN state after each of its k + 1 positions, per slot.
    - `seq_lens[b]`: tokens of row b whose effect the cache holds; `token_ids[b, :seq_lens[b]]` are those
      tokens, so a continuation can be checked against them.
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
        # The transformers base class keeps per-layer objects; this cache keeps stacked tensors instead.
        super().__init__(layers=[])
        self.layer_types = list(config.layer_types)
        self._batch_size = batch_size
        self.sequence_length = sequence_length
        self.block_size = block_size
        self.max_blocks_per_row = -(-sequence_length // block_size)
        # Prefix caching asks for more blocks: those beyond the rows' own hold cached prefixes.
        num_blocks = num_blocks or 1 + batch_size * self.max_blocks_per_row
        n_attention = self.layer_types.count(FULL_ATTENTION)
        n_gdn = self.layer_types.count(LINEAR_ATTENTION)
        self.num_speculative_tokens = num_speculative_tokens
        mtp_layers = 1 if num_speculative_tokens else 0
        kv_heads, head_dim = config.num_key_value_heads, config.head_dim
        kv_shape = (n_attention + mtp_layers, num_blocks, block_size, kv_heads, head_dim)
        # Decode steps stream the KV and the GDN states: in huge pages where the CPU holds them.
        self.key_cache = huge_pages.zeros(kv_shape, dtype, device)
        self.value_cache = huge_pages.zeros(kv_shape, dtype, device)
        conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + (
            config.linear_num_value_heads * config.linear_value_head_dim
        )
        self.snapshot_slots = snapshot_slots
        self.scratch_slot = batch_size + snapshot_slots
        slots = self.scratch_slot + 1
        self.conv_state = huge_pages.zeros(
            (n_gdn, slots, conv_dim, config.linear_conv_kernel_dim - 1), dtype, device
        )
        self.recurrent_state = huge_pages.zeros(
            (
                n_gdn,
                slots,
                config.linear_num_value_heads,
                config.linear_key_head_dim,
                config.linear_value_head_dim,
            ),
            torch.float32,
            device,
        )
        self.spec_conv_state: torch.Tensor | None = None
        self.spec_recurrent_state: torch.Tensor | None = None
        if num_speculative_tokens:
            positions = num_speculative_tokens + 1
            conv_shape = (*self.conv_state.shape[:2], positions, *self.conv_state.shape[2:])
            self.spec_conv_state = huge_pages.zeros(conv_shape, dtype, device)
            self.spec_recurrent_state = huge_pages.zeros(
                (*self.recurrent_state.shape[:2], positions, *self.recurrent_state.shape[2:]),
                torch.float32,
                device,
            )
        # Row b owns blocks 1 + b * max_blocks_per_row ...; the null block is never handed out.
        self.block_tables = (1 + torch.arange(batch_size * self.max_blocks_per_row, device=device)).view(
            batch_size, self.max_blocks_per_row
        )
        self.seq_lens = torch.zeros(batch_size, dtype=torch.long)
        self.token_ids = torch.zeros((batch_size, sequence_length), dtype=torch.long)
        # Index of each model layer within its group (attention layers or GDN layers).
        self._group_index = [self.layer_types[:i].count(t) for i, t in enumerate(self.layer_types)]

    def snapshot_slot(self, index: int) -> int:
        """The slot of the `index`-th state a packed prefill call snapshots."""
        if not 0 <= index < self.snapshot_slots:
            raise IndexError(f"snapshot slot {index} of a cache with {self.snapshot_slots}")
        return self._batch_size + index

    # -- the four tensors the compiled steps take, in their argument order
    def step_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.key_cache, self.value_cache, self.conv_state, self.recurrent_state

    def spec_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The speculative state tensors a verify step writes (after the four of `step_tensors`)."""
        if self.spec_conv_state is None or self.spec_recurrent_state is None:
            raise RuntimeError("this cache was built without speculative state (num_speculative_tokens=0).")
        return self.spec_conv_state, self.spec_recurrent_state

    def cached_tokens(self, row: int) -> torch.Tensor:
        return self.token_ids[row, : int(self.seq_lens[row])]

    # -- transformers' Cache interface
    def __len__(self) -> int:
        return len(self.layer_types)

    def __getitem__(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [B, n_kv_heads, max_len, head_dim] of an attention layer, in position order, or
        (conv_state, recurrent_state) of a GDN layer. Positions >= seq_lens[b] hold no data."""
        if self.layer_types[layer_idx] == LINEAR_ATTENTION:
            return self.get_conv_state(layer_idx), self.get_recurrent_state(layer_idx)
        group = self._group_index[layer_idx]
        keys = self.key_cache[group][self.block_tables].flatten(1, 2)[:, : self.sequence_length]
        values = self.value_cache[group][self.block_tables].flatten(1, 2)[:, : self.sequence_length]
        return keys.transpose(1, 2), values.transpose(1, 2)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def _gdn_group(self, layer_idx: int) -> int:
        if self.layer_types[layer_idx] != LINEAR_ATTENTION:
            raise ValueError(f"Layer {layer_idx} is a {self.layer_types[layer_idx]} layer, not a GDN layer.")
        return self._group_index[layer_idx]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.conv_state[self._gdn_group(layer_idx), : self.batch_size]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.recurrent_state[self._gdn_group(layer_idx), : self.batch_size]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The longest row's cached length (rows are not padded inside the cache)."""
        return int(self.seq_lens.max())

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.sequence_length

    def get_max_length(self) -> int:
        return self.sequence_length

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def max_batch_size(self) -> int:
        return self._batch_size

    @property
    def max_cache_len(self) -> int:
        return self.sequence_length

    @property
    def is_compileable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.layer_types)

    @property
    def is_linear(self) -> list[bool]:
        return [t == LINEAR_ATTENTION for t in self.layer_types]

    def reset(self) -> None:
        for tensor in (*self.step_tensors(), self.seq_lens, self.token_ids):
            tensor.zero_()

    def forget(self) -> None:
        """Empty every row for reuse: lengths, token ids and GDN states zeroed. KV past a row's length is
        never read, so the KV tensors are left as they are (zeroing them would rewrite the whole cache)."""
        states = (self.conv_state, self.recurrent_state, self.spec_conv_state, self.spec_recurrent_state)
        for tensor in (*states, self.seq_lens, self.token_ids):
            if tensor is not None:
                tensor.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row b takes the content of row beam_idx[b] (rows may be repeated): KV is copied block by block
        into each row's own blocks, so no two rows ever share a writable block."""
        beam_idx = beam_idx.to(torch.long).cpu()
        if beam_idx.numel() != self.batch_size:
            raise ValueError(
                f"beam_idx has {beam_idx.numel()} entries for a cache of {self.batch_size} rows."
            )
        tables = self.block_tables
        src_tables = tables[beam_idx.to(tables.device)]
        for cache in (self.key_cache, self.value_cache):
            cache[:, tables.reshape(-1)] = cache[:, src_tables.reshape(-1)].clone()
        for state in (self.conv_state, self.recurrent_state):
            state[:, : self.batch_size] = state[:, beam_idx.to(state.device)]
        self.seq_lens = self.seq_lens[beam_idx]
        self.token_ids = self.token_ids[beam_idx]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices` (moved to rows 0..n-1); the remaining rows are emptied."""
        indices = indices.to(torch.long).cpu()
        order = torch.cat([indices, torch.zeros(self.batch_size - indices.numel(), dtype=torch.long)])
        self.reorder_cache(order)
        self.seq_lens[indices.numel() :] = 0
        self.token_ids[indices.numel() :] = 0

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(
            "A Qwen36HybridCache cannot be cropped: the GDN recurrent state summarises the whole prefix and "
            "cannot be rolled back. Keep the cache of the shorter sequence instead."
        )

    def __repr__(self) -> str:
        return (
            f"Qwen36HybridCache(batch_size={self.batch_size}, sequence_length={self.sequence_length}, "
            f"block_size={self.block_size}, seq_lens={self.seq_lens.tolist()})"
        )
