"""The OpenAI-compatible HTTP server (FastAPI): chat and completions, streamed as server-sent events, over
the engine's asyncio face. Each choice of a request is one engine request; a client that disconnects
aborts its requests, which frees their slots and blocks at once.

`build_app(load, settings)` returns the app; `load()` runs in a thread at startup and returns the
`ServedModel` (exporting a checkpoint can take minutes); until it is done `/health` answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine import (
    AsyncEngine,
    EngineDeadError,
    EngineRequest,
    RequestOutput,
    SamplingParams,
    TokenConstraint,
)
from .chat import ChatDelta, ChatOutputParser, check_tools, encode_chat, forced_tool_grammar, render_chat
from .errors import OpenAIError, bad_request, install_error_handlers
from .metrics import ServerMetrics
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from .reasoning import THINK_END, prompt_opens_reasoning
from .structured import StructuredOutput

logger = logging.getLogger(__name__)

# Sampling fields a model's generation_config.json may set as defaults (vLLM applies the same ones).
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# One engine request of an HTTP request: choice index, prompt ids, params, constraint, request id, and the
# prompt's reusable prefix (`Engine.add_request`).
EngineRequestSpec = tuple[int, list[int], SamplingParams, TokenConstraint | None, str, int | None]


@dataclass
class ServedModel:
    """What the server needs of a loaded model."""

    engine: AsyncEngine
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    eos_token_id: int
    generation_defaults: dict[str, Any] = field(default_factory=dict)


@dataclass
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    default_enable_thinking: bool = True
    # Requests queued beyond the running ones; more get a 503 with Retry-After.
    max_waiting_requests: int = 256


def _finish_reason(output: RequestOutput) -> str | None:
    return None if output.finish_reason is None else output.finish_reason.value


@dataclass
class _Choice:
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
    token_times: list[float] = field(default_factory=list)

    def add(self, output: RequestOutput) -> None:
        self.token_ids += output.new_token_ids
        self.logprobs += output.logprobs
        self.top_logprobs += output.top_logprobs
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
            self.prompt_top_logprobs = output.prompt_top_logprobs or [None] * len(output.prompt_logprobs)
        self.text += output.text_delta
        self.cached_tokens = output.cached_prompt_tokens
        self.token_times += [time.monotonic()] * len(output.new_token_ids)
        if output.finished:
            self.finish_reason = _finish_reason(output)


class OpenAIServer:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.metrics = ServerMetrics(settings.served_model_name)
        self.model: ServedModel | None = None
        self.load_error: BaseException | None = None
        self.structured: StructuredOutput | None = None
        self._in_flight = 0  # engine requests submitted and not finished

    # ------------------------------------------------------------------ common checks
    def ready(self) -> ServedModel:
        if self.model is None:
            reason = f"failed to load: {self.load_error}" if self.load_error else "is loading"
            raise OpenAIError(503, f"The model {reason}.", headers={"Retry-After": "5"})
        return self.model

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.settings.served_model_name:
            raise OpenAIError(
                404,
                f"The model `{name}` does not exist: this server serves `{self.settings.served_model_name}`.",
                "model",
                "model_not_found",
            )

    def check_ids(self, ids: Sequence[int], param: str) -> list[int]:
        vocab = self.ready().vocab_size
        outside = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if outside:
            raise bad_request(f"{param} holds {outside[:8]}, outside the vocabulary (0..{vocab - 1}).", param)
        return list(ids)

    def admit(self, count: int) -> None:
        """Refuse `count` more sequences if the queue cannot take them."""
        model = self.ready()
        capacity = model.max_num_seqs + self.settings.max_waiting_requests
        if count > capacity:
            raise bad_request(f"n={count} sequences exceed what this server can queue ({capacity}).", "n")
        if self._in_flight + count > capacity:
            raise OpenAIError(
                503,
                f"The server is at capacity ({self._in_flight} sequences running or queued): retry later.",
                headers={"Retry-After": "1"},
            )

    def sampling_params(
        self,
        body: SamplingFields,
        prompt_tokens: int,
        max_tokens: int | None,
        logprobs: int | None,
        choice: int,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        model = self.ready()
        room = model.max_model_len - prompt_tokens
        if (max_tokens is not None and max_tokens > room) or room < 1:
            requested = prompt_tokens + (max_tokens or 1)
            raise bad_request(
                f"This model's maximum context length is {model.max_model_len} tokens. However, you "
                f"requested {requested} tokens ({prompt_tokens} in the prompt, {max_tokens or 1} for the "
                "completion). Please reduce the prompt or max_tokens.",
                "max_tokens",
            )
        defaults = model.generation_defaults

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(body, name)
            return value if value is not None else defaults.get(name, fallback)

        stop = body.stop if body.stop is not None else ()
        try:
            return SamplingParams(
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=max(pick("top_k", 0), 0),
                min_p=pick("min_p", 0.0),
                repetition_penalty=pick("repetition_penalty", 1.0),
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                seed=None if body.seed is None else body.seed + choice,  # vLLM's rule for n > 1
                max_tokens=max_tokens if max_tokens is not None else room,
                min_tokens=body.min_tokens,
                stop=(stop,) if isinstance(stop, str) else tuple(stop),
                stop_token_ids=tuple(self.check_ids(body.stop_token_ids or [], "stop_token_ids")),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=self.logit_bias(body.logit_bias),
            )
        except ValueError as error:
            raise bad_request(str(error)) from error

    def logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's logit_bias: token ids (JSON object keys, so strings) to values added to their logits."""
        if not bias:
            return None
        try:
            ids = [int(key) for key in bias]
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids, got {sorted(bias)[:8]}.", "logit_bias"
            ) from None
        return dict(zip(self.check_ids(ids, "logit_bias"), bias.values(), strict=True))

    def check_grammar_fields(self, body: SamplingFields) -> None:
        if body.min_tokens:
            # The grammar may allow only the end of the text while min_tokens forbids it.
            raise bad_request("min_tokens cannot combine with a grammar (response_format or a forced tool).")

    def check_stream_options(self, body: SamplingFields) -> None:
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only allowed with stream: true.", "stream_options")

    def response_constraint(self, body: SamplingFields, gate: int | None) -> TokenConstraint | None:
        rf = body.response_format
        if rf is None or rf.type == "text":
            return None
        self.check_grammar_fields(body)
        if rf.type == "json_object":
            return self.structured.json_constraint({"type": "object"}, gate)
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise bad_request("response_format json_schema needs json_schema.schema.", "response_format")
        return self.structured.json_constraint(rf.json_schema.json_schema, gate)

    # ------------------------------------------------------------------ running choices
    def run_group(self, specs: list[EngineRequestSpec]) -> _Runs:
        """The engine requests of one HTTP request (index, prompt ids, params, constraint, request id, the
        prompt's reusable prefix), counted against the server's capacity from now until each ends."""
        self.admit(len(specs))
        self._in_flight += len(specs)
        return _Runs(self, [_EngineRun(self, *spec) for spec in specs])


