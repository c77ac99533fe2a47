"""A replica's KV events in vLLM's wire format, for KV-aware routers (vllm-router's kv_aware policy, NVIDIA
Dynamo): which prefixes this replica can reuse, as the prefix cache stores and evicts them
(prefix_caching/events.py: a block is announced once a GDN checkpoint makes a prefix through it reusable).

A ZMQ PUB socket sends each engine step's events as three frames, (topic, sequence number as 8 big-endian
bytes, msgpack payload); the payload is `[timestamp, [event, ...], data_parallel_rank]`, each event a map
tagged by "type" (BlockStored, BlockRemoved). A ROUTER socket replays the batches a subscriber missed: it
asks with (empty frame, first sequence number) and gets each buffered batch, then sequence number -1."""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any, Literal

import msgspec
import zmq
from pydantic import BaseModel, ConfigDict

from ..prefix_caching import BlocksStored, PrefixCacheEvent

logger = logging.getLogger(__name__)

_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KVEventsConfig(BaseModel):
    """`--kv-events-config`, with vLLM's field names and defaults."""

    model_config = ConfigDict(extra="forbid")

    enable_kv_cache_events: bool = False
    publisher: Literal["zmq", "null"] = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def source(self) -> dict[str, Any]:
        """This replica's entry in /kv_event_sources (data-parallel rank 0)."""
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic,
            "publisher": self.publisher,
            "encoding": "msgpack",
            "schema_version": 1,
        }


class KVEventPublisher:
    """Publishes event batches from its own thread (ZMQ sockets stay on the thread that made them)."""

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self._batches: queue.SimpleQueue[list[PrefixCacheEvent] | None] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="optimum-qwen36-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def publish(self, events: list[PrefixCacheEvent]) -> None:
        self._batches.put(events)

    def close(self) -> None:
        self._batches.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        context = zmq.Context()
        try:
            pub = context.socket(zmq.PUB)
            pub.bind(self.config.endpoint)
            replay = None
            if self.config.replay_endpoint is not None:
                replay = context.socket(zmq.ROUTER)
                replay.bind(self.config.replay_endpoint)
        except zmq.ZMQError as error:
            self._error = ValueError(f"--kv-events-config: cannot bind its sockets: {error}")
            self._ready.set()
            context.destroy(linger=0)
            return
        self._ready.set()
        topic = self.config.topic.encode()
        buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=self.config.buffer_steps)
        sequence = 0
        try:
            while True:
                if replay is not None:
                    self._answer_replays(replay, buffer)
                try:
                    events = self._batches.get(timeout=0.05)
                except queue.Empty:
                    continue
                if events is None:
                    return
                payload = msgspec.msgpack.encode([time.time(), [self._event(e) for e in events], 0])
                pub.send_multipart((topic, sequence.to_bytes(8, "big"), payload))
                buffer.append((sequence, payload))
                sequence += 1
        finally:
            context.destroy(linger=0)

    def _event(self, event: PrefixCacheEvent) -> dict[str, Any]:
        if isinstance(event, BlocksStored):
            return {
                "type": "BlockStored",
                "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash,
                "token_ids": list(event.token_ids),
                "block_size": self.block_size,
                "lora_id": None,
                "medium": "GPU",  # vLLM's name for the engine's own KV cache, whatever the device
                "lora_name": None,
            }
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": "GPU"}

    @staticmethod
    def _answer_replays(replay: zmq.Socket, buffer: collections.deque[tuple[int, bytes]]) -> None:
        while replay.poll(0):
            client, _, start = replay.recv_multipart()
            first = int.from_bytes(start, "big")
            for sequence, payload in list(buffer):
                if sequence >= first:
                    replay.send_multipart((client, b"", sequence.to_bytes(8, "big"), payload))
            replay.send_multipart((client, b"", _END_OF_REPLAY, b""))
