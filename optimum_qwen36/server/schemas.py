"""What /openapi.json documents besides the request bodies (protocol.py): the 200 bodies of each endpoint
(the endpoints build them as dicts; tests/test_server_fuzz.py holds every response to these schemas), OpenAI's
error body for 400, 401, 404 and 503, and the document itself: FastAPI's, less the 422 that FastAPI gives
every route (this server answers a body it cannot validate with a 400 OpenAI error)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

FinishReason = Literal["stop", "length", "tool_calls", "abort"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Body):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Body):
    error: ErrorDetail


class PromptTokensDetails(_Body):
    cached_tokens: int


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


# ---------------------------------------------------------------------- chat
class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None


class FunctionCallOut(_Body):
    name: str
    arguments: str


class ToolCallOut(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatMessageOut(_Body):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = []


class ChatChoice(_Body):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletion(_Body):
    """The whole answer (`stream` false); with `stream` true, server-sent events of ChatCompletionChunk."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(_Body):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Body):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDeltaOut(_Body):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Body):
    index: int
    delta: ChatDeltaOut
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_Body):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------------- completions
class CompletionLogprobs(_Body):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None


class Completion(_Body):
    """The whole answer (`stream` false), or, streamed, each server-sent event's body."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------------- models and tokens
class ModelCard(_Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = None
    max_model_len: int | None = None
    input_modalities: list[Literal["text", "image"]] | None = None


class ModelList(_Body):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Body):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Body):
    prompt: str


class TokenizerInfo(_Body):
    """The tokenizer's tokenizer_config.json settings (more fields than these), as vLLM serves them."""

    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None = None


# ---------------------------------------------------------------------- the Responses API
class ResponseText(_Body):
    type: Literal["output_text", "reasoning_text"]
    text: str


class OutputItem(_Body):
    """A reasoning item (content: reasoning_text parts), a message (content: output_text parts) or a
    function call (call_id, name, arguments)."""

    id: str
    type: Literal["reasoning", "message", "function_call"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponseText] | None = None
    role: Literal["assistant"] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None


class ResponseUsage(_Body):
    input_tokens: int
    input_tokens_details: PromptTokensDetails
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseEvent(_Body):
    """One event of a streamed response (its `type` is also the server-sent event's name): the response
    created, in progress and completed or incomplete, output items and their parts added, text deltas and
    done, or an error."""

    type: str
    sequence_number: int


class ResponseObject(_Body):
    """A Responses API response (`stream` false), or, streamed, typed server-sent events whose last one
    (response.completed or response.incomplete) carries it."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    error: ErrorDetail | None
    incomplete_details: dict[str, str] | None
    instructions: str | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    usage: ResponseUsage | None


# ---------------------------------------------------------------------- the document
STREAMED_EVENTS = (ChatCompletionChunk, Completion, ResponseEvent)
_ERRORS = {
    400: "The request is invalid: the message says which field and why.",
    401: "The API key is missing or wrong (when the server has one).",
    404: "No such model (the body's `model` is not the served one) or route.",
    503: "The model is loading, the engine stopped, or the queue is full: retry after `Retry-After` seconds.",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for these error statuses: OpenAI's error body, as JSON whatever the route's
    own media type."""
    body = {"application/json": {"schema": _ref(ErrorResponse)}}
    return {status: {"description": _ERRORS[status], "content": body} for status in statuses}


def streamed(model: type[BaseModel], event: type[BaseModel], done: bool) -> dict[int | str, dict[str, Any]]:
    """A 200 that is `model` as JSON, or, when the request streams, server-sent events whose data is an
    `event` body as JSON (or OpenAI's error body, where the stream fails), then `[DONE]` if `done`.

    Before OpenAPI 3.2's `itemSchema`, an event stream's `schema` describes one event as an object of its
    fields (`data`, `event`), as schemathesis validates it."""
    data: dict[str, Any] = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [_ref(event), _ref(ErrorResponse)]},
    }
    if done:
        data = {"anyOf": [{"const": "[DONE]"}, data]}
    one_event = {
        "type": "object",
        "properties": {"data": data, "event": {"type": "string"}},
        "required": ["data"],
        "description": f"One server-sent event: {event.__name__} as JSON{', then [DONE]' if done else ''}.",
    }
    return {200: {"model": model, "content": {"text/event-stream": {"schema": one_event}}}}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def describe_errors_as_served(app: FastAPI) -> None:
    """Make the app's OpenAPI document FastAPI's less its 422 validation-error responses, with the bodies
    that only `error_responses` and `streamed` refer to."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = build()
            for path in document.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            for model in (ErrorResponse, *STREAMED_EVENTS):  # named only inside event streams' schemas
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}), **{model.__name__: schema})
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
