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
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from . import model_endpoints
from .chat_completions import create_chat_completion
from .completions import create_completion
from .errors import OpenAIError, install_error_handlers
from .openai_server import OpenAIServer
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .served import ServedModel, ServerSettings
from .web_ui import install_web_ui

logger = logging.getLogger(__name__)


def build_app(load: Callable[[], ServedModel], settings: ServerSettings) -> FastAPI:
    server = OpenAIServer(settings)

    def load_in_background() -> None:
        try:
            server.start_serving(load())
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
        return model_endpoints.health(server)

    @app.get("/metrics")
    async def metrics() -> Response:
        return await model_endpoints.metrics(server)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        return model_endpoints.models(server)

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return model_endpoints.tokenize(server, body)

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return model_endpoints.detokenize(server, body)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(server, body, request)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(server, body, request)

    if settings.web_ui:
        install_web_ui(app, default_enable_thinking=settings.default_enable_thinking)
    return app
