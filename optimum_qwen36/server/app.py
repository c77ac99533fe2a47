"""The OpenAI-compatible HTTP server (FastAPI): chat and completions, streamed as server-sent events, over
the engine's asyncio face. Each choice of a request is one engine request; a client that disconnects
aborts its requests, which frees their slots and blocks at once.

`build_app(load, settings)` returns the app; `load()` runs in a thread at startup and returns the
`ServedModel` (exporting a checkpoint can take minutes); until it is done `/health` answers 503. Unless
settings.web_ui is off, a chat page is served at `/` (web_ui.py).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from .. import __version__
from . import model_endpoints, replica_endpoints
from .chat_completions import create_chat_completion, render_chat_completion
from .completions import create_completion, render_completion
from .errors import OpenAIError, install_error_handlers
from .openai_server import OpenAIServer
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .responses_api import ResponsesAPI
from .responses_api_protocol import ResponsesRequest
from .schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ResponseEvent,
    ResponseObject,
    TokenizeResponse,
    TokenizerInfo,
    describe_errors_as_served,
    error_responses,
    streamed,
)
from .served import ServedModel, ServerSettings
from .web_ui import install_web_ui

logger = logging.getLogger(__name__)
_BEARER = HTTPBearer(auto_error=False, description="The server's API key (when it has one: --api-key).")


def build_app(load: Callable[[], ServedModel], settings: ServerSettings) -> FastAPI:
    server = OpenAIServer(settings)

    def load_in_background() -> None:
        try:
            started = time.monotonic()
            server.start_serving(load())
            where = f" at {settings.url}/v1" if settings.url else ""
            seconds = time.monotonic() - started
            logger.info("Ready: serving %s%s (loaded in %.1f s)", settings.served_model_name, where, seconds)
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
            if server.model.kv_event_publisher is not None:
                await asyncio.to_thread(server.model.kv_event_publisher.close)

    app = FastAPI(title="optimum-qwen36", version=__version__, lifespan=lifespan)
    app.state.server = server
    install_error_handlers(app)
    describe_errors_as_served(app)
    responses_api = ResponsesAPI(server)

    def authorize(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]) -> None:
        if settings.api_key is None:
            return
        token = credentials.credentials if credentials is not None else ""
        if not secrets.compare_digest(token.encode(), settings.api_key.encode()):
            raise OpenAIError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.")

    guarded = [Depends(authorize)]
    errors = error_responses(400, 401, 404, 503)
    # The 200 bodies are built as dicts and documented by models: sent as built (no null-valued field added).
    api: dict[str, Any] = {"dependencies": guarded, "responses": errors, "response_model_exclude_unset": True}

    def generating(body: type[BaseModel], event: type[BaseModel], done: bool) -> dict[str, Any]:
        """A generation route's documentation: `body` as JSON, or server-sent `event`s when streamed."""
        return {"dependencies": guarded, "responses": {**streamed(body, event, done), **errors}}

    health_200 = {200: {"description": "The engine runs (an empty body)."}, **error_responses(503)}

    @app.get("/health", response_class=Response, responses=health_200)
    async def health() -> Response:
        return model_endpoints.health(server)

    @app.get("/metrics", response_class=PlainTextResponse, responses=error_responses(503))
    async def metrics() -> Response:
        return await model_endpoints.metrics(server)

    # What routers read of a replica (SGLang's names, new and old): read-only and unauthenticated, as /health.
    replica = error_responses(503)

    @app.get("/model_info", responses=replica)
    @app.get("/get_model_info", responses=replica)
    async def model_info() -> dict[str, Any]:
        return replica_endpoints.model_info(server)

    @app.get("/server_info", responses=replica)
    @app.get("/get_server_info", responses=replica)
    async def server_info() -> dict[str, Any]:
        return replica_endpoints.server_info(server)

    @app.get("/get_load", responses=replica)
    async def get_load() -> list[dict[str, Any]]:
        return await replica_endpoints.load(server)

    @app.get("/kv_event_sources", responses=replica)
    async def kv_event_sources() -> dict[str, Any]:
        return replica_endpoints.kv_event_sources(server)

    @app.get("/v1/models", response_model=ModelList, **api)
    async def models() -> dict[str, Any]:
        return model_endpoints.models(server)

    @app.get("/v1/models/{model_id}", response_model=ModelCard, **api)
    async def model(model_id: str) -> dict[str, Any]:
        return model_endpoints.model(server, model_id)

    @app.post("/tokenize", response_model=TokenizeResponse, **api)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return model_endpoints.tokenize(server, body)

    @app.post("/detokenize", response_model=DetokenizeResponse, **api)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return model_endpoints.detokenize(server, body)

    @app.get("/tokenizer_info", response_model=TokenizerInfo, **api)
    async def tokenizer_info() -> dict[str, Any]:
        return model_endpoints.tokenizer_info(server)

    @app.post("/v1/completions", **generating(Completion, Completion, done=True))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(server, body, request)

    @app.post("/v1/chat/completions", **generating(ChatCompletion, ChatCompletionChunk, done=True))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(server, body, request)

    @app.post("/v1/completions/render", **api)
    async def completions_render(body: CompletionRequest) -> list[dict[str, Any]]:
        return await render_completion(server, body)

    @app.post("/v1/chat/completions/render", **api)
    async def chat_completions_render(body: ChatCompletionRequest) -> dict[str, Any]:
        return await render_chat_completion(server, body)

    @app.post("/v1/responses", **generating(ResponseObject, ResponseEvent, done=False))
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await responses_api.create(body, request)

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, **api)
    async def stored_response(response_id: str) -> dict[str, Any]:
        return responses_api.retrieve(response_id)

    if settings.web_ui:
        install_web_ui(app, default_enable_thinking=settings.default_enable_thinking)
    return app
