"""The engine: continuous batching with chunked prefill interleaved with decode, one KV block pool shared
with prefix caching, per-request sampling, and the only caller of a model's step backend."""

from .detokenizer import IncrementalDetokenizer
from .engine import Engine
from .loop import AsyncEngine, EngineDeadError, EngineLoop, RequestStream
from .request import FinishReason, Request, RequestOutput, RequestState, ResumePoint
from .sampling import SamplingParams, TokenConstraint
from .scheduler import Scheduler, StepPlan

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineDeadError",
    "EngineLoop",
    "FinishReason",
    "IncrementalDetokenizer",
    "Request",
    "RequestOutput",
    "RequestState",
    "RequestStream",
    "ResumePoint",
    "SamplingParams",
    "Scheduler",
    "StepPlan",
    "TokenConstraint",
]
