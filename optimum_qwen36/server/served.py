"""What a server serves (`ServedModel`: a loaded model's engine, tokenizer, limits and generation defaults)
and how (`ServerSettings`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine import AsyncEngine
from .images import ImageReader
from .kv_events import KVEventPublisher, KVEventsConfig

# Sampling fields a model's generation_config.json may set as defaults (vLLM applies the same ones).
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class ServedModel:
    """What the server needs of a loaded model."""

    engine: AsyncEngine
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    eos_token_id: int
    # Every token that ends generation (the generation config's EOS ids and the tokenizer's).
    end_token_ids: tuple[int, ...] = ()
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    # Reads chat requests' image parts; None: the model takes text only.
    images: ImageReader | None = None
    # What the checkpoint's config says it is (routers read it: SGLang's /model_info).
    model_type: str = "qwen3_5"
    architectures: tuple[str, ...] = ()
    tp_degree: int = 1
    block_size: int = 64  # tokens per KV block, the unit of prefix caching and of KV events
    prefix_caching: bool = True
    # Where this replica publishes its KV events (None: it does not).
    kv_events: KVEventsConfig | None = None
    kv_event_publisher: KVEventPublisher | None = None


@dataclass
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    default_enable_thinking: bool = True
    # Requests queued beyond the running ones; more get a 503 with Retry-After.
    max_waiting_requests: int = 256
    # The chat page at / (web_ui.py); off, / is a 404 like any unknown path.
    web_ui: bool = True
    # Responses API responses kept in memory for previous_response_id (the oldest go first).
    max_stored_responses: int = 1000
    # Where clients reach the server (the log says so once the model is loaded).
    url: str | None = None
