"""The official openai SDK drives the real server: completions and chat, streaming and not,
n > 1, logprobs in each endpoint's own shape, stop strings, seeds; the raw SSE framing; the
utility routes, the weight bytes and the prefix cache's counters in /metrics; cached prompts
answer as computed ones."""
from __future__ import annotations

import json
import math
import os

import pytest

from engine import SamplingParams
from tandem_server import EXTRA_FLAGS_ENV, MODEL, assert_openai_error, metric, scrape, wait_idle

PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Name three colors."}]
MAX_TOKENS = 12


# ---- completions --------------------------------------------------------------------------
def test_completion(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    (choice,) = out.choices
    assert choice.index == 0 and choice.text and choice.finish_reason == "length"
    assert out.usage.completion_tokens == MAX_TOKENS
    assert out.usage.total_tokens == out.usage.prompt_tokens + MAX_TOKENS


def test_completion_prompt_list_and_n(client):
    out = client.completions.create(model=MODEL, prompt=[PROMPT, "Water boils at"], n=3, max_tokens=4,
                                    temperature=1.0, seed=7)
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 6 * 4


def test_completion_streaming_matches_non_streaming(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_echo(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert out.choices[0].text.startswith(PROMPT) and len(out.choices[0].text) > len(PROMPT)


def test_echo_with_logprobs_scores_the_prompt(client, llm):
    """OpenAI's legacy scoring: the prompt's tokens with their logprobs (the first has none), as
    the offline engine computes them, and nothing generated."""
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    (choice,) = out.choices
    assert choice.text == PROMPT and choice.finish_reason == "length" and out.usage.completion_tokens == 0
    (offline,) = llm.generate(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=2))
    lp = choice.logprobs
    assert len(lp.tokens) == len(offline.prompt_token_ids) == out.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for served, entry in zip(lp.token_logprobs[1:], offline.prompt_logprobs[1:]):
        assert math.isclose(served, entry.logprob, abs_tol=1e-4)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])


def test_echo_with_logprobs_streams_the_prompt_first(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1)
    full = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
    streamed = [token for chunk in chunks if chunk.logprobs for token in chunk.logprobs.token_logprobs]
    assert "".join(chunk.text for chunk in chunks) == full.text
    assert len(full.logprobs.tokens) == len(streamed) and streamed[0] is None
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(streamed[1:], full.logprobs.token_logprobs[1:]))


def test_completion_logprobs_shape(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0
    for i, token in enumerate(lp.tokens[:-1]):
        assert lp.text_offset[i + 1] == lp.text_offset[i] + len(token)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 3
        # greedy: the sampled token is the most likely one
        assert top[token] == max(top.values()) and math.isclose(top[token], logprob, abs_tol=1e-5)


def test_completion_stop_string(client):
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    text = free.choices[0].text
    stop = text.strip()[2:4]  # a piece from the middle of what greedy decoding says
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and stop not in choice.text
    assert text.startswith(choice.text + stop)


def test_completion_seed_reproducible(client):
    def sample(seed):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0,
                                        seed=seed)
        return out.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


# ---- chat ---------------------------------------------------------------------------------
def test_chat(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    assert out.usage.completion_tokens <= MAX_TOKENS


def test_chat_content_parts_equal_string(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three colors."}]}]
    plain = [{"role": "user", "content": "Name three colors."}]
    a = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=8, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=plain, max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_chat_max_completion_tokens_and_n(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=5, n=2,
                                         temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 10


def test_chat_streaming(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    choice_chunks = [c for c in chunks if c.choices]
    assert choice_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in choice_chunks) == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in choice_chunks]
    assert finishes[-1] == full.choices[0].finish_reason and not any(finishes[:-1])
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    streamed_usage, full_usage = chunks[-1].usage.model_dump(), full.usage.model_dump()
    # the second request finds the first's prompt in the prefix cache: whole blocks of it
    num_cached = streamed_usage.pop("prompt_tokens_details")["cached_tokens"]
    assert num_cached >= full_usage.pop("prompt_tokens_details")["cached_tokens"] and num_cached % 16 == 0
    assert 0 < num_cached < streamed_usage["prompt_tokens"]
    assert streamed_usage == full_usage


def test_chat_streaming_n(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2, seed=5,
                                                 temperature=1.0, stream=True,
                                                 extra_body={"ignore_eos": True}))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert mine[-1].finish_reason == "length" and not any(ch.finish_reason for ch in mine[:-1])


def test_chat_logprobs_shape(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=2)
    choice = out.choices[0]
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-5)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_chat_streaming_logprobs(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=1, stream=True))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 5 and all(len(e.top_logprobs) == 1 for e in entries)


