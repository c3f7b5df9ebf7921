"""`tandem serve` with CPU offloading (Neo) on the host-only testbed: concurrent requests that
overflow a tiny GPU pool get the same greedy text as the GPU-only engine, and /metrics
reports the tiers, the plan modes, the swaps, the CPU attention time and the cost model's error;
a prefix the GPU pool evicted is kept in the host pool and promoted back, with the same text."""
import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tandem_server import REQUEST_TIMEOUT_S, greedy_completion, metric, pipelining_cost_tables, wait_idle

TWO_CORES = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2
PROMPTS = [f"Count from {i} to {i + 20}, one number per line:" for i in range(8)]
MAX_TOKENS = 40
# 73 tokens (5 blocks), then 87 (6 blocks): in the 8-block GPU pool the second evicts the first's
# later cached blocks, which the host pool keeps until the first prompt comes again
EVICTED_PROMPT = "A library keeps its books in order by subject, then by author, then by title. " * 4
EVICTING_PROMPT = "Rivers carry sand from the mountains down to the sea, where it settles into beaches. " * 5


@pytest.mark.skipif(not TWO_CORES, reason="the testbed needs 2 cores")
def test_offloading_server_matches_engine_and_reports_tiers(start_server, llm, tmp_path):
    from engine import SamplingParams

    tables = tmp_path / "costs.json"
    tables.write_text(json.dumps(pipelining_cost_tables(llm.engine.model_config.num_layers)))
    # 8 blocks of 16 tokens: the GPU pool holds about two of these requests
    server = start_server("--device", "testbed", "--num-gpu-blocks", "8", "--num-cpu-blocks", "256",
                          "--max-model-len", "128", "--cost-tables", str(tables))
    expected = [o.outputs[0].text for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as http:
        def complete(prompt, max_tokens=MAX_TOKENS):
            return greedy_completion(http, prompt, max_tokens)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(complete, PROMPTS))
        assert texts == expected
        samples = wait_idle(http)
        pipelined = metric(samples, "iterations_total", mode="pipelined")
        assert pipelined > 0
        assert metric(samples, "swapped_requests_total", direction="out") > 0
        assert metric(samples, "swapped_blocks_total", direction="out") >= metric(
            samples, "swapped_requests_total", direction="out")
        assert metric(samples, "cpu_attention_seconds_total") > 0
        # CPU decodes were placed, so the backpressure has a rate and a finite limit from it
        rate = metric(samples, "cpu_runqueue_service_rate")
        assert rate > 0 and metric(samples, "cpu_admission_limit") == pytest.approx(max(1.0, rate * 0.25 * 64))
        assert metric(samples, "cost_model_relative_error_count") == (
            metric(samples, "iterations_total", mode="pipelined") + metric(samples, "iterations_total", mode="gpu_only"))
        assert metric(samples, "generation_tokens_total") == len(PROMPTS) * MAX_TOKENS
        for tier in ("gpu", "cpu"):  # idle: nothing running, every block free
            assert metric(samples, "num_requests_running_by_tier", tier=tier) == 0
            assert metric(samples, "kv_cache_usage_perc_by_tier", tier=tier) == 0
        text = http.get("/metrics").text
        assert 'tandem:num_requests_running_by_tier{model_name="smollm2-135m",tier="cpu"}' in text
        assert 'tandem:kv_cached_blocks{model_name="smollm2-135m",tier="cpu"}' in text

        first = complete(EVICTED_PROMPT, max_tokens=4)
        complete(EVICTING_PROMPT, max_tokens=4)
        assert complete(EVICTED_PROMPT, max_tokens=4) == first
        after = wait_idle(http)

        def delta(name, **labels):
            return metric(after, name, **labels) - metric(samples, name, **labels)

        assert delta("prefix_cache_demoted_blocks_total") > 0
        assert delta("prefix_cache_hits_total", tier="cpu") > 0 and delta("prefix_cache_queries_total", tier="cpu") > 0
        assert delta("prefix_cache_promoted_blocks_total") > 0  # copying beats computing on these cost tables
