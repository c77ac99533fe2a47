"""The engine requests behind one HTTP request, one per choice: submitted together, their outputs merged
into one stream, closed together (which aborts the ones still running and frees their slots and blocks)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from ..engine import AsyncEngine, EngineDeadError, EngineRequest, RequestOutput
from .errors import OpenAIError, bad_request
from .metrics import FinishedRequest, ServerMetrics


class EngineRun:
    """One engine request, as an async iterator of its outputs; `release_capacity` (its share of the
    server's capacity) is called once, however the run ends."""

    def __init__(
        self,
        index: int,
        request: EngineRequest,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        release_capacity: Callable[[], None],
    ) -> None:
        self.index = index
        self._release_capacity = release_capacity
        self._released = False
        self.outputs = self._outputs(request, engine, metrics)

    async def _outputs(
        self, request: EngineRequest, engine: AsyncEngine, metrics: ServerMetrics
    ) -> AsyncIterator[RequestOutput]:
        arrival = time.monotonic()
        times: list[float] = []
        try:
            outputs = engine.generate(request)
            async with contextlib.aclosing(outputs) as outs:
                async for output in outs:
                    times += [time.monotonic()] * len(output.new_token_ids)
                    if output.finished and output.finish_reason is not None:
                        end = time.monotonic()
                        reason = output.finish_reason.value
                        finished = FinishedRequest(reason, len(request.prompt_ids), times, arrival, end)
                        metrics.request_finished(finished)
                    yield output
        except ValueError as error:
            if times:  # a failure mid-generation is the server's, not the request's
                raise
            raise bad_request(str(error)) from error  # the engine refused it at submission
        except EngineDeadError as error:
            raise OpenAIError(
                503, f"The engine is not running: {error}", headers={"Retry-After": "5"}
            ) from error
        finally:
            self.release()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release_capacity()

    async def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # already closed by its reader
            await self.outputs.aclose()
        self.release()  # a run that never started never ran its finally


class ChoiceRuns:
    """All choices of a request: started together, their outputs merged as (choice index, output), closed
    together (which aborts the ones still running)."""

    def __init__(self, runs: list[EngineRun]) -> None:
        self.runs = runs
        self._merged: AsyncIterator[tuple[int, RequestOutput]] | None = None

    async def start(self) -> None:
        """Submit every choice at once and wait for each one's first output, so that a refusal raises
        before a streamed response has begun."""
        results = await asyncio.gather(*(anext(run.outputs) for run in self.runs), return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            await self.close()
            raise failure
        self._merged = self._merge(results)

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if self._merged is None:
            raise RuntimeError("start() the runs first")
        return self._merged

    async def _merge(self, firsts: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(run: EngineRun, first: RequestOutput) -> None:
            try:
                await queue.put((run.index, first))
                # Iterated to its end even after a finished output: its end releases its capacity.
                async for output in run.outputs:
                    await queue.put((run.index, output))
                await queue.put((run.index, None))
            except asyncio.CancelledError:
                raise
            except BaseException as error:
                await queue.put((run.index, error))

        tasks = [asyncio.create_task(pump(run, first)) for run, first in zip(self.runs, firsts, strict=True)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        if self._merged is not None:
            with contextlib.suppress(RuntimeError):
                await self._merged.aclose()
        for run in self.runs:
            await run.close()