def test_chat_stop_and_seed(client):
    a = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, seed=99,
                                       temperature=0.9)
    b = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, seed=99,
                                       temperature=0.9)
    assert a.choices[0].message.content == b.choices[0].message.content
    text = a.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if stop.strip():
        cut = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, seed=99,
                                             temperature=0.9, stop=stop)
        assert cut.choices[0].finish_reason == "stop"
        assert stop not in cut.choices[0].message.content
        assert text.startswith(cut.choices[0].message.content)


# ---- raw SSE ------------------------------------------------------------------------------
def sse_events(http, path: str, body: dict) -> list[str]:
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), raw
    return [e[len("data: "):] for e in events]


def test_raw_sse_chat(http):
    events = sse_events(http, "/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    last_choice = [c for c in chunks if c["choices"]][-1]["choices"][0]
    assert last_choice["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])


def test_raw_sse_completion_without_usage(http):
    events = sse_events(http, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                                                  "temperature": 0, "stream": True})
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["choices"] and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# ---- utility routes -----------------------------------------------------------------------
def test_models(client, http):
    (model,) = client.models.list().data
    assert model.id == MODEL and model.object == "model"
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] > 0


def test_tokenize_detokenize(http, llm):
    tokens = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert tokens["tokens"] == llm.tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == llm.engine.max_model_len
    text = http.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith(PROMPT)

    chat = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    expected = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    assert chat["tokens"] == expected


def test_tokenize_needs_prompt_or_messages(http):
    assert_openai_error(http.post("/tokenize", json={"model": MODEL}), 400, "prompt")


@pytest.mark.skipif(bool(os.environ.get(EXTRA_FLAGS_ENV)),
                    reason="every weight is resident only without extra serve flags; test_streaming_server "
                           "checks the tiers of streamed weights")
def test_weight_bytes_are_exported_by_format_and_tier(http, llm):
    expected = llm.engine.runner.model.weight_bytes()  # the GGUF's 4-bit blocks stay packed (quantization auto)
    assert set(expected) == {("float32", "gpu"), ("int4", "gpu")}
    samples = scrape(http)
    for (fmt, tier), nbytes in expected.items():
        assert metric(samples, "weight_bytes", format=fmt, tier=tier) == nbytes


# ---- prefix caching ------------------------------------------------------------------------
BLOCK_SIZE = 16  # the server's default --block-size: hits are whole blocks
# Its own words, so that nothing an earlier test sent is cached; ~180 tokens: many full blocks.
SHARED_PREFIX = "A library keeps its books in order by subject, then by author, then by title. " * 10
PREFIX_CACHE_SERIES = [("prefix_cache_queries_total", tier) for tier in ("gpu", "cpu")] + \
    [("prefix_cache_hits_total", tier) for tier in ("gpu", "cpu")] + \
    [("kv_cached_blocks", tier) for tier in ("gpu", "cpu")] + \
    [("prefix_cache_demoted_blocks_total", None), ("prefix_cache_promoted_blocks_total", None)]


def prefix_cache_delta(before: dict, after: dict, name: str, tier: str = "gpu") -> float:
    return metric(after, name, tier=tier) - metric(before, name, tier=tier)


