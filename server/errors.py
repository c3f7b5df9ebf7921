"""Errors as each protocol shapes them: OpenAI's {"error": {"message", "type", "param", "code"}} for
its endpoints (chat, completions, responses, ...) and Anthropic's {"type": "error", "error": {"type",
"message"}} for /v1/messages. An APIError is raised once and shaped by the path it answers."""
from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel

ANTHROPIC_PATH = "/v1/messages"  # and the paths below it (count_tokens)
# Anthropic's error types by status (its own 529 "overloaded" is tandem's 429 queue_full)
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                         429: "rate_limit_error"}
ANTHROPIC_SERVER_ERROR = "api_error"


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """Anthropic has no `param`: the message names the field when the message does not already."""
        message = self.message
        if self.param and self.param not in message:
            message = f"{self.param}: {message}"
        return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(self.status, ANTHROPIC_SERVER_ERROR),
                                           "message": message}}

    def response(self, path: str = "") -> JSONResponse:
        """The error as the protocol served at `path` shapes it."""
        body = self.anthropic_body() if speaks_anthropic(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def speaks_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None  # the request field at fault, as the client spelled it
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every OpenAI-shaped error response (what APIError.body() writes), for /openapi.json."""
    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """The body of every error of /v1/messages (what APIError.anthropic_body() writes)."""
    type: Literal["error"]
    error: AnthropicErrorDetail
