"""A second server with API keys (flag and environment), a tiny waiting queue and a short
shutdown grace: 401s, 429s with Retry-After, and a clean exit on SIGTERM. The SIGTERM test
stops this server, so it stays last in the file."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest

from tandem_server import MODEL, ServerProcess, assert_openai_error, wait_idle

CLI_KEY = "key-from-flag"
ENV_KEYS = ("key-from-env-1", "key-from-env-2")
MAX_WAITING_REQUESTS = 2
SHUTDOWN_GRACE_S = 4.0
BURST_SIZE = 10
BURST_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = SHUTDOWN_GRACE_S + 15.0  # the grace, then the engine thread's join and process exit


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("guarded") / "serve.log",
                           "--api-key", CLI_KEY, "--max-waiting-requests", str(MAX_WAITING_REQUESTS),
                           "--max-num-seqs", "2", "--shutdown-grace", str(SHUTDOWN_GRACE_S),
                           env={"TANDEM_API_KEY": ",".join(ENV_KEYS)})
    yield server.start()
    server.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def authed(guarded):
    with httpx.Client(base_url=guarded.url, headers=auth(CLI_KEY), timeout=BURST_TIMEOUT_S) as client:
        yield client


BODY = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}


# ---- auth ---------------------------------------------------------------------------------
@pytest.mark.parametrize("headers", [{}, auth("wrong-key"), {"Authorization": "Bearer"}, {"Authorization": CLI_KEY},
                                     {"Authorization": f"Basic {CLI_KEY}"}],
                         ids=["missing", "wrong", "empty", "no_bearer", "basic"])
@pytest.mark.parametrize("method,path", [("POST", "/v1/completions"), ("GET", "/v1/models"),
                                         ("POST", "/tokenize")])
def test_missing_or_wrong_key_is_401(guarded, headers, method, path):
    response = httpx.request(method, f"{guarded.url}{path}", json=BODY, headers=headers, timeout=10)
    error = assert_openai_error(response, 401)
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"


@pytest.mark.parametrize("key", [CLI_KEY, *ENV_KEYS])
def test_right_key_from_flag_or_env(guarded, key):
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=key, max_retries=0, timeout=30)
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert out.usage.completion_tokens == 2
    assert client.models.list().data[0].id == MODEL


def test_sdk_with_wrong_key_raises(guarded):
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="nope", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version"])
def test_open_routes_need_no_key(guarded, path):
    assert httpx.get(f"{guarded.url}{path}", timeout=10).status_code == 200


# ---- queue bound --------------------------------------------------------------------------
async def timed_post(client: httpx.AsyncClient, body: dict) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    response = await client.post("/v1/completions", json=body)
    return response, time.monotonic() - start


async def burst(base_url: str) -> list[tuple[httpx.Response, float]]:
    body = {"model": MODEL, "prompt": "Count to twenty:", "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=base_url, headers=auth(CLI_KEY), timeout=BURST_TIMEOUT_S,
                                 limits=httpx.Limits(max_connections=BURST_SIZE)) as client:
        return await asyncio.wait_for(asyncio.gather(*(timed_post(client, body) for _ in range(BURST_SIZE))),
                                      BURST_TIMEOUT_S)


def test_queue_bound_gives_429_while_admitted_finish(guarded, authed):
    results = asyncio.run(burst(guarded.url))
    statuses = [r.status_code for r, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    admitted = [(r, t) for r, t in results if r.status_code == 200]
    rejected = [(r, t) for r, t in results if r.status_code == 429]
    assert len(admitted) >= MAX_WAITING_REQUESTS and rejected, statuses
    for response, _ in admitted:
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "length" and response.json()["usage"]["completion_tokens"] == 16
    for response, _ in rejected:
        error = assert_openai_error(response, 429)
        assert error["type"] == "rate_limit_error"
        assert int(response.headers["Retry-After"]) >= 1
    # refused at the door, not after waiting for a slot
    assert max(t for _, t in rejected) < max(t for _, t in admitted)
    wait_idle(authed)


# ---- shutdown (stops the server: keep last) -----------------------------------------------
def read_stream(url: str, body: dict, result: dict, first_chunk: threading.Event) -> None:
    """Stream a completion on a thread; records the text, whether and when [DONE] came, any error."""
    result.update(text="", done=False, done_time=None, error=None)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth(CLI_KEY),
                          timeout=BURST_TIMEOUT_S) as response:
            result["status"] = response.status_code
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    result["done"], result["done_time"] = True, time.monotonic()
                elif line.startswith("data: "):
                    result["text"] += "".join(c["text"] for c in json.loads(line[6:])["choices"])
                    first_chunk.set()
    except httpx.HTTPError as exc:  # a request cut off at the end of the grace period
        result["error"] = exc
    finally:
        first_chunk.set()


def test_sigterm_finishes_short_aborts_long_exits_0(guarded):
    # far more tokens than the grace period allows: it gets cut off
    long_body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 4000, "ignore_eos": True,
                 "stream": True}
    # well inside the grace period: 32 tokens beside the long request overran 4 s once on an
    # AVX2-only VM in fp32 (over 130 ms a step), so 12
    short_body = {"model": MODEL, "prompt": "Hello", "max_tokens": 12, "ignore_eos": True, "stream": True}
    results = [{}, {}]
    started = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=read_stream, args=(guarded.url, body, result, event), daemon=True)
               for body, result, event in zip((long_body, short_body), results, started)]
    for thread, event in zip(threads, started):
        thread.start()
        assert event.wait(30)
    start = time.monotonic()
    guarded.signal(signal.SIGTERM)

    assert guarded.wait(EXIT_TIMEOUT_S) == 0, guarded.log_tail()
    elapsed = time.monotonic() - start
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()
    long, short = results
    assert short["done"] and short["error"] is None and short["status"] == 200
    assert short["done_time"] > start  # it was in flight at SIGTERM and finished in the grace period
    assert not long["done"]  # aborted at the end of the grace period
    assert elapsed >= SHUTDOWN_GRACE_S - 0.5  # in-flight work was given the grace period
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{guarded.url}/health", timeout=5)
