"""`optimum-qwen36 serve` replicas behind sglang-router and vllm-router, as users run them: two replica
processes (publishing KV events) and the router on 127.0.0.1. Through the router: the model listed under its
served name and answered whether or not a request names it; multi-turn conversations kept on the replica
that caches them (sglang-router's cache_aware, vllm-router's kv_aware from the KV events); a replica stopped
(SIGTERM) under traffic without a failed request, then restarted and routed to again."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from chat_model import CONVERSATIONS, GREETING, cached_chat_checkpoint
from helpers import free_port
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("sglang_router")
pytest.importorskip("vllm_router")
pytestmark = pytest.mark.slow

MODEL = "tiny-chat"
GREEDY_ANSWER = CONVERSATIONS["no_thinking"].answer  # GREETING's answer with thinking off, as served here
# Failing over fast enough for a test: a replica's failure opens its circuit at once and its first failed
# health check takes it out of rotation; it is probed again after 2 s and checked every second.
FAILOVER_FLAGS = [
    "--cb-failure-threshold", "1", "--cb-timeout-duration-secs", "2",
    "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
]  # fmt: skip


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def get(url: str) -> bytes | None:
    """The body of a GET, or None while the server is not up or answers an error."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read()
    except (OSError, urllib.error.URLError):
        return None


class Replica:
    """One `optimum-qwen36 serve` process of the chat model on a fixed port, its output in a log file."""

    def __init__(self, checkpoint: Path, log: Path) -> None:
        self.checkpoint, self.log = checkpoint, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{free_port()}",
            "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
        }
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [sys.executable, "-m", "optimum_qwen36.cli", "serve", str(self.checkpoint)]
        command += ["--backend", "eager", "--port", str(self.port), "--served-model-name", MODEL]
        command += ["--sequence-length", "1024", "--default-enable-thinking", "false"]
        command += ["--kv-events-config", json.dumps(self.kv_events)]  # for vllm-router's kv_aware
        # Two replicas and the router share the machine: at torch's default of one thread per core each,
        # the replicas' OpenMP threads wait on each other across processes (requests ten times slower on
        # two cores). The tiny model needs no more than one.
        environment = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment)

    def wait_healthy(self) -> None:
        def healthy() -> bool:
            assert self.process is not None and self.process.poll() is None, self.output()
            return get(self.url + "/health") is not None

        wait_until(healthy, 120, f"{self.url}/health answers 200")

    def served_requests(self) -> float:
        """Requests this process has finished (`vllm:request_success_total` over its finish reasons)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as response:
            text = response.read().decode()
        families = {family.name: family for family in text_string_to_metric_families(text)}
        return sum(sample.value for sample in families["vllm:request_success"].samples)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@contextmanager
def router_process(command: list[str], log: Path, ready: Callable[[str], bool]) -> Iterator[None]:
    """A router process until the block ends, once `ready(its log)`. Its output goes to `log` (a pipe
    nobody reads would fill with its warnings and stall it)."""
    with open(log, "ab") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:

        def started() -> bool:
            assert process.poll() is None, log.read_text(errors="replace")[-4000:]
            return ready(log.read_text(errors="replace"))

        wait_until(started, 30, "the router registers every replica")
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def sglang_router(replicas: list[Replica], log: Path, *flags: str) -> Iterator[str]:
    """sglang-router in front of the replicas, once it has registered them all: its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "sglang_router", "launch", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--worker-urls", *(replica.url for replica in replicas)]
    # Its Prometheus exporter takes port 29000 unless told otherwise, which another router may hold.
    command += ["--prometheus-port", str(free_port()), "--log-level", "warn", *flags]

    def all_registered(_: str) -> bool:
        readiness = get(url + "/readiness")
        return readiness is not None and json.loads(readiness)["healthy_workers"] == len(replicas)

    with router_process(command, log, all_registered):
        yield url


