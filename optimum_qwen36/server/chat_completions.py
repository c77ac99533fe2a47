"""/v1/chat/completions: messages rendered with the chat template, tool_choice (auto, none, required or a
named function, the last two forced by a grammar), response_format, and each choice's text split into
reasoning, content and tool calls, as whole messages or stream deltas."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ..engine import EngineRequest, RequestOutput
from ..network.vision import ImageInput
from .chat import ChatDelta, ChatOutputParser, encode_chat, template_messages
from .errors import bad_request
from .openai_server import OpenAIServer
from .protocol import ChatCompletionRequest, NamedToolChoice
from .reasoning import prompt_opens_reasoning
from .render import generate_request
from .responses import Choice, ChoicesResponse, token_usage
from .served import ServedModel
from .tool_grammar import forced_tool_grammar

# The tool choices whose calls a grammar forces.
_FORCED = ("required", "named")


@dataclass
class PreparedChat:
    """A chat request ready to run: one engine request per choice, and a parser for each one's text."""

    choices: list[Choice]
    parsers: list[ChatOutputParser]
    requests: list[EngineRequest]


async def create_chat_completion(
    server: OpenAIServer, body: ChatCompletionRequest, request: Request
) -> Response:
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    server.admit(body.n)  # before the grammars are built
    prepared = await prepare_chat(server, body, response_id)
    runs = server.run_choices(prepared.requests)
    response = _ChatCompletionResponse(server, response_id, body, prepared.choices, prepared.parsers)
    return await response.respond(request, runs)


async def render_chat_completion(server: OpenAIServer, body: ChatCompletionRequest) -> dict[str, Any]:
    """vLLM's /v1/chat/completions/render: what the request would run, without running it."""
    server.check_count(body.n)  # what the request would need, before its choices are built
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    prepared = await prepare_chat(server, body, response_id)
    return generate_request(server, response_id, prepared.requests[0], body)


async def prepare_chat(server: OpenAIServer, body: ChatCompletionRequest, response_id: str) -> PreparedChat:
    """The messages rendered and tokenized, and each choice's sampling parameters and grammar (a forced tool
    call's, or response_format's)."""
    model = server.ready()
    server.check_model(body.model)
    server.check_stream_options(body)
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    choice_kind, forced_name = _tool_choice(body, tools)
    # tool_choice 'none': the model is not shown the tools, and nothing is parsed as a call.
    shown_tools = [] if choice_kind == "none" else tools
    template_kwargs = {"enable_thinking": server.settings.default_enable_thinking}
    template_kwargs.update(body.chat_template_kwargs or {})
    messages = template_messages(body.messages)
    images = await _read_images(model, messages)
    chat_prompt = encode_chat(model.tokenizer, messages, shown_tools, template_kwargs)
    history = chat_prompt.history
    token_ids = chat_prompt.token_ids
    if images:
        token_ids, history = (
            model.images.place(token_ids, images),
            model.images.placed_history(token_ids, history, images),
        )
    prompt_ids = server.check_ids(token_ids, "messages")
    in_reasoning = prompt_opens_reasoning(chat_prompt.text)
    gate = server.reasoning_gate(body) if in_reasoning else None
    max_tokens = body.max_completion_tokens or body.max_tokens
    top = body.top_logprobs if body.logprobs else None
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true.", "top_logprobs")
    if choice_kind in _FORCED:
        server.check_grammar_fields(body)
        parallel = body.parallel_tool_calls is not False
        grammar = forced_tool_grammar(tools, forced_name, parallel, model.tokenizer.added_tokens_encoder)
    prepared = PreparedChat([], [], [])
    for j in range(body.n):
        params = server.sampling_params(body, len(prompt_ids), max_tokens, top, j, "messages")
        if choice_kind in _FORCED:
            constraint = await asyncio.to_thread(server.structured.lark_constraint, grammar, gate, "tools")
        else:
            constraint = await asyncio.to_thread(server.response_constraint, body, gate)
        prepared.choices.append(Choice(j, prompt_ids))
        prepared.parsers.append(ChatOutputParser(in_reasoning, shown_tools))
        request_id = f"{response_id}-{j}"
        engine_request = EngineRequest(prompt_ids, params, request_id, constraint, history, images=images)
        prepared.requests.append(engine_request)
    return prepared


async def _read_images(model: ServedModel, messages: list[dict[str, Any]]) -> tuple[ImageInput, ...]:
    """The images of the messages' image parts, in prompt order; a model without a vision tower refuses
    them by name."""
    parts = [
        (f"messages.{i}.content.{j}", part["image_url"]["url"])
        for i, message in enumerate(messages)
        if isinstance(message.get("content"), list)
        for j, part in enumerate(message["content"])
        if part.get("type") == "image_url"
    ]
    if not parts:
        return ()
    if model.images is None:
        where = parts[0][0]
        raise bad_request(
            f"{where} is an image, but this model takes text only (serve a Qwen3.5 / Qwen3.6 checkpoint "
            "with its vision tower to send images).",
            where,
        )
    return tuple(await asyncio.to_thread(model.images.read, parts))


