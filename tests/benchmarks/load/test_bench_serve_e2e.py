"""The harness against a real `tandem serve`: its token counts equal the server's usage and /metrics.

One server (started by the harness's own launcher) serves both runs; the workloads are tiny so the
whole module stays well under a minute on two cores.
"""
from __future__ import annotations

import json
import sys

import pytest

from benchmarks.load.serve import main
from benchmarks.load.systems import RunningSystem, SystemSpec

STARTUP_TIMEOUT_S = 120.0
COMMON = ["--num-requests", "5", "--input-len", "40", "--output-len", "6", "--length-spread", "0.2",
          "--warmup", "1", "--request-timeout", "60", "--max-duration", "60", "--save-requests", "--no-progress",
          "--no-plot"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    spec = SystemSpec("tandem", f"{sys.executable} -m server.cli serve --port {{port}} --dtype float32 "
                                f"--max-num-seqs 4")
    system = RunningSystem(spec, tmp_path_factory.mktemp("serve") / "serve.log", env={"HF_HUB_OFFLINE": "1"})
    with system.start(STARTUP_TIMEOUT_S):
        yield system


def run_harness(tmp_path, url: str, *flags: str) -> dict:
    output = tmp_path / "result.json"
    assert main(["--base-url", url, *COMMON, "--output", str(output), *flags]) == 0
    return json.loads(output.read_text())


def check_counts(results: dict) -> None:
    (system,) = results["systems"]
    for run in system["runs"]:
        summary, targets, counters = run["summary"], run["targets"], run["server_counters"]
        assert summary["num_succeeded"] == summary["num_sent"] == 5 and not summary["errors"]
        assert summary["usage_reported"] and run["prompts"] == {"exact": True, "num_inexact": 0, "fresh_per_run": True}
        for request in run["requests"]:  # every prompt hit its length; ignore_eos made outputs exact
            assert request["num_prompt_tokens"] == request["num_target_input_tokens"]
            assert request["num_output_tokens"] == request["num_target_output_tokens"]
            assert len(request["token_times_s"]) >= 1
        assert summary["num_prompt_tokens"] == targets["num_prompt_tokens"] == counters["prompt_tokens"]
        assert summary["num_output_tokens"] == targets["num_output_tokens"] == counters["generation_tokens"]
        assert counters["request_success"] == 5
        assert summary["ttft"]["p50"] > 0 and summary["per_token_latency"]["mean"] > 0


def test_completions_poisson_counts_match_usage_and_metrics(server, tmp_path):
    results = run_harness(tmp_path, server.url, "--rate", "20", "--endpoint", "completions")
    assert results["load_kind"] == "rate"
    check_counts(results)


def test_chat_closed_loop_counts_match_usage_and_metrics(server, tmp_path):
    results = run_harness(tmp_path, server.url, "--concurrency", "2", "--endpoint", "chat")
    assert results["load_kind"] == "concurrency"
    check_counts(results)
