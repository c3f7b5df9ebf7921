"""`tandem serve` with a weight budget smaller than the model (PIPO): layers stream from host
memory and disk on the host-only testbed, beside Neo's offloading; concurrent greedy requests get
the offline engine's text, the OpenAI SDK's chat and streaming work, and /metrics reports the
weight bytes per tier, the bytes streamed per tier, transfer time and stalls. (The whole server
suite runs in this mode with TANDEM_TEST_SERVE_FLAGS, tests/server/tandem_server.py.)"""
import os
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tandem_server import MODEL, REQUEST_TIMEOUT_S, metric, pipelining_cost_tables, wait_idle

TWO_CORES = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2
PROMPTS = [f"Count from {i} to {i + 20}, one number per line:" for i in range(6)]
MAX_TOKENS = 24
# Embedded model in float32: embeddings, head and norms 0.11 GiB, 30 layers of 13.5 MiB; the model
# is 0.5 GiB. Room for some resident layers and the buffers, some in host memory, the rest on disk.
STREAMING_FLAGS = ("--weights-gpu-gib", "0.2", "--weights-cpu-gib", "0.1")


def serves_the_engines_texts(server, llm, prompts: list[str]) -> dict:
    """Each prompt's greedy completion, one request at a time, is the offline engine's text;
    -> the server's /metrics samples once idle."""
    from engine import SamplingParams

    expected = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as http:
        for prompt, text in zip(prompts, expected):
            response = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                          "max_tokens": MAX_TOKENS, "temperature": 0,
                                                          "ignore_eos": True})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == text
        return wait_idle(http)


@pytest.mark.skipif(not TWO_CORES, reason="the testbed needs 2 cores")
def test_streamed_weights_server_matches_engine_and_reports_tiers(start_server, llm, tmp_path):
    import json

    from engine import SamplingParams

    tables = tmp_path / "costs.json"
    tables.write_text(json.dumps(pipelining_cost_tables(llm.engine.model_config.num_layers)))
    server = start_server("--device", "testbed", "--num-gpu-blocks", "8", "--num-cpu-blocks", "256",
                          "--max-model-len", "128", "--cost-tables", str(tables), *STREAMING_FLAGS,
                          "--offload-dir", str(tmp_path / "offload"))
    expected = [o.outputs[0].text for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as http:
        def complete(prompt):
            response = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                          "temperature": 0, "ignore_eos": True})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(complete, PROMPTS)) == expected
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                               timeout=REQUEST_TIMEOUT_S)
        messages = [{"role": "user", "content": "Name three colors."}]
        (offline,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12))
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        assert chat.choices[0].message.content == offline.outputs[0].text
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == offline.outputs[0].text

        samples = wait_idle(http)
        assert metric(samples, "iterations_total", mode="pipelined") > 0  # Neo's two-batch forward ran too
        weight_bytes = {tier: sum(v for (name, labels), v in samples.items() if name == "tandem:weight_bytes"
                                  and ("tier", tier) in labels) for tier in ("gpu", "host", "disk")}
        assert all(weight_bytes.values()) and weight_bytes["gpu"] <= 0.2 * 2**30
        for tier in ("host", "disk"):
            assert metric(samples, "weight_streamed_bytes_total", tier=tier) > 0
        assert metric(samples, "weight_transfer_seconds_total") > 0
        assert metric(samples, "iteration_weight_transfer_seconds_count") == metric(
            samples, "iteration_compute_seconds_count") > 0
    assert "weight placement (auto):" in server.log_path.read_text()  # logged before loading


@pytest.mark.skipif(not TWO_CORES, reason="the testbed needs 2 cores")
def test_sliced_mlp_server_matches_engine_and_reports_the_cpu_part(start_server, llm):
    """`--mlp-slicing`: each MLP's CC slice on the engine thread, CG streamed, GG resident; the
    text is the resident engine's, /metrics has the CPU's MLP time, the tokens moved to CG' and
    CG's host bytes."""
    server = start_server("--device", "testbed", "--cpu-attention", "off", "--max-model-len", "128",
                          "--mlp-slicing", "0.25,0.5")
    samples = serves_the_engines_texts(server, llm, PROMPTS[:2])
    assert metric(samples, "mlp_cpu_seconds_total") > 0
    assert ("tandem:mlp_moved_tokens_total", ()) in samples  # CG''s tokens, as many as the models moved
    assert metric(samples, "weight_streamed_bytes_total", tier="host") > 0
    assert metric(samples, "weight_bytes", format="float32", tier="host") > 0


def test_solved_slicing_beside_layers_streamed_whole_serves_the_engines_text(start_server, llm):
    """`--mlp-slicing auto` under a budget too small for every layer's attention weights: the one
    plan streams some layers whole and slices the rest; the server's text is the resident engine's."""
    server = start_server("--cpu-attention", "off", "--max-model-len", "128", "--mlp-slicing", "auto",
                          "--quantization", "none", *STREAMING_FLAGS)  # dense: the budget binds
    samples = serves_the_engines_texts(server, llm, PROMPTS[:2])
    assert metric(samples, "weight_streamed_bytes_total", tier="host") > 0  # the layers streamed whole
    assert metric(samples, "mlp_cpu_seconds_total") > 0  # the sliced layers' CPU parts
    plan = re.search(r"(\d+) with a sliced MLP, (\d+) streamed whole", server.log_path.read_text())
    assert plan and int(plan[1]) > 0 and int(plan[2]) > 0  # the one plan, logged before loading

