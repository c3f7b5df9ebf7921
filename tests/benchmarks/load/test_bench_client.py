"""The benchmark's client and runner against fake endpoints (httpx.MockTransport; no server)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from benchmarks.load.client import Endpoint, EndpointError, check_endpoint, server_counters
from benchmarks.load.runner import run_requests
from benchmarks.load.systems import SystemSpec, free_port
from benchmarks.load.workload import Load, synthetic_lengths

COMPLETIONS = Endpoint("http://fake", "m", "completions")
CHAT = Endpoint("http://fake", "m", "chat")


def sse(*events) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def completion_stream(num_tokens: int, prompt_tokens: int = 9, usage: bool = True, done: bool = True) -> bytes:
    events = [{"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None if i < num_tokens - 1 else "length"}],
               "usage": None} for i in range(num_tokens)]
    if usage:
        events.append({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": num_tokens,
                                                "total_tokens": prompt_tokens + num_tokens}})
    return sse(*events, *(["[DONE]"] if done else []))


def run(endpoint, specs, handler, **kwargs):
    prompts = {s.index: "hello" for s in specs}
    options = {"concurrency": None, "request_timeout_s": 10.0, "max_duration_s": 30.0, "progress": False}
    return asyncio.run(run_requests(endpoint, specs, prompts, transport=httpx.MockTransport(handler),
                                    **{**options, **kwargs}))


def burst(n=1, output_len=4):
    return Load("burst").schedule(synthetic_lengths(n, 10, output_len, 0.0, seed=0), seed=0)


def test_completion_stream_timings_and_usage():
    seen = []

    def handler(request):
        seen.append(json.loads(request.content))
        return httpx.Response(200, content=completion_stream(4, prompt_tokens=11))

    (record,) = run(COMPLETIONS, burst(output_len=4), handler)
    assert record.ok and record.usage_reported
    assert (record.num_prompt_tokens, record.num_output_tokens) == (11, 4)
    assert len(record.token_times_s) == 4
    assert record.start_s <= record.token_times_s[0] <= record.end_s
    body = seen[0]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 4 and body["ignore_eos"] and body["prompt"] == "hello" and body["model"] == "m"


def test_chat_stream_skips_role_and_empty_finish_chunks():
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": None}]},  # a partial character
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 2}}, "[DONE]"]
    seen = []

    def handler(request):
        seen.append(json.loads(request.content))
        return httpx.Response(200, content=sse(*events))

    (record,) = run(CHAT, burst(output_len=2), handler)
    assert record.ok and len(record.token_times_s) == 2 and record.num_output_tokens == 2
    assert seen[0]["messages"] == [{"role": "user", "content": "hello"}]
    assert str(seen[0]).count("prompt") == 0


def test_chat_sends_a_whole_conversation_and_keeps_the_reply_text():
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    body = CHAT.body(conversation, 3)
    assert body["messages"] == conversation and body["ignore_eos"] and body["max_tokens"] == 3
    with pytest.raises(ValueError, match="chat"):
        COMPLETIONS.body(conversation, 3)
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 2,
                                        "prompt_tokens_details": {"cached_tokens": 24}}}, "[DONE]"]
    (record,) = run(CHAT, burst(output_len=2), lambda r: httpx.Response(200, content=sse(*events)))
    assert record.ok and record.output_text == "Hello"
    assert (record.num_prompt_tokens, record.num_cached_prompt_tokens) == (30, 24)  # llama.cpp's usage says


def test_without_usage_chunks_are_counted():
    (record,) = run(COMPLETIONS, burst(output_len=3), lambda r: httpx.Response(200, content=completion_stream(3, usage=False)))
    assert record.ok and not record.usage_reported and record.num_output_tokens == 3


@pytest.mark.parametrize("response, error, message", [
    (httpx.Response(429, json={"error": {"message": "the server is busy", "type": "rate_limit_error"}}),
     "429", "the server is busy"),
    (httpx.Response(500, text="<html>oops</html>"), "500", "<html>oops</html>"),
    (httpx.Response(200, content=sse({"error": {"message": "engine died", "type": "internal_error"}})),
     "stream_error", "engine died"),
    (httpx.Response(200, content=completion_stream(2, done=False)), "incomplete", "[DONE]"),
    (httpx.Response(200, content=b"data: {not json\n\n"), "bad_response", "not JSON"),
])
def test_errors_are_recorded_by_kind(response, error, message):
    (record,) = run(COMPLETIONS, burst(), lambda r: response)
    assert not record.ok and record.error == error and message in record.error_message


def test_request_timeout_is_a_failure_not_a_hang():
    async def handler(request):
        await asyncio.sleep(5.0)
        return httpx.Response(200, content=completion_stream(1))

    (record,) = run(COMPLETIONS, burst(), handler, request_timeout_s=0.2)
    assert record.error == "timeout" and record.end_s < 2.0


def test_closed_loop_keeps_exactly_concurrency_in_flight():
    in_flight, peak = 0, 0

    async def handler(request):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.02)
        in_flight -= 1
        return httpx.Response(200, content=completion_stream(2))

    specs = Load("concurrency", 3).schedule(synthetic_lengths(12, 10, 2, 0.0, seed=0), seed=0)
    records = run(COMPLETIONS, specs, handler, concurrency=3)
    assert all(r.ok for r in records) and peak == 3
    assert sorted(r.index for r in records) == list(range(12))


def test_open_loop_sends_on_schedule_and_stops_at_max_duration():
    specs = Load("rate", 20.0).schedule(synthetic_lengths(8, 10, 2, 0.0, seed=0), seed=2)
    records = run(COMPLETIONS, specs, lambda r: httpx.Response(200, content=completion_stream(2)))
    for r in records:
        assert r.start_s >= r.scheduled_s - 1e-3 and r.start_s - r.scheduled_s < 0.5
    late = Load("rate", 1.0).schedule(synthetic_lengths(50, 10, 2, 0.0, seed=0), seed=0)
    records = run(COMPLETIONS, late, lambda r: httpx.Response(200, content=completion_stream(2)), max_duration_s=0.5)
    num_sent = sum(r.start_s is not None for r in records)
    assert 1 <= num_sent < 10  # Poisson at 1 req/s sends a handful in half a second, not 50


# ---- preflight and /metrics ---------------------------------------------------------------
def test_endpoint_down_is_a_clear_message():
    port = free_port()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}") as http:
        with pytest.raises(EndpointError, match=f"cannot connect to http://127.0.0.1:{port}.*running"):
            check_endpoint(http, None)


def fake_server(routes: dict[str, httpx.Response]) -> httpx.Client:
    return httpx.Client(base_url="http://fake", transport=httpx.MockTransport(
        lambda request: routes.get(request.url.path, httpx.Response(404))))


def test_check_endpoint_model_and_errors():
    models = httpx.Response(200, json={"data": [{"id": "smol", "max_model_len": 2048}]})
    assert check_endpoint(fake_server({"/health": httpx.Response(200), "/v1/models": models}), None) == "smol"
    assert check_endpoint(fake_server({"/v1/models": models}), "smol") == "smol"  # no /health is fine
    with pytest.raises(EndpointError, match="not 'other'"):
        check_endpoint(fake_server({"/v1/models": models}), "other")
    with pytest.raises(EndpointError, match="503.*warming"):
        check_endpoint(fake_server({"/health": httpx.Response(503, json={"error": {"message": "warming up"}})}),
                       None)
    with pytest.raises(EndpointError, match="--api-key"):
        check_endpoint(fake_server({"/health": httpx.Response(200), "/v1/models": httpx.Response(401)}), None)


def test_server_counters_sum_labels_and_accept_any_prefix():
    text = ("# HELP tandem:prompt_tokens_total Prompt tokens.\n# TYPE tandem:prompt_tokens_total counter\n"
            'tandem:prompt_tokens_total{model_name="m"} 120.0\n'
            'tandem:generation_tokens_total{model_name="m"} 40.0\n'
            'tandem:request_success_total{finished_reason="length",model_name="m"} 3.0\n'
            'tandem:request_success_total{finished_reason="stop",model_name="m"} 2.0\n'
            'vllm:time_to_first_token_seconds_bucket{le="0.1"} 4.0\n')
    counters = server_counters(fake_server({"/metrics": httpx.Response(200, text=text)}))
    assert counters == {"prompt_tokens": 120.0, "generation_tokens": 40.0, "request_success": 5.0}
    assert server_counters(fake_server({})) is None


def test_server_counters_read_prefix_cache_counters_by_exact_name_and_tier():
    tandem = ('tandem:prefix_cache_queries_total{model_name="m",tier="gpu"} 100.0\n'
              'tandem:prefix_cache_hits_total{model_name="m",tier="gpu"} 60.0\n'
              'tandem:prefix_cache_queries_total{model_name="m",tier="cpu"} 40.0\n'
              'tandem:prefix_cache_hits_total{model_name="m",tier="cpu"} 10.0\n')
    counters = server_counters(fake_server({"/metrics": httpx.Response(200, text=tandem)}))
    assert counters == {"prefix_cache_queries": 140.0, "prefix_cache_hits": 70.0,
                        "prefix_cache_queries:gpu": 100.0, "prefix_cache_hits:gpu": 60.0,
                        "prefix_cache_queries:cpu": 40.0, "prefix_cache_hits:cpu": 10.0}
    # a KV connector's external cache is another cache; an older vLLM's gpu_ names and _total-less ones count
    vllm = ('vllm:prefix_cache_queries_total{engine="0"} 50.0\nvllm:prefix_cache_hits_total{engine="0"} 20.0\n'
            'vllm:external_prefix_cache_queries_total{engine="0"} 999.0\n'
            'vllm:external_prefix_cache_hits_total{engine="0"} 999.0\n')
    assert server_counters(fake_server({"/metrics": httpx.Response(200, text=vllm)})) == {
        "prefix_cache_queries": 50.0, "prefix_cache_hits": 20.0}
    older = "vllm:gpu_prefix_cache_queries 8.0\nvllm:gpu_prefix_cache_hits 2.0\n"
    assert server_counters(fake_server({"/metrics": httpx.Response(200, text=older)})) == {
        "prefix_cache_queries": 8.0, "prefix_cache_hits": 2.0}


def test_system_spec_parsing():
    spec = SystemSpec.parse("seqs8=tandem serve --port {port} --max-num-seqs 8")
    assert (spec.name, spec.command) == ("seqs8", "tandem serve --port {port} --max-num-seqs 8")
    with pytest.raises(ValueError, match="port"):
        SystemSpec.parse("a=tandem serve")
    with pytest.raises(ValueError, match="NAME=COMMAND"):
        SystemSpec.parse("tandem serve --port {port}")
