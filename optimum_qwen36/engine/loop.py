"""The engine on its own thread: thread-safe submission, per-request output streams, and an asyncio face.

`EngineLoop` owns an `Engine` and is the only thread that touches it. Callers on any thread `submit` a
request (validated on the loop thread: a bad request raises in the caller and queues nothing) and read its
`RequestStream`, which yields each step's `RequestOutput` until the finished one. `abort` takes effect
before the loop's next step. When a step raises, every request in flight ends with that error (each stream
raises it), the loop stays up for new requests.

`AsyncEngine` is the same loop for asyncio code (the server): `generate()` is an async iterator of outputs,
and leaving it early (a client disconnects, the task is cancelled) aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..prefix_caching import PrefixCacheEvent
from .engine import Engine
from .request import EngineRequest, RequestOutput

logger = logging.getLogger(__name__)

# A stream's end when the engine failed: the exception, carried to the reader.
_Item = RequestOutput | BaseException
Sink = Callable[[_Item], None]


class EngineDeadError(RuntimeError):
    """The engine loop was shut down: no request can be submitted any more."""


class RequestStream:
    """The outputs of one request, in order, ending with the finished one (iterate it, from any thread)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._items: queue.SimpleQueue[_Item] = queue.SimpleQueue()

    def put(self, item: _Item) -> None:
        self._items.put(item)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            item = self._items.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


@dataclass
class _Command:
    """Work for the loop thread: `run` between steps, or `fail` if the loop ends before running it."""

    run: Callable[[], None]
    fail: Callable[[BaseException], None] = lambda error: None


class EngineLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._event_sink: Callable[[list[PrefixCacheEvent]], None] | None = None
        self._lock = threading.Lock()  # orders submissions against the loop's end
        self._stopping = threading.Event()
        self._dead = False
        self._thread = threading.Thread(target=self._run, name="optimum-qwen36-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    def submit(self, request: EngineRequest) -> RequestStream:
        """Queue a request; returns the stream of its outputs. Raises what `Engine.add_request` raises for
        bad input (and queues nothing)."""
        stream = RequestStream("")
        stream.request_id = self.add(request, stream.put).result()
        return stream

    def add(self, request: EngineRequest, sink: Sink) -> Future[str]:
        """Queue a request whose outputs (or the engine's exception) are passed to `sink` on the loop
        thread; the future gives its id, or the error that refused it."""
        added: Future[str] = Future()

        def add() -> None:
            try:
                rid = self.engine.add_request(request)
            except Exception as error:  # handed to the submitting thread
                added.set_exception(error)
                return
            self._sinks[rid] = sink
            added.set_result(rid)

        self._command(_Command(add, added.set_exception))
        return added

    def abort(self, request_id: str) -> None:
        """End a request before the next step (its stream gets a finished output with reason abort)."""

        def abort() -> None:
            output = self.engine.abort(request_id)
            sink = self._sinks.pop(request_id, None)
            if output is not None and sink is not None:
                self._deliver(request_id, sink, output)

        self._command(_Command(abort))

    def call(self, function: Callable[[Engine], Any]) -> Any:
        """Run `function(engine)` on the loop thread between steps; returns its result (`Engine.stats`)."""
        done: Future[Any] = Future()

        def run() -> None:
            try:
                done.set_result(function(self.engine))
            except Exception as error:  # handed to the calling thread
                done.set_exception(error)

        self._command(_Command(run, done.set_exception))
        return done.result()

    def publish_prefix_cache_events(self, sink: Callable[[list[PrefixCacheEvent]], None]) -> None:
        """From now on, after each step, hand `sink` (on the loop thread) what the prefix cache stored and
        evicted during it (a replica's KV events, for routers)."""

        def start() -> None:
            self.engine.prefix_cache.record_events()
            self._event_sink = sink

        self.call(lambda _: start())

    def shutdown(self) -> None:
        """Stop the loop: requests in flight end with EngineDeadError."""
        self._stopping.set()
        with self._lock:
            if not self._dead:
                self._commands.put(_Command(lambda: None))  # wake the loop
        self._thread.join()

    def __enter__(self) -> EngineLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def alive(self) -> bool:
        """Whether the loop thread still runs (it stops at shutdown, or if the loop itself crashed)."""
        return self._thread.is_alive() and not self._dead

    def _command(self, command: _Command) -> None:
        with self._lock:
            if self._dead or self._stopping.is_set():
                raise EngineDeadError("The engine loop is shut down: create a new one to submit requests.")
            self._commands.put(command)

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                # Block for work only when nothing is in flight; otherwise take what arrived and step.
                command = self._next_command(block=not self.engine.has_unfinished())
                while command is not None:
                    command.run()
                    command = self._next_command(block=False)
                if self.engine.has_unfinished() and not self._stopping.is_set():
                    self._step()
            error: BaseException = EngineDeadError("The engine loop was shut down while this request ran.")
        except BaseException as crash:  # the loop itself failed: every caller must hear of it
            error = crash
        with self._lock:
            self._dead = True  # no command can be queued any more: the drain below sees them all
        self._fail_all(error)
        while (command := self._next_command(block=False)) is not None:
            command.fail(EngineDeadError("The engine loop ended before this command ran."))

    def _next_command(self, block: bool) -> _Command | None:
        try:
            return self._commands.get(block=block)
        except queue.Empty:
            return None

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # the requests in flight end with it; the loop survives
            self._fail_all(error, after_error=True)
            return
        for output in outputs:
            sink = self._sinks.pop(output.request_id) if output.finished else self._sinks[output.request_id]
            self._deliver(output.request_id, sink, output)
        if self._event_sink is not None:
            events = self.engine.prefix_cache.take_events()
            if events:
                self._event_sink(events)

    def _deliver(self, request_id: str, sink: Sink, item: _Item) -> None:
        """Hand an output to its reader; a reader that cannot take it (its event loop closed) is gone, so
        its request is aborted rather than left running."""
        try:
            sink(item)
        except Exception:
            logger.warning("The reader of request %r failed: aborting it.", request_id, exc_info=True)
            self._sinks.pop(request_id, None)
            self.engine.abort(request_id)

    def _fail_all(self, error: BaseException, after_error: bool = False) -> None:
        for request_id in list(self._sinks):
            sink = self._sinks.pop(request_id)
            try:
                self.engine.abort(request_id, after_error=after_error)
            except Exception:
                logger.exception("Could not release request %r after an error.", request_id)
            try:
                sink(error)
            except Exception:
                logger.warning("The reader of request %r failed.", request_id, exc_info=True)


class AsyncEngine:
    """An EngineLoop for asyncio: `await`-free submission, outputs as an async iterator."""

    def __init__(self, engine: Engine) -> None:
        self.loop = EngineLoop(engine)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs as the engine produces them; raises ValueError for bad
        input before yielding anything. Closing the iterator before the end aborts the request."""
        running = asyncio.get_running_loop()
        items: asyncio.Queue[_Item] = asyncio.Queue()

        def sink(item: _Item) -> None:
            running.call_soon_threadsafe(items.put_nowait, item)

        added = self.loop.add(request, sink)
        try:
            rid = await asyncio.wrap_future(added)
        except asyncio.CancelledError:
            # Cancelled while the loop was queueing it: abort it once it has an id.
            def abort_once_added(future: Future[str]) -> None:
                if future.exception() is None:
                    self._abort_quietly(future.result())

            added.add_done_callback(abort_once_added)
            raise
        finished = False
        try:
            while not finished:
                item = await items.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._abort_quietly(rid)

    def _abort_quietly(self, request_id: str) -> None:
        with contextlib.suppress(EngineDeadError):  # a shut-down loop has already ended it
            self.loop.abort(request_id)

    async def stats(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.loop.call, Engine.stats)

    @property
    def alive(self) -> bool:
        return self.loop.alive

    def shutdown(self) -> None:
        self.loop.shutdown()
