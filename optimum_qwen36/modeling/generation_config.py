"""transformers-compatible generation settings: validation, logits processors and stopping criteria.

Only public transformers classes are used, so `generate()` behaves like transformers' for the options it
accepts, and every other option is refused with a clear error instead of being silently ignored.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

_REPETITION_IGNORES_PADDING = (
    "prompt_ignore_length" in inspect.signature(RepetitionPenaltyLogitsProcessor.__init__).parameters
)


def _global_defaults() -> dict[str, Any]:
    """transformers' defaults for unset settings (recent versions leave them None in GenerationConfig())."""
    getter = getattr(GenerationConfig, "_get_default_generation_params", None)
    return dict(getter()) if getter is not None else GenerationConfig().to_dict()


GENERATION_DEFAULTS = _global_defaults()

# generate() keyword arguments that are inputs rather than generation settings.
# The processor's image outputs (Qwen3_5ForConditionalGeneration's generate() inputs) among them.
IMAGE_INPUT_KWARGS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
INPUT_KWARGS = (
    "input_ids",
    "attention_mask",
    "past_key_values",
    "cache",
    "tokenizer",
    "use_cache",
    *IMAGE_INPUT_KWARGS,
)

# Settings with no implementation here; a non-default value is refused rather than ignored.
UNSUPPORTED_SETTINGS = (
    "num_beams",
    "num_beam_groups",
    "num_return_sequences",
    "penalty_alpha",
    "diversity_penalty",
    "length_penalty",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "encoder_repetition_penalty",
    "bad_words_ids",
    "force_words_ids",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "sequence_bias",
    "guidance_scale",
    "watermarking_config",
    "prompt_lookup_num_tokens",
    "dola_layers",
    "output_attentions",
    "output_hidden_states",
    "top_h",
    "max_time",
    "remove_invalid_values",
    "renormalize_logits",
)


def prepare_generation_config(
    base: GenerationConfig, generation_config: GenerationConfig | None, kwargs: dict[str, Any]
) -> tuple[GenerationConfig, dict[str, Any]]:
    """Merge like transformers (kwargs > generation_config > the model's); returns (config, input kwargs)."""
    config = copy.deepcopy(generation_config if generation_config is not None else base)
    leftover = config.update(**kwargs)
    # Unset (None) fields come from the model's generation config, then from transformers' global defaults.
    for source in (base.to_dict(), GENERATION_DEFAULTS):
        for name, value in source.items():
            if getattr(config, name, None) is None and value is not None:
                setattr(config, name, value)
    unknown = sorted(set(leftover) - set(INPUT_KWARGS))
    if unknown:
        raise ValueError(
            f"generate() got arguments it does not support: {unknown}. This model generates text from "
            f"input_ids; the accepted inputs are {list(INPUT_KWARGS)} plus GenerationConfig fields."
        )
    refused = [
        name
        for name in UNSUPPORTED_SETTINGS
        if getattr(config, name, None) not in (None, False, GENERATION_DEFAULTS.get(name))
    ]
    if refused:
        raise ValueError(
            f"Unsupported generation settings: { {n: getattr(config, n) for n in refused} }. "
            "Supported: greedy and multinomial sampling (do_sample, temperature, top_k, top_p, min_p), "
            "repetition_penalty, no_repeat_ngram_size, min_length, min_new_tokens, "
            "max_new_tokens/max_length, eos_token_id, pad_token_id, stop_strings, stopping_criteria, "
            "logits_processor, streamer."
        )
    return config, {k: leftover[k] for k in leftover if k in INPUT_KWARGS}


def eos_token_ids(config: GenerationConfig) -> list[int]:
    eos = config.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])]


