"""The response to a generation request, from its n choices' engine outputs: streamed as server-sent events
(chunks as outputs arrive, then the usage if asked for, then [DONE]) or collected into one JSON body. A client
that disconnects, before or during either, aborts the request's engine requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine import RequestOutput
from .errors import OpenAIError, internal_error
from .openai_server import OpenAIServer
from .protocol import SamplingFields
from .runs import ChoiceRuns

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Choice:
    """One sequence being generated for a request: its outputs so far."""

    index: int
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    # echo with logprobs: the prompt tokens' (None for the first), from the first output
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    cached_tokens: int = 0

    def add(self, output: RequestOutput) -> None:
        self.token_ids += output.new_token_ids
        self.logprobs += output.logprobs
        self.top_logprobs += output.top_logprobs
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
            self.prompt_top_logprobs = output.prompt_top_logprobs or [None] * len(output.prompt_logprobs)
        self.text += output.text_delta
        self.cached_tokens = output.cached_prompt_tokens
        if output.finished and output.finish_reason is not None:
            self.finish_reason = output.finish_reason.value


class ChoicesResponse(ABC):
    """A generation endpoint's response: what its choices' payloads are is the endpoint's (the methods
    below); how they are streamed or collected, and the envelope around them, is shared."""

    # The `object` of the collected response and of each streamed chunk.
    object: str
    chunk_object: str

    def __init__(
        self, server: OpenAIServer, response_id: str, body: SamplingFields, choices: list[Choice]
    ) -> None:
        self.id = response_id
        self.created = int(time.time())
        self.model_name = server.settings.served_model_name
        self.tokenizer = server.ready().tokenizer
        self.body = body
        self.choices = choices
        # Every streamed chunk then carries a usage field: null but in the last chunk.
        self.streams_usage = bool(body.stream_options and body.stream_options.include_usage)

    # ------------------------------------------------------------------ the endpoint's payloads
    def opening_chunks(self) -> Iterable[dict[str, Any]]:
        """Choice payloads streamed before the first output."""
        return ()

    @abstractmethod
    def output_chunks(self, choice: Choice, output: RequestOutput) -> Iterable[dict[str, Any]]:
        """Add a streamed `output` to its `choice` and give the choice payloads it makes."""

    @abstractmethod
    def collected_choices(self) -> list[dict[str, Any]]:
        """Every choice's payload, once all have finished."""

    @abstractmethod
    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object: the request's prompt, completion and cached prompt tokens."""

    # ------------------------------------------------------------------ shared
    async def respond(self, request: Request, runs: ChoiceRuns) -> Response:
        if self.body.stream:
            await until_disconnected(request, runs.start(), runs)
            return EventStream(self._events(runs), runs)
        await until_disconnected(request, self._collect(runs), runs)
        return JSONResponse(self._envelope(self.object, self.collected_choices(), self.usage()))

    async def _collect(self, runs: ChoiceRuns) -> None:
        await runs.start()
        async for index, output in runs:
            self.choices[index].add(output)

    async def _events(self, runs: ChoiceRuns) -> AsyncIterator[str]:
        try:
            for payload in self.opening_chunks():
                yield _sse(self._chunk([payload]))
            async for index, output in runs:
                for payload in self.output_chunks(self.choices[index], output):
                    yield _sse(self._chunk([payload]))
            if self.streams_usage:
                yield _sse(self._chunk([], self.usage()))
        except Exception as error:
            yield _stream_error(error)
        yield "data: [DONE]\n\n"

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._envelope(self.chunk_object, choices, usage)

    def _envelope(
        self, object_name: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        payload = {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
        }
        if usage is not None or self.streams_usage:
            payload["usage"] = usage
        return payload


def token_usage(prompt_tokens: int, choices: list[Choice], cached_tokens: int) -> dict[str, Any]:
    completion_tokens = sum(len(choice.token_ids) for choice in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class EventStream(StreamingResponse):
    """Closes the request's runs however the response ends: finished, failed, or the client gone (even
    before the body started)."""

    def __init__(self, events: AsyncIterator[str], runs: ChoiceRuns) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.runs = runs

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.runs.close()


async def until_disconnected(request: Request, work: Awaitable[T], runs: ChoiceRuns) -> T:
    """Await `work`; if the client goes away first, or `work` fails, close the runs (which aborts their
    engine requests)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise OpenAIError(499, "The client disconnected.")
    except BaseException:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        await runs.close()
        raise


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _stream_error(error: BaseException) -> str:
    return _sse((error if isinstance(error, OpenAIError) else internal_error(error)).body())
