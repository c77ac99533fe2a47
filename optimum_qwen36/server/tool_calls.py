"""Qwen3.6 tool calls, as the chat template asks the model to write them:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

parsed into OpenAI `tool_calls` (arguments as a JSON string, each value typed by the tool's JSON schema),
whole or incrementally: a call's id and name as soon as its `<function=...>` line is complete, then one
arguments fragment per completed parameter, so the fragments of a call concatenate to its JSON arguments.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .reasoning import held_back

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?")
PARAMETER_END = "</parameter>"
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_CALL_END = re.compile(r"\s*(?:</function>\s*)?</tool_call>")


@dataclass
class ToolCallDelta:
    """A piece of tool call `index`: the first carries its id and name, later ones arguments text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON object


@dataclass
class ToolParse:
    """What a piece of text holds: plain content, and tool-call deltas."""

    content: str = ""
    deltas: list[ToolCallDelta] = field(default_factory=list)


def resolve_schema(schema: Any, root: dict[str, Any]) -> Any:
    """`schema` with a local `$ref` (or a one-item allOf, as pydantic writes a referenced field) followed."""
    for _ in range(32):  # a reference cycle stops here
        if not isinstance(schema, dict):
            return schema
        if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) == 1:
            rest = {k: v for k, v in schema.items() if k != "allOf"}
            schema = {**resolve_schema(schema["allOf"][0], root), **rest}
            continue
        reference = schema.get("$ref")
        if not (isinstance(reference, str) and reference.startswith("#/")):
            return schema
        target: Any = root
        for part in reference[2:].split("/"):
            target = (
                target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
            )
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**target, **rest} if isinstance(target, dict) else rest
    return schema


def _types(schema: Any, root: dict[str, Any]) -> list[str]:
    schema = resolve_schema(schema, root)
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    if "properties" in schema:
        return ["object"]
    return [k for option in schema.get("anyOf", schema.get("oneOf", [])) for k in _types(option, root)]


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def typed_value(text: str, schema: Any, root: dict[str, Any] | None = None) -> Any:
    """A parameter's text as the value its JSON schema declares (the text itself when it is a string, the
    schema says nothing, or the text does not parse as the declared type); `root`: the tool's parameters
    schema, which the schema's `$ref`s point into."""
    kinds = _types(schema, root or {})
    for kind in kinds:
        if kind == "string":
            continue
        try:
            value = json.loads(text, parse_constant=_refuse_constant)  # NaN / Infinity are not JSON
        except ValueError:
            if kind == "boolean" and text.strip().lower() in ("true", "false"):
                return text.strip().lower() == "true"
            continue
        expected = {
            "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
            "boolean": lambda v: isinstance(v, bool),
            "object": lambda v: isinstance(v, dict),
            "array": lambda v: isinstance(v, list),
            "null": lambda v: v is None,
        }.get(kind)
        if expected is not None and expected(value):
            return value
        if kind == "integer" and isinstance(value, float) and value.is_integer():
            return int(value)
    return text


class ToolCallParser:
    """Feed content text deltas in order; `feed` returns the plain content and the tool-call deltas they
    complete; `finish()` what remains at the end (an unterminated call's parameters so far, closed)."""

    def __init__(self, tools: Sequence[dict[str, Any]]) -> None:
        self._parameters: dict[str, dict[str, Any]] = {}
        for tool in tools:
            function = tool.get("function", tool)
            self._parameters[function["name"]] = function.get("parameters") or {}
        self._pending = ""  # outside a call: a tail that may begin <tool_call>; inside: the call's text
        # Inside a call, how far into `_pending` no </parameter> can begin: a long value is scanned once,
        # not again with every delta.
        self._scanned = 0
        self._inside = False
        self._name: str | None = None  # the current call's function, once its header is parsed
        self._num_arguments = 0
        self._text_after_call = False
        self.calls: list[ToolCall] = []

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, delta: str) -> ToolParse:
        parse = ToolParse()
        text = self._pending + delta
        self._pending = ""
        while text:
            if not self._inside:
                start = text.find(CALL_START)
                if start == -1:
                    keep = held_back(text, (CALL_START,))
                    parse.content += self._outside(text[: len(text) - keep])
                    self._pending = text[len(text) - keep :]
                    return parse
                parse.content += self._outside(text[:start])
                text = text[start + len(CALL_START) :]
                self._inside = True
            text = self._parse_call(text, parse)
        return parse

    def _outside(self, text: str) -> str:
        # After a call the template's format leaves newlines (before the next call, or the end): they are
        # not an answer; text after them is.
        if self.calls and not self._text_after_call:
            text = text.lstrip()
            self._text_after_call = bool(text)
        return text

    def _parse_call(self, text: str, parse: ToolParse) -> str:
        """Consume what is complete of the current call; returns the text after it once it ended ('' while
        it goes on: the incomplete rest waits in `_pending`)."""
        position = 0
        if self._name is None:
            header = _FUNCTION.match(text)
            if header is None:
                self._pending = text
                return ""
            self._name = header.group(1).strip()
            self.calls.append(ToolCall(f"call_{secrets.token_hex(12)}", self._name, ""))
            parse.deltas.append(ToolCallDelta(len(self.calls) - 1, self.calls[-1].id, self._name))
            position = header.end()
        while True:
            if text.find(PARAMETER_END, position + self._scanned) == -1:
                self._scanned = max(0, len(text) - position - len(PARAMETER_END) + 1)
                break
            self._scanned = 0
            parameter = _PARAMETER.match(text, position)
            if parameter is None:
                break
            key = parameter.group(1).strip()
            parameters = self._parameters.get(self._name, {})
            schema = (parameters.get("properties") or {}).get(key)
            value = json.dumps(typed_value(parameter.group(2), schema, parameters), ensure_ascii=False)
            self._arguments(
                parse, ("{" if self._num_arguments == 0 else ", ") + f"{json.dumps(key)}: {value}"
            )
            self._num_arguments += 1
            position = parameter.end()
        end = _CALL_END.match(text, position)
        if end is None:
            self._pending = text[position:]
            return ""
        self._close(parse)
        return text[end.end() :]

    def _arguments(self, parse: ToolParse, fragment: str) -> None:
        self.calls[-1].arguments += fragment
        parse.deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=fragment))

    def _close(self, parse: ToolParse) -> None:
        self._arguments(parse, "}" if self._num_arguments else "{}")
        self._inside, self._name, self._num_arguments, self._scanned = False, None, 0, 0
        self._text_after_call = False

    def finish(self) -> ToolParse:
        parse = ToolParse()
        text, self._pending = self._pending, ""
        if not self._inside:
            parse.content = self._outside(text)
        elif self._name is None:  # never got a function name: it was text after all
            parse.content = CALL_START + text
            self._inside = False
        else:  # cut short (max_tokens): the parameters that were complete
            self._close(parse)
        return parse

    def parse(self, text: str) -> ToolParse:
        """The whole text at once."""
        parse = self.feed(text)
        rest = self.finish()
        parse.content += rest.content
        parse.deltas += rest.deltas
        return parse
