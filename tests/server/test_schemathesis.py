"""schemathesis against a live server, from its /openapi.json: every operation gets bodies valid
and not (schemathesis's coverage and fuzzing phases), and no answer may be a 5xx, every 4xx is
its protocol's error shape (Anthropic's under /v1/messages, OpenAI's elsewhere), and every answer
has a documented status, content type and body.

The schema is loaded when the module is collected, before any server runs (schemathesis 4.32's
fixture-loaded schemas break on pytest 9.2), from the same app code without a model; the live
server's /openapi.json is checked to be that very document before the run."""
from __future__ import annotations

import httpx
import pytest

from server.errors import speaks_anthropic
from tandem_server import MODEL, REQUEST_TIMEOUT_S, ServerProcess, openapi_document

schemathesis = pytest.importorskip("schemathesis")

# A small context keeps every valid generation short on a CPU: a chat's default max_tokens is the
# rest of the context, and SmolLM2's template alone takes ~30 tokens.
MAX_MODEL_LEN = 64
MAX_EXAMPLES = 50  # per operation in the fuzzing phase, valid and invalid together; the coverage phase adds its own
ERROR_KEYS = {"message", "type", "param", "code"}

DOCUMENT = openapi_document()
schema = schemathesis.openapi.from_dict(DOCUMENT)
schema.config.update(request_timeout=REQUEST_TIMEOUT_S)
schema.config.generation.update(max_examples=MAX_EXAMPLES, deterministic=True)
# The server checks more than the schema says (ranges, token ids against the vocabulary, the context
# length), so a schema-valid body may rightly get a 400: only that answer's shape is checked.
schema.config.checks.update(excluded_check_names=["positive_data_acceptance"])


@pytest.fixture(scope="module")
def api_server(start_server) -> ServerProcess:
    server = start_server("--max-model-len", str(MAX_MODEL_LEN))
    assert httpx.get(f"{server.url}/openapi.json", timeout=REQUEST_TIMEOUT_S).json() == DOCUMENT
    return server


def protocol_shaped_error(ctx, response, case) -> None:
    """A 4xx carries {"error": {"message": str, "type": str, "param": str|null, "code": str|null}},
    or under /v1/messages {"type": "error", "error": {"type": str, "message": str}}."""
    if not 400 <= response.status_code < 500:
        return
    body = response.json()
    if speaks_anthropic(case.path):
        assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body
        assert all(isinstance(value, str) for value in body["error"].values()), body
        return
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str), error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error


@pytest.mark.api
@schema.parametrize()
def test_api(case, api_server):
    if not case.meta.generation.mode.is_negative and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL  # a valid body names the served model; any other is a 404 (test_bad_inputs)
    case.call_and_validate(base_url=api_server.url, additional_checks=[protocol_shaped_error])
