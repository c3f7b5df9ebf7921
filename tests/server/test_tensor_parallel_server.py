"""`tandem serve -tp 2` through the OpenAI SDK: the embedded model over two Ray actors answers as
one rank does, streamed and not; a rank killed mid-stream makes /health answer 503 and the server
exit 1 naming the rank, rather than hang."""
import os
import re
import signal
import time

import httpx
import openai
import pytest

from tandem_server import MODEL, REQUEST_TIMEOUT_S, rank_pids

pytestmark = pytest.mark.tp

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
EXIT_TIMEOUT_S = 60.0


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)


@pytest.fixture(scope="module")
def tp_server(start_server):
    return start_server("-tp", "2")


def test_chat_at_two_ranks_answers_as_one_rank(tp_server, client):
    two = sdk(tp_server)
    expected = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
    answer = two.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
    assert answer.choices[0].message.content == expected.choices[0].message.content
    assert answer.usage.completion_tokens == expected.usage.completion_tokens
    stream = two.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) \
        == expected.choices[0].message.content


def test_parallel_requests_at_two_ranks(tp_server):
    """Several sequences at once (n=3, seeded sampling beside greedy) come back whole."""
    two = sdk(tp_server)
    answer = two.completions.create(model=MODEL, prompt="Once upon a time", n=3, temperature=0.8, seed=5,
                                    max_tokens=16)
    again = two.completions.create(model=MODEL, prompt="Once upon a time", n=3, temperature=0.8, seed=5,
                                   max_tokens=16)
    assert [c.text for c in answer.choices] == [c.text for c in again.choices]
    assert answer.usage.completion_tokens == 3 * 16


def test_a_killed_rank_makes_health_503_and_the_server_exit(start_server):
    server = start_server("-tp", "2", "--dead-engine-grace", "3")
    pids = rank_pids(server)
    assert set(pids) == {0, 1}
    two = sdk(server)
    stream = two.completions.create(model=MODEL, prompt="Count to one hundred:", max_tokens=400, temperature=0,
                                    stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # generating
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in stream:
            pass
    health = httpx.get(f"{server.url}/health", timeout=5.0)
    assert health.status_code == 503
    assert "rank 1" in health.json()["error"]["message"]
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.proc.returncode == 1, server.log_tail()
    assert "tandem serve: exiting: the engine loop died: tensor-parallel rank 1" in server.log_tail()
    segments = re.findall(r"tandem-tp-\w+", server.log_tail(10**6))
    assert not any(os.path.exists(f"/dev/shm/{name}") for name in segments)  # the ranks' segment is gone
