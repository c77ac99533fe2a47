"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the status code OpenAI and
vLLM use, for every failure a request can meet (bad JSON or fields, unknown routes, a full queue)."""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return _ErrorResponse(self.body(), status_code=self.status, headers=self.headers)


class _ErrorResponse(JSONResponse):
    """JSON escaped to ASCII: an error may quote text the request sent, which need not be valid Unicode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def _where(problem: dict[str, Any]) -> str:
    """A validation problem's place in the body, as a param path (`messages.0.content`): without the names
    pydantic gives the members of a union it tried (`str`, `list[int]`, `tagged-union[...]`)."""
    parts = [str(part) for part in problem.get("loc", ()) if part != "body"]
    parts = [part for part in parts if "[" not in part and part not in _TYPE_NAMES]
    return ".".join(parts) or (problem.get("ctx") or {}).get("where", "")


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    problems = [problem for problem in error.errors() if problem.get("type") != "json_invalid"]
    if len(problems) < len(error.errors()):
        invalid = next(p for p in error.errors() if p.get("type") == "json_invalid")
        return bad_request(f"Invalid request: the body is not valid JSON ({invalid.get('msg')}).").response()
    places = [_where(problem) for problem in problems]
    # Of a union's members, the one that got furthest says what is wrong: a place inside another one's wins.
    deepest = [
        i for i, place in enumerate(places) if not any(p.startswith(place + ".") for p in places if place)
    ]
    described = []
    for i in deepest:
        message = str(problems[i].get("msg")).removeprefix("Value error, ")
        line = f"{places[i]}: {message}" if problems[i].get("loc", ()) != ("body",) and places[i] else message
        if line not in described:
            described.append(line)
    param = next((places[i] for i in deepest if places[i]), None)
    return bad_request("Invalid request: " + "; ".join(described) + ".", param).response()


def _http_error(_: Request, error: HTTPException) -> JSONResponse:
    message = error.detail if isinstance(error.detail, str) else HTTPStatus(error.status_code).phrase
    return OpenAIError(error.status_code, message, headers=getattr(error, "headers", None)).response()


def _openai_error(_: Request, error: OpenAIError) -> JSONResponse:
    return error.response()


def internal_error(error: BaseException) -> OpenAIError:
    """A failure of the server's, logged with its traceback (the handler may run outside the except block)."""
    logger.error("Request failed", exc_info=error)
    return OpenAIError(
        500,
        f"The server failed on this request ({type(error).__name__}: {error}); its log has the traceback.",
    )


def _unexpected_error(_: Request, error: Exception) -> JSONResponse:
    return internal_error(error).response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(Exception, _unexpected_error)
