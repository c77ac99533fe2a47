"""POST /v1/responses (OpenAI's Responses API) over the same engine as chat: the input (text, or messages,
function calls, their outputs and reasoning items) and `instructions` become a chat request, its one choice's
text is split into reasoning, a message and function calls, and those become the response's output items,
whole or as the API's stream of typed events.

`previous_response_id` continues a conversation kept in this server's memory: the last
`ServerSettings.max_stored_responses` responses made with `store` (the default), lost on restart; an id not
among them is refused, and the client sends the conversation as input instead. GET /v1/responses/{id}
returns a stored response.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from .chat import ChatDelta, ChatOutputParser
from .chat_completions import PreparedChat, prepare_chat
from .errors import OpenAIError, bad_request, internal_error
from .openai_server import OpenAIServer
from .protocol import ChatCompletionRequest
from .reasoning import THINK_END
from .responses import Choice, EventStream, until_disconnected
from .responses_api_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    ImageContent,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)
from .runs import ChoiceRuns
from .served import ServedModel


@dataclass
class _Stored:
    response: dict[str, Any]
    # The conversation through this response, as chat messages (without its instructions, which a
    # follow-up does not inherit).
    messages: list[dict[str, Any]]


class ResponsesAPI:
    """The Responses API endpoints of one server, and the responses it keeps for follow-ups."""

    def __init__(self, server: OpenAIServer) -> None:
        self.server = server
        self._stored: OrderedDict[str, _Stored] = OrderedDict()

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        server = self.server
        server.ready()
        server.check_model(body.model)
        _refuse_unserved(body)
        history = self._history(body.previous_response_id)
        _check_images(body.input, server.ready())
        messages = history + _chat_messages(body.input)
        response_id = f"resp_{uuid.uuid4().hex}"
        server.admit(1)  # before the grammars are built
        prepared = await prepare_chat(
            server, _chat_request(body, messages, server.settings.served_model_name), response_id
        )
        runs = server.run_choices(prepared.requests)
        response = _Response(self, response_id, body, prepared, messages)
        if body.stream:
            await until_disconnected(request, runs.start(), runs)
            return EventStream(response.events(runs), runs)
        await until_disconnected(request, response.collect(runs), runs)
        response.finish_output()
        return JSONResponse(response.final())

    def retrieve(self, response_id: str) -> dict[str, Any]:
        self.server.ready()
        stored = self._stored.get(response_id)
        if stored is None:
            raise OpenAIError(404, _not_kept(response_id), "response_id", "response_not_found")
        return stored.response

    def keep(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self._stored[response["id"]] = _Stored(response, messages)
        while len(self._stored) > self.server.settings.max_stored_responses:
            self._stored.popitem(last=False)

    def _history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        if previous_response_id is None:
            return []
        stored = self._stored.get(previous_response_id)
        if stored is None:
            raise OpenAIError(
                400, _not_kept(previous_response_id), "previous_response_id", "previous_response_not_found"
            )
        self._stored.move_to_end(previous_response_id)
        return list(stored.messages)


def _not_kept(response_id: str) -> str:
    return (
        f"The response {response_id!r} is not in this server's memory: it keeps the last responses made "
        "with store: true, in memory only (lost on restart). Send the conversation as input instead."
    )


def _refuse_unserved(body: ResponsesRequest) -> None:
    if body.background:
        raise bad_request(
            "background responses are not served: this server answers while you wait.", "background"
        )
    if body.conversation is not None:
        raise bad_request(
            "conversation objects are not served: use previous_response_id, or send the conversation as "
            "input.",
            "conversation",
        )
    if body.truncation == "auto":
        raise bad_request(
            "truncation 'auto' is not served: this server never drops input; shorten the input instead.",
            "truncation",
        )
    wanted = [item for item in body.include or [] if item.endswith("logprobs")]
    if wanted:
        raise bad_request(
            f"include {wanted[0]!r} is not served: this server returns no log-probabilities here.", "include"
        )


def _check_images(input_: str | list[Any], model: ServedModel) -> None:
    """Images come in user messages, to a model with a vision tower: the first that does not is refused."""
    if isinstance(input_, str):
        return
    for i, item in enumerate(input_):
        if not isinstance(item, MessageItem) or isinstance(item.content, str):
            continue
        for j, part in enumerate(item.content):
            if not isinstance(part, ImageContent):
                continue
            where = f"input.{i}.content.{j}"
            if item.role != "user":
                raise bad_request(
                    f"{where} is an image in a {item.role} message: images come from the user.", where
                )
            if model.images is None:
                raise bad_request(
                    f"{where} is an image, but this model takes text only (serve a Qwen3.5 / Qwen3.6 "
                    "checkpoint with its vision tower to send images).",
                    where,
                )


def _user_content(content: str | list[Any]) -> str | list[dict[str, Any]]:
    """A user message's content for chat: its text, or its text and image parts."""
    if isinstance(content, str) or not any(isinstance(part, ImageContent) for part in content):
        return _text(content)
    return [
        {"type": "image_url", "image_url": {"url": part.image_url}}
        if isinstance(part, ImageContent)
        else {"type": "text", "text": getattr(part, "text", None) or getattr(part, "refusal", "")}
        for part in content
    ]


