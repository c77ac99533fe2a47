"""What routers read of a replica, in the shapes their own engines serve: SGLang's /model_info and
/server_info (also under their older /get_ names), from which sglang-router learns the served model's name,
/get_load, the load its power-of-two policy compares, and /kv_event_sources, where vllm-router's kv_aware
policy subscribes to the replica's KV events."""

from __future__ import annotations

from typing import Any

from .. import __version__
from .metrics import kv_cache_shares
from .openai_server import OpenAIServer


def model_info(server: OpenAIServer) -> dict[str, Any]:
    model = server.ready()
    name = server.settings.served_model_name
    return {
        "model_path": name,
        "tokenizer_path": name,
        "served_model_name": name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": model.images is not None,
        "has_audio_understanding": False,
        "model_type": model.model_type,
        "architectures": list(model.architectures),
    }


def server_info(server: OpenAIServer) -> dict[str, Any]:
    """The server's settings under SGLang's server-argument names (sglang-router reads the model's name and
    parallelism), and what vllm-router's kv_aware policy reads to index a replica's KV events (`model_id`,
    `instance_id`, `kv_block_size`)."""
    model = server.ready()
    name = server.settings.served_model_name
    return {
        "model_id": name,
        "instance_id": server.instance_id,
        "kv_block_size": model.block_size,
        "model_path": name,
        "tokenizer_path": name,
        "served_model_name": name,
        "tp_size": model.tp_degree,
        "dp_size": 1,
        "page_size": model.block_size,
        "context_length": model.max_model_len,
        "max_running_requests": model.max_num_seqs,
        "max_queued_requests": server.settings.max_waiting_requests,
        "enable_prefix_caching": model.prefix_caching,
        "version": __version__,
    }


async def load(server: OpenAIServer) -> list[dict[str, Any]]:
    """SGLang's /get_load: one entry per data-parallel rank (one here)."""
    stats = await server.ready().engine.stats()
    used_share, _ = kv_cache_shares(stats)  # cached prefixes no request uses are free for the taking
    return [
        {
            "dp_rank": 0,
            "num_reqs": stats["running"] + stats["waiting"],
            "num_waiting_reqs": stats["waiting"],
            "num_tokens": round(used_share * stats["blocks"]) * stats["block_size"],  # KV tokens held
        }
    ]


def kv_event_sources(server: OpenAIServer) -> dict[str, Any]:
    """The KV event publishers by data-parallel rank (one, or none without --kv-events-config)."""
    config = server.ready().kv_events
    return {} if config is None else {"0": config.source()}
