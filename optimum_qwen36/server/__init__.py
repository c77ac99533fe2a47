"""The OpenAI-compatible server (`optimum-qwen36 serve`): FastAPI + uvicorn over the engine."""

from .app import build_app
from .loading import served_model
from .served import GENERATION_DEFAULTS, ServedModel, ServerSettings

__all__ = ["GENERATION_DEFAULTS", "ServedModel", "ServerSettings", "build_app", "served_model"]
