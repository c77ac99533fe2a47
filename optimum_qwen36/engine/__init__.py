"""The engine: continuous batching with chunked prefill interleaved with decode, one KV block pool shared
with prefix caching, per-request sampling, and the only caller of a model's step backend."""

from .detokenizer import IncrementalDetokenizer
from .engine import Engine
from .loop import AsyncEngine, EngineDeadError, EngineLoop, RequestStream
from .request import (
    ChosenToken,
    ComputedSequence,
    EngineRequest,
    FinishReason,
    Request,
    RequestOutput,
    RequestState,
    TokenChooser,
)
from .sampling import SamplingParams, TokenConstraint
from .scheduler import Scheduler, StepPlan

__all__ = [
    "AsyncEngine",
    "ChosenToken",
    "ComputedSequence",
    "Engine",
    "EngineDeadError",
    "EngineLoop",
    "EngineRequest",
    "FinishReason",
    "IncrementalDetokenizer",
    "Request",
    "RequestOutput",
    "RequestState",
    "RequestStream",
    "SamplingParams",
    "Scheduler",
    "StepPlan",
    "TokenChooser",
    "TokenConstraint",
]
