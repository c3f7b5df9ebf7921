"""`tandem serve --speculative-config`: concurrent clients get the text the engine gives without
drafts, streamed or not, and /metrics counts drafts, draft tokens and accepted ones (per position)
as vLLM's spec-decode metrics do."""
import json
from concurrent.futures import ThreadPoolExecutor

import httpx

from tandem_server import REQUEST_TIMEOUT_S, greedy_completion, metric, wait_idle

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "adaptive": False})
PROMPTS = [f"Count from {i} to {i + 12}, separated by commas: {i}, {i + 1}, {i + 2}," for i in range(6)]
PROMPTS += ["Repeat after me: the cat sat on the mat. The cat sat on the mat. The cat"]
MAX_TOKENS = 32


def test_speculating_server_matches_the_engine_and_counts_drafts(start_server, llm):
    from engine import SamplingParams

    server = start_server("--dtype", "float32", "--speculative-config", NGRAM)
    expected = [o.outputs[0].text for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as http:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(lambda prompt: greedy_completion(http, prompt, MAX_TOKENS), PROMPTS)) == expected
        streamed = ""
        with http.stream("POST", "/v1/completions", json={
                "model": "smollm2-135m", "prompt": PROMPTS[-1], "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed += json.loads(line[6:])["choices"][0]["text"]
        assert streamed == expected[-1]
        samples = wait_idle(http)
        drafts, draft_tokens = metric(samples, "spec_decode_num_drafts_total"), \
            metric(samples, "spec_decode_num_draft_tokens_total")
        accepted = metric(samples, "spec_decode_num_accepted_tokens_total")
        assert 0 < drafts <= draft_tokens and 0 < accepted <= draft_tokens
        assert metric(samples, "spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
        assert metric(samples, "generation_tokens_total") == (len(PROMPTS) + 1) * MAX_TOKENS
