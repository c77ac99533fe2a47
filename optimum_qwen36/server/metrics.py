"""Prometheus metrics (prometheus_client, one registry per server): request counts and latencies recorded as
requests finish, engine gauges read from `Engine.stats()` when `/metrics` is scraped. Each series is served
under our prefix and, for what routers and llm-d's endpoint picker read, under vLLM's own names
(`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, `vllm:cache_config_info`, ...), every one present
at zero from start-up."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "optimum_qwen36:"
VLLM_PREFIX = "vllm:"
FINISH_REASONS = ("stop", "length", "abort")
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


@dataclass(frozen=True)
class FinishedRequest:
    finish_reason: str
    prompt_tokens: int
    token_times: list[float]  # when each generated token was seen (time.monotonic())
    arrival_time: float
    end_time: float


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry)

        self.running = gauge("num_requests_running", "Requests holding a GDN slot (prefilling or decoding).")
        self.waiting = gauge("num_requests_waiting", "Requests queued for a slot.")
        self.slots_used = gauge("gdn_slots_used", "GDN state slots in use.")
        self.slots = gauge("gdn_slots", "GDN state slots (the compiled batch size).")
        self.kv_usage = gauge(
            "kv_cache_usage_perc",
            "Fraction of KV blocks requests hold (1 = full); cached prefixes no request uses count as free.",
        )
        self.kv_cached = gauge(
            "kv_cache_cached_perc",
            "Fraction of KV blocks holding cached prefixes no request uses (evicted when blocks run out).",
        )
        self.kv_blocks = gauge("kv_blocks", "KV blocks in the pool.")
        self.preemptions = gauge("num_preemptions", "Requests preempted since start (KV blocks ran out).")
        self.prefix_hit_tokens = gauge(
            "prefix_cache_hit_tokens", "Prompt tokens reused from the prefix cache."
        )
        self.prefix_queried_tokens = gauge(
            "prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_gauges = (self.prefix_hit_tokens, self.prefix_queried_tokens)
        self.spec_draft_tokens = Gauge(
            PREFIX + "spec_decode_num_draft_tokens",
            "MTP draft tokens verified since start, by draft position (0 = first).",
            [*labels, "position"],
            registry=self.registry,
        )
        self.spec_accepted_tokens = Gauge(
            PREFIX + "spec_decode_num_accepted_tokens",
            "MTP draft tokens accepted since start, by draft position (0 = first).",
            [*labels, "position"],
            registry=self.registry,
        )
        engine_gauges = (
            self.running,
            self.waiting,
            self.slots_used,
            self.slots,
            self.kv_usage,
            self.kv_cached,
        )
        for metric in (*engine_gauges, self.kv_blocks, self.preemptions, *self.prefix_gauges):
            metric.labels(model_name)  # present at zero from start-up
        self.finished = [
            _FinishedRequests(prefix, model_name, self.registry) for prefix in (PREFIX, VLLM_PREFIX)
        ]
        self.vllm_engine = _VLLMEngineMetrics(model_name)
        self.registry.register(self.vllm_engine)

    def request_finished(self, request: FinishedRequest) -> None:
        for metrics in self.finished:
            metrics.record(request)

    def render(self, stats: dict[str, Any] | None) -> bytes:
        """The Prometheus text, with the engine gauges set from `stats` (Engine.stats(); None while the model
        loads: they read zero)."""
        self.vllm_engine.stats = stats
        if stats is None:
            return generate_latest(self.registry)
        model = self.model_name
        self.running.labels(model).set(stats["running"])
        self.waiting.labels(model).set(stats["waiting"])
        self.slots_used.labels(model).set(stats["slots_used"])
        self.slots.labels(model).set(stats["slots"])
        self.kv_blocks.labels(model).set(stats["blocks"])
        usage, cached = kv_cache_shares(stats)
        self.kv_usage.labels(model).set(usage)
        self.kv_cached.labels(model).set(cached)
        self.preemptions.labels(model).set(stats["preemptions"])
        self.prefix_hit_tokens.labels(model).set(stats["prefix_cache"]["hit_tokens"])
        self.prefix_queried_tokens.labels(model).set(stats["prefix_cache"]["prompt_tokens"])
        speculative = stats.get("speculative")
        if speculative is not None:
            for position, (drafted, accepted) in enumerate(
                zip(speculative["drafted_per_position"], speculative["accepted_per_position"], strict=True)
            ):
                self.spec_draft_tokens.labels(model, str(position)).set(drafted)
                self.spec_accepted_tokens.labels(model, str(position)).set(accepted)
        return generate_latest(self.registry)


def kv_cache_shares(stats: dict[str, Any]) -> tuple[float, float]:
    """(used, cached) shares of the KV block pool, from `Engine.stats()`: blocks requests hold, and blocks
    holding cached prefixes no request uses, which are evicted on demand and so count as free in the first
    (as vLLM counts them: a router reading the usage sees an idle replica as empty)."""
    blocks = stats["blocks"]
    if not blocks:
        return 0.0, 0.0
    cached = stats["evictable_blocks"]
    return (blocks - stats["free_blocks"] - cached) / blocks, cached / blocks


class _FinishedRequests:
    """What is recorded as requests finish, under one prefix."""

    def __init__(self, prefix: str, model_name: str, registry: CollectorRegistry) -> None:
        labels = ["model_name"]
        self.model_name = model_name

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(prefix + name, doc, [*labels, *extra], registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(prefix + name, doc, labels, buckets=buckets, registry=registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Finished requests.", ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Time per output token.", _TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, end to end.", _LATENCY_BUCKETS)
        # Every series exists from start-up, at zero, so a scraper's rate() has a start.
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e):
            metric.labels(model_name)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)

    def record(self, request: FinishedRequest) -> None:
        model = self.model_name
        self.prompt_tokens.labels(model).inc(request.prompt_tokens)
        self.generation_tokens.labels(model).inc(len(request.token_times))
        self.request_success.labels(model, request.finish_reason).inc()
        self.e2e.labels(model).observe(request.end_time - request.arrival_time)
        if request.token_times:
            self.ttft.labels(model).observe(request.token_times[0] - request.arrival_time)
            for before, after in itertools.pairwise(request.token_times):
                self.tpot.labels(model).observe(after - before)


class _VLLMEngineMetrics(Collector):
    """The engine's state under vLLM's names and types, from the `Engine.stats()` of the scrape."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        model = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(VLLM_PREFIX + name, doc, labels=["model_name"])
            family.add_metric(model, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(VLLM_PREFIX + name, doc, labels=["model_name"])
            family.add_metric(model, value)
            return family

        prefix_cache = stats["prefix_cache"] if stats else {"prompt_tokens": 0, "hit_tokens": 0}
        yield gauge("num_requests_running", "Requests running.", stats["running"] if stats else 0)
        yield gauge("num_requests_waiting", "Requests waiting.", stats["waiting"] if stats else 0)
        usage = kv_cache_shares(stats)[0] if stats else 0.0
        yield gauge("kv_cache_usage_perc", "KV-cache usage (1 = full; cached prefixes count as free).", usage)
        preemptions = stats["preemptions"] if stats else 0
        yield counter("num_preemptions", "Preemptions since start.", preemptions)
        queried = prefix_cache["prompt_tokens"]
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queried)
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", prefix_cache["hit_tokens"]
        )
        if stats:
            info = GaugeMetricFamily(
                VLLM_PREFIX + "cache_config_info",
                "The KV cache's configuration (the value is 1).",
                labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"],
            )
            info.add_metric([str(stats["block_size"]), str(stats["blocks"]), "True"], 1.0)
            yield info
