"""The endpoints that answer from the served model without generating: /health, /metrics, /v1/models (and
/v1/models/{id}), /tokenize, /detokenize and /tokenizer_info."""

from __future__ import annotations

import time
from typing import Any

from fastapi.responses import Response
from tokenizers import AddedToken

from .chat import render_chat, template_messages
from .errors import OpenAIError
from .openai_server import OpenAIServer
from .protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest


def health(server: OpenAIServer) -> Response:
    if not server.ready().engine.alive:
        raise OpenAIError(503, "The engine loop has stopped: restart the server.")
    if server.draining:
        raise OpenAIError(503, "The server is shutting down.", headers={"Retry-After": "5"})
    return Response(status_code=200)


async def metrics(server: OpenAIServer) -> Response:
    """Served from start-up: while the model loads, the engine's series read zero."""
    stats = None if server.model is None else await server.model.engine.stats()
    body = server.metrics.render(stats)
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
        # What a request's messages may carry (the chat page offers image attachment when "image" is here);
        # the field's name and values are OpenRouter's model card's.
        "input_modalities": ["text", "image"] if model.images is not None else ["text"],
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


def tokenizer_info(server: OpenAIServer) -> dict[str, Any]:
    """The tokenizer's configuration as its tokenizer_config.json holds it, with its chat template, as vLLM's
    /tokenizer_info serves it (lm-evaluation-harness then needs no local copy of the tokenizer)."""
    tokenizer = server.ready().tokenizer
    info = {k: v for k, v in (tokenizer.init_kwargs or {}).items() if k not in _LOCAL_TOKENIZER_KWARGS}
    info = _as_json(info)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = getattr(tokenizer, name, None)
    info["tokenizer_class"] = type(tokenizer).__name__
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    return info


# init_kwargs that describe this machine's copy, not the tokenizer.
_LOCAL_TOKENIZER_KWARGS = {
    "name_or_path",
    "vocab_file",
    "merges_file",
    "tokenizer_file",
    "is_local",
    "local_files_only",
    "backend",
}


def _as_json(value: Any) -> Any:
    """Tokenizer settings as JSON (an added token as its text's settings)."""
    if isinstance(value, dict):
        return {str(k): _as_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_as_json(v) for v in value]
    if isinstance(value, AddedToken):
        return _as_json(value.__getstate__())
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)
