"""Bad input, table-driven: each case gets the right 4xx in OpenAI's error shape, naming the
field where there is one; afterwards the server still serves correctly."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from tandem_server import MODEL, assert_openai_error, wait_idle

MAX_MODEL_LEN = 8192  # the embedded SmolLM2 under the engine's default cap; checked below
VOCAB_SIZE = 49152
BODY_LIMIT = 4 * 2**20  # `tandem serve --max-body-bytes` default

COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


@dataclass(frozen=True)
class Case:
    path: str
    body: dict | bytes  # bytes go out verbatim
    status: int
    param: str | None
    in_message: tuple[str, ...] = ()


def completion(**fields) -> dict:
    return {**COMPLETION, **fields}


def chat(**fields) -> dict:
    return {**CHAT, **fields}


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


def raw(text: str) -> bytes:
    return text.encode()


C, CH = "/v1/completions", "/v1/chat/completions"
CASES = {
    # wrong types
    "temperature_string": Case(C, completion(temperature="hot"), 400, "temperature"),
    "n_bool": Case(C, completion(n=True), 400, "n"),
    "max_tokens_string": Case(C, completion(max_tokens="5"), 400, "max_tokens"),
    "max_tokens_fraction": Case(C, completion(max_tokens=2.5), 400, "max_tokens"),
    "seed_string": Case(C, completion(seed="abc"), 400, "seed"),
    "stop_int": Case(C, completion(stop=5), 400, "stop"),
    "prompt_mixed_list": Case(C, completion(prompt=[1, "a"]), 400, "prompt"),
    "message_content_int": Case(CH, chat(messages=[{"role": "user", "content": 5}]), 400, "messages.0.content"),
    "messages_string": Case(CH, chat(messages="hello"), 400, "messages"),
    "logit_bias_value_string": Case(C, completion(logit_bias={"5": "x"}), 400, "logit_bias.5"),
    # out of range
    "temperature_nan": Case(C, raw(f'{{"model": "{MODEL}", "prompt": "Hi", "temperature": NaN}}'), 400,
                            "temperature"),
    "temperature_infinity": Case(CH, raw(f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Hi"}}],'
                                         f' "temperature": Infinity}}'), 400, "temperature"),
    "temperature_negative": Case(C, completion(temperature=-0.5), 400, "temperature"),
    "top_p_above_1": Case(C, completion(top_p=1.5), 400, "top_p"),
    "top_k_negative": Case(C, completion(top_k=-5), 400, "top_k"),
    "presence_penalty_3": Case(C, completion(presence_penalty=3), 400, "presence_penalty"),
    "n_0": Case(C, completion(n=0), 400, "n"),
    "n_too_many": Case(C, completion(n=100000), 400, "n"),
    "max_tokens_0": Case(C, completion(max_tokens=0), 400, "max_tokens"),
    "max_tokens_negative": Case(C, completion(max_tokens=-3), 400, "max_tokens"),
    "max_tokens_beyond_context": Case(C, completion(max_tokens=100000), 400, "max_tokens",
                                      (str(MAX_MODEL_LEN), "100000")),
    "max_completion_tokens_0": Case(CH, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    "max_completion_tokens_beyond_context": Case(CH, chat(max_completion_tokens=20000), 400,
                                                 "max_completion_tokens", (str(MAX_MODEL_LEN), "20000")),
    "min_tokens_above_max_tokens": Case(C, completion(min_tokens=10), 400, "min_tokens"),
    "prompt_beyond_context": Case(C, completion(prompt=[1] * (MAX_MODEL_LEN + 10)), 400, "prompt",
                                  (str(MAX_MODEL_LEN + 10), str(MAX_MODEL_LEN))),
    "logprobs_21": Case(C, completion(logprobs=21), 400, "logprobs"),
    "top_logprobs_21": Case(CH, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    "top_logprobs_without_logprobs": Case(CH, chat(top_logprobs=2), 400, "top_logprobs"),
    # token ids
    "prompt_id_beyond_vocab": Case(C, completion(prompt=[1, VOCAB_SIZE]), 400, "prompt", (str(VOCAB_SIZE),)),
    "prompt_id_negative": Case(C, completion(prompt=[-1]), 400, "prompt"),
    "prompt_lists_with_empty": Case(C, completion(prompt=[[1, 2], []]), 400, "prompt"),
    "stop_token_ids_beyond_vocab": Case(C, completion(stop_token_ids=[10**9]), 400, "stop_token_ids"),
    "logit_bias_key_not_id": Case(C, completion(logit_bias={"abc": 1}), 400, "logit_bias"),
    # keys that str.isdigit took but int() refuses: were 500s
    "logit_bias_key_double_minus": Case(C, completion(logit_bias={"--5": 1}), 400, "logit_bias"),
    "logit_bias_key_superscript": Case(C, completion(logit_bias={"\u00b2": 1}), 400, "logit_bias"),
    "logit_bias_key_beyond_vocab": Case(C, completion(logit_bias={str(VOCAB_SIZE): 1}), 400, "logit_bias"),
    "detokenize_beyond_vocab": Case("/detokenize", {"model": MODEL, "tokens": [VOCAB_SIZE]}, 400, "tokens"),
    # empty or missing
    "prompt_empty_string": Case(C, completion(prompt=""), 400, "prompt"),
    "prompt_empty_list": Case(C, completion(prompt=[]), 400, "prompt"),
    "prompt_missing": Case(C, without(COMPLETION, "prompt"), 400, "prompt"),
    "model_missing": Case(C, without(COMPLETION, "model"), 400, "model"),
    "messages_empty": Case(CH, chat(messages=[]), 400, "messages"),
    "messages_missing": Case(CH, without(CHAT, "messages"), 400, "messages"),
    "role_unknown": Case(CH, chat(messages=[{"role": "robot", "content": "Hi"}]), 400, "messages.0.role"),
    "content_part_not_text": Case(CH, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]), 400,
        "messages.0.content.0.type"),  # the part's fault, not the string content it was never meant to be
    "tokenize_neither": Case("/tokenize", {"model": MODEL}, 400, "prompt"),
    # the chat template raised on an empty conversation: was a 500 (found by schemathesis)
    "tokenize_messages_empty": Case("/tokenize", {"model": MODEL, "messages": []}, 400, "messages"),
    # unknown model
    "model_unknown_completion": Case(C, completion(model="gpt-4"), 404, "model", ("gpt-4",)),
    "model_unknown_chat": Case(CH, chat(model="gpt-4"), 404, "model"),
    # unsupported or unknown parameters: refused by name, never ignored
    "functions": Case(CH, chat(functions=[{"name": "f"}]), 400, "functions", ("functions",)),
    # tools and structured outputs
    "tool_type_unknown": Case(CH, chat(tools=[{"type": "retrieval"}]), 400, "tools.0.type"),
    "tool_choice_without_tools": Case(CH, chat(tool_choice="auto"), 400, "tool_choice", ("tools",)),
    "response_format_type_unknown": Case(CH, chat(response_format={"type": "yaml"}), 400, "response_format.type"),
    "json_schema_not_an_object": Case(C, completion(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}), 400,
        "response_format"),
    "structured_outputs_two_kinds": Case(C, completion(structured_outputs={"regex": "a", "choice": ["a"]}), 400,
                                         "structured_outputs"),
    "best_of": Case(C, completion(best_of=2), 400, "best_of", ("best_of",)),
    "suffix": Case(C, completion(suffix="!"), 400, "suffix", ("suffix",)),
    "unknown_field": Case(C, completion(frobnicate=1), 400, "frobnicate", ("frobnicate",)),
    "stream_options_without_stream": Case(C, completion(stream_options={"include_usage": True}), 400,
                                          "stream_options"),
    "stream_options_unknown_key": Case(CH, chat(stream=True, stream_options={"bogus": True}), 400,
                                       "stream_options.bogus"),
    "echo_with_logprobs_above_20": Case(C, completion(echo=True, logprobs=21), 400, "logprobs"),
    "max_tokens_0_without_prompt_logprobs": Case(C, completion(echo=True, max_tokens=0), 400, "max_tokens"),
    # routes
    "unknown_route": Case("/v1/engines", completion(), 404, None),
    # bodies that are not a JSON object
    "invalid_json": Case(C, b'{"model": "smollm2-135m", "prompt": ', 400, None, ("JSON",)),
    "non_utf8": Case(C, b'{"model": "smollm2-135m", "prompt": "\xff\xfe"}', 400, None, ("UTF-8",)),
    "json_array": Case(C, b"[1, 2]", 400, None),
    "empty_body": Case(C, b"", 400, None),
    # JSON that Python decodes but nothing downstream takes: were 500s
    "number_too_long": Case(C, raw(f'{{"model": "{MODEL}", "prompt": "Hi", "max_tokens": 1{"0" * 5000}}}'), 400, None,
                            ("number",)),
    "nested_too_deeply": Case(C, b"[" * 100_000 + b"]" * 100_000, 400, None, ("deeply",)),
    "lone_surrogate_prompt": Case(C, raw(f'{{"model": "{MODEL}", "prompt": "\\ud800"}}'), 400, None,
                                  ("surrogate",)),
    "lone_surrogate_message": Case(CH, raw(f'{{"model": "{MODEL}", "messages": [{{"role": "user", '
                                           f'"content": "\\udfff"}}]}}'), 400, None, ("surrogate",)),
    "lone_surrogate_tokenize": Case("/tokenize", raw('{"prompt": "a\\ud83d"}'), 400, None, ("surrogate",)),
    "lone_surrogate_model": Case(C, raw('{"model": "\\ud800", "prompt": "Hi"}'), 400, None, ("surrogate",)),
    "oversized_body": Case(C, b'{"model": "smollm2-135m", "prompt": "' + b"a" * (BODY_LIMIT + 1) + b'"}', 413,
                           None, (str(BODY_LIMIT),)),
}


def test_table_is_large():
    assert len(CASES) >= 25


def test_model_limits_match_the_table(http):
    (model,) = http.get("/v1/models").json()["data"]
    assert model["max_model_len"] == MAX_MODEL_LEN


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_input(http, case: Case):
    if isinstance(case.body, bytes):
        response = http.post(case.path, content=case.body, headers={"content-type": "application/json"})
    else:
        response = http.post(case.path, content=json.dumps(case.body), headers={"content-type": "application/json"})
    error = assert_openai_error(response, case.status, case.param)
    assert error["type"] == "invalid_request_error"
    for text in case.in_message:
        assert text in error["message"], error


def test_wrong_method_405(http):
    response = http.get(C)
    assert_openai_error(response, 405)
    assert "POST" in response.headers["allow"]


def test_oversized_chunked_body_413(http):
    """Without a Content-Length the limit is enforced while reading."""
    def chunks():
        yield b'{"model": "smollm2-135m", "prompt": "'
        for _ in range(BODY_LIMIT // 2**16 + 1):
            yield b"a" * 2**16
        yield b'"}'

    response = http.post(C, content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_openai_error(response, 413)


def test_still_serving_after_bad_inputs(http, client):
    wait_idle(http)  # nothing bad input did left work queued or blocks held
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    assert http.get("/health").status_code == 200