class _EngineRun:
    """One engine request, as an async iterator of its outputs; its capacity share is released once."""

    def __init__(
        self,
        server: OpenAIServer,
        index: int,
        prompt_ids: list[int],
        params: SamplingParams,
        constraint: TokenConstraint | None,
        request_id: str,
        reusable_prefix: int | None,
    ) -> None:
        self.server, self.index = server, index
        self._released = False
        self.outputs = self._outputs(prompt_ids, params, constraint, request_id, reusable_prefix)

    async def _outputs(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        constraint: TokenConstraint | None,
        rid: str,
        reusable_prefix: int | None,
    ) -> AsyncIterator[RequestOutput]:
        server = self.server
        arrival = time.monotonic()
        times: list[float] = []
        try:
            engine = server.ready().engine
            request = EngineRequest(prompt_ids, params, rid, constraint, reusable_prefix)
            outputs = engine.generate(request)
            async with contextlib.aclosing(outputs) as outs:
                async for output in outs:
                    times += [time.monotonic()] * len(output.new_token_ids)
                    if output.finished and output.finish_reason is not None:
                        end = time.monotonic()
                        reason = output.finish_reason.value
                        server.metrics.request_finished(reason, len(prompt_ids), times, arrival, end)
                    yield output
        except ValueError as error:
            if times:  # a failure mid-generation is the server's, not the request's
                raise
            raise bad_request(str(error)) from error  # the engine refused it at submission
        except EngineDeadError as error:
            raise OpenAIError(
                503, f"The engine is not running: {error}", headers={"Retry-After": "5"}
            ) from error
        finally:
            self.release()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.server._in_flight -= 1

    async def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # already closed by its reader
            await self.outputs.aclose()
        self.release()  # a run that never started never ran its finally


