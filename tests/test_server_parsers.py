"""The server's reasoning and tool-call parsers on real Qwen3.6 output text, whole and cut at every point a
stream could cut it (each character boundary, and each token of the real tokenizer)."""

from __future__ import annotations

import json
from typing import Literal

import pydantic
import pytest
import torch
from chat_model import CONVERSATIONS, WEATHER_ARGUMENTS, WEATHER_TOOL
from chat_model import WEATHER_CALL as WEATHER_CALL_TEXT

from optimum_qwen36.server.chat import ChatDelta, ChatOutputParser, render_chat
from optimum_qwen36.server.reasoning import ReasoningParser, prompt_opens_reasoning
from optimum_qwen36.server.tool_calls import ToolCallParser, typed_value
from optimum_qwen36.tokenizer import load_qwen36_tokenizer

TWO_CALLS = (
    "Let me look both up.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
    "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
    "<function=get_weather>\n<parameter=city>\nNew\nYork <b>\n</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_qwen36_tokenizer()


def run(parser: ChatOutputParser, pieces: list[str]) -> tuple[str, str, list[dict]]:
    """Feed the pieces, then finish; returns (reasoning, content, calls from the deltas)."""
    total = ChatDelta()
    for piece in [*pieces, None]:
        delta = parser.finish() if piece is None else parser.feed(piece)
        total.reasoning += delta.reasoning
        total.content += delta.content
        total.tool_calls += delta.tool_calls
    calls: list[dict] = []
    for delta in total.tool_calls:
        if delta.id is not None:
            assert delta.index == len(calls) and delta.name
            calls.append({"id": delta.id, "name": delta.name, "arguments": ""})
        calls[delta.index]["arguments"] += delta.arguments
    return total.reasoning, total.content, calls


def splits(text: str) -> list[list[str]]:
    """Every cut in two, and one character at a time."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


def calls_of(parsed: tuple[str, str, list[dict]]) -> list[tuple[str, str]]:
    return [(c["name"], c["arguments"]) for c in parsed[2]]


@pytest.mark.parametrize("name", ["tool_call", "tool_answer", "thinking"])
def test_every_split_of_trained_answers_parses_like_the_whole(name: str) -> None:
    text = CONVERSATIONS[name].answer
    whole = run(ChatOutputParser(True, [WEATHER_TOOL]), [text])
    for pieces in splits(text):
        got = run(ChatOutputParser(True, [WEATHER_TOOL]), pieces)
        assert got[:2] == whole[:2], pieces
        assert calls_of(got) == calls_of(whole)


def test_tool_call_answer_parses_into_typed_arguments() -> None:
    reasoning, content, calls = run(
        ChatOutputParser(True, [WEATHER_TOOL]), [CONVERSATIONS["tool_call"].answer]
    )
    assert reasoning == "The user wants the forecast: I call the tool.\n"
    assert content == ""
    assert [c["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == WEATHER_ARGUMENTS  # days is the integer 3: the schema says so
    assert calls[0]["id"].startswith("call_")


def test_token_by_token_like_a_stream(tokenizer) -> None:
    ids = tokenizer.encode(TWO_CALLS, add_special_tokens=False)
    pieces = [tokenizer.decode(ids[: i + 1])[len(tokenizer.decode(ids[:i])) :] for i in range(len(ids))]
    assert "".join(pieces) == TWO_CALLS
    reasoning, content, calls = run(ChatOutputParser(True, [WEATHER_TOOL]), pieces)
    assert reasoning == "Let me look both up.\n"
    assert content == "Checking.\n\n"
    assert [json.loads(c["arguments"]) for c in calls] == [WEATHER_ARGUMENTS, {"city": "New\nYork <b>"}]
    assert len({c["id"] for c in calls}) == 2
    for pieces in splits(TWO_CALLS):
        got = run(ChatOutputParser(True, [WEATHER_TOOL]), pieces)
        assert got[:2] == (reasoning, content) and calls_of(got) == [
            (c["name"], c["arguments"]) for c in calls
        ]


def test_text_after_a_call_keeps_its_own_whitespace() -> None:
    text = WEATHER_CALL_TEXT + "\n\nLine 1\n\n  Line 2\n"
    for pieces in splits(text):
        _, content, calls = run(ChatOutputParser(False, [WEATHER_TOOL]), pieces)
        assert content == "Line 1\n\n  Line 2\n" and len(calls) == 1


def test_not_json_constants_stay_strings() -> None:
    assert typed_value("NaN", {"type": "number"}) == "NaN"
    assert typed_value("Infinity", {"type": "number"}) == "Infinity"


def test_tool_call_inside_reasoning_ends_it() -> None:
    text = (
        "I will call it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    for pieces in splits(text):
        reasoning, content, calls = run(ChatOutputParser(True, [WEATHER_TOOL]), pieces)
        assert reasoning == "I will call it.\n" and content == ""
        assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Rome"}]


def test_without_tools_the_call_text_is_content() -> None:
    reasoning, content, calls = run(ChatOutputParser(False, None), [CONVERSATIONS["tool_call"].answer])
    assert reasoning == "" and calls == []
    assert content.startswith("The user wants") and "<tool_call>" in content


def test_reasoning_cut_short_stays_reasoning() -> None:
    parser = ReasoningParser(in_reasoning=True)
    assert parser.parse("Still thinking </thi").reasoning == "Still thinking </thi"
    assert ReasoningParser(in_reasoning=False).parse("\n\nAnswer </think> x").content == "Answer </think> x"


def test_call_cut_short_keeps_complete_parameters() -> None:
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2"
    _, content, calls = run(ChatOutputParser(False, [WEATHER_TOOL]), [text])
    assert content == "" and json.loads(calls[0]["arguments"]) == {"city": "Oslo"}
    # Never got a function name: it was text.
    assert run(ChatOutputParser(False, [WEATHER_TOOL]), ["a <tool_call> b"])[1] == "a <tool_call> b"


def test_prompt_opens_reasoning(tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert prompt_opens_reasoning(render_chat(tokenizer, messages, [], {"enable_thinking": True}))
    assert not prompt_opens_reasoning(render_chat(tokenizer, messages, [], {"enable_thinking": False}))


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        ("3", {"type": "integer"}, 3),
        ("3", {"type": "string"}, "3"),
        ("2.5", {"type": "number"}, 2.5),
        ("True", {"type": "boolean"}, True),
        ('{"a": [1]}', {"type": "object"}, {"a": [1]}),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("null", {"type": ["integer", "null"]}, None),
        ("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 7),
        ("seven", {"type": "integer"}, "seven"),  # not what the schema says: kept as the model wrote it
        ("3", None, "3"),
    ],
)
def test_typed_value(text: str, schema: dict | None, value: object) -> None:
    assert typed_value(text, schema) == value


def test_parser_without_the_function_wrapper_is_not_fooled() -> None:
    parser = ToolCallParser([WEATHER_TOOL])
    parse = parser.parse("Plain answer with a < sign and <tool_ mention.")
    assert parse.content == "Plain answer with a < sign and <tool_ mention." and not parser.called


def test_a_long_streamed_value_is_scanned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter value streamed one character at a time is searched for its end as it grows (linear),
    not re-parsed from its start on every delta (quadratic in the value's length)."""
    from optimum_qwen36.server import tool_calls

    matches = 0
    pattern = tool_calls._PARAMETER

    class Counting:
        def match(self, text: str, position: int = 0):
            nonlocal matches
            matches += 1
            return pattern.match(text, position)

    monkeypatch.setattr(tool_calls, "_PARAMETER", Counting())
    value = "line of a file\n" * 2000
    call = "<tool_call>\n<function=write>\n<parameter=content>\n{}\n</parameter>\n</function>\n</tool_call>"
    text = call.format(value)
    parser = ToolCallParser([{"type": "function", "function": {"name": "write", "parameters": {}}}])
    deltas = [d for ch in text for d in parser.feed(ch).deltas] + parser.finish().deltas
    assert matches <= len("</parameter>") + 1
    assert json.loads("".join(d.arguments for d in deltas)) == {"content": value}


@pytest.mark.parametrize(
    ("value", "accepted"),
    [("Paris", True), ("a < b and <i>x</i>, </param>", True), ("ab\n</parameter>\nzz", False)],
)
def test_forced_tool_call_values_may_hold_any_text(
    tokenizer, ll_tokenizer, value: str, accepted: bool
) -> None:
    """tool_choice 'required' / named: a string parameter's value is any text up to the first </parameter>
    (the <tool_call> tags are their added tokens, as the model writes them)."""
    name = WEATHER_TOOL["function"]["name"]
    text = (
        f"<tool_call>\n<function={name}>\n<parameter=city>\n{value}\n</parameter>\n</function>\n</tool_call>"
    )
    assert _forced_call_accepts(tokenizer, ll_tokenizer, [WEATHER_TOOL], None, text) == accepted


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=tokenizer.eos_token_id)


