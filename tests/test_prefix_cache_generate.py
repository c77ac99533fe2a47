"""Prefix caching through generate(): a warm run gives the cold run's greedy tokens and logits.

Every case compares a model with prefix caching against the same checkpoint without it (the
cold reference), in fp32. The measured bound is documented in docs/PREFIX_CACHING.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import save_tiny_checkpoint
from helpers import export_eager, left_padded_prompts
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from optimum_qwen36 import NeuronQwen36ForCausalLM

NEW = 8
LOGIT_ATOL = 1e-4  # fp32: measured 0.0 with 64-token chunks, 2.6e-5 with 100-token chunks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = save_tiny_checkpoint(tmp_path_factory.mktemp("pc") / "ckpt", "causal", seed=5)
    return path


@pytest.fixture(scope="module")
def cold(checkpoint: Path) -> NeuronQwen36ForCausalLM:
    return export_eager(checkpoint, sequence_length=512, prefill_chunk_size=64)


def warm_model(checkpoint: Path, **settings: Any) -> NeuronQwen36ForCausalLM:
    return export_eager(
        checkpoint, sequence_length=512, prefill_chunk_size=64, prefix_caching=True, **settings
    )


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 512, (n,), generator=torch.Generator().manual_seed(seed))


def generate(model: NeuronQwen36ForCausalLM, prompts: list[torch.Tensor], new: int = NEW) -> Any:
    ids, mask = left_padded_prompts([len(p) for p in prompts])
    for row, p in enumerate(prompts):
        ids[row, ids.shape[1] - len(p) :] = p
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=new, do_sample=False, return_dict_in_generate=True,
        output_logits=True, pad_token_id=0,
    )  # fmt: skip


def assert_same(out: Any, ref: Any) -> None:
    assert torch.equal(out.sequences, ref.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits, strict=True))
    assert diff <= LOGIT_ATOL, diff


_COLD: dict[tuple, Any] = {}  # cold reference outputs, computed once per (chunk, prompts, new)


def check(
    model: NeuronQwen36ForCausalLM,
    cold_model: NeuronQwen36ForCausalLM,
    prompts: list[torch.Tensor],
    new: int = NEW,
) -> list[int]:
    out = generate(model, prompts, new)
    key = (cold_model.neuron_config.prefill_chunk_size, tuple(tuple(p.tolist()) for p in prompts), new)
    if key not in _COLD:
        _COLD[key] = generate(cold_model, prompts, new)
    assert_same(out, _COLD[key])
    assert model.prefix_cache.stats()["bytes_used"] <= model.prefix_cache.config.budget_bytes
    return out.cached_tokens.tolist()


def test_repeats_short_prompts_and_exact_multiples(checkpoint: Path, cold: NeuronQwen36ForCausalLM) -> None:
    model = warm_model(checkpoint)
    assert model.neuron_config.prefix_caching
    p300, p40, p128 = tokens(300, 1), tokens(40, 2), tokens(128, 3)
    assert check(model, cold, [p300]) == [0]
    assert check(model, cold, [p300]) == [256]  # full repeat
    assert check(model, cold, [p40]) == [0]
    assert check(model, cold, [p40]) == [0]  # shorter than a block: nothing aligned to reuse
    assert check(model, cold, [p128]) == [0]
    assert check(model, cold, [p128]) == [64]  # exact multiple: the last token is recomputed
    stats = model.prefix_cache.stats()
    assert stats["lookups"] == 6 and stats["hit_tokens"] == 320
    assert stats["prompt_tokens"] == 2 * (300 + 40 + 128)
    assert stats["checkpoints"] >= 3 and stats["bytes_used"] > 0


def test_partial_prefixes_and_branching_siblings(checkpoint: Path, cold: NeuronQwen36ForCausalLM) -> None:
    model = warm_model(checkpoint)
    base = tokens(150, 4)
    a, b, c = (torch.cat([base, tokens(n, 10 + n)]) for n in (60, 70, 80))
    assert check(model, cold, [a]) == [0]
    assert check(model, cold, [b]) == [0]  # branches inside block 2; stores the branch point 128
    assert check(model, cold, [c]) == [128]  # a later sibling hits it
    assert check(model, cold, [base[:100]]) == [0]  # ends inside block 1
    assert check(model, cold, [torch.cat([base[:100], tokens(5, 6)])]) == [64]


def test_multi_turn_reuses_the_answer(checkpoint: Path, cold: NeuronQwen36ForCausalLM) -> None:
    model = warm_model(checkpoint)
    prompt = tokens(100, 7)
    first = generate(model, [prompt], new=40)
    assert first.cached_tokens.tolist() == [0]
    # Fed: 100 prompt tokens + 39 generated: the row left its tail (its last block's KV and the state after
    # 139 tokens) and the state at 128, staged while decoding.
    turn2 = torch.cat([first.sequences[0], tokens(20, 8)])
    # The returned cache records the row's tokens; its blocks belong to the prefix cache, not to the row.
    assert first.past_key_values.seq_lens[0] == 139
    assert not first.past_key_values.block_tables.any()
    assert check(model, cold, [turn2]) == [139]
    # The tail went to that turn: a retry resumes from the staged state (its prompt-end checkpoint is there).
    assert check(model, cold, [turn2]) == [128]


def test_a_row_that_ends_early_caches_its_answer_not_its_padding(
    checkpoint: Path, cold: NeuronQwen36ForCausalLM
) -> None:
    """Row 0 ends after 35 tokens while row 1 goes on to 100: row 0 keeps decoding padding (its logits are
    returned), which the prefix cache must not keep, so that its next turn hits the state staged at 128 in
    its answer, not one staged later in the padding."""
    model = warm_model(checkpoint)
    ids = torch.stack([tokens(100, 7), tokens(100, 30)])

    class EndRowZero(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            ended = torch.zeros(input_ids.shape[0], dtype=torch.bool)
            ended[0] = input_ids.shape[1] >= 100 + 35
            return ended

    first = model.generate(
        ids, max_new_tokens=100, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
        stopping_criteria=StoppingCriteriaList([EndRowZero()]),
    )  # fmt: skip
    assert first.sequences.shape[1] == 200
    turn2 = torch.cat([first.sequences[0, : 100 + 35], tokens(20, 8)])
    assert check(model, cold, [turn2]) == [128]
    # A one-row call returns a cache whose other rows are empty, whatever earlier calls left there.
    assert generate(model, [tokens(10, 40)], new=2).past_key_values.seq_lens[1:].sum() == 0


def test_mixed_hits_in_one_batch(checkpoint: Path, cold: NeuronQwen36ForCausalLM) -> None:
    model = warm_model(checkpoint)
    shared, short = tokens(200, 9), tokens(130, 10)
    check(model, cold, [shared, short])
    rows = [torch.cat([shared, tokens(30, 11)]), tokens(70, 12), torch.cat([short, tokens(3, 13)])]
    assert check(model, cold, rows) == [192, 0, 128]
    # Rows of one call share with each other too: row 1 hits what row 0 stored just before.
    new = tokens(250, 14)
    assert check(model, cold, [new, torch.cat([new, tokens(10, 15)])]) == [0, 192]


@pytest.mark.slow
def test_constant_eviction_under_a_small_budget(checkpoint: Path, cold: NeuronQwen36ForCausalLM) -> None:
    probe = warm_model(checkpoint)
    check(probe, cold, [tokens(130, 0)])
    ckpt_bytes = probe.prefix_cache.state_spec.nbytes
    kv_bytes = probe.prefix_cache.kv_bytes_per_block
    model = warm_model(checkpoint, prefix_cache_bytes=6 * kv_bytes + 2 * ckpt_bytes)
    stems = [tokens(260, 20 + i) for i in range(3)]
    gen = torch.Generator().manual_seed(0)
    hits = []
    for i, stem in enumerate([0, 0, 1, 1, 2, 2, 0, 0]):  # each stem twice, then back to an evicted one
        cut = int(torch.randint(130, 250, (1,), generator=gen))
        hits += check(model, cold, [torch.cat([stems[stem][:cut], tokens(10, 100 + i)])], new=4)
    assert hits[0] == 0 and hits[1] > 0 and hits[6] == 0 and hits[7] > 0
    stats = model.prefix_cache.stats()
    assert stats["blocks_evicted"] > 0 and stats["checkpoints_evicted"] > 0 and stats["hit_tokens"] > 0


@pytest.mark.parametrize("fault", ["zero_layer", "wrong_position", "missing"])
def test_bad_checkpoint_falls_back_to_a_correct_prefill(
    checkpoint: Path, cold: NeuronQwen36ForCausalLM, fault: str
) -> None:
    model = warm_model(checkpoint)
    prompt = tokens(300, 30)
    check(model, cold, [prompt])
    pc = model.prefix_cache
    (node,) = [n for n in pc._nodes.values() if n.checkpoint is not None]
    if fault == "zero_layer":
        node.checkpoint.recurrent[0].zero_()
    elif fault == "wrong_position":
        node.checkpoint.position = 192
    else:
        pc._drop_checkpoint(node)
    assert check(model, cold, [prompt]) == [0]
    assert pc.stats()["checkpoints_invalid"] == (0 if fault == "missing" else 1)
    assert check(model, cold, [prompt]) == [256]  # a fresh, sound checkpoint replaced it


def test_settings_are_stored_and_checked(checkpoint: Path, tmp_path: Path) -> None:
    model = warm_model(checkpoint, prefix_cache_bytes=12345678)
    assert model.neuron_config.prefix_cache_bytes == 12345678
    assert model.prefix_cache.config.budget_bytes == 12345678
    model.save_pretrained(tmp_path)
    loaded = NeuronQwen36ForCausalLM.from_pretrained(tmp_path)
    assert loaded.neuron_config.prefix_caching and loaded.prefix_cache is not None
    out = generate(model, [tokens(70, 40)], new=2)
    with pytest.raises(ValueError, match="prefix caching"):
        model.generate(out.sequences, max_new_tokens=2, past_key_values=out.past_key_values)
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        warm_model(checkpoint, prefix_cache_bytes=-1)


def test_chunk_size_not_aligned_to_the_kernel_chunk_stays_within_fp32_noise(checkpoint: Path) -> None:
    # Chunks of 100 tokens: the warm run's chunk boundaries differ from the cold run's, so the sums
    # are not bitwise equal any more (measured max |diff| ~3e-5 on logits of magnitude ~3).
    cold_model = export_eager(checkpoint, sequence_length=512, prefill_chunk_size=100)
    model = export_eager(checkpoint, sequence_length=512, prefill_chunk_size=100, prefix_caching=True)
    prompt = tokens(300, 50)
    check(model, cold_model, [prompt])
    assert check(model, cold_model, [prompt]) == [256]


def test_a_generate_call_that_raises_releases_its_blocks(
    checkpoint: Path, cold: NeuronQwen36ForCausalLM
) -> None:
    model = warm_model(checkpoint)
    pool = model.prefix_cache.pool

    class Interrupt(Exception):
        pass

    def interrupt(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > 200 + 2:  # after two decode steps
            assert any(pool.ref_count(b) for b in range(1, pool.num_blocks))  # the rows hold blocks now
            raise Interrupt
        return scores

    ids, mask = left_padded_prompts([200, 150])
    with pytest.raises(Interrupt):
        model.generate(
            ids, attention_mask=mask, max_new_tokens=6, do_sample=False, logits_processor=[interrupt]
        )
    # No block is held by the interrupted rows: what the cache keeps (the prefilled prompts' blocks) is
    # evictable, and the next call is correct.
    assert not any(pool.ref_count(b) for b in range(1, pool.num_blocks))
    prompts = [ids[0], ids[1, 50:]]
    assert check(model, cold, prompts) == [192, 128]
    model.prefix_cache.clear()
    assert pool.num_free == pool.num_blocks - 1
