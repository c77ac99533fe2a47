"""The driver's engine under tensor parallelism: every call that changes an engine runs on every rank's
(distributed/replicated.py), with the driver filling in what would differ (a request's random seed)."""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from typing import Any

from ..distributed.replicated import Driver
from .sampling import SamplingParams


def fill_seed(params: SamplingParams | None) -> SamplingParams:
    """Sampling params with a seed: every rank must draw the same random numbers for a request."""
    params = params or SamplingParams()
    return params if params.seed is not None else dataclasses.replace(params, seed=secrets.randbits(63))


def outputs_digest(outputs: list[Any]) -> str:
    """What a step produced (request ids, tokens, finish reasons): the ranks must agree on it."""
    summary = [(o.request_id, list(o.new_token_ids), o.finished, str(o.finish_reason)) for o in outputs]
    return hashlib.sha256(repr(summary).encode()).hexdigest()


class ReplicatedEngine:
    """The driver's engine: calls that change it run on every rank; reads (stats, requests) run here. Its
    requests are sampled by the engine (generate() runs an engine of its own on every rank)."""

    def __init__(self, engine: Any, driver: Driver, model: Any) -> None:
        self._engine = engine
        self._driver = driver
        self._model = model  # the workers stop when the model goes: it must live as long as its engines

    def add_request(
        self,
        prompt_ids: Any,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        constraint: Any = None,
        reusable_prefix: int | None = None,
    ) -> str:
        args = ([int(t) for t in prompt_ids], fill_seed(params), request_id, constraint, reusable_prefix)
        return self._driver.call(self._engine, "add_request", args)

    def abort(self, request_id: str, after_error: bool = False) -> Any:
        if self._driver.group.dead is not None:  # nothing runs any more: free the request here
            return self._engine.abort(request_id, after_error=True)
        return self._driver.call(self._engine, "abort", (request_id, after_error))

    def step(self) -> list[Any]:
        return self._driver.call(self._engine, "step", digest=outputs_digest)

    def run(self) -> dict[str, Any]:
        return self._driver.call(self._engine, "run")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)
