"""OpenAI request bodies (the fields vLLM's OpenAI server takes for chat, completions and tokenization),
validated by pydantic in strict mode: a field of the wrong type (`true` as a token id, `2.0` as a count) or
out of range is a 400 naming it, and text anywhere in a body must be valid Unicode. These models are also
what /openapi.json documents of each request."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..engine.sampling import LOGIT_BIAS_RANGE, MAX_LOGPROBS, PENALTY_RANGE

Penalty = Field(default=None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
TokenId = Annotated[int, Field(ge=0)]
Text = Annotated[str, Field(min_length=1)]
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
# The chat template's own arguments: the server sets them, a request's chat_template_kwargs cannot.
RESERVED_TEMPLATE_KWARGS = ("add_generation_prompt", "tools", "tokenize", "messages", "conversation")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value: Any, path: str) -> str | None:
    """Where in a JSON value a string holds a lone UTF-16 surrogate (JSON's \\ud800 escapes decode to one
    unless paired), or None."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        where = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _SURROGATE.search(key):
            return where
        found = _lone_surrogate(item, where)
        if found is not None:
            return found
    return None


class RequestBody(BaseModel):
    """A request body: strict types, unknown fields ignored (as OpenAI's and vLLM's servers do)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = _lone_surrogate(data, "")
        if where is not None:
            raise PydanticCustomError(
                "lone_surrogate",
                "{where} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape): send valid "
                "Unicode text",
                {"where": where or "the body"},
            )
        return data


class BodyPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BodyPart):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchema(BodyPart):
    model_config = ConfigDict(populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BodyPart):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


# ---------------------------------------------------------------------- messages
class TextPart(BodyPart):
    type: Literal["text"] = "text"
    text: str


MessageContent = str | list[TextPart]


class ImageURL(BodyPart):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BodyPart):
    """An image of a user message: a data: URL, or an http(s) URL the server may fetch (server/images.py)."""

    type: Literal["image_url"]
    image_url: ImageURL


UserContent = str | list[TextPart | ImagePart]


def check_text_parts(content: Any, kinds: tuple[str, ...] = ("text",), untyped: str | None = "text") -> Any:
    """A part whose type is not one of `kinds` (a part without a type counts as `untyped`): an audio or file
    part, or an image outside a user message, is refused by name instead of being dropped or rendered as
    placeholder tokens."""
    if isinstance(content, list):
        for number, part in enumerate(content):
            kind = part.get("type", untyped) if isinstance(part, dict) else None
            if kind not in kinds:
                described = f"a {kind!r} part" if isinstance(kind, str) else "not a content part"
                raise ValueError(
                    f"content[{number}] is {described}: this message takes only "
                    f"{' or '.join(repr(k) for k in kinds)} parts"
                )
    return content


class _Message(BaseModel):
    """A chat message; fields besides the documented ones reach the chat template as they are."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str | None = None

    @field_validator("content", mode="before", check_fields=False)
    @classmethod
    def _text_parts(cls, content: Any) -> Any:
        return check_text_parts(content)


class SystemMessage(_Message):
    role: Literal["system"]
    content: MessageContent


class DeveloperMessage(_Message):
    """OpenAI's newer name for the system message: rendered as one (as vLLM does)."""

    role: Literal["developer"]
    content: MessageContent


class UserMessage(_Message):
    role: Literal["user"]
    content: UserContent

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, content: Any) -> Any:
        """Text and image parts (a model without a vision tower refuses the images by name)."""
        return check_text_parts(content, kinds=("text", "image_url"))


class FunctionCall(BodyPart):
    name: str
    # OpenAI sends a JSON string; a JSON object is taken too.
    arguments: str | dict[str, Any]


class ToolCall(BodyPart):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: MessageContent | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None


class ToolMessage(_Message):
    role: Literal["tool"]
    content: MessageContent
    tool_call_id: str | None = None


ChatMessage = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
    Field(discriminator="role"),
]


# ---------------------------------------------------------------------- tools
def check_tool(tool: Any) -> None:
    """A tool as the chat template and the forced-call grammar need it; the error names the tool."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict):
        raise ValueError("a tool is {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")
    name = function.get("name")
    if not isinstance(name, str) or not re.fullmatch(TOOL_NAME_PATTERN, name):
        raise ValueError(
            f"the tool name {name!r} is not valid: a name is 1 to 64 letters, digits, '_' or '-' "
            "(OpenAI's rule)"
        )
    parameters = function.get("parameters")
    if parameters is None:
        return
    problem = _parameters_problem(parameters)
    if problem:
        raise ValueError(f"the parameters of tool {name!r} {problem}")


def _parameters_problem(parameters: Any) -> str | None:
    if not isinstance(parameters, dict):
        return f"must be a JSON Schema object, not {type(parameters).__name__}"
    if parameters.get("type", "object") != "object":
        return f"must describe an object ('type': 'object'), not {parameters['type']!r}"
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict):
        return "have 'properties' that is not an object"
    for key, schema in properties.items():
        if not key or ">" in key or "\n" in key:
            return f"name a parameter {key!r}: a parameter name is not empty and has no '>' or newline"
        if not isinstance(schema, dict | bool):
            return f"give parameter {key!r} a schema that is not an object"
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return "have 'required' that is not a list of parameter names"
    return None


class FunctionDefinition(BodyPart):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    # A JSON Schema of type object.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BodyPart):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    @model_validator(mode="before")
    @classmethod
    def _usable(cls, data: Any) -> Any:
        check_tool(data)
        return data


class NamedFunction(BodyPart):
    name: str


class NamedToolChoice(BodyPart):
    type: Literal["function"] = "function"
    function: NamedFunction


def check_unique_tool_names(tools: list[Tool] | None) -> list[Tool] | None:
    names = [tool.function.name for tool in tools or []]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"tools holds more than one function named {repeated[0]!r}")
    return tools


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    clashing = sorted(set(kwargs or {}) & set(RESERVED_TEMPLATE_KWARGS))
    if clashing:
        raise ValueError(
            f"chat_template_kwargs cannot set {', '.join(clashing)}: the server passes "
            f"{', '.join(RESERVED_TEMPLATE_KWARGS)} to the template itself (chat always ends with the "
            "generation prompt; /tokenize takes add_generation_prompt as a field of its own)"
        )
    return kwargs


# ---------------------------------------------------------------------- requests
class SamplingFields(RequestBody):
    """Fields chat and completions share. None: the model's generation_config default (as vLLM does)."""

    model: str | None = None
    n: int = Field(default=1, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    # -1 or 0: no limit; beyond the vocabulary: no limit either.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Penalty
    frequency_penalty: float | None = Penalty
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]] | None = (
        None
    )
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop is not None and any(not s for s in ([stop] if isinstance(stop, str) else stop)):
            raise ValueError("stop strings must not be empty")
        return stop


class CompletionRequest(SamplingFields):
    # A text, token ids, or a batch of either.
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None

    _unique_tools = field_validator("tools")(check_unique_tool_names)
    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)


class TokenizeCompletionRequest(RequestBody):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(RequestBody):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)

    @model_validator(mode="before")
    @classmethod
    def _not_both(cls, data: Any) -> Any:
        if isinstance(data, dict) and "prompt" in data:
            raise ValueError("give prompt or messages, not both")
        return data


def _tokenize_kind(body: Any) -> str:
    return "chat" if isinstance(body, dict) and "messages" in body else "completion"


# vLLM's two tokenize bodies: a text, or messages rendered with the chat template.
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("completion")] | Annotated[TokenizeChatRequest, Tag("chat")],
    Discriminator(_tokenize_kind),
]


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]
