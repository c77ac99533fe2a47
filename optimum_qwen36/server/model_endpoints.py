"""The endpoints that answer from the served model without generating: /health, /metrics, /v1/models (and
/v1/models/{id}), /tokenize and /detokenize."""

from __future__ import annotations

import time
from typing import Any

from fastapi.responses import Response

from .chat import render_chat, template_messages
from .errors import OpenAIError
from .openai_server import OpenAIServer
from .protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest


def health(server: OpenAIServer) -> Response:
    if not server.ready().engine.alive:
        raise OpenAIError(503, "The engine loop has stopped: restart the server.")
    return Response(status_code=200)


async def metrics(server: OpenAIServer) -> Response:
    model = server.ready()
    body = server.metrics.render(await model.engine.stats())
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


def models(server: OpenAIServer) -> dict[str, Any]:
    model = server.ready()
    name = server.settings.served_model_name
    card = {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "optimum-qwen36",
        "root": name,
        "max_model_len": model.max_model_len,
    }
    return {"object": "list", "data": [card]}


def model(server: OpenAIServer, model_id: str) -> dict[str, Any]:
    server.check_model(model_id)
    return models(server)["data"][0]


def tokenize(server: OpenAIServer, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    model = server.ready()
    server.check_model(body.model)
    if isinstance(body, TokenizeChatRequest):
        kwargs = {
            "enable_thinking": server.settings.default_enable_thinking,
            **(body.chat_template_kwargs or {}),
        }
        messages = template_messages(body.messages)
        text = render_chat(model.tokenizer, messages, [], kwargs, body.add_generation_prompt)
        ids = model.tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = model.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}


def detokenize(server: OpenAIServer, body: DetokenizeRequest) -> dict[str, Any]:
    model = server.ready()
    server.check_model(body.model)
    return {"prompt": model.tokenizer.decode(server.check_ids(body.tokens, "tokens"))}
