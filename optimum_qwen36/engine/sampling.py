"""Per-request sampling settings (vLLM / OpenAI names) and one vectorised sampler for every running row.

Each row is processed with its own settings in the same pass, and draws its randomness from its own
`torch.Generator` (seeded from `SamplingParams.seed` when given), so a request's tokens do not depend on
which other requests share the step.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

# OpenAI's bounds for the two additive penalties and for a logit bias, and its cap on top logprobs.
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token and when to stop (vLLM's `SamplingParams` field names).

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1 disable those filters. repetition_penalty scales
    the logits of tokens seen in the prompt or the output (transformers' rule); presence_penalty and
    frequency_penalty subtract from the logits of tokens in the output (OpenAI's rule). logit_bias adds its
    value (-100..100) to the logit of each token id it names, at every step (OpenAI's rule: -100 bans a
    token, 100 all but forces it). min_tokens holds back
    the stop tokens (EOS and stop_token_ids) until that many tokens were generated. logprobs: how many of the
    most likely tokens' log-probabilities to return with each token (besides the sampled token's).
    prompt_logprobs: the same for each prompt token after the first (the log-probability the model gives it
    after the tokens before it); such a request computes its whole prompt, reusing no cached prefix."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", {int(t): float(b) for t, b in self.logit_bias.items()})
        problems = []
        if not isinstance(self.n, int) or self.n < 1:
            problems.append(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be an integer >= 0 (0 or -1: no limit), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                problems.append(f"{name} must be in [{PENALTY_RANGE[0]}, {PENALTY_RANGE[1]}], got {value}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            problems.append(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            problems.append(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        elif self.max_tokens is not None and self.min_tokens > self.max_tokens:
            problems.append(f"min_tokens ({self.min_tokens}) cannot exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                problems.append(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids must be token ids (>= 0), got {list(self.stop_token_ids)}")
        low, high = LOGIT_BIAS_RANGE
        for token, bias in (self.logit_bias or {}).items():
            if token < 0 or not low <= bias <= high:
                problems.append(
                    f"logit_bias maps token ids (>= 0) to values in [{low:g}, {high:g}], "
                    f"got {token}: {bias:g}"
                )
                break
        if problems:
            raise ValueError("Invalid SamplingParams: " + "; ".join(problems) + ".")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class TokenConstraint(Protocol):
    """Which tokens a request may produce next (structured output: a grammar matcher). The engine asks for
    the mask before each of the request's tokens and reports the token it picked."""

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor | None:
        """A bool mask [vocab_size] of the tokens allowed next, or None when any token is."""
        ...

    def accept(self, token_id: int) -> None:
        """The request produced `token_id` (one of the allowed tokens)."""
        ...


@dataclass
class SamplingRow:
    """What the sampler needs of one running request at one step."""

    params: SamplingParams
    # The request's token ids so far: prompt then output (repetition_penalty reads both).
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    # Held back until min_tokens outputs exist: the EOS ids (unless ignore_eos) and stop_token_ids.
    stop_ids: Sequence[int]
    generator: torch.Generator = field(repr=False)
    constraint: TokenConstraint | None = None


@dataclass
class SampledTokens:
    """One step's result for every row: the token, its log-probability under the model's distribution, and
    (for rows that asked) the top log-probabilities, as (token ids, log-probabilities) of shape [k]."""

    tokens: torch.Tensor  # [rows] int64
    logprobs: torch.Tensor  # [rows] float32
    top_logprobs: list[tuple[torch.Tensor, torch.Tensor] | None]


def _seen_mask(rows: Sequence[SamplingRow], vocab: int, include_prompt: bool) -> torch.Tensor:
    mask = torch.zeros((len(rows), vocab), dtype=torch.bool)
    for i, row in enumerate(rows):
        ids = list(row.output_ids) + (list(row.prompt_ids) if include_prompt else [])
        if ids:
            mask[i, torch.tensor(ids, dtype=torch.long)] = True
    return mask


def _output_counts(rows: Sequence[SamplingRow], vocab: int) -> torch.Tensor:
    counts = torch.zeros((len(rows), vocab), dtype=torch.float32)
    for i, row in enumerate(rows):
        if row.output_ids:
            ids = torch.tensor(list(row.output_ids), dtype=torch.long)
            counts[i].index_add_(0, ids, torch.ones(len(ids)))
    return counts


def _column(rows: Sequence[SamplingRow], name: str) -> torch.Tensor:
    return torch.tensor([float(getattr(row.params, name)) for row in rows], dtype=torch.float32)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """repetition_penalty (prompt and output tokens, transformers' rule), then presence and frequency
    penalties (output tokens, OpenAI's rule), then logit_bias, then min_tokens and the row's constraint; rows
    without them are untouched. `logits` itself is never modified: where no row has any of them it is what
    comes back (a copy of a step's logits costs more than their argmax)."""
    vocab = logits.shape[-1]
    copied = False
    repetition = _column(rows, "repetition_penalty")
    if (repetition != 1).any():
        seen = _seen_mask(rows, vocab, include_prompt=True)
        penalty = repetition[:, None].expand_as(logits)
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits, copied = torch.where(seen, scaled, logits), True
    presence, frequency = _column(rows, "presence_penalty"), _column(rows, "frequency_penalty")
    if (presence != 0).any() or (frequency != 0).any():
        counts = _output_counts(rows, vocab)
        logits, copied = logits - (frequency[:, None] * counts + presence[:, None] * (counts > 0)), True
    for i, row in enumerate(rows):
        suppress_stops = len(row.output_ids) < row.params.min_tokens and row.stop_ids
        if not (row.params.logit_bias or suppress_stops or row.constraint is not None):
            continue
        if not copied:
            logits, copied = logits.clone(), True
        if row.params.logit_bias:
            ids = torch.tensor(list(row.params.logit_bias), dtype=torch.long)
            logits[i].index_add_(0, ids, torch.tensor(list(row.params.logit_bias.values())))
        if suppress_stops:
            logits[i, torch.tensor(list(row.stop_ids), dtype=torch.long)] = float("-inf")
        allowed = row.constraint.allowed_tokens(vocab) if row.constraint is not None else None
        if allowed is not None:
            logits[i].masked_fill_(~allowed, float("-inf"))
    return logits


