"""generate(): cache continuation, sampling, EOS/padding, processors, streamers and the errors it raises.

The documented options (min_p, min_new_tokens / min_length, stop_strings, a user logits_processor and
stopping_criteria, seeded sampling) are each checked against transformers' own generate() on the same fp32
weights: the same sequences, raw logits and processed scores at every step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import save_tiny_checkpoint
from helpers import CountingBackend, export_eager, left_padded_prompts
from transformers import GenerationConfig, PreTrainedTokenizerBase
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from optimum_qwen36 import NeuronQwen36ForCausalLM, Qwen36HybridCache
from optimum_qwen36.tokenizer import load_qwen36_tokenizer


@pytest.fixture
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("causal", seed=7)


# Tests against transformers share one checkpoint and model: generate() keeps no state between calls.
COMPARE = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)
ATOL = RTOL = 1e-4  # fp32: the parity bound of tests/test_parity.py
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[NeuronQwen36ForCausalLM, torch.nn.Module]:
    """(ours on the eager backend, transformers' fp32 model) on the same weights."""
    path, reference = save_tiny_checkpoint(tmp_path_factory.mktemp("options") / "ckpt", "causal", seed=7)
    return export_eager(path), reference


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_qwen36_tokenizer()


def assert_same_steps(ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...], what: str) -> None:
    """Per-step logits or scores: the same filtered-out (-inf) entries exactly, the rest within ATOL."""
    assert len(ours) == len(theirs), f"{what}: {len(ours)} steps, transformers {len(theirs)}"
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        masked = torch.isinf(a)
        assert torch.equal(masked, torch.isinf(b)), f"{what}, step {step}: other entries filtered out"
        assert torch.equal(a[masked], b[masked]), f"{what}, step {step}: infinities of another sign"
        torch.testing.assert_close(a[~masked], b[~masked], atol=ATOL, rtol=RTOL, msg=f"{what}, step {step}")


def generate_like_transformers(
    pair: tuple[NeuronQwen36ForCausalLM, torch.nn.Module],
    input_ids: torch.Tensor,
    seed: int | None = None,
    **kwargs: Any,
) -> GenerateDecoderOnlyOutput:
    """Run our generate() and transformers' with the same arguments (each from `seed` when sampling) and
    assert the same sequences, raw logits and processed scores; returns ours."""
    outputs = []
    for generator in pair:
        if seed is not None:
            torch.manual_seed(seed)
        outputs.append(generator.generate(input_ids, **COMPARE, **kwargs))
    ours, theirs = outputs
    assert torch.equal(ours.sequences, theirs.sequences), (ours.sequences, theirs.sequences)
    assert_same_steps(ours.logits, theirs.logits, "logits")
    assert_same_steps(ours.scores, theirs.scores, "scores")
    return ours


