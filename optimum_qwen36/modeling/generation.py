"""`generate()`: transformers' generation API as a client of the model's engine.

Each row of the batch is one engine request whose tokens a `BatchGeneration` picks (the engine's
`TokenChooser` hook): once every row has the logits of its next token, transformers' logits processors,
sampling, stopping criteria and streamer run over the whole batch, as in transformers' own loop, so the
same settings and seed give transformers' tokens. A row that ended goes on with pad tokens (their logits
are still returned), which the prefix cache never keeps.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..distributed.replicated import Replicas, on_every_rank, tensor_digest
from ..engine import ChosenToken, Engine, EngineRequest, SamplingParams
from ..network.vision import ImageInput, split_images
from .cache import Qwen36HybridCache
from .generation_config import (
    build_logits_processors,
    build_stopping_criteria,
    max_new_tokens_of,
    pads_finished_rows,
    prepare_generation_config,
    select_next_tokens,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from ..backends.base import ImageEncoder
    from ..network.neuron_config import Qwen36NeuronConfig
    from ..prefix_caching import PrefixCache

# The output field holding the cache: `cache` in recent transformers (which still reads `past_key_values`).
OUTPUT_CACHE_FIELD = (
    "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
)


def generated_digest(output: torch.Tensor | GenerateDecoderOnlyOutput) -> str:
    """The tokens a generate() call produced: every rank must produce the same."""
    return tensor_digest(output if isinstance(output, torch.Tensor) else output.sequences)


class BatchGeneration:
    """The token chooser of one generate() call's rows (by request id, in row order): transformers'
    generation loop, one step each time every row has the logits of its next token."""

    def __init__(
        self,
        request_ids: list[str],
        input_ids: torch.Tensor,
        config: GenerationConfig,
        processors: LogitsProcessorList,
        criteria: StoppingCriteriaList,
        max_new_tokens: int,
        pad_token_id: int | None,
        streamer: Any,
    ) -> None:
        self.request_ids = request_ids
        self.sequences = input_ids
        self.config = config
        self.processors = processors
        self.criteria = criteria
        self.max_new_tokens = max_new_tokens
        # Like transformers: ended rows get pad_token_id only when an EOS criterion is present.
        self.pad_token_id = (
            pad_token_id if pad_token_id is not None and pads_finished_rows(criteria) else None
        )
        self.streamer = streamer
        self.unfinished = torch.ones(len(request_ids), dtype=torch.bool)
        self.raw_logits: list[torch.Tensor] = []
        self.scores: list[torch.Tensor] = []
        self.steps = 0  # tokens generated per row
        self.done = False
        self._waiting: dict[str, torch.Tensor] = {}  # this step's logits, by row, until every row has them
        self._offered: set[str] = set()

    def offered(self, request_id: str) -> bool:
        """Whether the row has had the logits of a next token (its prompt is computed)."""
        return request_id in self._offered

    def choose(self, logits: Mapping[str, torch.Tensor]) -> dict[str, ChosenToken]:
        self._offered.update(logits)
        self._waiting.update(logits)
        if len(self._waiting) < len(self.request_ids):
            return {}
        step_logits = torch.stack([self._waiting.pop(request_id) for request_id in self.request_ids])
        processed = self.processors(self.sequences, step_logits)
        if self.config.output_logits:
            self.raw_logits.append(step_logits)
        if self.config.output_scores:
            self.scores.append(processed)
        next_tokens = select_next_tokens(processed, self.config.do_sample)
        if self.pad_token_id is not None:
            next_tokens = torch.where(self.unfinished, next_tokens, self.pad_token_id)
        self.sequences = torch.cat([self.sequences, next_tokens[:, None]], dim=1)
        if self.streamer is not None:
            self.streamer.put(next_tokens)
        self.unfinished &= ~self.criteria(self.sequences, processed)
        self.steps += 1
        if not self.unfinished.any() or self.steps == self.max_new_tokens:
            self.done = True
            return {}
        # Ended rows go on with pad_token_id (or their own picks), as in transformers: their logits are
        # still returned. The prefix cache keeps none of what follows their end.
        return {
            request_id: ChosenToken(int(token), filler=not bool(unfinished))
            for request_id, token, unfinished in zip(
                self.request_ids, next_tokens.tolist(), self.unfinished.tolist(), strict=True
            )
        }


class GenerateMixin:
    """`generate()` of the model class: transformers-style generation through the model's engine."""

    config: PretrainedConfig
    neuron_config: Qwen36NeuronConfig
    generation_config: GenerationConfig
    prefix_cache: PrefixCache | None
    _calls: itertools.count[int]
    tensor_parallel: Replicas | None
    generation_engine: Callable[[], Engine]
    image_encoder: ImageEncoder | None
    _empty_cache: Callable[[], Qwen36HybridCache]

    @on_every_rank(digest=generated_digest, local=("streamer",))
    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        logits_processor: LogitsProcessorList | None = None,
        stopping_criteria: StoppingCriteriaList | None = None,
        streamer: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor | GenerateDecoderOnlyOutput:
        """transformers-style generation from left-padded `input_ids` + `attention_mask`.

        Returns the prompts followed by the new tokens (pad_token_id after a row's EOS), or with
        `return_dict_in_generate=True` a `GenerateDecoderOnlyOutput` whose `past_key_values` is a
        `Qwen36HybridCache`: passing it back with the extended sequences continues without recomputing the
        cached prefix (the cache passed is updated in place, as transformers' caches are).

        With tensor parallelism every rank runs the same call on its shard (the arguments are sent to the
        workers; `streamer` stays here)."""
        if self.neuron_config.num_speculative_tokens:
            warnings.warn(
                "generate() decodes one token per step: MTP speculative decoding (num_speculative_tokens="
                f"{self.neuron_config.num_speculative_tokens}) runs in the engine (create_engine(), "
                "optimum-qwen36 serve).",
                stacklevel=3,
            )
        config, inputs_kwargs = prepare_generation_config(self.generation_config, generation_config, kwargs)
        input_ids = inputs if inputs is not None else inputs_kwargs.get("input_ids")
        if input_ids is None:
            raise ValueError("generate() needs input_ids (a [batch, length] tensor of token ids).")
        input_ids = self._token_ids(input_ids)
        rows = self._prompt_rows(input_ids, inputs_kwargs.get("attention_mask"))
        row_images = self._row_images(rows, inputs_kwargs)
        width = input_ids.shape[1]
        max_new_tokens = max_new_tokens_of(config, width)
        # transformers >= 5.x names the cache `cache`; `past_key_values` is the older name of the same input.
        cache = inputs_kwargs.get("cache", inputs_kwargs.get("past_key_values"))
        self._check_cache(cache, rows, max_new_tokens)
        pad_token_id = self._pad_token_id(config)
        padding_lengths = torch.tensor([width - len(r) for r in rows])
        batch = BatchGeneration(
            [f"generate-{next(self._calls)}-row-{row}" for row in range(len(rows))],
            input_ids,
            config,
            build_logits_processors(config, width, padding_lengths, logits_processor),
            build_stopping_criteria(
                config, width + max_new_tokens, stopping_criteria, inputs_kwargs.get("tokenizer")
            ),
            max_new_tokens,
            pad_token_id,
            streamer,
        )
        if streamer is not None:
            streamer.put(input_ids)
        engine = self.generation_engine()
        params = SamplingParams(max_tokens=max_new_tokens)
        try:
            for row, (request_id, tokens) in enumerate(zip(batch.request_ids, rows, strict=True)):
                computed = cache.computed_sequence(row) if cache is not None else None
                request = EngineRequest(
                    tokens.tolist(),
                    params,
                    request_id,
                    chooser=batch,
                    computed=computed,
                    images=row_images[row],
                )
                engine.add_request(request)
                if self.prefix_cache is not None:
                    # Each row looks up the prefix cache once the rows before it are computed: it also hits
                    # what they stored.
                    run_until(engine, lambda request_id=request_id: batch.offered(request_id))
            run_until(engine, lambda: batch.done)
            if config.return_dict_in_generate:
                if cache is None:
                    cache = self._empty_cache()
                    if self.tensor_parallel is not None:  # a later call on the driver names it
                        self.tensor_parallel.register(cache)
                for row, request_id in enumerate(batch.request_ids):
                    tokens = engine.request(request_id).token_ids
                    cache.record_row(row, tokens, engine.computed_sequence(request_id))
                cache.seq_lens[len(rows) :] = 0  # rows beyond this call's batch are dropped
            cached_tokens = [engine.request(rid).cached_prompt_tokens for rid in batch.request_ids]
        finally:
            failed = not batch.done
            for request_id in batch.request_ids:
                # Its blocks go back to the pool (with prefix caching: to the cache, unless the call failed:
                # nothing half-computed is cached).
                engine.abort(request_id, after_error=failed)
        if streamer is not None:
            streamer.end()
        if not config.return_dict_in_generate:
            return batch.sequences
        output = GenerateDecoderOnlyOutput(
            sequences=batch.sequences,
            scores=tuple(batch.scores) if config.output_scores else None,
            logits=tuple(batch.raw_logits) if config.output_logits else None,
            **{OUTPUT_CACHE_FIELD: cache},
        )
        if self.prefix_cache is not None:
            output["cached_tokens"] = torch.tensor(cached_tokens)  # per row: prompt tokens reused
        return output

    def _token_ids(self, input_ids: Any) -> torch.Tensor:
        """`input_ids` as a [batch, length] int64 tensor, refused unless every id is in the vocabulary: an id
        out of range would fail deep inside a compiled graph (on cpu, by aborting the process)."""
        ids = torch.as_tensor(input_ids)
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(
                f"input_ids must hold integer token ids, got dtype {ids.dtype}: tokenize the text (or "
                "convert the ids with .long()) instead of passing other values."
            )
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.numel() == 0:
            raise ValueError(f"input_ids must be [batch, length] with length >= 1, got {tuple(ids.shape)}.")
        ids = ids.to(torch.long)
        vocab = self.config.vocab_size
        outside = (ids < 0) | (ids >= vocab)
        if outside.any():
            row, col = (int(i) for i in outside.nonzero()[0])
            raise ValueError(
                f"input_ids[{row}, {col}] = {int(ids[row, col])} is not a token of this model's vocabulary "
                f"(0..{vocab - 1}); {int(outside.sum())} id(s) are out of range. Use the model's tokenizer."
            )
        return ids

    def _row_images(self, rows: list[torch.Tensor], inputs: dict[str, Any]) -> list[tuple[ImageInput, ...]]:
        """Each row's images, from the processor's `pixel_values` and `image_grid_thw` (all rows' images in
        order): a row takes as many as its image placeholder tokens stand for."""
        pixel_values, grid = inputs.get("pixel_values"), inputs.get("image_grid_thw")
        if pixel_values is None and grid is None:
            return [()] * len(rows)
        encoder = self.image_encoder
        if encoder is None:
            raise ValueError(
                f"{type(self).__name__} runs the language model only: load the checkpoint with "
                "NeuronQwen36ForConditionalGeneration to generate from images."
            )
        if pixel_values is None or grid is None:
            raise ValueError(
                "images need both pixel_values and image_grid_thw, as the processor returns them."
            )
        images = iter(split_images(torch.as_tensor(pixel_values), grid))
        placeholders = torch.tensor(encoder.placeholder_ids)
        per_row = []
        for index, row in enumerate(rows):
            needed, covered, taken = int(torch.isin(row, placeholders).sum()), 0, []
            while covered < needed:
                image = next(images, None)
                if image is None:
                    raise ValueError(
                        f"row {index}'s image placeholder tokens need more images than were given."
                    )
                taken.append(image)
                covered += image.num_tokens(encoder.spatial_merge_size)
            per_row.append(tuple(taken))
        if next(images, None) is not None:
            raise ValueError("more images were given than the rows' image placeholder tokens stand for.")
        return per_row

    def _prompt_rows(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """Each row's real tokens. Rows must be left-padded (zeros of the mask before its ones)."""
        batch, width = input_ids.shape
        if batch > self.neuron_config.batch_size:
            raise ValueError(
                f"Batch of {batch} rows but the model was exported with batch_size="
                f"{self.neuron_config.batch_size}: split the batch or re-export with a larger batch_size."
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = torch.as_tensor(attention_mask).to(torch.long)
        if mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(input_ids.shape)}."
            )
        lengths = mask.sum(dim=1)
        expected = torch.arange(width).unsqueeze(0) >= (width - lengths).unsqueeze(1)
        if not torch.equal(mask.bool(), expected):
            raise ValueError(
                "attention_mask must be left padding (0s then 1s in every row). Tokenize batches with "
                "tokenizer.padding_side = 'left'."
            )
        if (lengths == 0).any():
            raise ValueError("Every row needs at least one token (a row of the attention_mask is all zeros).")
        return [input_ids[b, width - int(lengths[b]) :] for b in range(batch)]

    def _check_cache(
        self, cache: Qwen36HybridCache | None, rows: list[torch.Tensor], max_new_tokens: int
    ) -> None:
        """The rows fit the compiled sequence_length, and a cache passed back is one this model's rows
        continue."""
        capacity = self.neuron_config.sequence_length
        longest = max(len(r) for r in rows)
        if longest + max_new_tokens > capacity:
            raise ValueError(
                f"A prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the compiled "
                f"sequence_length={capacity}. Shorten the prompt, lower max_new_tokens, or re-export with "
                f"sequence_length >= {longest + max_new_tokens}."
            )
        if cache is None:
            return
        if self.prefix_cache is not None:
            raise ValueError(
                "past_key_values cannot be passed back with prefix caching: the prefix cache already "
                "reuses the previous tokens, so pass the full sequences without past_key_values."
            )
        if not isinstance(cache, Qwen36HybridCache):
            raise ValueError(
                f"past_key_values must be the Qwen36HybridCache returned by this model's generate(), "
                f"got {type(cache).__name__}."
            )
        if (cache.batch_size, cache.sequence_length) != (self.neuron_config.batch_size, capacity):
            raise ValueError("past_key_values was created by a model exported with other shapes.")
        if cache.storage is None and bool(cache.seq_lens.any()):
            raise ValueError(
                "past_key_values records tokens only (it comes from a model with prefix caching): pass the "
                "full sequences without past_key_values."
            )
        for b, tokens in enumerate(rows):
            cached = cache.cached_tokens(b)
            if len(tokens) <= len(cached) or not torch.equal(tokens[: len(cached)], cached):
                raise ValueError(
                    f"Row {b} does not extend the sequence held in past_key_values ({len(cached)} cached "
                    f"tokens): pass the previous output sequences plus at least one new token, or drop "
                    "past_key_values."
                )

    def _pad_token_id(self, config: GenerationConfig) -> int | None:
        """The token finished rows keep decoding on (it is fed to the model): pad_token_id, else the first
        EOS id."""
        pad_token_id = config.pad_token_id
        if pad_token_id is None and config.eos_token_id is not None:
            eos = config.eos_token_id
            pad_token_id = eos[0] if isinstance(eos, list | tuple) else eos
        if pad_token_id is not None and not 0 <= pad_token_id < self.config.vocab_size:
            raise ValueError(
                f"pad_token_id={pad_token_id} is not a token of this model's vocabulary "
                f"(0..{self.config.vocab_size - 1})."
            )
        return pad_token_id


def run_until(engine: Engine, done: Callable[[], bool]) -> None:
    """Step the engine until `done()`."""
    while not done():
        steps = engine.num_steps
        engine.step()
        if engine.num_steps == steps:
            raise RuntimeError("the engine planned nothing while generate() rows wait for their logits")
