"""/v1/completions: text or token-id prompts, each generated n times, with echo and OpenAI's text-completion
logprobs (tokens, their logprobs, top alternatives and text offsets)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ..engine import EngineRequest, RequestOutput
from .errors import bad_request
from .openai_server import OpenAIServer
from .protocol import CompletionRequest
from .render import generate_request
from .responses import Choice, ChoicesResponse, token_usage


async def create_completion(server: OpenAIServer, body: CompletionRequest, request: Request) -> Response:
    prompts = _checked_prompts(server, body)
    server.admit(len(prompts) * body.n)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    requests = await _engine_requests(server, body, prompts, response_id)
    choices = [Choice(index, list(r.prompt_ids)) for index, r in enumerate(requests)]
    runs = server.run_choices(requests)
    response = _CompletionResponse(server, response_id, body, choices, prompts)
    return await response.respond(request, runs)


async def render_completion(server: OpenAIServer, body: CompletionRequest) -> list[dict[str, Any]]:
    """vLLM's /v1/completions/render: what each prompt of the request would run, without running it."""
    prompts = _checked_prompts(server, body)
    server.check_count(len(prompts) * body.n)  # what the request would need, before it is built
    response_id = f"cmpl-{uuid.uuid4().hex}"
    requests = await _engine_requests(server, body, prompts, response_id)
    return [generate_request(server, response_id, r, body) for r in requests[:: body.n]]


def _checked_prompts(server: OpenAIServer, body: CompletionRequest) -> list[list[int]]:
    server.ready()
    server.check_model(body.model)
    server.check_stream_options(body)
    if body.suffix is not None:
        raise bad_request("suffix is not supported by this model.", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of is not supported (only best_of == n).", "best_of")
    return _prompt_ids(server, body)


async def _engine_requests(
    server: OpenAIServer, body: CompletionRequest, prompts: list[list[int]], response_id: str
) -> list[EngineRequest]:
    """One engine request per prompt and choice, choice j of prompt p at index p * n + j."""
    requests = []
    for p, prompt_ids in enumerate(prompts):
        for j in range(body.n):
            index = p * body.n + j
            params = server.sampling_params(
                body,
                len(prompt_ids),
                body.max_tokens,
                body.logprobs,
                j,
                "prompt",
                prompt_logprobs=body.logprobs if body.echo else None,
            )
            constraint = await asyncio.to_thread(server.response_constraint, body, None)
            requests.append(EngineRequest(prompt_ids, params, f"{response_id}-{index}", constraint))
    return requests


def _prompt_ids(server: OpenAIServer, body: CompletionRequest) -> list[list[int]]:
    """The request's prompts (one text, one list of ids, or a list of either), as token ids."""
    tokenizer = server.ready().tokenizer
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("prompt is empty.", "prompt")
    ids = []
    for number, one in enumerate(prompts):
        tokens = tokenizer.encode(one, add_special_tokens=False) if isinstance(one, str) else list(one)
        if not tokens:
            raise bad_request(f"prompt {number} is empty: it needs at least one token.", "prompt")
        ids.append(server.check_ids(tokens, "prompt"))
    return ids


class _CompletionResponse(ChoicesResponse):
    object = chunk_object = "text_completion"
    body: CompletionRequest

    def __init__(
        self,
        server: OpenAIServer,
        response_id: str,
        body: CompletionRequest,
        choices: list[Choice],
        prompts: list[list[int]],
    ) -> None:
        super().__init__(server, response_id, body, choices)
        self.prompts = prompts

    def opening_chunks(self) -> Iterable[dict[str, Any]]:
        # Without logprobs the echoed prompt goes first; with them it waits for its logprobs.
        if self.body.echo and self.body.logprobs is None:
            for choice in self.choices:
                yield _choice_payload(choice.index, self._echo(choice), None, None)

    def output_chunks(self, choice: Choice, output: RequestOutput) -> Iterable[dict[str, Any]]:
        offset = len(self._echo(choice)) + len(choice.text)
        before = len(choice.token_ids)
        choice.add(output)
        if self.body.echo and self.body.logprobs is not None and before == 0:
            # the prompt's logprobs come with the choice's first output
            yield _choice_payload(choice.index, self._echo(choice), self._prompt_logprobs(choice), None)
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = _logprobs(
                self.tokenizer,
                choice.token_ids[before:],
                choice.logprobs[before:],
                choice.top_logprobs[before:],
                offset,
            )
        if output.text_delta or output.finished or logprobs:
            yield _choice_payload(choice.index, output.text_delta, logprobs, choice.finish_reason)

    def collected_choices(self) -> list[dict[str, Any]]:
        payloads = []
        for choice in self.choices:
            echo = self._echo(choice)
            logprobs = None
            if self.body.logprobs is not None:
                logprobs = _logprobs(
                    self.tokenizer, choice.token_ids, choice.logprobs, choice.top_logprobs, len(echo)
                )
                if self.body.echo:
                    echoed = self._prompt_logprobs(choice)
                    logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
            payloads.append(_choice_payload(choice.index, echo + choice.text, logprobs, choice.finish_reason))
        return payloads

    def usage(self) -> dict[str, Any]:
        cached_tokens = sum(choice.cached_tokens for choice in self.choices) // self.body.n
        return token_usage(sum(len(p) for p in self.prompts), self.choices, cached_tokens)

    def _echo(self, choice: Choice) -> str:
        return self.tokenizer.decode(choice.prompt_ids) if self.body.echo else ""

    def _prompt_logprobs(self, choice: Choice) -> dict[str, Any]:
        """The echoed prompt's logprobs object (a text completion scores its prompt: the first token has
        none); empty for a choice that ended before its prompt was computed (an abort)."""
        if not choice.prompt_logprobs:
            return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        return _logprobs(
            self.tokenizer, choice.prompt_ids, choice.prompt_logprobs, choice.prompt_top_logprobs, 0
        )


def _logprobs(
    tokenizer: Any,
    token_ids: list[int],
    logprobs: list[float | None],
    tops: list[dict[int, float] | None],
    offset: int,
) -> dict[str, Any]:
    """OpenAI's text-completion logprobs object for `token_ids`, whose text starts at `offset`."""
    tokens = [tokenizer.decode([t]) for t in token_ids]
    offsets, position = [], offset
    for text in tokens:
        offsets.append(position)
        position += len(text)
    # One entry per token; with logprobs=0, just the chosen token's (as vLLM).
    top_logprobs = [
        None if value is None else {tokenizer.decode([t]): v for t, v in (top or {}).items()} or {text: value}
        for top, text, value in zip(tops or [None] * len(tokens), tokens, logprobs, strict=True)
    ]
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _choice_payload(
    index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": None,
    }