def _tool_choice(body: ChatCompletionRequest, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    """The request's tool_choice as one of 'none', 'auto', 'required' and 'named', with the named function's
    name."""
    choice = body.tool_choice or ("auto" if tools else "none")
    forced_name = None
    if isinstance(choice, NamedToolChoice):
        forced_name = choice.function.name
        if forced_name not in {t["function"]["name"] for t in tools}:
            raise bad_request(
                f"tool_choice names {forced_name!r}, which is not one of the tools.", "tool_choice"
            )
        choice = "named"
    if choice in _FORCED and not tools:
        raise bad_request(f"tool_choice {choice!r} needs tools.", "tool_choice")
    if choice in _FORCED and body.response_format is not None:
        raise bad_request("tool_choice 'required' or a named function cannot combine with response_format.")
    return choice, forced_name


class _ChatCompletionResponse(ChoicesResponse):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    body: ChatCompletionRequest

    def __init__(
        self,
        server: OpenAIServer,
        response_id: str,
        body: ChatCompletionRequest,
        choices: list[Choice],
        parsers: list[ChatOutputParser],
    ) -> None:
        super().__init__(server, response_id, body, choices)
        self.parsers = parsers

    def opening_chunks(self) -> Iterable[dict[str, Any]]:
        for choice in self.choices:
            role = {"role": "assistant", "content": ""}
            yield {"index": choice.index, "delta": role, "logprobs": None, "finish_reason": None}

    def output_chunks(self, choice: Choice, output: RequestOutput) -> Iterable[dict[str, Any]]:
        parser = self.parsers[choice.index]
        before = len(choice.token_ids)
        choice.add(output)
        delta = parser.feed(output.text_delta)
        if output.finished:
            rest = parser.finish()
            delta.reasoning += rest.reasoning
            delta.content += rest.content
            delta.tool_calls += rest.tool_calls
        logprobs = None
        if self.body.logprobs:
            content = _logprobs(
                self.tokenizer,
                choice.token_ids[before:],
                choice.logprobs[before:],
                choice.top_logprobs[before:],
            )
            logprobs = {"content": content, "refusal": None}
        if delta or logprobs:
            payload = {"index": choice.index, "delta": _delta_payload(delta), "logprobs": logprobs}
            yield {**payload, "finish_reason": None}
        if output.finished:
            yield {
                "index": choice.index,
                "delta": {},
                "logprobs": None,
                "finish_reason": self._finish_reason(choice),
            }

    def collected_choices(self) -> list[dict[str, Any]]:
        payloads = []
        for choice, parser in zip(self.choices, self.parsers, strict=True):
            delta = parser.feed(choice.text)
            rest = parser.finish()
            reasoning, content = delta.reasoning + rest.reasoning, delta.content + rest.content
            calls = parser.tools.calls if parser.tools is not None else []
            message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
            message["refusal"] = None
            message["reasoning"] = message["reasoning_content"] = reasoning or None
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ]
            logprobs = None
            if self.body.logprobs:
                content_logprobs = _logprobs(
                    self.tokenizer, choice.token_ids, choice.logprobs, choice.top_logprobs
                )
                logprobs = {"content": content_logprobs, "refusal": None}
            finish_reason = self._finish_reason(choice)
            payloads.append(
                {
                    "index": choice.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                }
            )
        return payloads

    def usage(self) -> dict[str, Any]:
        cached_tokens = max(choice.cached_tokens for choice in self.choices)
        return token_usage(len(self.choices[0].prompt_ids), self.choices, cached_tokens)

    def _finish_reason(self, choice: Choice) -> str | None:
        reason = choice.finish_reason
        return "tool_calls" if reason == "stop" and self.parsers[choice.index].called_tools else reason


def _logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[float], tops: list[dict]) -> list:
    """OpenAI's chat logprobs content: per token its text, logprob, UTF-8 bytes and top alternatives."""

    def entry(token: int, value: float) -> dict[str, Any]:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return [
        {**entry(token, value), "top_logprobs": [entry(t, v) for t, v in top.items()]}
        for token, value, top in zip(token_ids, logprobs, tops or [{}] * len(token_ids), strict=True)
    ]


def _delta_payload(delta: ChatDelta) -> dict[str, Any]:
    payload: dict[str, Any] = {}
    if delta.reasoning:
        payload["reasoning"] = payload["reasoning_content"] = delta.reasoning
    if delta.content:
        payload["content"] = delta.content
    if delta.tool_calls:
        calls = []
        for call in delta.tool_calls:
            item: dict[str, Any] = {"index": call.index, "function": {"arguments": call.arguments}}
            if call.id is not None:
                item.update(id=call.id, type="function")
                item["function"]["name"] = call.name
            calls.append(item)
        payload["tool_calls"] = calls
    return payload
