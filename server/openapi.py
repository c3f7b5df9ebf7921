"""What /openapi.json says beyond what FastAPI sees for itself.

Routes read their bodies through read_request (size limit, strict validation, OpenAI-shaped 400s),
so FastAPI knows no body model: each POST route names its model with `json_body`, and
`openapi_document` moves the model's JSON schema into components/schemas. Errors, the event
stream and the bearer key are documented here too; everything is derived from the models.
"""
from __future__ import annotations

from functools import partial

from fastapi import FastAPI
from pydantic import BaseModel

from server.errors import AnthropicErrorResponse, ErrorResponse, speaks_anthropic
from server.middleware import AuthMiddleware

COMPONENT_REF = "#/components/schemas/{model}"
SECURITY_SCHEME = "bearerKey"
HEADER_SECURITY_SCHEME = "apiKeyHeader"  # Anthropic's clients send the key as x-api-key
ERROR_DESCRIPTIONS = {
    400: "the body is not a JSON object, or a parameter is invalid or unsupported: `param` names it",
    401: "no valid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
    404: "the body names a model this server does not serve",
    413: "the body is larger than the server's --max-body-bytes",
    429: "the waiting queue is full: retry after Retry-After seconds",
    500: "an internal error failed this request",
    503: "the engine is not running",
}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
# 200 of the generation routes with `stream: true`: server-sent events, `data: <json>` then `data: [DONE]`.
# The schema is one event's, as OpenAPI 3.2's itemSchema and schemathesis read an event stream's.
SERVER_SENT_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a JSON chunk; `[DONE]` ends the stream"}}}
EVENT_STREAM = {200: {"description": "the completion as JSON, or with `stream: true` as server-sent events",
                      "content": {"text/event-stream": {"schema": SERVER_SENT_EVENT}}}}
# Anthropic's and the Responses API's streams: each event named by its payload's type, no terminator.
NAMED_SERVER_SENT_EVENT = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"type": "string", "description": "the payload's type"},
    "data": {"type": "string", "description": "a JSON event"}}}
NAMED_EVENT_STREAM = {200: {"description": "the response as JSON, or with `stream: true` as server-sent events",
                            "content": {"text/event-stream": {"schema": NAMED_SERVER_SENT_EVENT}}}}
ANTHROPIC_EVENT_STREAM = {200: {**NAMED_EVENT_STREAM[200], "description": "the message as JSON, or with "
                                                                          "`stream: true` as server-sent events"}}


def json_body(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra` documenting `model` as its required JSON body. The route still
    reads the body itself; the schema's own definitions are hoisted by `openapi_document`."""
    schema = model.model_json_schema(ref_template=COMPONENT_REF)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def error_responses(*statuses: int, anthropic_shape: bool = False) -> dict:
    """A route's `responses` for the error statuses it answers, each with OpenAI's error body, or
    Anthropic's with `anthropic_shape`."""
    model = AnthropicErrorResponse if anthropic_shape else ErrorResponse
    return {status: {"model": model, "description": ERROR_DESCRIPTIONS[status],
                     **({"headers": RETRY_AFTER} if status in (429, 503) else {})} for status in statuses}


def install(app: FastAPI, requires_key: bool) -> None:
    """Serve `openapi_document` as the app's /openapi.json."""
    app.openapi = partial(openapi_document, app, requires_key)


def openapi_document(app: FastAPI, requires_key: bool) -> dict:
    """FastAPI's document with every body schema in components/schemas and, when the server
    requires a key, the bearer scheme and a 401 on every path that needs it. Built once."""
    if app.openapi_schema is None:
        document = FastAPI.openapi(app)  # builds and caches app.openapi_schema, which is edited in place
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for path, path_item in document["paths"].items():
            for operation in path_item.values():
                _hoist_body_schemas(operation, schemas)
                if requires_key and path not in AuthMiddleware.OPEN_PATHS:
                    _require_key(operation, AnthropicErrorResponse if speaks_anthropic(path) else ErrorResponse)
        if requires_key:
            document["components"]["securitySchemes"] = {
                SECURITY_SCHEME: {"type": "http", "scheme": "bearer"},
                HEADER_SECURITY_SCHEME: {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    return app.openapi_schema


def _hoist_body_schemas(operation: dict, schemas: dict) -> None:
    """Replace each inline body schema by a $ref, moving it and its $defs into `schemas`."""
    for media in operation.get("requestBody", {}).get("content", {}).values():
        schema = media["schema"]
        if "$ref" in schema:
            continue
        name = schema["title"]
        for def_name, definition in {**schema.pop("$defs", {}), name: schema}.items():
            # models that share a part (ChatMessage) carry the same definition of it
            if schemas.setdefault(def_name, definition) != definition:
                raise ValueError(f"two different schemas are both named {def_name!r}")
        media["schema"] = {"$ref": COMPONENT_REF.format(model=name)}


def _require_key(operation: dict, error_model: type[BaseModel]) -> None:
    operation["security"] = [{SECURITY_SCHEME: []}, {HEADER_SECURITY_SCHEME: []}]  # either one
    operation["responses"]["401"] = {"description": ERROR_DESCRIPTIONS[401], "content": {
        "application/json": {"schema": {"$ref": COMPONENT_REF.format(model=error_model.__name__)}}}}
