"""Driving one ``generate()`` call's rows through the prefix cache, with the model's static-shape steps.

Per row: look up the prompt, share the hit's KV blocks through the row's block table, restore the
GDN checkpoint into the row's slot, prefill only the suffix with chunk ends at the checkpoint
positions (storing the state there), then register the KV blocks and stage the state at every
multiple of the granularity while decoding, so the next turn of a conversation hits the answer.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

from .checkpoint import GDNStateSpec
from .manager import CachedSequence, PrefixCache, PrefixCacheConfig
from .schedule import plan_prefill_chunks

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from ..exporters.base import StepBackend
    from ..modeling.cache import Qwen36HybridCache
    from ..neuron_config import Qwen36NeuronConfig


def build_prefix_cache(
    kv: Qwen36HybridCache, neuron_config: Qwen36NeuronConfig, model_config: PretrainedConfig
) -> PrefixCache:
    """A prefix cache managing every block of ``kv`` (block 0 excepted) and checkpointing its GDN slots."""
    spec = GDNStateSpec(
        num_layers=kv.conv_state.shape[0],
        conv_shape=tuple(kv.conv_state.shape[2:]),
        conv_dtype=kv.conv_state.dtype,
        recurrent_shape=tuple(kv.recurrent_state.shape[2:]),
        recurrent_dtype=kv.recurrent_state.dtype,
    )
    # K and V of one block across every attention layer.
    kv_bytes = 2 * kv.key_cache[:, 0].numel() * kv.key_cache.element_size()
    nc = neuron_config
    # States depend on the weights, their dtype and the backend's numerics: salt every key with them.
    identity = "|".join(
        (
            str(nc.checkpoint_id),
            str(nc.checkpoint_revision),
            nc.dtype,
            nc.backend,
            model_config.to_json_string(),
        )
    )
    config = PrefixCacheConfig(
        budget_bytes=nc.prefix_cache_bytes,
        block_size=kv.block_size,
        granularity=nc.prefix_cache_granularity,
        checkpoint_interval=nc.prefix_cache_interval,
        identity=hashlib.sha256(identity.encode()).hexdigest(),
    )
    return PrefixCache(config, num_blocks=kv.key_cache.shape[1], kv_bytes_per_block=kv_bytes, state_spec=spec)


class PrefixCachedRun:
    """The rows of one ``generate()`` call. Call ``prefill``, then ``before_decode``/``after_decode``
    around every decode step, and ``finish`` in all cases (it releases the rows' blocks)."""

    def __init__(
        self, prefix_cache: PrefixCache, kv: Qwen36HybridCache, backend: StepBackend, chunk_size: int
    ) -> None:
        self.prefix_cache = prefix_cache
        self.kv = kv
        self.backend = backend
        self.chunk_size = chunk_size
        self.seqs: list[CachedSequence] = []
        self.computed: list[int] = []  # tokens of each row whose KV and state are computed
        self.live: list[bool] = []  # row still generating real tokens (not padding after EOS)
        self.table_len: list[int] = []  # entries of each row's block table written so far
        # Every row starts on the null block: rows beyond the batch and finished rows decode dummy
        # tokens, whose KV writes must never land in a block the cache manages.
        kv.block_tables.zero_()
        kv.seq_lens.zero_()

    def prefill(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """Prefill every row's uncached suffix; returns the logits after each row's last token, [B, vocab]."""
        pc, kv = self.prefix_cache, self.kv
        last_logits = []
        for row, tokens in enumerate(rows):
            # Rows go one by one, so a row already hits what an earlier row of this batch stored.
            seq = pc.begin(tokens.tolist())
            self.seqs.append(seq)
            self.computed.append(0)
            self.live.append(True)
            self.table_len.append(0)
            conv, recurrent = kv.conv_state[:, row], kv.recurrent_state[:, row]
            if seq.checkpoint is not None:
                pc.restore(seq, conv, recurrent)
            else:
                conv.zero_()
                recurrent.zero_()
            hit, length = seq.cached_tokens, len(tokens)
            kv.record_tokens(row, tokens[:hit])
            self._extend_block_table(row, seq, length)
            for start, n in plan_prefill_chunks(hit, length, self.chunk_size, seq.snapshot_positions):
                padded = torch.zeros((1, self.chunk_size), dtype=torch.long)
                padded[0, :n] = tokens[start : start + n]
                logits = self.backend.prefill_chunk(
                    padded,
                    torch.tensor(start),
                    torch.tensor(n),
                    torch.tensor(row),
                    kv.block_tables[row],
                    *kv.step_tensors(),
                )
                kv.record_tokens(row, tokens[start : start + n])
                end = start + n
                self.computed[row] = end
                pc.commit(seq, end)
                if end in seq.snapshot_positions:
                    pc.store_checkpoint(seq, end, conv, recurrent)
            self._stage_if_due(row)
            last_logits.append(logits)
        return torch.cat(last_logits, dim=0)

    def before_decode(self, tokens: torch.Tensor, unfinished: torch.Tensor) -> None:
        """Record the tokens about to be fed and give each live row a block for its new position."""
        for row, seq in enumerate(self.seqs):
            if self.live[row] and not bool(unfinished[row]):
                self.live[row] = False  # what follows is padding: never cached
            if self.live[row]:
                seq.append_tokens([int(tokens[row])])
                self._extend_block_table(row, seq, self.computed[row] + 1)

    def after_decode(self) -> None:
        for row, seq in enumerate(self.seqs):
            if self.live[row]:
                self.computed[row] += 1
                self.prefix_cache.commit(seq, self.computed[row])
                self._stage_if_due(row)

    def finish(self, completed: bool = True) -> list[int]:
        """Release the rows, caching their computed tokens if ``completed``; returns cached_tokens per row."""
        for row, seq in enumerate(self.seqs):
            self.prefix_cache.finish(seq, self.computed[row] if completed else None)
        self.kv.block_tables.zero_()  # the rows' blocks now belong to the cache
        return [seq.cached_tokens for seq in self.seqs]

    def _extend_block_table(self, row: int, seq: CachedSequence, num_tokens: int) -> None:
        """Give the row blocks for ``num_tokens`` positions; only new entries are written."""
        known = self.table_len[row]
        blocks = self.prefix_cache.ensure_blocks(seq, num_tokens)
        if len(blocks) > known:
            self.kv.block_tables[row, known : len(blocks)] = torch.tensor(blocks[known:], dtype=torch.long)
            self.table_len[row] = len(blocks)

    def _stage_if_due(self, row: int) -> None:
        seq, computed = self.seqs[row], self.computed[row]
        if self.prefix_cache.decode_snapshot_due(seq, computed):
            self.prefix_cache.stage_checkpoint(
                seq, computed, self.kv.conv_state[:, row], self.kv.recurrent_state[:, row]
            )
