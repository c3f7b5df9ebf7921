"""/openapi.json: every route's body, errors and content types, derived from the pydantic models.
The document is built without a model (tandem_server.openapi_document), then compared with what
the live server serves."""
from __future__ import annotations

import pytest

from server import protocol
from server.errors import AnthropicErrorResponse, APIError, ErrorResponse, speaks_anthropic
from server.protocols import anthropic, responses
from server.middleware import AuthMiddleware
from tandem_server import openapi_document

BODY_MODELS = {"/v1/completions": protocol.CompletionRequest, "/v1/chat/completions": protocol.ChatCompletionRequest,
               "/tokenize": protocol.TokenizeRequest, "/detokenize": protocol.DetokenizeRequest,
               "/v1/messages": anthropic.MessagesRequest, "/v1/messages/count_tokens": anthropic.CountTokensRequest,
               "/v1/responses": responses.ResponsesRequest}
ERROR_REF = "#/components/schemas/ErrorResponse"
ANTHROPIC_ERROR_REF = "#/components/schemas/AnthropicErrorResponse"
HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


@pytest.fixture(scope="module")
def document() -> dict:
    return openapi_document()


def operations(document: dict):
    for path, path_item in document["paths"].items():
        for method, operation in path_item.items():
            if method in HTTP_METHODS:
                yield path, method, operation


def resolve(document: dict, ref: str) -> dict:
    assert ref.startswith("#/"), ref
    node = document
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def refs_in(node) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [ref for value in node.values() for ref in refs_in(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in refs_in(value)]
    return []


def test_every_post_route_documents_its_body_model(document):
    posts = {path: operation for path, method, operation in operations(document) if method == "post"}
    assert set(posts) == set(BODY_MODELS)
    for path, operation in posts.items():
        body = operation["requestBody"]
        assert body["required"] is True
        ref = body["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{BODY_MODELS[path].__name__}"
        schema = resolve(document, ref)
        fields = {field.alias or name for name, field in BODY_MODELS[path].model_fields.items()}
        assert set(schema["properties"]) == fields, path
        assert schema["additionalProperties"] is False  # unknown parameters are refused, as the schema says


def test_nested_models_are_components(document):
    chat = resolve(document, "#/components/schemas/ChatCompletionRequest")
    assert chat["properties"]["messages"]["items"] == {"$ref": "#/components/schemas/ChatMessage"}
    assert "$defs" not in chat
    assert set(resolve(document, "#/components/schemas/ChatMessage")["properties"]) == \
        set(protocol.ChatMessage.model_fields)


def test_every_ref_resolves(document):
    refs = refs_in(document)
    assert refs
    for ref in refs:
        assert isinstance(resolve(document, ref), dict), ref


def test_errors_are_documented_in_each_protocols_shape(document):
    error = resolve(document, ERROR_REF)
    detail = resolve(document, error["properties"]["error"]["$ref"])
    assert set(detail["required"]) == {"message", "type", "param", "code"}
    ErrorResponse.model_validate(APIError(400, "bad", param="n", code="x").body())
    anthropic_error = AnthropicErrorResponse.model_validate(APIError(400, "bad", param="n").anthropic_body())
    assert (anthropic_error.error.type, anthropic_error.error.message) == ("invalid_request_error", "n: bad")
    for path, method, operation in operations(document):
        errors = {status: response for status, response in operation["responses"].items() if int(status) >= 400}
        assert "500" in errors, (path, method)
        ref = ANTHROPIC_ERROR_REF if speaks_anthropic(path) else ERROR_REF
        for response in errors.values():
            assert response["content"]["application/json"]["schema"] == {"$ref": ref}


@pytest.mark.parametrize("path, statuses", [
    ("/v1/completions", {"200", "400", "404", "413", "429", "500", "503"}),
    ("/v1/chat/completions", {"200", "400", "404", "413", "429", "500", "503"}),
    ("/v1/messages", {"200", "400", "404", "413", "429", "500", "503"}),
    ("/v1/messages/count_tokens", {"200", "400", "404", "413", "500"}),
    ("/v1/responses", {"200", "400", "404", "413", "429", "500", "503"}),
    ("/tokenize", {"200", "400", "404", "413", "500"}),
    ("/detokenize", {"200", "400", "404", "413", "500"}),
    ("/health", {"200", "500", "503"}),
])
def test_statuses_each_route_answers(document, path, statuses):
    (operation,) = document["paths"][path].values()
    assert set(operation["responses"]) == statuses


def test_content_types(document):
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"):
        content = document["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
        assert "data" in content["text/event-stream"]["schema"]["required"]  # one event's schema
    assert "content" not in document["paths"]["/health"]["get"]["responses"]["200"]
    assert set(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert {"/v1/models", "/version"} <= set(document["paths"])


def test_key_is_documented_only_where_required(document):
    assert "securitySchemes" not in document["components"]
    keyed = openapi_document("secret")
    assert list(keyed["components"]["securitySchemes"].values()) == [
        {"type": "http", "scheme": "bearer"}, {"type": "apiKey", "in": "header", "name": "x-api-key"}]
    for path, method, operation in operations(keyed):
        open_path = path in AuthMiddleware.OPEN_PATHS
        assert ("security" in operation) != open_path, (path, method)
        assert ("401" in operation["responses"]) != open_path, (path, method)


def test_document_is_valid_openapi_3_1(document):
    """Against the OpenAPI 3.1 meta-schema, and each schema against JSON Schema 2020-12's."""
    schemathesis = pytest.importorskip("schemathesis")
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    assert document["openapi"].startswith("3.1")
    schemathesis.openapi.from_dict(document).validate()
    for schema in document["components"]["schemas"].values():
        jsonschema_rs.meta.validate(schema)


def test_the_server_serves_the_document(http, document):
    response = http.get("/openapi.json")
    assert response.status_code == 200
    assert response.json() == document
