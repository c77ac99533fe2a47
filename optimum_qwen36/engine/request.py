"""A request's life in the engine: its tokens, state, finish reason and timestamps, and what each step
delivers to its caller."""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..network.cache import CacheStorage
from ..network.vision import ImageInput, PromptImages
from .sampling import SamplingParams, TokenConstraint, request_generator


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and requeued: holds no slot and no blocks
    PREFILLING = "prefilling"  # holds a slot; some prompt tokens still to compute
    DECODING = "decoding"  # every prompt token computed; one new token per step
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # an EOS / stop token or a stop string
    LENGTH = "length"  # max_tokens, or the compiled sequence_length
    ABORT = "abort"


@dataclass(frozen=True)
class ComputedSequence:
    """A sequence's first `num_computed` tokens, computed in `storage`: its GDN state in `slot` and their
    KV in `block_ids` (in position order). A request that brings one starts after them: they are copied
    into its own slot and blocks when it is admitted (a transformers cache passed back to generate())."""

    storage: CacheStorage
    slot: int
    block_ids: tuple[int, ...]
    num_computed: int


@dataclass(frozen=True)
class ChosenToken:
    """A request's next token, as its `TokenChooser` picked it. `filler`: its caller has ended the request
    but keeps it computing (generate()'s finished rows, whose logits are still returned): the prefix cache
    keeps nothing from this token on."""

    token: int
    filler: bool = False


class TokenChooser(Protocol):
    """Picks the tokens of the requests that name it, in the engine's sampler's place (generate():
    transformers' logits processors, stopping criteria and streamer, over all of its rows at once). A
    request whose next token it has not picked computes nothing, and the engine never ends it (its caller
    does, with `Engine.abort`)."""

    def choose(self, logits: Mapping[str, torch.Tensor]) -> Mapping[str, ChosenToken]:
        """Given the next-token logits [vocab] that a step computed for some of its requests (by request
        id), the tokens it picks now, for any of its requests waiting for one (also those whose logits came
        in an earlier step)."""
        ...


@dataclass(frozen=True)
class EngineRequest:
    """What a caller asks the engine for, one frozen record from the caller to the scheduler (vLLM's
    `EngineCoreRequest`).

    `constraint` restricts which tokens it may produce (structured output). `reusable_prefix`: how many
    leading prompt tokens later requests are expected to share (a chat's history without its generation
    prompt, which the next turn renders differently), so that the prefix cache keeps a GDN state checkpoint
    there. `chooser` picks its tokens instead of the engine's sampler (then of `params` only max_tokens
    counts: the longest it may grow, which the block pool must hold). `computed`: its first tokens were
    computed elsewhere; their state is copied in instead of computed again. `images`: the images whose
    placeholder tokens the prompt holds, in order (the processor's expansion: one token per merged patch)."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    constraint: TokenConstraint | None = None
    reusable_prefix: int | None = None
    chooser: TokenChooser | None = None
    computed: ComputedSequence | None = None
    images: tuple[ImageInput, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "images", tuple(self.images))


@dataclass
class Request:
    """One prompt being generated for. `output_ids` are the sampled tokens; `num_computed` counts the
    tokens (prompt, then fed outputs) whose KV and GDN state are in the cache."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    state: RequestState = RequestState.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens reused from the prefix cache at (the last) admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    constraint: TokenConstraint | None = field(default=None, repr=False)  # e.g. a JSON-schema grammar
    # The leading prompt tokens later requests are expected to share (the prefix cache checkpoints there).
    reusable_prefix: int | None = None
    # MTP speculative decoding: tokens drafted after output_ids[-1], verified by the next decode step.
    draft_ids: list[int] = field(default_factory=list)
    # params.prompt_logprobs: per prompt position, the token's log-probability and the top ones (None at 0
    # and until computed).
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    # Picks its tokens instead of the engine's sampler.
    chooser: TokenChooser | None = field(default=None, repr=False)
    # Its first tokens' state, computed elsewhere, copied in at admission.
    computed: ComputedSequence | None = field(default=None, repr=False)
    # From this position on its tokens are filler (`ChosenToken.filler`): the prefix cache keeps none.
    filler_from: int | None = None
    # Its prompt's images on their placeholder tokens, and the features of those whose tokens are still to
    # compute (encoded when a chunk first needs them, dropped once their tokens are computed).
    images: PromptImages | None = field(default=None, repr=False)
    image_features: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt: it needs at least one token")
        self.generator = request_generator(self.params.seed)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)
            self.prompt_top_logprobs = [None] * len(self.prompt_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some prompt token's log-probability is still to compute (so no cached prefix may stand
        in for its computation)."""
        return len(self.prompt_ids) > 1 and self.prompt_logprobs[-1:] == [None]

    @property
    def has_new_token(self) -> bool:
        """Whether a token of it is still to compute (else it waits for its chooser's pick)."""
        return self.num_tokens > self.num_computed

    @property
    def cacheable_computed(self) -> int:
        """Computed tokens the prefix cache may keep: all of them, short of filler."""
        if self.filler_from is None:
            return self.num_computed
        return min(self.num_computed, self.filler_from)

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output tokens, in order: what the model has seen or will see."""
        return self.prompt_ids + self.output_ids

    @property
    def cache_key_ids(self) -> list[int]:
        """`token_ids` as the prefix cache keys them: an image's placeholder tokens stand for its content."""
        if self.images is None:
            return self.token_ids
        return self.images.cache_key_ids(self.prompt_ids) + self.output_ids

    @property
    def rope_delta(self) -> int:
        """How far the rotary positions of its tokens past the prompt lie from their positions."""
        return 0 if self.images is None else self.images.rope_delta

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Tokens that end the request (and that min_tokens holds back)."""
        eos = () if self.params.ignore_eos else self.eos_token_ids
        return eos + self.params.stop_token_ids


@dataclass
class RequestOutput:
    """What one step produced for one request: the new tokens (and their text, when the engine has a
    tokenizer), their log-probabilities, and whether the request is done."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    # With params.prompt_logprobs, in the request's first output: one entry per prompt token (None first).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    cached_prompt_tokens: int = 0
