"""The driver's engine under tensor parallelism: every call that changes an engine runs on every rank's
(distributed/replicated.py), with the driver filling in what would differ (a request's random seed)."""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from typing import Any

from ..distributed.replicated import Driver
from .request import EngineRequest
from .sampling import SamplingParams


def fill_seed(params: SamplingParams) -> SamplingParams:
    """Sampling params with a seed: every rank must draw the same random numbers for a request."""
    return params if params.seed is not None else dataclasses.replace(params, seed=secrets.randbits(63))


def outputs_digest(outputs: list[Any]) -> str:
    """What a step produced (request ids, tokens, finish reasons): the ranks must agree on it."""
    summary = [(o.request_id, list(o.new_token_ids), o.finished, str(o.finish_reason)) for o in outputs]
    return hashlib.sha256(repr(summary).encode()).hexdigest()


class ReplicatedEngine:
    """The driver's engine: calls that change it run on every rank; reads (stats, requests) run here."""

    def __init__(self, engine: Any, driver: Driver, model: Any) -> None:
        self._engine = engine
        self._driver = driver
        self._model = model  # the workers stop when the model goes: it must live as long as its engines

    def add_request(self, request: EngineRequest) -> str:
        if request.chooser is not None:
            raise ValueError(
                "a request with a token chooser runs on one rank only: under tensor parallelism every "
                "rank would need the same chooser (generate() runs on every rank instead)."
            )
        seeded = dataclasses.replace(request, params=fill_seed(request.params))
        return self._driver.call(self._engine, "add_request", (seeded,))

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
