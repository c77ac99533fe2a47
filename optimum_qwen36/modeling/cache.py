"""The cache `generate()` returns: transformers' `Cache` over the rows it computed."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from ..engine import ComputedSequence
from ..network.cache import CacheStorage
from ..network.config import LINEAR_ATTENTION


class Qwen36HybridCache(Cache):
    """The cache of a `NeuronQwen36ForCausalLM`, returned by `generate()` as `past_key_values`: the caller's
    own copy of each row's attention KV and GDN state, which passing it back continues without recomputing
    (later calls of the model never change it behind its holder's back).

    - `storage`: a `CacheStorage` in which row b owns slot b and the blocks `block_tables[b]`, so
      `key_cache`, `value_cache` ([n_attention_layers, num_blocks, block_size, n_kv_heads, head_dim]; row b's
      position p lives in block `block_tables[b, p // block_size]`, block 0 is the null block),
      `conv_state` and `recurrent_state` (slot b per row, float32 recurrent state) are its tensors.
    - `seq_lens[b]`: tokens of row b whose effect the cache holds; `token_ids[b, :seq_lens[b]]` are those
      tokens, so a continuation can be checked against them.

    With prefix caching the rows' KV and states stay in the model's prefix cache, which a next call reuses
    by itself: the cache then records the rows' tokens only (`storage` is None).
    """

    def __init__(
        self,
        config: PretrainedConfig,
        batch_size: int,
        sequence_length: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        holds_states: bool = True,
    ) -> None:
        # The transformers base class keeps per-layer objects; this cache keeps stacked tensors instead.
        super().__init__(layers=[])
        self.layer_types = list(config.layer_types)
        self._batch_size = batch_size
        self.sequence_length = sequence_length
        self.block_size = block_size
        self.max_blocks_per_row = -(-sequence_length // block_size)
        self.storage: CacheStorage | None = None
        tables = torch.zeros((batch_size, self.max_blocks_per_row), dtype=torch.long)
        if holds_states:
            self.storage = CacheStorage(config, batch_size, sequence_length, block_size, dtype, device)
            tables = self.storage.row_block_tables()
        self.block_tables = tables
        self.seq_lens = torch.zeros(batch_size, dtype=torch.long)
        self.token_ids = torch.zeros((batch_size, sequence_length), dtype=torch.long)

    # -- the storage's tensors
    @property
    def key_cache(self) -> torch.Tensor:
        return self._storage().key_cache

    @property
    def value_cache(self) -> torch.Tensor:
        return self._storage().value_cache

    @property
    def conv_state(self) -> torch.Tensor:
        return self._storage().conv_state

    @property
    def recurrent_state(self) -> torch.Tensor:
        return self._storage().recurrent_state

    def _storage(self) -> CacheStorage:
        if self.storage is None:
            raise ValueError(
                "This cache records the rows' tokens only: with prefix caching their KV and GDN states stay "
                "in the model's prefix cache, which the next generate() call reuses by itself."
            )
        return self.storage

    # -- rows, as generate() reads and writes them
    def cached_tokens(self, row: int) -> torch.Tensor:
        return self.token_ids[row, : int(self.seq_lens[row])]

    def computed_sequence(self, row: int) -> ComputedSequence | None:
        """Where row `row`'s computed tokens are (for a request that continues them), or None when the row
        is empty or its states are not held here."""
        computed = int(self.seq_lens[row])
        if computed == 0 or self.storage is None:
            return None
        blocks = self.block_tables[row, : -(-computed // self.block_size)]
        return ComputedSequence(self.storage, row, tuple(int(b) for b in blocks.tolist()), computed)

    def record_row(self, row: int, token_ids: list[int], computed: ComputedSequence) -> None:
        """Row `row` becomes the first `computed.num_computed` of `token_ids`, its KV and state copied from
        where they were computed (with no states held here, only the tokens are recorded)."""
        count = computed.num_computed
        self.seq_lens[row] = count
        self.token_ids[row] = 0
        self.token_ids[row, :count] = torch.tensor(token_ids[:count], dtype=torch.long)
        if self.storage is not None:
            blocks = self.block_tables[row, : len(computed.block_ids)].tolist()
            self.storage.copy_sequence(computed.storage, computed.slot, computed.block_ids, row, blocks)

    def clear_rows(self) -> None:
        """Every row empty: no tokens (their KV and states are then never read)."""
        self.seq_lens.zero_()
        self.token_ids.zero_()

    # -- transformers' Cache interface
    def __len__(self) -> int:
        return len(self.layer_types)

    def __getitem__(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [B, n_kv_heads, max_len, head_dim] of an attention layer, in position order, or
        (conv_state, recurrent_state) of a GDN layer. Positions >= seq_lens[b] hold no data."""
        if self.layer_types[layer_idx] == LINEAR_ATTENTION:
            return self.get_conv_state(layer_idx), self.get_recurrent_state(layer_idx)
        group = self._storage().group_index[layer_idx]
        keys = self.key_cache[group][self.block_tables].flatten(1, 2)[:, : self.sequence_length]
        values = self.value_cache[group][self.block_tables].flatten(1, 2)[:, : self.sequence_length]
        return keys.transpose(1, 2), values.transpose(1, 2)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self[i] for i in range(len(self)))

    def _gdn_group(self, layer_idx: int) -> int:
        if self.layer_types[layer_idx] != LINEAR_ATTENTION:
            raise ValueError(f"Layer {layer_idx} is a {self.layer_types[layer_idx]} layer, not a GDN layer.")
        return self._storage().group_index[layer_idx]

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
        for tensor in (*self._storage().step_tensors(), self.seq_lens, self.token_ids):
            tensor.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row b takes the content of row beam_idx[b] (rows may be repeated): KV is copied block by block
        into each row's own blocks, so no two rows ever share a writable block."""
        beam_idx = beam_idx.to(torch.long).cpu()
        if beam_idx.numel() != self.batch_size:
            raise ValueError(
                f"beam_idx has {beam_idx.numel()} entries for a cache of {self.batch_size} rows."
            )
        storage = self._storage()
        tables = self.block_tables.to(storage.device)
        src_tables = tables[beam_idx.to(tables.device)]
        for cache in (storage.key_cache, storage.value_cache):
            cache[:, tables.reshape(-1)] = cache[:, src_tables.reshape(-1)].clone()
        for state in (storage.conv_state, storage.recurrent_state):
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