def test_prefix_cache_metrics_count_a_shared_prefix(http):
    """Every series is there from the start, host tier included on a server without a host pool;
    a second prompt with the first one's prefix finds its blocks, and once idle they stay cached
    while the KV usage, which counts only blocks requests hold, is back at 0."""
    before = wait_idle(http)
    for name, tier in PREFIX_CACHE_SERIES:  # present, not just 0 by the helper's default
        assert (f"tandem:{name}", (("tier", tier),) if tier else ()) in before, name
    prompt_lens = []
    for question in ("Where are the novels?", "Where is the atlas?"):
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": SHARED_PREFIX + question,
                                                      "max_tokens": 2, "temperature": 0})
        assert response.status_code == 200, response.text
        prompt_lens.append(response.json()["usage"]["prompt_tokens"])
    after = wait_idle(http)
    hits = prefix_cache_delta(before, after, "prefix_cache_hits_total")
    assert prefix_cache_delta(before, after, "prefix_cache_queries_total") == sum(prompt_lens)
    assert 0 < hits < prompt_lens[1] and hits % BLOCK_SIZE == 0  # whole blocks of the shared prefix
    assert metric(after, "kv_cached_blocks", tier="gpu") >= hits / BLOCK_SIZE
    assert metric(after, "kv_cache_usage_perc") == 0
    if not os.environ.get(EXTRA_FLAGS_ENV):  # the shared server has no host pool (device cpu)
        assert metric(after, "kv_cached_blocks", tier="cpu") == 0
        assert prefix_cache_delta(before, after, "prefix_cache_queries_total", "cpu") == 0


# ~300 tokens, also its own words; two conversations share it as their system prompt
LONG_SYSTEM_PROMPT = "You answer for the prefix-cache test. " + " ".join(
    f"Rule {i}: keep every answer short, plain and polite." for i in range(1, 22))


def test_chats_sharing_a_cached_system_prompt_answer_as_computed_ones(client, http, llm):
    """The second conversation takes the first one's system prompt from the cache, a repeat of the
    first takes nearly its whole prompt; each answer is what the offline engine computes cold."""
    conversations = [[{"role": "system", "content": LONG_SYSTEM_PROMPT}, {"role": "user", "content": question}]
                     for question in ("Name a colour.", "Name a fruit.")]
    # a sequence asking for prompt logprobs takes nothing from the cache (PrefixCache.cacheable_blocks)
    cold = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=0)
    expected = [output.outputs[0].text for output in llm.chat(conversations, cold)]

    def answer(messages) -> str:
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        return out.choices[0].message.content

    before = scrape(http)
    first = answer(conversations[0])
    after_first = scrape(http)
    second, repeat = answer(conversations[1]), answer(conversations[0])
    after = scrape(http)
    assert [first, second, repeat] == [*expected, expected[0]]
    assert prefix_cache_delta(before, after_first, "prefix_cache_hits_total") == 0  # the first was cold
    # each later request finds at least the system prompt's full blocks
    system_blocks = len(llm.tokenizer.encode(LONG_SYSTEM_PROMPT)) // BLOCK_SIZE
    assert prefix_cache_delta(after_first, after, "prefix_cache_hits_total") >= 2 * system_blocks * BLOCK_SIZE


def test_version_and_health(http):
    assert http.get("/version").json()["version"]
    assert http.get("/health").status_code == 200


# ---- streaming agrees with non-streaming ---------------------------------------------------
def streamed_texts(stream) -> tuple[dict[int, str], dict[int, str]]:
    texts, finishes = {}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                assert choice.index not in finishes  # one finish per choice
                finishes[choice.index] = choice.finish_reason
    return texts, finishes


def test_streaming_prompts_times_n_match_non_streaming(client):
    params = dict(model=MODEL, prompt=[PROMPT, "Water boils at"], n=2, max_tokens=6, temperature=0.8, seed=11)
    full = client.completions.create(**params)
    texts, finishes = streamed_texts(client.completions.create(**params, stream=True))
    assert texts == {c.index: c.text for c in full.choices}
    assert finishes == {c.index: c.finish_reason for c in full.choices}


def test_streaming_stop_string_matches_non_streaming(client):
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
    stop = text.strip()[3:6]
    params = dict(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=stop)
    full = client.completions.create(**params).choices[0]
    texts, finishes = streamed_texts(client.completions.create(**params, stream=True))
    assert texts == {0: full.text} and finishes == {0: "stop"} and stop not in full.text


def test_streaming_multibyte_text_matches_non_streaming(client):
    """Characters split across tokens reach the client whole, never as replacement characters."""
    messages = [{"role": "user", "content": "Écris « bonjour » en chinois : 你好。Et un emoji : 🙂"}]
    params = dict(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    full = client.chat.completions.create(**params).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**params, stream=True)
                       if c.choices)
    assert streamed == full and "\ufffd" not in streamed
