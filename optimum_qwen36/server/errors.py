"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the status code OpenAI and
vLLM use, for every failure a request can meet (bad JSON or fields, unknown routes, a full queue)."""

from __future__ import annotations

import logging
from http import HTTPStatus

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
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    problems, param = [], None
    for problem in error.errors():
        location = [str(part) for part in problem.get("loc", ()) if part != "body"]
        if problem.get("type") == "json_invalid":
            problems.append(f"the body is not valid JSON ({problem.get('msg')})")
            continue
        where = ".".join(location)
        param = param or where or None
        problems.append(f"{where}: {problem.get('msg')}" if where else str(problem.get("msg")))
    return OpenAIError(400, "Invalid request: " + "; ".join(problems) + ".", param).response()


def _http_error(_: Request, error: HTTPException) -> JSONResponse:
    message = error.detail if isinstance(error.detail, str) else HTTPStatus(error.status_code).phrase
    return OpenAIError(error.status_code, message, headers=getattr(error, "headers", None)).response()


def _openai_error(_: Request, error: OpenAIError) -> JSONResponse:
    return error.response()


def _unexpected_error(_: Request, error: Exception) -> JSONResponse:
    logger.exception("Request failed")
    return OpenAIError(500, f"Internal error: {type(error).__name__}: {error}").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(Exception, _unexpected_error)
