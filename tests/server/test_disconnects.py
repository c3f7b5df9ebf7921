"""Clients that go away: 64 concurrent streams of which a third disconnect midway, and a
non-streaming client that times out. Aborted requests free their KV blocks, the others finish
correctly, and /metrics agrees with what was served."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tandem_server import MODEL, metric, wait_idle

NUM_CLIENTS = 64
MAX_TOKENS = 24
CHUNKS_BEFORE_DISCONNECT = 3
BURST_TIMEOUT_S = 120.0
PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "List three colors:"]


def is_dropout(i: int) -> bool:
    return i % 3 == 2


async def stream_one(client: httpx.AsyncClient, i: int) -> dict:
    """Stream one completion; dropouts close the connection after a few chunks."""
    body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = {"status": None, "text": "", "finish_reason": None, "usage": None, "done": False, "chunks": 0}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        result["status"] = response.status_code
        if response.status_code != 200:
            await response.aread()
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                result["done"] = True
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                result["usage"] = chunk["usage"]
            for choice in chunk["choices"]:
                result["text"] += choice["text"]
                result["finish_reason"] = choice["finish_reason"] or result["finish_reason"]
                result["chunks"] += 1
            if is_dropout(i) and result["chunks"] >= CHUNKS_BEFORE_DISCONNECT:
                break  # leaving the block closes the connection mid-stream
    return result


async def burst(base_url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=BURST_TIMEOUT_S) as client:
        return await asyncio.wait_for(asyncio.gather(*(stream_one(client, i) for i in range(NUM_CLIENTS))),
                                      BURST_TIMEOUT_S)


@pytest.fixture(scope="module")
def references(http) -> dict[str, str]:
    """Each prompt's greedy text, served alone."""
    refs = {}
    for prompt in PROMPTS:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        refs[prompt] = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    return refs


def test_concurrent_streams_with_disconnects(server, http, references):
    before = wait_idle(http)
    results = asyncio.run(burst(server.url))
    after = wait_idle(http)

    assert [r["status"] for r in results] == [200] * NUM_CLIENTS
    completed = [r for i, r in enumerate(results) if not is_dropout(i)]
    dropped = [r for i, r in enumerate(results) if is_dropout(i)]
    for i, r in enumerate(results):
        if is_dropout(i):
            assert not r["done"] and r["chunks"] == CHUNKS_BEFORE_DISCONNECT
        else:
            assert r["done"] and r["finish_reason"] == "length"
            assert r["usage"]["completion_tokens"] == MAX_TOKENS
            assert r["text"] == references[PROMPTS[i % len(PROMPTS)]]

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    finished_length = delta("request_success_total", finished_reason="length")
    aborted = delta("request_success_total", finished_reason="abort")
    # every request counted exactly once; a dropout may have finished before its abort arrived
    assert finished_length + aborted == NUM_CLIENTS
    assert len(completed) <= finished_length <= NUM_CLIENTS
    assert aborted >= len(dropped) - 2  # the disconnects really aborted (nearly) all the dropouts
    served_tokens = sum(r["usage"]["completion_tokens"] for r in completed)
    assert delta("generation_tokens_total") >= served_tokens + len(dropped) * CHUNKS_BEFORE_DISCONNECT
    assert delta("prompt_tokens_total") >= sum(r["usage"]["prompt_tokens"] for r in completed)
    assert delta("e2e_request_latency_seconds_count") >= len(completed)
    assert delta("time_to_first_token_seconds_count") == NUM_CLIENTS

    # still serving afterwards
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == references[PROMPTS[0]]


def test_non_streaming_client_timeout_aborts(server, http):
    before = wait_idle(http)
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.5)
    start = time.monotonic()
    # 4000 tokens would take minutes; an abort empties the engine within one iteration
    after = wait_idle(http, timeout=10.0)
    assert time.monotonic() - start < 10.0
    assert metric(after, "request_success_total", finished_reason="abort") \
        == metric(before, "request_success_total", finished_reason="abort") + 1
    assert metric(after, "request_success_total", finished_reason="length") \
        == metric(before, "request_success_total", finished_reason="length")
