"""From a loaded model to what the server serves: its engine on a loop thread, its tokenizer, limits and
generation defaults."""

from __future__ import annotations

from typing import Any

from ..engine import AsyncEngine
from ..modeling.causal_lm import NeuronQwen36ForCausalLM
from ..tokenizer import load_qwen36_tokenizer
from .images import ImageLimits, ImageReader
from .kv_events import KVEventPublisher, KVEventsConfig
from .served import GENERATION_DEFAULTS, ServedModel


def served_model(
    model: NeuronQwen36ForCausalLM,
    tokenizer: Any = None,
    *,
    prefix_caching: bool = True,
    max_num_batched_tokens: int | None = None,
    image_limits: ImageLimits | None = None,
    kv_events: KVEventsConfig | None = None,
) -> ServedModel:
    """Start an engine over `model` and describe it. Prefix caching is on unless turned off, as in vLLM,
    whether or not the model was exported with it: it changes the engine's KV block pool, not the graphs.
    With `kv_events` publishing, the prefix cache's events go out as a replica's KV events."""
    if kv_events is not None and kv_events.publishes and not prefix_caching:
        raise ValueError("KV events describe the prefix cache: they need prefix caching on.")
    tokenizer = tokenizer if tokenizer is not None else load_qwen36_tokenizer(model.tokenizer_dir)
    engine = model.create_engine(
        tokenizer=tokenizer, prefix_caching=prefix_caching, max_num_batched_tokens=max_num_batched_tokens
    )
    # Only what generation_config.json sets (to_diff_dict leaves out the class defaults), as vLLM does.
    configured = model.generation_config.to_diff_dict() if model.generation_config is not None else {}
    images = None
    if model.image_encoder is not None:
        config = model.checkpoint_config
        limits = image_limits or ImageLimits()
        images = ImageReader(model.tokenizer_dir, config.vision_config, config.image_token_id, limits)
    checkpoint_config = getattr(model, "checkpoint_config", model.config)
    async_engine = AsyncEngine(engine)
    publisher = None
    if kv_events is not None and kv_events.publishes:
        publisher = KVEventPublisher(kv_events, engine.cache.block_size)
        async_engine.loop.publish_prefix_cache_events(publisher.publish)
    return ServedModel(
        engine=async_engine,
        end_token_ids=tuple(engine.eos_token_ids),
        tokenizer=tokenizer,
        max_model_len=model.neuron_config.sequence_length,
        vocab_size=model.config.vocab_size,
        max_num_seqs=model.neuron_config.batch_size,
        eos_token_id=tokenizer.eos_token_id,
        generation_defaults={k: configured[k] for k in GENERATION_DEFAULTS if configured.get(k) is not None},
        images=images,
        model_type=checkpoint_config.model_type,
        architectures=tuple(checkpoint_config.architectures or ()),
        tp_degree=model.neuron_config.tp_degree,
        block_size=engine.cache.block_size,
        prefix_caching=prefix_caching,
        kv_events=kv_events if publisher is not None else None,
        kv_event_publisher=publisher,
    )
