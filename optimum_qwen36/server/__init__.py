"""The OpenAI-compatible server (`optimum-qwen36 serve`): FastAPI + uvicorn over the engine."""

from .app import ServedModel, ServerSettings, build_app
from .loading import served_model

__all__ = ["ServedModel", "ServerSettings", "build_app", "served_model"]
