"""Chat requests: messages rendered with the model's chat template (tools, tool-call history, thinking on or
off), and the generated text split into reasoning, content and tool calls, whole or as stream deltas."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from .errors import bad_request
from .reasoning import ReasoningParser, Split
from .tool_calls import ToolCallDelta, ToolCallParser


def template_messages(messages: Sequence[BaseModel]) -> list[dict[str, Any]]:
    """Validated chat messages as the chat template reads them (the fields a client left out stay out)."""
    return [message.model_dump(exclude_none=True) for message in messages]


def _template_message(index: int, message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message as the template reads it: a developer message as the system message, tool-call
    arguments as mappings (clients send JSON text)."""
    message = dict(message)
    if message["role"] == "developer":
        message["role"] = "system"
    if message["role"] == "assistant" and message.get("reasoning") and not message.get("reasoning_content"):
        message["reasoning_content"] = message["reasoning"]
    calls = []
    for number, call in enumerate(message.get("tool_calls") or []):
        function = dict(call["function"])
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as error:
                raise bad_request(
                    f"messages[{index}].tool_calls[{number}].function.arguments is not valid JSON: {error}",
                    f"messages.{index}.tool_calls.{number}",
                ) from error
        if not isinstance(arguments, dict):
            raise bad_request(
                f"messages[{index}].tool_calls[{number}].function.arguments must be a JSON object.",
                f"messages.{index}.tool_calls.{number}",
            )
        calls.append({**call, "function": {**function, "arguments": arguments}})
    if calls:
        message["tool_calls"] = calls
    return message


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    template_kwargs: dict[str, Any],
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text; a message the template refuses is a 400 with the template's reason."""
    rendered = [_template_message(i, m) for i, m in enumerate(messages)]
    try:
        return tokenizer.apply_chat_template(
            rendered,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
    except Exception as error:  # jinja's TemplateError, raise_exception, or a bad kwarg
        raise bad_request(
            f"The chat template could not render these messages: {error}", "messages"
        ) from error


@dataclass
class ChatPrompt:
    """A rendered chat prompt: its text, its token ids, and how many of them are the conversation so far
    (`history`: everything before the generation prompt, which the next turn renders again while its
    template writes this turn's answer differently), None when that is not a token prefix."""

    text: str
    token_ids: list[int]
    history: int | None


def encode_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    template_kwargs: dict[str, Any],
) -> ChatPrompt:
    """The prompt with the generation prompt, tokenized as the history's tokens then the generation prompt's
    when the generation prompt starts with an added token (tokenizers split those out first, so the two
    parts tokenize as the whole does); else as one text, without a history length."""
    text = render_chat(tokenizer, messages, tools, template_kwargs)
    history = render_chat(tokenizer, messages, tools, template_kwargs, add_generation_prompt=False)
    suffix = text[len(history) :]
    added = tuple(tokenizer.added_tokens_encoder)
    if not text.startswith(history) or not suffix.startswith(added):
        return ChatPrompt(text, tokenizer.encode(text, add_special_tokens=False), None)
    history_ids = tokenizer.encode(history, add_special_tokens=False)
    ids = history_ids + tokenizer.encode(suffix, add_special_tokens=False)
    return ChatPrompt(text, ids, len(history_ids))


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutputParser:
    """Generated text -> reasoning (if the prompt opened a think block), then content, in which tool calls
    are parsed (if the request has tools and tool_choice is not 'none')."""

    def __init__(self, in_reasoning: bool, tools: list[dict[str, Any]] | None) -> None:
        self.reasoning = ReasoningParser(in_reasoning)
        self.tools = ToolCallParser(tools) if tools else None

    def feed(self, text: str) -> ChatDelta:
        return self._content(self.reasoning.feed(text), final=False)

    def finish(self) -> ChatDelta:
        return self._content(self.reasoning.finish(), final=True)

    def _content(self, split: Split, final: bool) -> ChatDelta:
        delta = ChatDelta(reasoning=split.reasoning)
        if self.tools is None:
            delta.content = split.content
            return delta
        parse = self.tools.feed(split.content)
        if final:
            rest = self.tools.finish()
            parse.content += rest.content
            parse.deltas += rest.deltas
        delta.content, delta.tool_calls = parse.content, parse.deltas
        return delta

    @property
    def called_tools(self) -> bool:
        return self.tools is not None and self.tools.called
