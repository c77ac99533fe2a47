"""generate(): cache continuation, sampling, EOS/padding, processors, streamers and the errors it raises."""

from __future__ import annotations

import pytest
import torch
from helpers import CountingBackend, export_eager, left_padded_prompts
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from optimum_qwen36 import Qwen36HybridCache


@pytest.fixture
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("causal", seed=7)


def test_continuing_from_returned_cache_equals_one_shot(checkpoint) -> None:
    path, _ = checkpoint
    model = export_eager(path)
    input_ids, mask = left_padded_prompts([6, 20, 13], seed=2)
    one_shot = model.generate(input_ids, attention_mask=mask, max_new_tokens=30, do_sample=False)

    counting = CountingBackend(model.backend)
    model.backend = counting
    first = model.generate(
        input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False, return_dict_in_generate=True
    )
    assert isinstance(first.past_key_values, Qwen36HybridCache)
    assert counting.prefill_tokens == 6 + 20 + 13
    counting.prefill_tokens = 0
    extended_mask = torch.cat([mask, torch.ones((3, 12), dtype=torch.long)], dim=1)
    second = model.generate(
        first.sequences, attention_mask=extended_mask, past_key_values=first.past_key_values,
        max_new_tokens=18, do_sample=False,
    )  # fmt: skip
    # Only the last generated token of each row was not in the cache yet: nothing else is recomputed.
    assert counting.prefill_tokens == 3
    assert torch.equal(second, one_shot)


def test_multi_turn_continuation_processes_only_the_new_message(checkpoint) -> None:
    path, _ = checkpoint
    model = export_eager(path, batch_size=1)
    prompt, _ = left_padded_prompts([10], seed=3)
    first = model.generate(prompt, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    follow_up, _ = left_padded_prompts([7], seed=4)
    turn_two = torch.cat([first.sequences, follow_up], dim=1)
    counting = CountingBackend(model.backend)
    model.backend = counting
    warm = model.generate(turn_two, cache=first.past_key_values, max_new_tokens=8, do_sample=False)
    assert counting.prefill_tokens == 1 + 7
    model.backend = counting.backend
    cold = model.generate(turn_two, max_new_tokens=8, do_sample=False)
    assert torch.equal(warm, cold)


def test_continuation_must_extend_the_cached_sequence(checkpoint) -> None:
    path, _ = checkpoint
    model = export_eager(path, batch_size=1)
    prompt, _ = left_padded_prompts([10], seed=3)
    first = model.generate(prompt, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    other, _ = left_padded_prompts([20], seed=9)
    with pytest.raises(ValueError, match="does not extend the sequence held in past_key_values"):
        model.generate(other, past_key_values=first.past_key_values, max_new_tokens=2)
    with pytest.raises(ValueError, match="at least one new token"):
        model.generate(first.sequences[:, :-1], past_key_values=first.past_key_values, max_new_tokens=2)


def test_sampling_is_reproducible_from_a_seed(checkpoint) -> None:
    path, _ = checkpoint
    model = export_eager(path)
    input_ids, mask = left_padded_prompts([4, 9, 7], seed=5)
    settings = dict(
        attention_mask=mask, max_new_tokens=20, do_sample=True, temperature=1.3, top_k=50, top_p=0.95
    )
    torch.manual_seed(123)
    a = model.generate(input_ids, **settings)
    torch.manual_seed(123)
    b = model.generate(input_ids, **settings)
    torch.manual_seed(321)
    c = model.generate(input_ids, **settings)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_eos_then_padding_like_transformers(checkpoint) -> None:
    path, reference = checkpoint
    model = export_eager(path)
    input_ids, mask = left_padded_prompts([8, 3, 15], seed=6)
    greedy = model.generate(input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    # Two EOS ids: tokens that rows actually produce mid-way, so rows stop at different steps.
    width = input_ids.shape[1]
    eos = [int(greedy[0, width + 4]), int(greedy[2, width + 9])]
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=1)
    ours = model.generate(input_ids, **kwargs)
    theirs = reference.generate(input_ids, **kwargs)
    assert torch.equal(ours, theirs)
    assert (ours[0, width + 5 :] == 1).all()


def test_scores_with_processors_match_transformers(checkpoint) -> None:
    path, reference = checkpoint
    model = export_eager(path)
    input_ids, mask = left_padded_prompts([8, 11, 5], seed=8)
    kwargs = dict(
        attention_mask=mask, max_new_tokens=10, do_sample=False, repetition_penalty=1.5,
        no_repeat_ngram_size=2, return_dict_in_generate=True, output_scores=True, pad_token_id=0,
    )  # fmt: skip
    ours = model.generate(input_ids, **kwargs)
    theirs = reference.generate(input_ids, **kwargs)
    assert torch.equal(ours.sequences, theirs.sequences)
    for a, b in zip(ours.scores, theirs.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_generation_config_max_length_and_custom_stopping(checkpoint) -> None:
    path, _ = checkpoint
    model = export_eager(path, batch_size=1)
    prompt, _ = left_padded_prompts([6], seed=1)
    out = model.generate(prompt, generation_config=GenerationConfig(max_length=10, do_sample=False))
    assert out.shape == (1, 10)

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 9, dtype=torch.bool)

    out = model.generate(
        prompt, max_new_tokens=20, do_sample=False, stopping_criteria=StoppingCriteriaList([StopAfter()])
    )
    assert out.shape == (1, 9)


def test_streamer_receives_prompt_then_each_token(checkpoint) -> None:
    path, _ = checkpoint
    model = export_eager(path, batch_size=1)
    prompt, _ = left_padded_prompts([5], seed=1)

    class Recorder:
        def __init__(self) -> None:
            self.chunks: list[torch.Tensor] = []
            self.ended = False

        def put(self, value: torch.Tensor) -> None:
            self.chunks.append(value)

        def end(self) -> None:
            self.ended = True

    recorder = Recorder()
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, streamer=recorder)
    assert recorder.ended
    assert torch.equal(recorder.chunks[0], prompt)
    assert torch.equal(torch.cat([c.view(-1) for c in recorder.chunks[1:]]), out[0, 5:])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (dict(input_ids=torch.ones((1, 250), dtype=torch.long), max_new_tokens=10), "exceeds the compiled"),
        (dict(input_ids=torch.ones((4, 5), dtype=torch.long), max_new_tokens=2), "batch_size=3"),
        (
            dict(
                input_ids=torch.ones((2, 4), dtype=torch.long),
                attention_mask=torch.tensor([[1, 1, 0, 0]] * 2),
            ),
            "left padding",
        ),
        (
            dict(input_ids=torch.ones((1, 4), dtype=torch.long), num_beams=2),
            "Unsupported generation settings",
        ),
        (
            dict(input_ids=torch.ones((1, 4), dtype=torch.long), pixel_values=torch.ones(1)),
            "does not support",
        ),
        (dict(input_ids=torch.ones((1, 4), dtype=torch.long), max_length=3), "Nothing to generate"),
        (dict(input_ids=torch.ones((1, 4), dtype=torch.long), past_key_values=object()), "Qwen36HybridCache"),
        (dict(max_new_tokens=2), "needs input_ids"),
    ],
)
def test_bad_generate_inputs_raise(checkpoint, call: dict, message: str) -> None:
    path, _ = checkpoint
    model = export_eager(path)
    with pytest.raises(ValueError, match=message):
        model.generate(**call)
