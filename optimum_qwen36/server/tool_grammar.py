"""The grammar (llguidance's lark dialect) of forced tool calls (tool_choice 'required' or a named function):
calls in the chat template's format (`<tool_call>`, `<function=NAME>`, one `<parameter=KEY>` block per
argument: tool_calls.py shows it) whose parameters follow each tool's JSON schema, so a forced call always
parses into arguments valid under that schema.

Parameters come in the order the schema declares them (the order the template shows the model), each
required one present, no undeclared one. The template writes a string value as raw text and any other value
as JSON, and the parser reads them back that way (`tool_calls.typed_value`): so a string is free text
(within its enum, const, pattern or length), and a number, boolean, null, object or array is JSON valid
under its schema (llguidance's `%json`). A tool without declared properties takes any parameters.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llguidance import regex_to_lark

from .tool_calls import CALL_END, CALL_START, resolve_schema

PARAMETER_END = "\n</parameter>\n"
# Free text that cannot end a parameter early (the parser cuts a value at its first </parameter>).
_TEXT = r"/(?s:.*)/ & ~/(?s:.*)<\/parameter>(?s:.*)/"
_JSON_TYPES = ("null", "boolean", "integer", "number", "object", "array")


def forced_tool_grammar(
    tools: list[dict[str, Any]], name: str | None, parallel: bool, added_tokens: Mapping[str, int]
) -> str:
    """Calls of the function `name` (one call), or of any of `tools` (tool_choice 'required': one call, or
    one or more when `parallel`). `added_tokens`: the tokenizer's added tokens (text to id); a call marker
    that is one of them is that token, as the model writes it (llguidance never lets free text spell an
    added token)."""

    def marker(text: str) -> str:
        return f"<[{added_tokens[text]}]>" if text in added_tokens else _literal(text)

    chosen = [tool["function"] for tool in tools if name is None or tool["function"]["name"] == name]
    grammar = _Grammar()
    functions = " | ".join(grammar.function(function) for function in chosen)
    repeat = "+" if parallel and name is None else ""
    start, end = marker(CALL_START), marker(CALL_END)
    grammar.rules[:0] = [
        f"start: /\\n*/ call{repeat}",
        f'call: {start} "\\n<function=" ({functions}) "</function>\\n" {end} /\\n*/',
    ]
    return "\n".join(grammar.rules)


class _Grammar:
    def __init__(self) -> None:
        self.rules: list[str] = []
        self._count = 0

    def rule(self, body: str, options: str = "") -> str:
        """A new rule for `body`; its name."""
        self._count += 1
        name = f"r{self._count}"
        self.rules.append(f"{name}{options}: {body}")
        return name

    def function(self, function: dict[str, Any]) -> str:
        """The rule of one function's header rest and parameters (after `<function=`)."""
        schema = function.get("parameters") or {}
        properties = schema.get("properties")
        header = _literal(function["name"] + ">\n")
        if not isinstance(properties, dict) or not properties:
            # Nothing declared: any parameters, each a free value.
            key = r"/[^>\n]+/"
            parameter = self.rule(f'"<parameter=" {key} ">\\n" {self.text_value()}')
            return self.rule(f"{header} {parameter}*")
        required = set(schema.get("required") or ())
        parts = [header]
        for key, property_schema in properties.items():
            value = self.value(property_schema, schema)
            opening = _literal(f"<parameter={key}>\n")
            parameter = self.rule(f"{opening} {value}")
            parts.append(parameter if key in required else f"{parameter}?")
        return self.rule(" ".join(parts))

    def value(self, schema: Any, root: dict[str, Any]) -> str:
        """A rule for a parameter's value as the template writes it, then the parameter's end."""
        return self.rule(" | ".join(self.alternatives(schema, root)))

    def alternatives(self, schema: Any, root: dict[str, Any]) -> list[str]:
        schema = resolve_schema(schema, root)
        if not isinstance(schema, dict) or not schema:
            return [self.text_value()]
        if "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            return [f"{_literal(_as_written(v))} {_literal(PARAMETER_END)}" for v in values]
        for union in ("anyOf", "oneOf"):
            if isinstance(schema.get(union), list) and schema[union]:
                return [alt for option in schema[union] for alt in self.alternatives(option, root)]
        kinds = schema.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not isinstance(kinds, list):
            kinds = ["object"] if "properties" in schema else []
        if not kinds:
            return [self.text_value()]
        alternatives = []
        for kind in kinds:
            if kind == "string":
                alternatives.append(self.string_value(schema))
            elif kind in _JSON_TYPES:
                typed = {**schema, "type": kind}
                for definitions in ("$defs", "definitions"):
                    if definitions in root:
                        typed.setdefault(definitions, root[definitions])
                alternatives.append(f"%json {json.dumps(typed)} {_literal(PARAMETER_END)}")
        return alternatives or [self.text_value()]

    def text_value(self) -> str:
        return self.rule(_TEXT, f"[suffix={_literal(PARAMETER_END)}]")

    def string_value(self, schema: dict[str, Any]) -> str:
        """Raw text within the string schema's pattern and length bounds."""
        low, high = schema.get("minLength"), schema.get("maxLength")
        terms = [_TEXT]
        if isinstance(low, int) or isinstance(high, int):
            terms.append(
                f"/(?s:.){{{low if isinstance(low, int) else 0},{high if isinstance(high, int) else ''}}}/"
            )
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            terms.append(f"/{_anchored(pattern)}/")
        return self.rule(" & ".join(terms), f"[suffix={_literal(PARAMETER_END)}]")


def _as_written(value: Any) -> str:
    """A value as the template writes it into a parameter: a string as itself, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _anchored(pattern: str) -> str:
    """A JSON Schema pattern (a search: it may match anywhere) as a regex over the whole value."""
    anchored_start = pattern.startswith("^")
    anchored_end = pattern.endswith("$") and not pattern.endswith("\\$")
    body = pattern[int(anchored_start) : len(pattern) - int(anchored_end)]
    body = regex_to_lark(body, "dw")
    return ("" if anchored_start else "(?s:.*)") + f"(?:{body})" + ("" if anchored_end else "(?s:.*)")