class _Runs:
    """All choices of a request: started together, their outputs merged, closed together (which aborts
    the ones still running)."""

    def __init__(self, server: OpenAIServer, runs: list[_EngineRun]) -> None:
        self.server, self.runs = server, runs
        self._merged: AsyncIterator[tuple[int, RequestOutput]] | None = None

    async def start(self) -> None:
        """Submit every choice at once and wait for each one's first output, so that a refusal raises
        before a streamed response has begun."""
        results = await asyncio.gather(*(anext(run.outputs) for run in self.runs), return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            await self.close()
            raise failure
        self._merged = self._merge(results)

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if self._merged is None:
            raise RuntimeError("start() the runs first")
        return self._merged

    async def _merge(self, firsts: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(run: _EngineRun, first: RequestOutput) -> None:
            try:
                await queue.put((run.index, first))
                if not first.finished:
                    async for output in run.outputs:
                        await queue.put((run.index, output))
                await queue.put((run.index, None))
            except asyncio.CancelledError:
                raise
            except BaseException as error:
                await queue.put((run.index, error))

        tasks = [asyncio.create_task(pump(run, first)) for run, first in zip(self.runs, firsts, strict=True)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        if self._merged is not None:
            with contextlib.suppress(RuntimeError):
                await self._merged.aclose()
        for run in self.runs:
            await run.close()


class _StreamingResponse(StreamingResponse):
    """Closes the request's runs however the response ends: finished, failed, or the client gone (even
    before the body started)."""

    def __init__(self, body: AsyncIterator[str], runs: _Runs) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.runs = runs

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.runs.close()


async def _until_disconnected(request: Request, work: Any, runs: _Runs) -> Any:
    """Await `work` (a coroutine); if the client goes away first, or `work` fails, close the runs (which
    aborts their engine requests)."""
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


async def _collect(request: Request, runs: _Runs, choices: list[_Choice]) -> None:
    """A non-streamed response: every choice's outputs, gathered (a disconnect aborts them)."""

    async def collect() -> None:
        await runs.start()
        async for index, output in runs:
            choices[index].add(output)

    await _until_disconnected(request, collect(), runs)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _stream_error(error: BaseException) -> str:
    if isinstance(error, OpenAIError):
        return _sse(error.body())
    logger.exception("A streamed request failed", exc_info=error)
    return _sse(OpenAIError(500, f"Internal error: {type(error).__name__}: {error}").body())


def build_app(load: Callable[[], ServedModel], settings: ServerSettings) -> FastAPI:
    server = OpenAIServer(settings)

    def load_in_background() -> None:
        try:
            model = load()
            server.structured = StructuredOutput(model.tokenizer, model.vocab_size, model.eos_token_id)
            server.structured.prepare()  # seconds: done here, not on the first structured request
            server.model = model
            logger.info("Serving %s", settings.served_model_name)
        except BaseException as error:
            server.load_error = error
            logger.exception("Loading the model failed")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loader = threading.Thread(target=load_in_background, name="optimum-qwen36-load", daemon=True)
        loader.start()
        yield
        if server.model is not None:
            await asyncio.to_thread(server.model.engine.shutdown)

    app = FastAPI(title="optimum-qwen36", lifespan=lifespan)
    app.state.server = server
    install_error_handlers(app)

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not secrets.compare_digest(token.encode(), settings.api_key.encode()):
            raise OpenAIError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.")

    guarded = [Depends(authorize)]

    @app.get("/health")
    async def health() -> Response:
        if not server.ready().engine.alive:
            raise OpenAIError(503, "The engine loop has stopped: restart the server.")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        model = server.ready()
        body = server.metrics.render(await model.engine.stats())
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        model = server.ready()
        card = {
            "id": settings.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "optimum-qwen36",
            "root": settings.served_model_name,
            "max_model_len": model.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        model = server.ready()
        server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("Give exactly one of prompt or messages.", "prompt")
        if body.messages is not None:
            kwargs = {
                "enable_thinking": settings.default_enable_thinking,
                **(body.chat_template_kwargs or {}),
            }
            text = render_chat(model.tokenizer, body.messages, [], kwargs, body.add_generation_prompt)
            ids = model.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = model.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        model = server.ready()
        server.check_model(body.model)
        return {"prompt": model.tokenizer.decode(server.check_ids(body.tokens, "tokens"))}

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _completions(server, body, request)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _chat(server, body, request)

    return app


# ---------------------------------------------------------------------- /v1/completions
def _completion_prompts(server: OpenAIServer, body: CompletionRequest) -> list[list[int]]:
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


def _completion_logprobs(
    tokenizer: Any,
    token_ids: list[int],
    logprobs: list[float | None],
    tops: list[dict[int, float] | None],
    offset: int,
) -> dict[str, Any]:
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


async def _completions(server: OpenAIServer, body: CompletionRequest, request: Request) -> Response:
    model = server.ready()
    server.check_model(body.model)
    server.check_stream_options(body)
    if body.suffix is not None:
        raise bad_request("suffix is not supported by this model.", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of is not supported (only best_of == n).", "best_of")
    prompts = _completion_prompts(server, body)
    server.admit(len(prompts) * body.n)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    choices, specs = [], []
    for p, prompt_ids in enumerate(prompts):
        for j in range(body.n):
            index = p * body.n + j
            params = server.sampling_params(
                body,
                len(prompt_ids),
                body.max_tokens,
                body.logprobs,
                j,
                prompt_logprobs=body.logprobs if body.echo else None,
            )
            constraint = await asyncio.to_thread(server.response_constraint, body, None)
            choices.append(_Choice(index, prompt_ids))
            specs.append((index, prompt_ids, params, constraint, f"{rid}-{index}", None))
    runs = server.run_group(specs)
    tokenizer = model.tokenizer

    def echo_text(choice: _Choice) -> str:
        return tokenizer.decode(choice.prompt_ids) if body.echo else ""

    def prompt_logprobs(choice: _Choice) -> dict[str, Any]:
        """The echoed prompt's logprobs object (a text completion scores its prompt: the first token has
        none); empty for a choice that ended before its prompt was computed (an abort)."""
        if not choice.prompt_logprobs:
            return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        return _completion_logprobs(
            tokenizer, choice.prompt_ids, choice.prompt_logprobs, choice.prompt_top_logprobs, 0
        )

    def chunk(choice_payloads: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        payload = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": server.settings.served_model_name,
            "choices": choice_payloads,
        }
        if usage is not None or (body.stream_options and body.stream_options.include_usage):
            payload["usage"] = usage
        return payload

    def usage() -> dict[str, Any]:
        prompt_tokens = sum(len(p) for p in prompts)
        return _usage(
            prompt_tokens,
            sum(len(c.token_ids) for c in choices),
            sum(c.cached_tokens for c in choices) // body.n,
        )

    if body.stream:
        await _until_disconnected(request, runs.start(), runs)

        async def events() -> AsyncIterator[str]:
            try:
                if body.echo and body.logprobs is None:
                    for choice in choices:
                        yield _sse(chunk([_completion_choice(choice.index, echo_text(choice), None, None)]))
                async for index, output in runs:
                    choice = choices[index]
                    offset = len(echo_text(choice)) + len(choice.text)
                    before = len(choice.token_ids)
                    choice.add(output)
                    if body.echo and body.logprobs is not None and before == 0:
                        # the prompt's logprobs come with the choice's first output
                        echoed = _completion_choice(index, echo_text(choice), prompt_logprobs(choice), None)
                        yield _sse(chunk([echoed]))
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = _completion_logprobs(
                            tokenizer,
                            choice.token_ids[before:],
                            choice.logprobs[before:],
                            choice.top_logprobs[before:],
                            offset,
                        )
                    if output.text_delta or output.finished or logprobs:
                        payload = _completion_choice(index, output.text_delta, logprobs, choice.finish_reason)
                        yield _sse(chunk([payload]))
                if body.stream_options and body.stream_options.include_usage:
                    yield _sse(chunk([], usage()))
            except Exception as error:
                yield _stream_error(error)
            yield "data: [DONE]\n\n"

        return _StreamingResponse(events(), runs)

    await _collect(request, runs, choices)
    payloads = []
    for choice in choices:
        logprobs = None
        if body.logprobs is not None:
            logprobs = _completion_logprobs(
                tokenizer, choice.token_ids, choice.logprobs, choice.top_logprobs, len(echo_text(choice))
            )
            if body.echo:
                echoed = prompt_logprobs(choice)
                logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
        text = echo_text(choice) + choice.text
        payloads.append(_completion_choice(choice.index, text, logprobs, choice.finish_reason))
    return JSONResponse(chunk(payloads, usage()))


def _completion_choice(
    index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": None,
    }


# ---------------------------------------------------------------------- /v1/chat/completions
def _chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[float], tops: list[dict]) -> list:
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


async def _chat(server: OpenAIServer, body: ChatCompletionRequest, request: Request) -> Response:
    model = server.ready()
    server.check_model(body.model)
    server.check_stream_options(body)
    tools = check_tools(body.tools)
    choice_kind = body.tool_choice or ("auto" if tools else "none")
    forced_name = None
    if isinstance(choice_kind, dict):
        function = choice_kind.get("function")
        forced_name = function.get("name") if isinstance(function, dict) else None
        if forced_name not in {t["function"]["name"] for t in tools}:
            raise bad_request(
                f"tool_choice names {forced_name!r}, which is not one of the tools.", "tool_choice"
            )
        choice_kind = "named"
    if choice_kind in ("required", "named") and not tools:
        raise bad_request(f"tool_choice {body.tool_choice!r} needs tools.", "tool_choice")
    if choice_kind in ("required", "named") and body.response_format is not None:
        raise bad_request("tool_choice 'required' or a named function cannot combine with response_format.")
    # tool_choice 'none': the model is not shown the tools, and nothing is parsed as a call.
    shown_tools = [] if choice_kind == "none" else tools
    template_kwargs = {"enable_thinking": server.settings.default_enable_thinking}
    template_kwargs.update(body.chat_template_kwargs or {})
    chat_prompt = encode_chat(model.tokenizer, body.messages, shown_tools, template_kwargs)
    prompt, prompt_ids = chat_prompt.text, server.check_ids(chat_prompt.token_ids, "messages")
    in_reasoning = prompt_opens_reasoning(prompt)
    gate = model.tokenizer.convert_tokens_to_ids(THINK_END) if in_reasoning else None
    server.admit(body.n)
    max_tokens = body.max_completion_tokens or body.max_tokens
    top = body.top_logprobs if body.logprobs else None
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true.", "top_logprobs")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    choices, parsers, specs = [], [], []
    for j in range(body.n):
        params = server.sampling_params(body, len(prompt_ids), max_tokens, top if body.logprobs else None, j)
        if choice_kind in ("required", "named"):
            server.check_grammar_fields(body)
            grammar = forced_tool_grammar(tools, forced_name)
            constraint = await asyncio.to_thread(server.structured.lark_constraint, grammar, gate)
        else:
            constraint = await asyncio.to_thread(server.response_constraint, body, gate)
        choices.append(_Choice(j, prompt_ids))
        parsers.append(ChatOutputParser(in_reasoning, shown_tools if choice_kind != "none" else None))
        specs.append((j, prompt_ids, params, constraint, f"{rid}-{j}", chat_prompt.history))
    runs = server.run_group(specs)
    name = server.settings.served_model_name

    def finish_reason(j: int) -> str | None:
        reason = choices[j].finish_reason
        return "tool_calls" if reason == "stop" and parsers[j].called_tools else reason

    def usage() -> dict[str, Any]:
        return _usage(
            len(prompt_ids), sum(len(c.token_ids) for c in choices), max(c.cached_tokens for c in choices)
        )

    def chunk(choice_payloads: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        payload = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name}
        payload["choices"] = choice_payloads
        if usage is not None or (body.stream_options and body.stream_options.include_usage):
            payload["usage"] = usage
        return payload

    if body.stream:
        await _until_disconnected(request, runs.start(), runs)

        async def events() -> AsyncIterator[str]:
            try:
                for j in range(body.n):
                    first = {"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                    yield _sse(chunk([{**first, "finish_reason": None}]))
                async for j, output in runs:
                    choice = choices[j]
                    before = len(choice.token_ids)
                    choice.add(output)
                    delta = parsers[j].feed(output.text_delta)
                    if output.finished:
                        rest = parsers[j].finish()
                        delta.reasoning += rest.reasoning
                        delta.content += rest.content
                        delta.tool_calls += rest.tool_calls
                    logprobs = None
                    if body.logprobs:
                        content = _chat_logprobs(
                            model.tokenizer,
                            choice.token_ids[before:],
                            choice.logprobs[before:],
                            choice.top_logprobs[before:],
                        )
                        logprobs = {"content": content}
                    if delta or logprobs:
                        payload = {"index": j, "delta": _delta_payload(delta), "logprobs": logprobs}
                        yield _sse(chunk([{**payload, "finish_reason": None}]))
                    if output.finished:
                        last = {"index": j, "delta": {}, "logprobs": None, "finish_reason": finish_reason(j)}
                        yield _sse(chunk([last]))
                if body.stream_options and body.stream_options.include_usage:
                    yield _sse(chunk([], usage()))
            except Exception as error:
                yield _stream_error(error)
            yield "data: [DONE]\n\n"

        return _StreamingResponse(events(), runs)

    await _collect(request, runs, choices)
    payloads = []
    for j, choice in enumerate(choices):
        delta = parsers[j].feed(choice.text)
        rest = parsers[j].finish()
        reasoning, content = delta.reasoning + rest.reasoning, delta.content + rest.content
        calls = parsers[j].tools.calls if parsers[j].tools is not None else []
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        message["reasoning"] = message["reasoning_content"] = reasoning or None
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
        logprobs = None
        if body.logprobs:
            content_lp = _chat_logprobs(
                model.tokenizer, choice.token_ids, choice.logprobs, choice.top_logprobs
            )
            logprobs = {"content": content_lp}
        payloads.append(
            {"index": j, "message": message, "logprobs": logprobs, "finish_reason": finish_reason(j)}
        )
    response = {"id": rid, "object": "chat.completion", "created": created, "model": name}
    response.update(choices=payloads, usage=usage())
    return JSONResponse(response)