def _merge_user_list(
    defaults: LogitsProcessorList | StoppingCriteriaList,
    user: LogitsProcessorList | StoppingCriteriaList | None,
) -> LogitsProcessorList | StoppingCriteriaList:
    """transformers' merge (`GenerationMixin._merge_criteria_processor_list`): a user entry of the same
    type as a built-in one replaces it at the built-in's position (it is not applied twice); the others
    follow."""
    if not user:
        return defaults
    merged = type(defaults)()
    for default in defaults:
        merged.append(next((custom for custom in user if type(custom) is type(default)), default))
    merged.extend(custom for custom in user if custom not in merged)
    return merged


def build_logits_processors(
    config: GenerationConfig,
    prompt_width: int,
    padding_lengths: torch.Tensor,
    user: LogitsProcessorList | None,
) -> LogitsProcessorList:
    """The processors transformers would build for these settings, in its order, merged with the user's
    before the sampling warpers (as transformers does: the warpers are not merged, they always follow)."""
    processors = LogitsProcessorList()
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        # Recent transformers do not penalise a row's left padding; older ones have no such option.
        ignore = {"prompt_ignore_length": padding_lengths} if _REPETITION_IGNORES_PADDING else {}
        processors.append(RepetitionPenaltyLogitsProcessor(penalty=config.repetition_penalty, **ignore))
    if config.no_repeat_ngram_size:
        processors.append(NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    eos = eos_token_ids(config)
    if config.min_length and eos:
        # min_length counts the (padded) prompt, like max_length.
        processors.append(MinLengthLogitsProcessor(config.min_length, eos))
    if config.min_new_tokens and eos:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_width, config.min_new_tokens, eos))
    processors = _merge_user_list(processors, user)
    if config.do_sample:
        if config.temperature is not None and config.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k is not None and config.top_k != 0:
            processors.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
        if config.top_p is not None and config.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
        if config.min_p is not None:
            processors.append(MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
    return processors


def build_stopping_criteria(
    config: GenerationConfig, max_length: int, user: StoppingCriteriaList | None, tokenizer: Any = None
) -> StoppingCriteriaList:
    """transformers' criteria for these settings, merged with the user's the same way.

    A user `MaxLengthCriteria` replaces the built-in one, but generate() never runs past max_new_tokens
    (the cache is sized for it)."""
    criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=max_length)])
    if config.stop_strings is not None:
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: pass generate(..., tokenizer=tokenizer).")
        criteria.append(StopStringCriteria(stop_strings=config.stop_strings, tokenizer=tokenizer))
    eos = eos_token_ids(config)
    if eos:
        criteria.append(EosTokenCriteria(eos_token_id=torch.tensor(eos)))
    return _merge_user_list(criteria, user)


def pads_finished_rows(criteria: StoppingCriteriaList) -> bool:
    """transformers writes pad_token_id after a finished row only when an EOS criterion is present; a row
    that stopped on a stop string or a user criterion alone keeps its sampled tokens."""
    return any(hasattr(c, "eos_token_id") for c in criteria)


def max_new_tokens_of(config: GenerationConfig, prompt_width: int) -> int:
    """transformers' rule: max_new_tokens wins; else max_length counts the (padded) prompt too."""
    new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt_width
    if new < 1:
        raise ValueError(
            f"Nothing to generate: max_length={config.max_length} is not larger than the prompt width "
            f"{prompt_width}. Set max_new_tokens instead."
        )
    return new


def select_next_tokens(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """argmax, or transformers' `_sample` draw: one `torch.multinomial` over the [rows, vocab] softmaxed
    scores. On CPU it takes argmax(p / e) with e ~ Exp(1) drawn for every row and token in order from the
    global generator, so a `torch.manual_seed` gives transformers' tokens (tests/test_generate.py checks it)
    as long as the draw covers exactly the caller's rows (finished ones too) and the real vocabulary:
    sampling the static batch's dummy rows, skipping finished rows, a padded vocabulary or another sampler
    (Gumbel noise, a private torch.Generator) would consume the stream differently. It runs on CPU (the
    backends return CPU logits): transformers on a GPU draws from the CUDA generator, another stream."""
    if do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    return scores.argmax(dim=-1)
