"""Qwen36HybridCache: transformers' Cache interface on the static hybrid storage."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_text_config
from helpers import export_eager, left_padded_prompts
from transformers.cache_utils import Cache

from optimum_qwen36 import Qwen36HybridCache


def make_cache(batch_size: int = 3) -> Qwen36HybridCache:
    config = tiny_text_config(num_hidden_layers=8)  # 6 GDN + 2 attention layers
    return Qwen36HybridCache(config, batch_size, 100, 16, torch.float32)


def test_shapes_hold_kv_for_attention_layers_only() -> None:
    cache = make_cache()
    assert isinstance(cache, Cache)
    assert len(cache) == 8
    assert cache.key_cache.shape == (2, 1 + 3 * 7, 16, 2, 32)  # null block + 7 blocks of 16 per row
    # One GDN state slot per row, and the scratch slot a static-batch backend decodes padding rows in.
    assert cache.conv_state.shape == (6, 3 + 1, 2 * 2 * 16 + 4 * 16, 3) and cache.storage.scratch_slot == 3
    assert cache.recurrent_state.shape == (6, 3 + 1, 4, 16, 16)
    assert cache.recurrent_state.dtype == torch.float32
    assert not (cache.block_tables == 0).any()  # the null block is never handed out
    assert cache.block_tables.unique().numel() == cache.block_tables.numel()  # no sharing by default
    assert cache.get_max_cache_shape() == 100 and cache.batch_size == 3
    keys, values = cache[3]
    assert keys.shape == values.shape == (3, 2, 100, 32)
    conv, recurrent = cache[0]
    assert conv.shape == (3, 128, 3) and recurrent.shape == (3, 4, 16, 16)
    with pytest.raises(ValueError, match="not a GDN layer"):
        cache.get_recurrent_state(3)
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(10)


def test_reorder_copies_rows_without_sharing_blocks() -> None:
    cache = make_cache()
    for row in range(3):
        cache.token_ids[row, : row + 1] = torch.arange(row + 1) + 10 * row
        cache.seq_lens[row] = row + 1
        cache.recurrent_state[:, row] = row
        cache.conv_state[:, row] = row
        for block in cache.block_tables[row]:
            cache.key_cache[:, block] = row
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    assert cache.seq_lens.tolist() == [3, 1, 1]
    assert torch.equal(cache.cached_tokens(0), torch.tensor([20, 21, 22]))
    for row, source in enumerate([2, 0, 0]):
        assert (cache.recurrent_state[:, row] == source).all()
        assert (cache.conv_state[:, row] == source).all()
        assert (cache.key_cache[:, cache.block_tables[row]] == source).all()
    assert cache.block_tables.unique().numel() == cache.block_tables.numel()
    cache.batch_select_indices(torch.tensor([1]))
    assert cache.seq_lens.tolist() == [1, 0, 0]
    cache.reset()
    assert cache.get_seq_length() == 0 and not cache.recurrent_state.any()


def test_generation_continues_after_selecting_rows(tiny_checkpoint) -> None:
    """batch_select_indices keeps a row's full state: continuing it equals continuing it alone."""
    path, _ = tiny_checkpoint("causal", seed=11)
    model = export_eager(path)
    input_ids, mask = left_padded_prompts([5, 9, 7], seed=1)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                         return_dict_in_generate=True)  # fmt: skip
    row_one = out.sequences[1:2]
    expected = model.generate(row_one, max_new_tokens=6, do_sample=False)
    cache = out.past_key_values
    cache.batch_select_indices(torch.tensor([1]))
    continued = model.generate(row_one, past_key_values=cache, max_new_tokens=6, do_sample=False)
    assert torch.equal(continued, expected)
