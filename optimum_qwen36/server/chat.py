"""Chat requests: messages rendered with the model's chat template (tools, tool-call history, thinking on or
off), and the generated text split into reasoning, content and tool calls, whole or as stream deltas."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .errors import bad_request
from .reasoning import ReasoningParser, Split
from .tool_calls import ToolCallDelta, ToolCallParser


def _check_content(index: int, content: Any) -> None:
    """Content is a string, None or a list of text parts: this server runs the text model, so an image or
    audio part is refused by name instead of being dropped or rendered as placeholder tokens."""
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise bad_request(
            f"messages[{index}].content must be a string or a list of content parts.",
            f"messages.{index}.content",
        )
    for number, part in enumerate(content):
        kind = part.get("type", "text") if isinstance(part, dict) else None
        where = f"messages[{index}].content[{number}]"
        if kind == "text" and not isinstance(part.get("text"), str):
            raise bad_request(f"{where} is a text part without a string 'text'.", f"messages.{index}.content")
        if kind != "text":
            raise bad_request(
                f"{where} is "
                + (f"a '{kind}' part" if isinstance(kind, str) else "not a content part")
                + ": this server runs the text model and takes only {'type': 'text', 'text': ...} parts.",
                f"messages.{index}.content.{number}",
            )


def _template_message(index: int, message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message as the template reads it: tool-call arguments as mappings (clients send JSON)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad_request(f"messages[{index}] must be an object with a 'role'.", f"messages.{index}")
    _check_content(index, message.get("content"))
    message = dict(message)
    if message["role"] == "assistant" and message.get("reasoning") and not message.get("reasoning_content"):
        message["reasoning_content"] = message["reasoning"]
    calls = []
    for number, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise bad_request(
                f"messages[{index}].tool_calls[{number}] must be an object with a 'function' object.",
                f"messages.{index}.tool_calls.{number}",
            )
        function = dict(function)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as error:
                raise bad_request(
                    f"messages[{index}].tool_calls[{number}].function.arguments is not valid JSON: {error}",
                    f"messages.{index}.tool_calls.{number}",
                ) from error
        if not isinstance(arguments, dict) or not isinstance(function.get("name"), str):
            raise bad_request(
                f"messages[{index}].tool_calls[{number}] needs function.name and JSON-object arguments.",
                f"messages.{index}.tool_calls.{number}",
            )
        calls.append({**call, "function": {**function, "arguments": arguments}})
    if calls:
        message["tool_calls"] = calls
    return message


def check_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    for index, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise bad_request(f"tools[{index}] must be {{'type': 'function', 'function': {{...}}}}.", "tools")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"tools[{index}].function.name is missing.", "tools")
    return list(tools or [])


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


def forced_tool_grammar(tools: list[dict[str, Any]], name: str | None) -> str:
    """A lark grammar (llguidance) for content that is one or more calls in the template's format: of the
    named function, or of any of `tools` (tool_choice 'required')."""
    names = [name] if name is not None else [t["function"]["name"] for t in tools]
    alternatives = " | ".join(json.dumps(n) for n in names)
    return "\n".join(
        [
            r"start: /\n*/ call+",
            r'call: "<tool_call>\n<function=" NAME ">\n" param* "</function>\n</tool_call>" /\n*/',
            r'param: "<parameter=" /[^>\n]+/ ">\n" value',
            # A value is any text (`<` included) up to the first </parameter> (llguidance's lazy suffix).
            r'value[suffix="</parameter>\n"]: /(?s:.*)/',
            f"NAME: {alternatives}",
        ]
    )
