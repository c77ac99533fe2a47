"""Token-for-token parity with transformers' Qwen3.5 implementation (fp32, strong GDN decays)."""

from __future__ import annotations

import pytest
import torch
from helpers import export_eager, left_padded_prompts

NEW_TOKENS = 40

# (layout, config overrides): head ratios, layer patterns, tied/untied, K != V, both checkpoint layouts.
CONFIGS = {
    "causal-3to1-untied": ("causal", {}),
    "conditional-tied-ratio3": (
        "conditional",
        dict(
            tie_word_embeddings=True,
            linear_num_key_heads=1,
            linear_num_value_heads=3,
            num_hidden_layers=5,
            layer_types=[
                "full_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
                "linear_attention",
            ],
        ),
    ),
    "causal-kv-ne-gqa4": (
        "causal",
        dict(
            linear_key_head_dim=16,
            linear_value_head_dim=32,
            num_attention_heads=4,
            num_key_value_heads=1,
            num_hidden_layers=6,
            layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        ),
    ),
}


def reference_generate(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor, **kwargs):
    return model.generate(
        input_ids, attention_mask=mask, do_sample=False, return_dict_in_generate=True, output_logits=True,
        pad_token_id=0, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_parity_left_padded_batch(tiny_checkpoint, name: str) -> None:
    layout, overrides = CONFIGS[name]
    path, reference = tiny_checkpoint(layout, seed=len(name), **overrides)
    model = export_eager(path)  # prefill chunk of 16 tokens
    # Shorter than, equal to and longer than (several chunks of) the prefill chunk, in one batch.
    input_ids, mask = left_padded_prompts([5, 16, 37], seed=1)
    ours = model.generate(
        input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
        return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    theirs = reference_generate(reference, input_ids, mask, max_new_tokens=NEW_TOKENS)
    assert ours.sequences.shape == (3, 37 + NEW_TOKENS)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert len(ours.logits) == NEW_TOKENS
    for step, (a, b) in enumerate(zip(ours.logits, theirs.logits, strict=True)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")


@pytest.mark.parametrize("length", [1, 64, 100])
def test_single_prompt_lengths_around_chunks(tiny_checkpoint, length: int) -> None:
    path, reference = tiny_checkpoint("causal", seed=3)
    model = export_eager(path, batch_size=1)
    input_ids, mask = left_padded_prompts([length], seed=length)
    ours = model.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    theirs = reference_generate(reference, input_ids, mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(ours, theirs.sequences)


def test_cache_contents_match_transformers(tiny_checkpoint) -> None:
    """The hybrid cache holds exactly what transformers' cache holds: K/V per attention layer, conv and
    recurrent state per GDN layer, for each row's real (unpadded) tokens."""
    path, reference = tiny_checkpoint("causal", seed=4)
    model = export_eager(path)
    lengths = [9, 30, 21]
    input_ids, mask = left_padded_prompts(lengths, seed=5)
    ours = model.generate(input_ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                          return_dict_in_generate=True)  # fmt: skip
    theirs = reference_generate(reference, input_ids, mask, max_new_tokens=6)
    cache, ref_cache = ours.past_key_values, theirs.past_key_values
    width = input_ids.shape[1]
    processed = width + 6 - 1  # the last sampled token is not fed back
    for layer_idx, layer_type in enumerate(reference.config.layer_types):
        ref_layer = ref_cache.layers[layer_idx]
        for row, length in enumerate(lengths):
            real = length + 6 - 1
            assert int(cache.seq_lens[row]) == real
            if layer_type == "full_attention":
                keys, values = cache[layer_idx]
                torch.testing.assert_close(
                    keys[row, :, :real], ref_layer.keys[row, :, processed - real :], atol=1e-4, rtol=1e-4
                )
                torch.testing.assert_close(
                    values[row, :, :real], ref_layer.values[row, :, processed - real :], atol=1e-4, rtol=1e-4
                )
            else:
                conv, recurrent = cache[layer_idx]
                # transformers keeps the last `kernel` inputs; the oldest one is never used again.
                torch.testing.assert_close(
                    conv[row], ref_layer.conv_states[0][row, :, 1:], atol=1e-4, rtol=1e-4
                )
                torch.testing.assert_close(
                    recurrent[row], ref_layer.recurrent_states[0][row], atol=1e-4, rtol=1e-4
                )
