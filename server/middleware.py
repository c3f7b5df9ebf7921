"""What every request passes before its route: the count of requests by endpoint, the API-key check
and the size-limited body reader."""
from __future__ import annotations

import hmac
import json
import re
from typing import Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, bad_request

# JSON may spell a UTF-16 surrogate as an escape (\ud800): a cheap test whether a body needs the full look
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class AuthMiddleware:
    """API-key check as a plain ASGI middleware: a bearer key (OpenAI's clients) or an x-api-key
    header (Anthropic's). (Starlette's BaseHTTPMiddleware would hide client disconnects from
    request.is_disconnected(), and non-streaming aborts rely on it.)"""

    OPEN_PATHS = ("/health", "/metrics", "/version")
    _BEARER = b"bearer "

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self.api_keys = [key.encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._needs_key(scope) and not self._has_valid_key(scope):
            response = APIError(401, "missing or invalid API key; send 'Authorization: Bearer <key>' "
                                     "or 'x-api-key: <key>'", type="authentication_error",
                                code="invalid_api_key").response(scope["path"])
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _needs_key(self, scope: Scope) -> bool:
        # CORS preflights never carry credentials
        return scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"] not in self.OPEN_PATHS

    def _has_valid_key(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        prefix_length = len(self._BEARER)
        bearer = given[:prefix_length].lower() == self._BEARER
        token = given[prefix_length:] if bearer else headers.get(b"x-api-key", b"")
        # compare against every key so timing reveals nothing about which one matched
        ok = False
        for key in self.api_keys:
            ok |= hmac.compare_digest(token, key)
        return ok


class RequestCounter:
    """Counts the requests to `endpoints` by the status answered (`record(endpoint, status)`); a plain
    ASGI middleware for the reason AuthMiddleware is one."""

    def __init__(self, app: ASGIApp, endpoints: tuple[str, ...], record: Callable[[str, int], None]) -> None:
        self.app = app
        self.endpoints = frozenset(endpoints)
        self.record = record

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.endpoints:
            await self.app(scope, receive, send)
            return

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.record(scope["path"], message["status"])
            await send(message)

        await self.app(scope, receive, send_counted)


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
    return _decode_json(b"".join(chunks))


def _decode_json(raw: bytes) -> object:
    """`raw` as JSON; anything Python's decoder or a later encoder cannot take is a 400."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad_request("the request body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except ValueError:  # an integer beyond Python's limit on the digits it converts
        raise bad_request("the request body holds a number too long to decode") from None
    except RecursionError:
        raise bad_request("the request body nests arrays or objects too deeply") from None
    # an unpaired surrogate is no character: tokenizers, and the encoder of any reply quoting it, fail on it
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(body):
        raise bad_request("the request body holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)")
    return body


def _has_lone_surrogate(body: object) -> bool:
    pending = [body]  # a stack, not recursion: the body may nest as deeply as the decoder allowed
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(value, dict):
            pending.extend(value)
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return False
