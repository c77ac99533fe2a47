"""OpenAI's Responses API request body (POST /v1/responses): the fields this server serves, validated as
strictly as chat's (protocol.py); what it cannot serve (hosted tools, files, background runs,
conversations) is refused by name."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from .protocol import TOOL_NAME_PATTERN, BodyPart, RequestBody, check_text_parts, check_tool


def _check_text_content(content: Any) -> Any:
    return check_text_parts(content, ("input_text", "output_text", "refusal"), untyped=None)


def _check_message_content(content: Any) -> Any:
    """Text, and images (for a user message, checked when the messages are read)."""
    return check_text_parts(content, ("input_text", "output_text", "refusal", "input_image"), untyped=None)


class TextContent(BodyPart):
    type: Literal["input_text", "output_text"]
    text: str


class RefusalContent(BodyPart):
    type: Literal["refusal"]
    refusal: str


class ImageContent(BodyPart):
    """An image of a user message: a data: URL, or an http(s) URL the server may fetch (server/images.py)."""

    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None


Content = Annotated[TextContent | RefusalContent, Field(discriminator="type")]
MessageContent = Annotated[TextContent | RefusalContent | ImageContent, Field(discriminator="type")]


class MessageItem(BodyPart):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[MessageContent]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    _text_parts = field_validator("content", mode="before")(_check_message_content)


class FunctionCallItem(BodyPart):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(BodyPart):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Content]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    _text_parts = field_validator("output", mode="before")(_check_text_content)


class ReasoningText(BodyPart):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(BodyPart):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(item: Any) -> str | None:
    """An input item's kind; a message may leave out its type (OpenAI's EasyInputMessage)."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_type,
        custom_error_type="input_item",
        custom_error_message="an input item is a message, function_call, function_call_output or reasoning "
        "item (the items of hosted tools are not served)",
    ),
]


class FunctionTool(BodyPart):
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _usable(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "function":
            raise ValueError(
                f"a {data.get('type')!r} tool cannot run here: this server runs function tools only"
            )
        check_tool({"function": data})
        return data


class FunctionToolChoice(BodyPart):
    type: Literal["function"]
    name: str


class TextFormat(BodyPart):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BodyPart):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(BodyPart):
    # "none" turns the model's thinking off; any other effort leaves it on.
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
