"""Driving one ``generate()`` call's rows through the prefix cache, with the model's static-shape steps.

Per row: look up the prompt, share the hit's KV blocks through the row's block table, restore the
GDN checkpoint into the row's slot, prefill only the suffix with chunk ends at the checkpoint
positions (storing the state there), then register the KV blocks and stage the state at every
multiple of the granularity while decoding, so the next turn of a conversation hits the answer.
"""

from __future__ import annotations

import torch

from ..prefix_caching import CachedSequence, PrefixCache, plan_prefill_chunks
from .runner import ModelRunner


class PrefixCachedRun:
    """The rows of one ``generate()`` call. Call ``prefill``, then ``before_decode``/``after_decode``
    around every decode step, and ``finish`` in all cases (it releases the rows' blocks)."""

    def __init__(self, prefix_cache: PrefixCache, runner: ModelRunner) -> None:
        self.prefix_cache = prefix_cache
        self.runner = runner
        self.kv = kv = runner.cache
        self.chunk_size = runner.prefill_chunk_size
        self.seqs: list[CachedSequence] = []
        self.computed: list[int] = []  # tokens of each row whose KV and state are computed
        self.live: list[bool] = []  # row still generating real tokens (not padding after EOS)
        self.table_len: list[int] = []  # entries of each row's block table written so far
        # Every row starts on the null block: finished rows decode dummy tokens, whose KV writes must never
        # land in a block the cache manages.
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
            conv, recurrent = self.runner.slot_state(row)
            if seq.checkpoint is not None:
                pc.restore(seq, conv, recurrent)
            else:
                self.runner.reset_slot(row)
            hit, length = seq.cached_tokens, len(tokens)
            kv.record_tokens(row, tokens[:hit])
            self._extend_block_table(row, seq, length)
            for start, n in plan_prefill_chunks(hit, length, self.chunk_size, seq.snapshot_positions):
                logits = self.runner.prefill(tokens[start : start + n], start, row, kv.block_tables[row])
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
            self.prefix_cache.stage_checkpoint(seq, computed, *self.runner.slot_state(row))
