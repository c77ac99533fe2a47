"""A request as vLLM's render endpoints describe it (its `GenerateRequest`): the prompt's token ids and the
sampling parameters it would run with. vllm-router's cache-aware and KV-aware policies match the token ids
against what each replica has cached."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..engine import EngineRequest
from .openai_server import OpenAIServer
from .protocol import SamplingFields


def generate_request(
    server: OpenAIServer, request_id: str, request: EngineRequest, body: SamplingFields
) -> dict[str, Any]:
    params = dataclasses.asdict(request.params)
    params["n"] = getattr(body, "n", 1)
    if params["logit_bias"] is not None:
        params["logit_bias"] = {str(token): bias for token, bias in params["logit_bias"].items()}
    options = body.stream_options
    return {
        "request_id": request_id,
        "token_ids": list(request.prompt_ids),
        "features": None,
        "sampling_params": params,
        "model": server.settings.served_model_name,
        "stream": bool(body.stream),
        "stream_options": options.model_dump() if options is not None else None,
        "cache_salt": None,
        "priority": 0,
        "kv_transfer_params": None,
    }