def _forced_call_accepts(
    tokenizer, ll, tools: list[dict], name: str | None, text: str, parallel: bool = True
) -> bool:
    """Whether the forced-call grammar of `tools` accepts `text`, as the tokenizer encodes it."""
    import llguidance

    from optimum_qwen36.server.tool_grammar import forced_tool_grammar

    grammar = forced_tool_grammar(tools, name, parallel, tokenizer.added_tokens_encoder)
    matcher = llguidance.LLMatcher(ll, llguidance.grammar_from("lark", grammar))
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (
        matcher.validate_tokens(ids) == len(ids)
        and bool(matcher.consume_tokens(ids))
        and matcher.is_accepting()
    )


def _call(function: str, /, **arguments: str) -> str:
    """A call in the template's format, each argument written as the template writes it."""
    parameters = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in arguments.items())
    return f"<tool_call>\n<function={function}>\n{parameters}</function>\n</tool_call>"


class _Address(pydantic.BaseModel):
    street: str
    zip: int


class _Person(pydantic.BaseModel):
    name: str
    kind: Literal["a", "b"]
    address: _Address  # pydantic writes it as a $ref into $defs
    tags: list[str] | None = None


_PERSON_TOOL = {"type": "function", "function": {"name": "person", "parameters": _Person.model_json_schema()}}
_ADDRESS = json.dumps({"street": "x", "zip": 1})


