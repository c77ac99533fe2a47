"""The server's state across requests (the served model once loaded, metrics, sequences in flight) and what
every endpoint checks of a request against it: the model is ready and named, token ids lie in the
vocabulary, the queue has room; and the engine parameters a generation request's fields become."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from ..engine import EngineRequest, SamplingParams, TokenConstraint
from .errors import OpenAIError, bad_request
from .metrics import ServerMetrics
from .protocol import SamplingFields
from .reasoning import THINK_END, TOOL_CALL_START
from .runs import ChoiceRuns, EngineRun
from .served import ServedModel, ServerSettings
from .structured import Gate, StructuredOutput

# What sglang-router sends as `model` for a request that names none.
ROUTER_NO_MODEL = "unknown"


class OpenAIServer:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.metrics = ServerMetrics(settings.served_model_name)
        self.model: ServedModel | None = None
        self.load_error: BaseException | None = None
        self.structured: StructuredOutput | None = None
        self._in_flight = 0  # engine requests submitted and not finished
        # Shutting down: requests in flight finish, new ones are refused so a router sends them elsewhere.
        self.draining = False
        # Tells this replica from others behind a router (its KV events are indexed under it).
        self.instance_id = f"optimum-qwen36-{uuid.uuid4().hex[:12]}"

    def start_serving(self, model: ServedModel) -> None:
        """Serve `model` from now on, its structured-output tables built first (seconds: here, not on the
        first structured request)."""
        self.structured = StructuredOutput(model.tokenizer, model.vocab_size, model.eos_token_id)
        self.structured.prepare()
        self.model = model

    # ------------------------------------------------------------------ common checks
    def ready(self) -> ServedModel:
        if self.model is None:
            reason = f"failed to load: {self.load_error}" if self.load_error else "is loading"
            raise OpenAIError(503, f"The model {reason}.", headers={"Retry-After": "5"})
        return self.model

    def check_model(self, name: str | None) -> None:
        """A request names the served model or none (sglang-router names none `unknown`)."""
        if name not in (None, self.settings.served_model_name, ROUTER_NO_MODEL):
            raise OpenAIError(
                404,
                f"The model `{name}` does not exist: this server serves `{self.settings.served_model_name}`.",
                "model",
                "model_not_found",
            )

    def check_ids(self, ids: Sequence[int], param: str) -> list[int]:
        vocab = self.ready().vocab_size
        outside = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if outside:
            raise bad_request(f"{param} holds {outside[:8]}, outside the vocabulary (0..{vocab - 1}).", param)
        return list(ids)

    @property
    def in_flight(self) -> int:
        """Sequences submitted to the engine and not finished."""
        return self._in_flight

    def admit(self, count: int) -> None:
        """Refuse `count` more sequences if the server is shutting down or the queue cannot take them."""
        self.ready()
        if self.draining:
            raise OpenAIError(
                503,
                "The server is shutting down: send the request to another replica, or retry once it is back.",
                headers={"Retry-After": "5"},
            )
        capacity = self.check_count(count)
        if self._in_flight + count > capacity:
            raise OpenAIError(
                503,
                f"The server is at capacity ({self._in_flight} sequences running or queued): retry later.",
                headers={"Retry-After": "1"},
            )

    def check_count(self, count: int) -> int:
        """Refuse a request of `count` sequences that this server could never queue; its capacity."""
        capacity = self.ready().max_num_seqs + self.settings.max_waiting_requests
        if count > capacity:
            raise bad_request(f"n={count} sequences exceed what this server can queue ({capacity}).", "n")
        return capacity

    def check_grammar_fields(self, body: SamplingFields) -> None:
        if body.min_tokens:
            # The grammar may allow only the end of the text while min_tokens forbids it.
            raise bad_request("min_tokens cannot combine with a grammar (response_format or a forced tool).")

    def check_stream_options(self, body: SamplingFields) -> None:
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only allowed with stream: true.", "stream_options")

    # ------------------------------------------------------------------ engine parameters
    def sampling_params(
        self,
        body: SamplingFields,
        prompt_tokens: int,
        max_tokens: int | None,
        logprobs: int | None,
        choice: int,
        prompt_param: str,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The engine parameters of one choice; a prompt (the request's `prompt_param`) and max_tokens that
        do not fit the model's length are refused naming the field to shorten."""
        model = self.ready()
        room = model.max_model_len - prompt_tokens
        if (max_tokens is not None and max_tokens > room) or room < 1:
            requested = prompt_tokens + (max_tokens or 1)
            raise bad_request(
                f"This model's maximum context length is {model.max_model_len} tokens. However, you "
                f"requested {requested} tokens ({prompt_tokens} in the prompt, {max_tokens or 1} for the "
                "completion). Please reduce the prompt or max_tokens.",
                prompt_param if room < 1 else "max_tokens",  # the field whose change alone fixes it
            )
        if max_tokens is not None and body.min_tokens > max_tokens:
            raise bad_request(
                f"min_tokens ({body.min_tokens}) exceeds max_tokens ({max_tokens}).", "min_tokens"
            )
        defaults = model.generation_defaults

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(body, name)
            return value if value is not None else defaults.get(name, fallback)

        stop = body.stop if body.stop is not None else ()
        try:
            return SamplingParams(
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=_top_k(pick("top_k", 0), model.vocab_size),
                min_p=pick("min_p", 0.0),
                repetition_penalty=pick("repetition_penalty", 1.0),
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                seed=None if body.seed is None else body.seed + choice,  # vLLM's rule for n > 1
                max_tokens=max_tokens if max_tokens is not None else room,
                min_tokens=body.min_tokens,
                stop=(stop,) if isinstance(stop, str) else tuple(stop),
                stop_token_ids=tuple(self.check_ids(body.stop_token_ids or [], "stop_token_ids")),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=self.logit_bias(body.logit_bias),
            )
        except ValueError as error:
            raise bad_request(str(error)) from error

    def reasoning_gate(self, body: SamplingFields) -> Gate:
        """Where a grammar starts when the prompt opens a think block: after `</think>`. Until then the
        tokens that would end the text (EOS, the request's stop_token_ids) or open a tool call inside the
        reasoning are held back, so a constrained answer comes, or the text ends by length."""
        model = self.ready()
        added = model.tokenizer.added_tokens_encoder
        held = {*model.end_token_ids, *(body.stop_token_ids or ())}
        if TOOL_CALL_START in added:
            held.add(added[TOOL_CALL_START])
        return Gate(added[THINK_END], tuple(sorted(held)))

    def logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's logit_bias: token ids (JSON object keys, so strings) to values added to their logits."""
        if not bias:
            return None
        try:
            ids = [int(key) for key in bias]
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids, got {sorted(bias)[:8]}.", "logit_bias"
            ) from None
        return dict(zip(self.check_ids(ids, "logit_bias"), bias.values(), strict=True))

    def response_constraint(self, body: SamplingFields, gate: Gate | None) -> TokenConstraint | None:
        rf = body.response_format
        if rf is None or rf.type == "text":
            return None
        self.check_grammar_fields(body)
        if rf.type == "json_object":
            return self.structured.json_constraint({"type": "object"}, gate)
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise bad_request("response_format json_schema needs json_schema.schema.", "response_format")
        return self.structured.json_constraint(rf.json_schema.json_schema, gate)

    # ------------------------------------------------------------------ running choices
    def run_choices(self, requests: list[EngineRequest]) -> ChoiceRuns:
        """The engine requests of one HTTP request, choice i's at index i, counted against the server's
        capacity from now until each ends."""
        self.admit(len(requests))
        self._in_flight += len(requests)
        engine = self.ready().engine
        runs = [EngineRun(i, r, engine, self.metrics, self._release_one) for i, r in enumerate(requests)]
        return ChoiceRuns(runs)

    def _release_one(self) -> None:
        self._in_flight -= 1


def _top_k(top_k: int, vocab_size: int) -> int:
    """top_k for the engine: 0 (no limit) for -1, 0 or anything that keeps the whole vocabulary."""
    return 0 if top_k <= 0 or top_k >= vocab_size else top_k