def filter_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, then top_k, top_p and min_p, each with the row's own value (greedy rows: unchanged)."""
    temperature = _column(rows, "temperature")
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    vocab = logits.shape[-1]
    top_k = torch.tensor([row.params.top_k or vocab for row in rows])
    top_p, min_p = _column(rows, "top_p"), _column(rows, "min_p")
    if (top_k < vocab).any() or (top_p < 1).any():
        ordered, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(vocab).expand_as(ordered)
        drop = rank >= top_k[:, None]
        # top_p keeps the smallest set of most likely tokens whose probability reaches top_p (at least one).
        probs = ordered.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        # Only rows that set top_p: a float32 cumulative sum can reach 1 before the last token.
        drop |= (before >= top_p[:, None]) & (rank > 0) & (top_p < 1)[:, None]
        scaled = scaled.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    if (min_p > 0).any():
        probs = scaled.softmax(dim=-1)
        scaled = scaled.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return scaled


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampledTokens:
    """The next token of every row from its float32 logits [rows, vocab]."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(rows)} requests")
    logits = logits.float()
    model_logprobs = logits.log_softmax(dim=-1)
    penalized = apply_penalties(logits, rows)
    tokens = penalized.argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if sampled:
        chosen = [rows[i] for i in sampled]
        probs = filter_logits(penalized[sampled], chosen).softmax(dim=-1)
        # argmax(p / E) with E ~ Exp(1) is a draw from p (torch.multinomial's rule); each row's noise comes
        # from its own generator, so its draw does not depend on the other rows.
        tokens[sampled] = torch.stack([_draw(p, row.generator) for p, row in zip(probs, chosen, strict=True)])
    top = [_top_logprobs(model_logprobs[i], row) for i, row in enumerate(rows)]
    return SampledTokens(tokens, model_logprobs.gather(1, tokens[:, None]).squeeze(1), top)


def _draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A token drawn from probs [vocab]: argmax(p / E) with E ~ Exp(1) (torch.multinomial's rule), the noise
    from the row's own generator, so its draw does not depend on the other rows."""
    noise = torch.empty(probs.shape[-1]).exponential_(generator=generator)
    # A zero draw would make 0 / 0 of filtered tokens.
    return (probs / noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax(dim=-1)


def _top_logprobs(logprobs: torch.Tensor, row: SamplingRow) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not row.params.logprobs:
        return None
    values, ids = logprobs.topk(row.params.logprobs)
    return ids, values


@dataclass
class VerifiedToken:
    """A token that speculative decoding keeps, its log-probability under the model's distribution and
    (when the row asked) the top log-probabilities at its position."""

    token: int
    logprob: float
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None


def verify_drafts(logits: torch.Tensor, row: SamplingRow, drafts: Sequence[int]) -> list[VerifiedToken]:
    """The tokens one row keeps from a verify step: the drafts the target accepts, in order, then one token
    of the target's own (a correction where a draft was rejected, or the token after the last draft).

    logits [len(drafts) + 1, vocab] (float32) are the target's after the row's last token and after each
    draft. Each position is processed with the row's settings and the tokens kept before it (penalties,
    min_tokens). The drafts are greedy proposals (a point mass), so speculative sampling's rule (Leviathan
    et al. 2023) keeps draft d with probability p(d) and otherwise draws from p with d removed: the kept
    tokens are distributed exactly as sampling one token at a time. A greedy row keeps a draft when it is
    the argmax, so its tokens are those of greedy decoding."""
    model_logprobs = logits.float().log_softmax(dim=-1)
    output_ids = list(row.output_ids)
    kept: list[VerifiedToken] = []
    for position in range(len(drafts) + 1):
        current = dataclasses.replace(row, output_ids=output_ids)
        penalized = apply_penalties(logits[position : position + 1].float(), [current])
        draft = drafts[position] if position < len(drafts) else None
        if row.params.greedy:
            token = int(penalized.argmax(dim=-1))
            accepted = token == draft
        else:
            probs = filter_logits(penalized, [current]).softmax(dim=-1)[0]
            accepted = draft is not None and bool(torch.rand((), generator=row.generator) < probs[draft])
            if accepted:
                token = int(draft)
            else:
                if draft is not None:
                    probs = probs.index_fill(0, torch.tensor([draft]), 0.0)
                token = int(_draw(probs, row.generator))
        top = _top_logprobs(model_logprobs[position], row)
        kept.append(VerifiedToken(token, float(model_logprobs[position, token]), top))
        output_ids.append(token)
        if not accepted:
            return kept
    return kept


def request_generator(seed: int | None) -> torch.Generator:
    """A request's own generator: seeded with `seed`, or without one from the OS's randomness."""
    return torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)
