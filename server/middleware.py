"""What every request passes before its route: the bearer-key check and the size-limited body reader."""
from __future__ import annotations

import hmac
import json

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import APIError, bad_request


class AuthMiddleware:
    """Bearer-key check as a plain ASGI middleware. (Starlette's BaseHTTPMiddleware would hide
    client disconnects from request.is_disconnected(), and non-streaming aborts rely on it.)"""

    OPEN_PATHS = ("/health", "/metrics", "/version")
    _BEARER = b"bearer "

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self.api_keys = [key.encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._needs_key(scope) and not self._has_valid_key(scope):
            response = APIError(401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
                                type="authentication_error", code="invalid_api_key").response()
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _needs_key(self, scope: Scope) -> bool:
        # CORS preflights never carry credentials
        return scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"] not in self.OPEN_PATHS

    def _has_valid_key(self, scope: Scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        prefix_length = len(self._BEARER)
        token = given[prefix_length:] if given[:prefix_length].lower() == self._BEARER else b""
        # compare against every key so timing reveals nothing about which one matched
        ok = False
        for key in self.api_keys:
            ok |= hmac.compare_digest(token, key)
        return ok


async def read_json_body(request: Request, max_body_bytes: int) -> object:
    """The request body decoded as JSON. Over `max_body_bytes` is a 413, refused from the
    Content-Length when there is one and while reading otherwise; not UTF-8 or not JSON is a 400."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_body_bytes:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {max_body_bytes} bytes",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise APIError(413, f"request body exceeds the limit of {max_body_bytes} bytes",
                           code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad_request("the request body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
