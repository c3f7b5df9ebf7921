"""`tandem serve -dp 2`: two replicas of the embedded model (Ray actors) behind one server answer
as one engine does; a conversation's turns go to the replica holding its history; /metrics labels
each replica's series; a replica killed mid-request fails that request with a 503 naming it, and
the other serves on."""
import os
import signal
import threading

import httpx
import pytest

from tandem_server import MODEL, REQUEST_TIMEOUT_S, metric, rank_pids, scrape

pytestmark = pytest.mark.tp

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
SYSTEM = ("You are a careful assistant for a lighthouse museum. Answer in one short sentence, name the "
          "exhibit you mean, and never invent opening hours, prices or the names of keepers. ") * 2


@pytest.fixture(scope="module")
def dp_server(start_server):
    return start_server("-dp", "2")


@pytest.fixture
def dp_http(dp_server):
    with httpx.Client(base_url=dp_server.url, timeout=REQUEST_TIMEOUT_S) as http:
        yield http


def chat(http: httpx.Client, messages: list[dict], max_tokens: int = 16, stream: bool = False) -> str:
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": max_tokens}
    if not stream:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        import json
        return "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in response.iter_lines()
                       if line.startswith("data: {") and json.loads(line[6:])["choices"])


def generated_by_replica(http: httpx.Client) -> dict[str, float]:
    return {replica: metric(scrape(http), "generation_tokens_total", replica=replica) for replica in ("0", "1")}


def test_replicas_answer_as_one_engine(dp_http, client):
    expected = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
    text = expected.choices[0].message.content
    assert chat(dp_http, MESSAGES, 24) == text
    assert chat(dp_http, MESSAGES, 24, stream=True) == text


def test_each_conversation_stays_with_the_replica_holding_its_history(dp_http):
    conversations = [[{"role": "system", "content": topic + SYSTEM}] for topic in ("Lenses.", "Storms.")]
    homes = []
    for turn in range(3):
        for index, messages in enumerate(conversations):
            before = generated_by_replica(dp_http)
            messages.append({"role": "user", "content": f"Tell me more, part {turn}."})
            messages.append({"role": "assistant", "content": chat(dp_http, messages)})
            after = generated_by_replica(dp_http)
            served = [replica for replica in after if after[replica] > before[replica]]
            assert len(served) == 1
            if turn == 0:
                homes.append(served[0])
            assert served[0] == homes[index], f"conversation {index} moved at turn {turn}"
    assert homes[0] != homes[1]  # idle replicas take new conversations in turn
    samples = scrape(dp_http)
    for replica in homes:
        assert metric(samples, "prefix_cache_hits_total", replica=replica, tier="gpu") > 0


def test_metrics_label_every_replica_and_count_requests_once(dp_http):
    chat(dp_http, MESSAGES, 4)
    samples = scrape(dp_http)
    assert {labels for name, labels in samples if name == "tandem:num_requests_running"} == \
        {(("replica", "0"),), (("replica", "1"),)}
    assert metric(samples, "api_requests_total", endpoint="/v1/chat/completions", status="200") >= 1


def test_a_killed_replica_fails_its_request_with_503_and_the_other_serves_on(start_server):
    server = start_server("-dp", "2")
    pids = rank_pids(server, "data-parallel replica")
    assert set(pids) == {0, 1}
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as http:
        chat(http, MESSAGES, 2)
        chat(http, MESSAGES, 2)  # each replica has served (idle replicas take new prompts in turn)
        long_request = {}

        def count() -> None:
            long_request["response"] = http.post("/v1/completions", json={
                "model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 2000, "temperature": 0,
                "ignore_eos": True})

        thread = threading.Thread(target=count)
        thread.start()
        busy = _busy_replica(http)
        os.kill(pids[int(busy)], signal.SIGKILL)
        thread.join(REQUEST_TIMEOUT_S)
        response = long_request["response"]
        assert response.status_code == 503, response.text
        assert f"data-parallel replica {busy}" in response.json()["error"]["message"]
        assert http.get("/health").status_code == 200
        for _ in range(3):
            assert chat(http, MESSAGES, 4)
        assert server.proc.poll() is None


def _busy_replica(http: httpx.Client, timeout_s: float = 60.0) -> str:
    """The replica whose runqueue holds a request."""
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples = scrape(http)
        for replica in ("0", "1"):
            if metric(samples, "num_requests_running", replica=replica) > 0:
                return replica
        time.sleep(0.05)
    raise AssertionError("no replica started the request")


def test_a_client_gone_mid_stream_frees_its_replica(dp_http):
    """The front end aborts the request on the replica that runs it: nothing runs and no KV block
    is held afterwards, on either replica."""
    import time
    body = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with dp_http.stream("POST", "/v1/completions", json=body) as response:
        for index, _ in enumerate(response.iter_lines()):
            if index > 4:
                break  # leaves with the response unread: the connection closes
    deadline = time.monotonic() + 20  # the whole request would take a minute or more
    while True:
        samples = scrape(dp_http)
        busy = [metric(samples, name, replica=replica) for replica in ("0", "1")
                for name in ("num_requests_running", "kv_cache_usage_perc")]
        if not any(busy) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not any(busy), busy