@contextmanager
def vllm_router(replicas: list[Replica], log: Path, *flags: str) -> Iterator[str]:
    """vllm-router in front of the replicas: its URL, once it has subscribed to every replica's KV events
    (its log says so; it has no endpoint that does)."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "vllm-router"), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--worker-urls", *(replica.url for replica in replicas)]
    command += ["--prometheus-port", str(free_port()), *flags]

    def subscribed(output: str) -> bool:
        return output.count("spawned subscriber") == len(replicas)

    with router_process(command, log, subscribed):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def replicas(logs: Path) -> Iterator[list[Replica]]:
    checkpoint = cached_chat_checkpoint()
    started = [Replica(checkpoint, logs / f"replica-{index}.log") for index in range(2)]
    try:
        for replica in started:
            replica.start()
        for replica in started:
            replica.wait_healthy()
        yield started
    finally:
        for replica in started:
            replica.stop()


@pytest.fixture(scope="module")
def cache_aware_router(replicas: list[Replica], logs: Path) -> Iterator[str]:
    with sglang_router(replicas, logs / "cache-aware-router.log", "--policy", "cache_aware") as url:
        yield url


def router_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_router_lists_and_answers_the_served_model(cache_aware_router: str) -> None:
    """The router lists the replicas' model by its served name (read from /model_info, /server_info) and
    passes requests on: one naming the model, and one naming none, which the router sends on as
    "model": "unknown" and the replica answers with its model."""
    client = router_client(cache_aware_router)
    assert [model.id for model in client.models.list().data] == [MODEL]
    named = client.chat.completions.create(model=MODEL, messages=GREETING, temperature=0)
    assert named.choices[0].message.content == GREEDY_ANSWER
    assert named.model == MODEL

    body = json.dumps({"messages": GREETING, "temperature": 0}).encode()
    request = urllib.request.Request(
        cache_aware_router + "/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        unnamed = json.load(response)
    assert unnamed["choices"][0]["message"]["content"] == GREEDY_ANSWER
    assert unnamed["model"] == MODEL


def converse_in_parallel(router: str, topics: list[str]) -> list[tuple[int, int]]:
    """One conversation of four turns per topic, all at once, each turn sending the history back: each
    follow-up's (cached, prompt) tokens. Each conversation opens with its own ~750-token document, a dozen
    64-token KV blocks, so the cached whole blocks of the previous turn's prompt are most of a follow-up; one
    sent to the other replica would find nothing of it cached (the documents share no prefix), so the cached
    share measures the routing."""
    client = router_client(router)

    def converse(topic: str) -> list[tuple[int, int]]:
        facts = " ".join(f"Fact {k} about {topic}: item {7 * k + len(topic)} is listed." for k in range(45))
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Notes on {topic}. {facts}"}]
        follow_ups = []
        for turn in range(4):
            answer = client.chat.completions.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=12
            )
            assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
            if turn > 0:
                follow_ups.append(
                    (answer.usage.prompt_tokens_details.cached_tokens, answer.usage.prompt_tokens)
                )
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
            messages.append({"role": "user", "content": f"And what follows from fact {turn}?"})
        return follow_ups

    with ThreadPoolExecutor(len(topics)) as pool:
        return [turn for conversation in pool.map(converse, topics) for turn in conversation]


def cached_share(follow_ups: list[tuple[int, int]]) -> float:
    return sum(cached for cached, _ in follow_ups) / sum(prompt for _, prompt in follow_ups)


def test_cache_aware_routing_keeps_conversations_on_their_replica(
    replicas: list[Replica], cache_aware_router: str
) -> None:
    """cache_aware spreads the conversations over both replicas and sends each follow-up to the replica
    holding its history."""
    topics = ["amber lanterns", "granite bridges", "velvet orchards", "copper tides", "harbors", "kites"]
    before = [replica.served_requests() for replica in replicas]
    follow_ups = converse_in_parallel(cache_aware_router, topics)
    served = [replica.served_requests() - count for replica, count in zip(replicas, before, strict=True)]
    assert cached_share(follow_ups) >= 0.8, follow_ups
    assert sum(served) == 4 * len(topics) and min(served) > 0, served


def test_kv_aware_routing_follows_the_replicas_kv_events(replicas: list[Replica], logs: Path) -> None:
    """vllm-router's kv_aware policy: it reads each replica's /get_server_info and /kv_event_sources,
    subscribes to its KV events, renders each request (/v1/chat/completions/render) and sends it where
    its prefix is stored; the prefix it credits is the one the replica reuses."""
    topics = ["silver comets", "paper boats", "iron gates", "linen sails", "quartz caves", "maple roads"]
    log = logs / "kv-aware-router.log"
    with vllm_router(replicas, log, "--policy", "kv_aware", "--log-level", "debug") as router:
        before = [replica.served_requests() for replica in replicas]
        follow_ups = converse_in_parallel(router, topics)
        served = [replica.served_requests() - count for replica, count in zip(replicas, before, strict=True)]
    assert cached_share(follow_ups) >= 0.8, follow_ups
    assert sum(served) == 4 * len(topics) and min(served) > 0, served
    decisions = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))  # its colours
    assert "kv_index decode batch" not in decisions, "the router could not read an event batch"
    credited = [int(n) for n in re.findall(r"credited_prefix_tokens=(\d+)", decisions)]
    # Each follow-up is credited the prefix its replica then reused.
    assert sorted(credited)[-len(follow_ups) :] == sorted(cached for cached, _ in follow_ups), credited


class Traffic:
    """Short chat requests through the router from a few threads, one after another in each, until
    stopped: how many were answered, and every failure."""

    def __init__(self, router: str, threads: int = 4) -> None:
        self.client = router_client(router)
        self.threads = threads
        self.numbers = itertools.count()
        self.answered = 0
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def keep_asking(self) -> None:
        while not self.stopping.is_set():
            messages = [{"role": "user", "content": f"Say hello to visitor {next(self.numbers)}."}]
            try:
                self.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
            except openai.OpenAIError as error:
                with self.lock:
                    self.failures.append(repr(error))
            else:
                with self.lock:
                    self.answered += 1

    @contextmanager
    def running(self) -> Iterator[Traffic]:
        with ThreadPoolExecutor(self.threads) as pool:
            streams = [pool.submit(self.keep_asking) for _ in range(self.threads)]
            try:
                yield self
            finally:
                self.stopping.set()
                for stream in streams:
                    stream.result()
        self.stopping.clear()


def test_replica_stopped_and_restarted_under_traffic(replicas: list[Replica], logs: Path) -> None:
    """A replica sent SIGTERM while requests stream through the router: it drains (503 with Retry-After to
    new requests, /health 503) and exits, the router retries what it refused on the other replica and takes
    it out of rotation, and no request fails; restarted on the same port, it is routed to again. cache_aware
    balances by load once two requests separate the replicas, so concurrent traffic reaches both."""
    stopped = replicas[1]
    balance_flags = ["--balance-abs-threshold", "1", "--balance-rel-threshold", "1.0"]
    flags = ["--policy", "cache_aware", *balance_flags, *FAILOVER_FLAGS]
    with sglang_router(replicas, logs / "failover-router.log", *flags) as router:
        traffic = Traffic(router)
        before = [replica.served_requests() for replica in replicas]
        with traffic.running():
            wait_until(
                lambda: all(r.served_requests() > n for r, n in zip(replicas, before, strict=True)),
                30,
                "the traffic reaches both replicas",
            )
            assert stopped.process is not None
            stopped.process.send_signal(signal.SIGTERM)
            assert stopped.process.wait(timeout=30) == 0, stopped.output()
            answered_at_exit = traffic.answered
            wait_until(
                lambda: traffic.answered >= answered_at_exit + 20, 30, "answers after the replica left"
            )
        assert traffic.failures == [], traffic.failures

        stopped.start()
        stopped.wait_healthy()
        with traffic.running():
            wait_until(
                lambda: stopped.served_requests() > 0, 30, "the router routes to the restarted replica"
            )
        assert traffic.failures == [], traffic.failures
