"""A request's life in the engine: its tokens, state, finish reason and timestamps, and what each step
delivers to its caller."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

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
class ResumePoint:
    """Where a request resumes a sequence computed by an earlier run over the same cache: the GDN slot that
    holds its state, and the blocks that hold the KV of its first `num_computed` tokens."""

    slot: int
    block_ids: tuple[int, ...]
    num_computed: int


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
    # Resumes an earlier run's sequence in its slot and blocks instead of starting from a prefix lookup.
    resume: ResumePoint | None = None
    # The caller picks each next token (generate() with its logits processors): the engine computes the
    # logits, keeps them in next_token_logits, and waits for `Engine.append_token` before decoding again.
    sampled_by_caller: bool = False
    next_token_logits: torch.Tensor | None = field(default=None, repr=False)
    # A caller-sampled request whose caller ended it keeps stepping on padding tokens from this position on
    # (generate()'s finished rows, whose logits are still returned): the prefix cache keeps none of them.
    padding_from: int | None = None
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
    def awaits_token(self) -> bool:
        """Whether the caller has the logits of the next token and the engine waits for its choice."""
        return self.next_token_logits is not None

    @property
    def cacheable_computed(self) -> int:
        """Computed tokens the prefix cache may keep: all of them, short of padding."""
        if self.padding_from is None:
            return self.num_computed
        return min(self.num_computed, self.padding_from)

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output tokens, in order: what the model has seen or will see."""
        return self.prompt_ids + self.output_ids

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