def greedy_new_tokens(
    model: NeuronQwen36ForCausalLM, input_ids: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[:, input_ids.shape[1] :]


def test_continuing_from_returned_cache_equals_one_shot(checkpoint) -> None:
    path, _ = checkpoint
    model = export_eager(path)
    input_ids, mask = left_padded_prompts([6, 20, 13], seed=2)
    one_shot = model.generate(input_ids, attention_mask=mask, max_new_tokens=30, do_sample=False)

    counting = CountingBackend(model.backend)
    model.generation_engine().runner.backend = counting
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


def test_continuing_rows_that_cross_a_kv_block_boundary_equals_one_shot(checkpoint) -> None:
    """Row 0 filled its first KV block, so its next token needs a new one at once, while the other rows'
    blocks are still theirs (each continuation takes its row's blocks before any row computes); row 1
    crosses a boundary later."""
    path, _ = checkpoint
    model = export_eager(path)
    input_ids, mask = left_padded_prompts([61, 30, 45], seed=5)
    one_shot = model.generate(input_ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    first = model.generate(
        input_ids, attention_mask=mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True
    )
    assert first.past_key_values.seq_lens[:3].tolist() == [64, 33, 48]
    extended_mask = torch.cat([mask, torch.ones((3, 4), dtype=torch.long)], dim=1)
    second = model.generate(
        first.sequences, attention_mask=extended_mask, past_key_values=first.past_key_values,
        max_new_tokens=36, do_sample=False,
    )  # fmt: skip
    assert torch.equal(second, one_shot)


def test_a_continuation_that_raises_leaves_its_cache_as_it_was(
    checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A continuation interrupted before any step or after a few steps leaves the cache passed back as it
    was (its rows are the caller's copy, which only a completed call updates): a retry with the same cache
    computes only the new tokens and gives the one-shot tokens. The engine is usable after both."""
    path, _ = checkpoint
    model = export_eager(path)
    input_ids, mask = left_padded_prompts([20, 9], seed=6)
    one_shot = model.generate(input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    first = model.generate(
        input_ids, attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True
    )
    cache = first.past_key_values
    recorded = (cache.seq_lens.clone(), cache.token_ids.clone(), cache.recurrent_state.clone())
    extended_mask = torch.cat([mask, torch.ones((2, 5), dtype=torch.long)], dim=1)

    class Interrupt(Exception):
        pass

    def interrupt(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > first.sequences.shape[1] + 2:
            raise Interrupt
        return scores

    def interrupt_at_once(*args: Any) -> None:
        raise Interrupt

    continuation = dict(
        attention_mask=extended_mask, past_key_values=cache, max_new_tokens=15, do_sample=False
    )
    with monkeypatch.context() as patch:
        patch.setattr("optimum_qwen36.engine.Engine.step", interrupt_at_once)
        with pytest.raises(Interrupt):
            model.generate(first.sequences, **continuation)
    with pytest.raises(Interrupt):
        model.generate(first.sequences, logits_processor=[interrupt], **continuation)
    assert cache.seq_lens[:2].tolist() == [24, 13]
    now = (cache.seq_lens, cache.token_ids, cache.recurrent_state)
    assert all(torch.equal(a, b) for a, b in zip(recorded, now, strict=True))
    counting = CountingBackend(model.backend)
    model.generation_engine().runner.backend = counting
    assert torch.equal(model.generate(first.sequences, **continuation), one_shot)
    assert counting.prefill_tokens == 2  # each row's last generated token


def test_generate_runs_in_one_engine_and_a_returned_cache_is_the_callers(
    checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every generate() call runs in the model's one engine (no engine is built after the first call),
    whose rows start from zero GDN states; a cache handed to the caller is its own copy, which later calls
    never change: continuing it after other calls gives the one-shot tokens."""
    path, _ = checkpoint
    model = export_eager(path)
    long_ids, long_mask = left_padded_prompts([20, 13, 17], seed=3)
    input_ids, mask = left_padded_prompts([6, 9, 4], seed=4)
    fresh = model.generate(input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    one_shot = model.generate(input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    built = []
    monkeypatch.setattr("optimum_qwen36.engine.Engine.__init__", lambda *args, **kwargs: built.append(args))
    returned = model.generate(
        input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False, return_dict_in_generate=True
    )
    model.generate(long_ids, attention_mask=long_mask, max_new_tokens=8, do_sample=False)
    again = model.generate(input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(again, fresh) and torch.equal(returned.sequences, fresh)
    extended_mask = torch.cat([mask, torch.ones((3, 8), dtype=torch.long)], dim=1)
    continued = model.generate(
        returned.sequences, attention_mask=extended_mask, past_key_values=returned.past_key_values,
        max_new_tokens=12, do_sample=False,
    )  # fmt: skip
    assert torch.equal(continued, one_shot)
    assert built == []


def test_multi_turn_continuation_processes_only_the_new_message(checkpoint) -> None:
    path, _ = checkpoint
    model = export_eager(path, batch_size=1)
    prompt, _ = left_padded_prompts([10], seed=3)
    first = model.generate(prompt, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    follow_up, _ = left_padded_prompts([7], seed=4)
    turn_two = torch.cat([first.sequences, follow_up], dim=1)
    counting = CountingBackend(model.backend)
    model.generation_engine().runner.backend = counting
    warm = model.generate(turn_two, cache=first.past_key_values, max_new_tokens=8, do_sample=False)
    assert counting.prefill_tokens == 1 + 7
    model.generation_engine().runner.backend = counting.backend
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


def test_eos_then_padding_like_transformers(pair) -> None:
    input_ids, mask = left_padded_prompts([8, 3, 15], seed=6)
    greedy = greedy_new_tokens(pair[0], input_ids, mask)
    # Two EOS ids: tokens that rows actually produce mid-way, so rows stop at different steps.
    eos = [int(greedy[0, 4]), int(greedy[2, 9])]
    ours = generate_like_transformers(
        pair, input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos,
        pad_token_id=1,
    )  # fmt: skip
    assert (ours.sequences[0, input_ids.shape[1] + 5 :] == 1).all()


def test_scores_with_processors_match_transformers(pair) -> None:
    input_ids, mask = left_padded_prompts([8, 11, 5], seed=8)
    generate_like_transformers(
        pair, input_ids, attention_mask=mask, max_new_tokens=10, do_sample=False, repetition_penalty=1.5,
        no_repeat_ngram_size=2, pad_token_id=0,
    )  # fmt: skip


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
            "NeuronQwen36ForConditionalGeneration",
        ),
        (dict(input_ids=torch.ones((1, 4), dtype=torch.long), max_length=3), "Nothing to generate"),
        (
            dict(input_ids=torch.ones((1, 4), dtype=torch.long), renormalize_logits=True),
            "Unsupported generation settings",
        ),
        (dict(input_ids=torch.ones((1, 4), dtype=torch.long), past_key_values=object()), "Qwen36HybridCache"),
        (dict(max_new_tokens=2), "needs input_ids"),
    ],
)
def test_bad_generate_inputs_raise(checkpoint, call: dict, message: str) -> None:
    path, _ = checkpoint
    model = export_eager(path)
    with pytest.raises(ValueError, match=message):
        model.generate(**call)


# ------------------------------------------------------------------ documented options vs transformers
def test_min_p_filters_like_transformers(pair) -> None:
    input_ids, mask = left_padded_prompts([5, 12, 9], seed=11)
    settings = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.7, top_k=0)
    ours = generate_like_transformers(pair, input_ids, seed=5, min_p=0.2, **settings)
    # The option acted: every row at every step lost tokens to min_p, and nothing is filtered without it.
    assert all(torch.isinf(s).any(dim=-1).all() for s in ours.scores)
    torch.manual_seed(5)
    plain = pair[0].generate(input_ids, **COMPARE, **settings)
    assert not any(torch.isinf(s).any() for s in plain.scores)


@pytest.mark.parametrize("option", ["min_new_tokens", "min_length"])
def test_min_new_tokens_holds_back_eos_like_transformers(pair, option: str) -> None:
    input_ids, mask = left_padded_prompts([8, 3, 15], seed=6)
    width = input_ids.shape[1]
    # An EOS that row 0 emits as its 2nd new token: without the option it would stop there.
    eos = int(greedy_new_tokens(pair[0], input_ids, mask)[0, 1])
    minimum = 6
    value = minimum if option == "min_new_tokens" else width + minimum  # min_length counts the prompt
    ours = generate_like_transformers(
        pair, input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
        eos_token_id=eos, pad_token_id=0, **{option: value},
    )  # fmt: skip
    assert all(torch.isneginf(s[:, eos]).all() for s in ours.scores[:minimum])
    assert not any(torch.isinf(s).any() for s in ours.scores[minimum:])
    assert int(ours.sequences[0, width + 1]) != eos  # row 0 went on instead of stopping


def ascii_stop_string(
    tokenizer: PreTrainedTokenizerBase, new_tokens: torch.Tensor, start: int
) -> tuple[int, str]:
    """(step, text): the first two consecutive new tokens from `start` on that decode to printable ASCII
    not seen earlier in the row, so the stop string spans a token boundary and first completes at `step`."""
    for step in range(start + 1, len(new_tokens)):
        text = tokenizer.decode(new_tokens[step - 1 : step + 1])
        if text.isascii() and text.isprintable() and text not in tokenizer.decode(new_tokens[: step - 1]):
            return step, text
    raise AssertionError(f"no ASCII token pair in {new_tokens.tolist()}")


def test_stop_strings_end_rows_like_transformers(pair, tokenizer: PreTrainedTokenizerBase) -> None:
    input_ids, mask = left_padded_prompts([8, 3, 15], seed=6)
    width = input_ids.shape[1]
    greedy = greedy_new_tokens(pair[0], input_ids, mask)
    # Rows 0 and 1 end on their own two-token stop string, at different steps; row 2 runs to the end.
    # The EOS is an id no row produces: only the stop strings end rows, and ended rows are padded.
    stops = [ascii_stop_string(tokenizer, greedy[0], 1), ascii_stop_string(tokenizer, greedy[1], 5)]
    eos = next(t for t in range(1, 512) if t not in greedy)
    ours = generate_like_transformers(
        pair, input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
        stop_strings=[text for _, text in stops], tokenizer=tokenizer, eos_token_id=eos, pad_token_id=0,
    )  # fmt: skip
    new = ours.sequences[:, width:]
    assert new.shape[1] == NEW_TOKENS
    for row, (step, _) in enumerate(stops):
        assert torch.equal(new[row, : step + 1], greedy[row, : step + 1])
        assert (new[row, step + 1 :] == 0).all()
    assert torch.equal(new[2], greedy[2])


class EndRowZeroAfter(StoppingCriteria):
    """Ends row 0 once it holds `width` tokens; no `eos_token_id` attribute, unlike EosTokenCriteria."""

    def __init__(self, width: int) -> None:
        self.width = width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        done[0] = input_ids.shape[1] >= self.width
        return done


def test_rows_ended_without_an_eos_criterion_keep_their_tokens_like_transformers(pair) -> None:
    input_ids, mask = left_padded_prompts([8, 3, 15], seed=6)
    width = input_ids.shape[1]
    # A stop string or a user criterion ends row 0 early; with no EOS transformers pads nothing.
    ours = generate_like_transformers(
        pair, input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
        stopping_criteria=StoppingCriteriaList([EndRowZeroAfter(width + 3)]),
    )  # fmt: skip
    assert torch.equal(ours.sequences[:, width:], greedy_new_tokens(pair[0], input_ids, mask))


class BoostNextId(LogitsProcessor):
    """+3 to the id after each row's last token: depends on input_ids (padding, prompt and new tokens)."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        boosted = scores.clone()
        boosted[torch.arange(scores.shape[0]), (input_ids[:, -1] + 1) % scores.shape[1]] += 3.0
        return boosted


def test_user_logits_processor_runs_where_transformers_runs_it(pair) -> None:
    input_ids, mask = left_padded_prompts([5, 12, 9], seed=12)
    settings = dict(
        attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.5, top_k=20,
        repetition_penalty=1.3,
    )  # fmt: skip
    # transformers applies it after the repetition penalty and before the warpers: the boost is scaled by
    # the temperature and can move tokens into the top-k, so any other place gives other scores.
    ours = generate_like_transformers(
        pair, input_ids, seed=9, logits_processor=LogitsProcessorList([BoostNextId()]), **settings
    )
    torch.manual_seed(9)
    plain = pair[0].generate(input_ids, **COMPARE, **settings)
    assert not torch.equal(ours.sequences, plain.sequences)


def test_user_processor_of_a_built_in_type_replaces_it_like_transformers(pair) -> None:
    input_ids, mask = left_padded_prompts([5, 12, 9], seed=12)
    settings = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, repetition_penalty=1.3)
    # transformers uses the user's penalty in place of repetition_penalty's, not both.
    user = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty=4.0)])
    ours = generate_like_transformers(pair, input_ids, logits_processor=user, **settings)
    plain = pair[0].generate(input_ids, **COMPARE, **settings)
    assert any(not torch.allclose(a, b) for a, b in zip(ours.scores, plain.scores, strict=True))


def test_user_stopping_criterion_of_a_built_in_type_replaces_it_like_transformers(pair) -> None:
    input_ids, mask = left_padded_prompts([8, 3, 15], seed=6)
    greedy = greedy_new_tokens(pair[0], input_ids, mask)
    config_eos, user_eos = int(greedy[0, 2]), int(greedy[1, 5])
    # The user's EosTokenCriteria replaces eos_token_id's criterion: row 0 does not stop at config_eos (it
    # still pads ended rows with it, pad_token_id defaulting to eos_token_id).
    ours = generate_like_transformers(
        pair, input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
        eos_token_id=config_eos, stopping_criteria=StoppingCriteriaList([EosTokenCriteria(user_eos)]),
    )  # fmt: skip
    new = ours.sequences[:, input_ids.shape[1] :]
    assert torch.equal(new[0, :4], greedy[0, :4])
    assert (new[1, 6:] == config_eos).all()


@pytest.mark.parametrize(
    ("lengths", "settings"),
    [
        ([4, 9, 7], dict(temperature=1.3, top_k=50, top_p=0.95)),
        ([10, 3], dict(temperature=0.6, top_k=0, top_p=0.8)),  # fewer rows than the exported batch
        ([6], dict(top_k=0)),  # plain softmax sampling
    ],
)
def test_seeded_sampling_gives_transformers_tokens(pair, lengths: list[int], settings: dict) -> None:
    input_ids, mask = left_padded_prompts(lengths, seed=5)
    width = input_ids.shape[1]
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=True, **settings)
    # One torch.multinomial over the whole batch per step, like transformers (select_next_tokens): the
    # same seed draws the same tokens.
    first = generate_like_transformers(pair, input_ids, seed=123, **kwargs)
    # An EOS row 0 sampled: it ends there and is padded, while every step still draws for all rows.
    eos = int(first.sequences[0, width + 3])
    ended = generate_like_transformers(pair, input_ids, seed=123, eos_token_id=eos, pad_token_id=0, **kwargs)
    stop = int((ended.sequences[0, width:] == eos).nonzero()[0])
    assert (ended.sequences[0, width + stop + 1 :] == 0).all()
    torch.manual_seed(124)
    assert not torch.equal(pair[0].generate(input_ids, **kwargs), first.sequences)
