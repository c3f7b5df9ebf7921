"""OpenAI request bodies -> prompts and SamplingParams: the checks that raise ParamError, and the
field renames that make chat's errors name chat's fields."""
from __future__ import annotations

import pytest

from scheduler.sampling_params import ParamError
from server.protocol import ChatCompletionRequest, CompletionRequest, param_error, parse

MODEL = "m"
MESSAGES = [{"role": "user", "content": "Hi"}]


def completion(**fields) -> CompletionRequest:
    return parse(CompletionRequest, {"model": MODEL, "prompt": "Hi", **fields})


def chat(**fields) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, {"model": MODEL, "messages": MESSAGES, **fields})


def raised(call) -> ParamError:
    with pytest.raises(ParamError) as info:
        call()
    return info.value


@pytest.mark.parametrize("prompt,prompts", [
    ("Hi", ["Hi"]),
    (["Hi", "Bye"], ["Hi", "Bye"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompts_become_a_list_of_prompts(prompt, prompts):
    assert completion(prompt=prompt).prompts() == prompts


@pytest.mark.parametrize("prompt,message", [([], "prompt must not be empty"),
                                            ([[1], []], "prompt token lists must not be empty")])
def test_empty_prompts_are_refused(prompt, message):
    error = raised(completion(prompt=prompt).prompts)
    assert (error.param, error.message) == ("prompt", message)


def test_completion_sampling_params():
    params = completion(max_tokens=5, logprobs=2, stop="\n", n=3, temperature=0.5).sampling_params()
    assert (params.max_tokens, params.logprobs, params.stop, params.n, params.temperature) == (5, 2, ("\n",), 3, 0.5)


def test_echo_with_logprobs_asks_for_the_prompts_logprobs():
    params = completion(echo=True, logprobs=2, max_tokens=0).sampling_params()
    assert (params.prompt_logprobs, params.logprobs, params.max_tokens) == (2, 2, 0)
    assert completion(echo=True).sampling_params().prompt_logprobs is None
    assert completion(logprobs=1).sampling_params().prompt_logprobs is None
    assert raised(completion(logprobs=1, max_tokens=0).sampling_params).param == "max_tokens"


def test_chat_logprobs_count_comes_from_top_logprobs():
    assert chat(logprobs=True, top_logprobs=3).sampling_params().logprobs == 3
    assert chat(logprobs=True).sampling_params().logprobs == 0
    assert chat().sampling_params().logprobs is None


def test_top_logprobs_without_logprobs_is_refused():
    error = raised(chat(top_logprobs=2).sampling_params)
    assert (error.param, error.message) == ("top_logprobs", "top_logprobs requires logprobs to be true")


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=7, max_completion_tokens=3).sampling_params().max_tokens == 3
    assert chat(max_tokens=7).sampling_params().max_tokens == 7


@pytest.mark.parametrize("fields,engine_param,request_param", [
    ({"max_completion_tokens": 0}, "max_tokens", "max_completion_tokens"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"logprobs": True, "top_logprobs": 21}, "logprobs", "top_logprobs"),
    ({}, "prompt", "messages"),
    ({"n": 0}, "n", "n"),
])
def test_chat_errors_name_chat_fields(fields, engine_param, request_param):
    request = chat(**fields)
    error = param_error(ParamError(engine_param, "bad"), request.param_renames())
    assert (error.status, error.param, error.message) == (400, request_param, "bad")


def test_sampling_param_errors_come_through_the_renames():
    request = chat(max_completion_tokens=0)
    error = raised(request.sampling_params)
    assert param_error(error, request.param_renames()).param == "max_completion_tokens"