@pytest.mark.parametrize(
    ("text", "accepted"),
    [
        (_call("person", name="Ada", kind="a", address=_ADDRESS), True),
        (_call("person", name="Ada", kind="b", address=_ADDRESS, tags='["x"]'), True),
        (_call("person", name="Ada", kind="a", address=_ADDRESS, tags="null"), True),
        (_call("person", name="Ada", kind="a"), False),  # a required parameter missing
        (_call("person", name="Ada", kind="c", address=_ADDRESS), False),  # outside the enum
        (_call("person", name="Ada", kind="a", address=_ADDRESS.replace("1", '"1"')), False),  # zip a string
        (_call("person", name="Ada", kind="a", address=_ADDRESS, age="3"), False),  # undeclared
        (_call("person", kind="a", name="Ada", address=_ADDRESS), False),  # not in the declared order
        (_call("other", name="Ada", kind="a", address=_ADDRESS), False),
    ],
)
def test_forced_tool_calls_follow_the_parameters_schema(
    tokenizer, ll_tokenizer, text: str, accepted: bool
) -> None:
    """Names, types, enums, required parameters and nested $ref schemas, in the template's format."""
    assert _forced_call_accepts(tokenizer, ll_tokenizer, [_PERSON_TOOL], None, text) == accepted
    if accepted:  # and the parser reads back arguments valid under the schema
        (call,) = ToolCallParser([_PERSON_TOOL]).parse(text).deltas[:1]
        deltas = ToolCallParser([_PERSON_TOOL]).parse(text).deltas
        _Person.model_validate_json("".join(d.arguments for d in deltas))
        assert call.name == "person"


@pytest.mark.parametrize(
    ("schema", "value", "accepted"),
    [
        ({"type": "string", "pattern": "^[A-Z]{3}$"}, "ABC", True),
        ({"type": "string", "pattern": "^[A-Z]{3}$"}, "ABCD", False),
        ({"type": "string", "maxLength": 3}, "abcd", False),
        ({"type": ["integer", "null"]}, "null", True),
        ({"type": ["integer", "null"]}, "1.5", False),
        ({"anyOf": [{"type": "integer"}, {"type": "string", "enum": ["auto"]}]}, "auto", True),
        ({"type": "boolean"}, "true", True),
        ({"const": 3}, "3", True),
    ],
)
def test_forced_tool_call_values_follow_their_schema(
    tokenizer, ll_tokenizer, schema: dict, value: str, accepted: bool
) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"v": schema}}}}
    assert _forced_call_accepts(tokenizer, ll_tokenizer, [tool], "f", _call("f", v=value)) == accepted


def test_forced_calls_repeat_only_for_required_with_parallel_calls(tokenizer, ll_tokenizer) -> None:
    two = _call("get_weather", city="Paris") + "\n" + _call("get_weather", city="Rome")
    assert _forced_call_accepts(tokenizer, ll_tokenizer, [WEATHER_TOOL], None, two)
    assert not _forced_call_accepts(tokenizer, ll_tokenizer, [WEATHER_TOOL], None, two, parallel=False)
    assert not _forced_call_accepts(tokenizer, ll_tokenizer, [WEATHER_TOOL], "get_weather", two)


def test_a_grammar_constraint_is_rebuilt_in_another_process(tmp_path) -> None:
    """Tensor-parallel workers receive the constraint pickled: it is rebuilt from its grammar and its
    tokenizer's directory with a fresh matcher, and allows what the original allows, token after token."""
    import pickle

    from optimum_qwen36.server.structured import StructuredOutput
    from optimum_qwen36.tokenizer import save_qwen36_tokenizer

    save_qwen36_tokenizer(tmp_path)
    tokenizer = load_qwen36_tokenizer(tmp_path)
    structured = StructuredOutput(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    original = structured.json_constraint(schema, gate=None)
    copy = pickle.loads(pickle.dumps(original))
    assert copy is not original and copy.grammar == original.grammar
    for token in tokenizer.encode('{"age":42}', add_special_tokens=False):
        allowed = original.allowed_tokens(len(tokenizer))
        assert torch.equal(copy.allowed_tokens(len(tokenizer)), allowed) and allowed[token]
        original.accept(token)
        copy.accept(token)
    with pytest.raises(TypeError, match="has accepted tokens"):
        pickle.dumps(original)
    built_in_memory = load_qwen36_tokenizer()
    built_in_memory.name_or_path = "not-a-directory"
    in_memory = StructuredOutput(built_in_memory, len(tokenizer), tokenizer.eos_token_id)
    with pytest.raises(TypeError, match="not loaded from a directory"):
        pickle.dumps(in_memory.json_constraint(schema, gate=None))
