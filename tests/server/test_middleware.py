"""The API-key middleware, the request counter and the size-limited JSON body reader, each in a tiny
Starlette app."""
from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from server.errors import APIError
from server.middleware import AuthMiddleware, RequestCounter, read_json_body

KEYS = ("first-key", "second-key")
BODY_LIMIT = 64


async def ok(_request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


async def echo_json(request: Request) -> JSONResponse:
    return JSONResponse({"received": await read_json_body(request, BODY_LIMIT)})


async def api_error(_request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


@pytest.fixture(scope="module")
def guarded() -> TestClient:
    routes = [Route(path, ok) for path in ("/v1/models", "/v1/messages", "/health", "/metrics", "/version")]
    return TestClient(Starlette(routes=routes, middleware=[Middleware(AuthMiddleware, api_keys=KEYS)]))


@pytest.fixture(scope="module")
def reader() -> TestClient:
    return TestClient(Starlette(routes=[Route("/json", echo_json, methods=["POST"])],
                                exception_handlers={APIError: api_error}))


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


# ---- auth ---------------------------------------------------------------------------------
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", "Bearer", "first-key", "Basic first-key",
                                           "Bearer first-key-and-more"])
def test_without_a_valid_bearer_key_is_401(guarded, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    error = error_of(guarded.get("/v1/models", headers=headers), 401)
    assert error == {"message": "missing or invalid API key; send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                     "type": "authentication_error", "param": None, "code": "invalid_api_key"}


def test_anthropic_clients_send_the_key_as_x_api_key_and_read_anthropics_401(guarded):
    assert guarded.get("/v1/messages", headers={"x-api-key": "second-key"}).status_code == 200
    response = guarded.get("/v1/messages", headers={"x-api-key": "wrong-key"})
    assert response.status_code == 401
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "authentication_error"


def test_the_request_counter_counts_its_endpoints_by_status():
    counted = []
    app = Starlette(routes=[Route("/v1/messages", ok), Route("/v1/models", ok)],
                    middleware=[Middleware(RequestCounter, endpoints=("/v1/messages",),
                                           record=lambda *entry: counted.append(entry)),
                                Middleware(AuthMiddleware, api_keys=KEYS)])
    client = TestClient(app)
    client.get("/v1/messages", headers={"x-api-key": "first-key"})
    client.get("/v1/messages")
    client.get("/v1/models", headers={"x-api-key": "first-key"})
    assert counted == [("/v1/messages", 200), ("/v1/messages", 401)]


@pytest.mark.parametrize("authorization", ["Bearer first-key", "Bearer second-key", "bearer second-key"])
def test_any_configured_key_passes(guarded, authorization):
    response = guarded.get("/v1/models", headers={"Authorization": authorization})
    assert response.status_code == 200 and response.text == "ok"


@pytest.mark.parametrize("path", AuthMiddleware.OPEN_PATHS)
def test_open_paths_need_no_key(guarded, path):
    assert guarded.get(path).status_code == 200


def test_preflight_passes_without_a_key(guarded):
    # no CORS middleware here, so the route itself refuses the method: not a 401
    assert guarded.options("/v1/models").status_code == 405


# ---- body reader --------------------------------------------------------------------------
def test_json_body_is_decoded(reader):
    response = reader.post("/json", content=b'{"prompt": "h\xc3\xa9"}')
    assert response.status_code == 200 and response.json() == {"received": {"prompt": "hé"}}


def test_declared_length_over_the_limit_is_413(reader):
    body = b"[" + b"1," * BODY_LIMIT + b"1]"
    error = error_of(reader.post("/json", content=body), 413)
    assert error["code"] == "request_too_large"
    assert error["message"] == f"request body of {len(body)} bytes exceeds the limit of {BODY_LIMIT} bytes"


def test_chunked_body_over_the_limit_is_413_while_reading(reader):
    def chunks():
        for _ in range(BODY_LIMIT + 1):
            yield b" "

    response = reader.post("/json", content=chunks())
    assert "content-length" not in response.request.headers
    error = error_of(response, 413)
    assert error["message"] == f"request body exceeds the limit of {BODY_LIMIT} bytes"


@pytest.mark.parametrize("body, received", [
    (b'{"prompt": "\\ud83d\\ude00"}', {"prompt": "\U0001f600"}),  # a surrogate pair is one character
    (b'{"prompt": "\\\\ud800"}', {"prompt": "\\ud800"}),  # an escaped backslash, then text
])
def test_surrogate_escapes_in_pairs_are_read(reader, body, received):
    assert reader.post("/json", content=body).json() == {"received": received}


def test_body_at_the_limit_is_read(reader):
    body = b'"' + b"a" * (BODY_LIMIT - 2) + b'"'
    assert reader.post("/json", content=body).json() == {"received": "a" * (BODY_LIMIT - 2)}


@pytest.mark.parametrize("body,message", [
    (b'{"prompt": "\xff"}', "the request body is not valid UTF-8"),
    (b'{"prompt": ', "the request body is not valid JSON: "),
    (b"", "the request body is not valid JSON: "),
    (b'{"prompt": "\\ud800"}', "the request body holds an unpaired UTF-16 surrogate"),
    (b'{"prompt": ["a\\udc00b"]}', "the request body holds an unpaired UTF-16 surrogate"),
    (b'{"\\ud83d": 1}', "the request body holds an unpaired UTF-16 surrogate"),
])
def test_bad_body_is_400(reader, body, message):
    error = error_of(reader.post("/json", content=body), 400)
    assert error["message"].startswith(message) and error["type"] == "invalid_request_error"
    assert error["param"] is None