def _text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "".join(getattr(part, "text", None) or getattr(part, "refusal", "") for part in content)


def _chat_messages(input_: str | list[Any]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: a reasoning item goes to the assistant turn after it, and a
    function call joins the assistant turn it follows (the template writes a turn's text, then its calls)."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None

    def assistant_turn() -> dict[str, Any]:
        nonlocal reasoning
        if not messages or messages[-1]["role"] != "assistant" or reasoning is not None:
            messages.append({"role": "assistant", "content": ""})
        if reasoning is not None:
            messages[-1]["reasoning_content"] = reasoning
            reasoning = None
        return messages[-1]

    for item in input_:
        if isinstance(item, ReasoningItem):
            parts = item.content if item.content else item.summary
            reasoning = "".join(part.text for part in parts)
        elif isinstance(item, MessageItem) and item.role == "assistant":
            turn = assistant_turn()
            turn["content"] = turn["content"] + _text(item.content)
        elif isinstance(item, MessageItem) and item.role == "user":
            messages.append({"role": "user", "content": _user_content(item.content)})
        elif isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function"}
            call["function"] = {"name": item.name, "arguments": item.arguments}
            assistant_turn().setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return messages


def _chat_request(
    body: ResponsesRequest, messages: list[dict[str, Any]], model: str
) -> ChatCompletionRequest:
    """The chat request that generates this response (its instructions first, as the system message)."""
    system = [m["content"] for m in messages[:1] if m["role"] in ("system", "developer")]
    rest = messages[len(system) :]
    instructions = "\n\n".join([*([body.instructions] if body.instructions else []), *system])
    chat: dict[str, Any] = {
        "model": model,
        "messages": ([{"role": "system", "content": instructions}] if instructions else []) + rest,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls,
        "user": body.user,
    }
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type"})}
            for tool in body.tools
        ]
    if isinstance(body.tool_choice, FunctionToolChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    text_format = body.text.format if body.text else None
    if text_format is not None and text_format.type == "json_schema":
        schema = {
            "name": text_format.name or "response",
            "schema": text_format.schema_,
            "strict": text_format.strict,
        }
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif text_format is not None:
        chat["response_format"] = {"type": text_format.type}
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": body.reasoning.effort != "none"}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as error:  # the input items made a conversation chat cannot take
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise bad_request(f"The input does not make a valid conversation: {problems}.", "input") from error


@dataclass
class _Item:
    """An output item being built: its payload, and for a text item the text so far."""

    payload: dict[str, Any]
    index: int
    text: str = ""


@dataclass
class _Output:
    """Output items made from the parsed text, in order, with the stream events that build them."""

    items: list[dict[str, Any]] = field(default_factory=list)
    open: _Item | None = None

    def feed(self, delta: ChatDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls:
            if call.id is not None:
                events += self.close()
                item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress"}
                item.update(call_id=call.id, name=call.name, arguments="")
                events += self._open(item)
            if call.arguments:
                self.open.payload["arguments"] += call.arguments
                events.append(self._event("response.function_call_arguments.delta", delta=call.arguments))
        return events

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """End the open item (if any)."""
        item, self.open = self.open, None
        if item is None:
            return []
        payload = {**item.payload, "status": status}
        kind = payload["type"]
        events = []
        if kind == "function_call":
            events.append(_at(item, "response.function_call_arguments.done", arguments=payload["arguments"]))
        else:
            part = _part(kind, item.text)
            text_done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            events.append(_at(item, text_done, content_index=0, text=item.text, **extra))
            events.append(_at(item, "response.content_part.done", content_index=0, part=part))
            payload["content"] = [part]
        events.append({"type": "response.output_item.done", "output_index": item.index, "item": payload})
        self.items.append(payload)
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open.payload["type"] != kind:
            events += self.close()
            prefix = "rs" if kind == "reasoning" else "msg"
            item: dict[str, Any] = {
                "id": f"{prefix}_{uuid.uuid4().hex}",
                "type": kind,
                "status": "in_progress",
            }
            item.update(
                {"summary": [], "content": []}
                if kind == "reasoning"
                else {"role": "assistant", "content": []}
            )
            events += self._open(item)
            events.append(self._event("response.content_part.added", content_index=0, part=_part(kind, "")))
        self.open.text += text
        if kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", content_index=0, delta=text))
        else:
            events.append(self._event("response.output_text.delta", content_index=0, delta=text, logprobs=[]))
        return events

    def _open(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        self.open = _Item(payload, len(self.items))
        return [{"type": "response.output_item.added", "output_index": self.open.index, "item": payload}]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return _at(self.open, kind, **fields)


def _at(item: _Item, kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "item_id": item.payload["id"], "output_index": item.index, **fields}


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Response:
    """One response being generated: its output items and its envelope, collected or streamed."""

    def __init__(
        self,
        api: ResponsesAPI,
        response_id: str,
        body: ResponsesRequest,
        prepared: PreparedChat,
        messages: list[dict[str, Any]],
    ) -> None:
        self.api = api
        self.id = response_id
        self.body = body
        self.choice: Choice = prepared.choices[0]
        self.parser: ChatOutputParser = prepared.parsers[0]
        self.messages = messages
        self.created_at = int(time.time())
        self.output = _Output()
        model = api.server.ready()
        self.tokenizer = model.tokenizer
        self.defaults = model.generation_defaults

    async def collect(self, runs: ChoiceRuns) -> None:
        await runs.start()
        async for _, output in runs:
            self.choice.add(output)
        self.output.feed(self.parser.feed(self.choice.text))

    def finish_output(self) -> list[dict[str, Any]]:
        """Parse the end of the text and close the last item, once generation ended; their events."""
        events = self.output.feed(self.parser.finish())
        return events + self.output.close(self._status())

    def final(self) -> dict[str, Any]:
        """The whole response (kept for follow-ups if `store`)."""
        response = self._envelope(self._status(), self.output.items, self._usage())
        if self.body.store:
            self.api.keep(response, [*self.messages, _assistant_turn(self.output.items)])
        return response

    async def events(self, runs: ChoiceRuns) -> AsyncIterator[str]:
        sequence = 0

        def sse(event: dict[str, Any]) -> str:
            nonlocal sequence
            event = {**event, "sequence_number": sequence}
            sequence += 1
            return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

        try:
            started = self._envelope("in_progress", [], None)
            yield sse({"type": "response.created", "response": started})
            yield sse({"type": "response.in_progress", "response": started})
            async for _, output in runs:
                self.choice.add(output)
                for event in self.output.feed(self.parser.feed(output.text_delta)):
                    yield sse(event)
            for event in self.finish_output():
                yield sse(event)
            response = self.final()
            kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
            yield sse({"type": kind, "response": response})
        except Exception as error:
            detail = (error if isinstance(error, OpenAIError) else internal_error(error)).body()["error"]
            failure = {"code": detail["code"], "message": detail["message"], "param": detail["param"]}
            yield sse({"type": "error", **failure})

    def _status(self) -> str:
        return "incomplete" if self.choice.finish_reason == "length" else "completed"

    def _usage(self) -> dict[str, Any]:
        choice = self.choice
        output_tokens = len(choice.token_ids)
        think_end = self.tokenizer.added_tokens_encoder.get(THINK_END)
        if self.parser.reasoning.in_reasoning:  # the text ended inside its reasoning
            reasoning_tokens = output_tokens
        elif think_end in choice.token_ids:
            reasoning_tokens = choice.token_ids.index(think_end) + 1
        else:
            reasoning_tokens = 0
        input_tokens = len(choice.prompt_ids)
        return {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": choice.cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens,
        }

    def _envelope(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        body = self.body
        text_format = body.text.format if body.text and body.text.format else None
        tool_choice = body.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None,
            "model": self.api.server.settings.served_model_name,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "store": body.store,
            "temperature": _pick(body.temperature, self.defaults.get("temperature")),
            "text": {
                "format": text_format.model_dump(by_alias=True, exclude_none=True)
                if text_format
                else {"type": "text"}
            },
            "tool_choice": tool_choice.model_dump()
            if isinstance(tool_choice, FunctionToolChoice)
            else tool_choice or "auto",
            "tools": [tool.model_dump() for tool in body.tools or []],
            "top_p": _pick(body.top_p, self.defaults.get("top_p")),
            "truncation": "disabled",
            "usage": usage,
            "metadata": body.metadata or {},
        } | ({"user": body.user} if body.user is not None else {})


def _pick(value: float | None, default: float | None) -> float:
    return value if value is not None else default if default is not None else 1.0


def _assistant_turn(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the assistant turn of the conversation a follow-up continues."""
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "reasoning":
            turn["reasoning_content"] = "".join(part["text"] for part in item["content"])
        elif item["type"] == "message":
            turn["content"] += "".join(part["text"] for part in item["content"])
        else:
            call = {"name": item["name"], "arguments": item["arguments"]}
            turn.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": call}
            )
    return turn
