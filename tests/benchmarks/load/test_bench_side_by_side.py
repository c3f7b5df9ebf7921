"""Side-by-side mode and error reporting of the serving benchmark (benchmarks/load/serve.py), against fake servers (fast)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.load.serve import main
from benchmarks.load.systems import RunningSystem, SystemSpec

FAKE = f"{sys.executable} {Path(__file__).with_name('fake_openai_server.py')} --port {{port}}"
QUICK = ["--num-requests", "6", "--input-len", "20", "--output-len", "10", "--length-spread", "0",
         "--warmup", "1", "--request-timeout", "20", "--max-duration", "20", "--startup-timeout", "30",
         "--no-progress"]


def test_side_by_side_interleaves_and_reports_ratios(tmp_path, capsys):
    output = tmp_path / "sbs.json"
    # Runs long enough (30 tokens of 5 or 20 ms) that one stall on the shared 2-core machine (a 0.25 s
    # first token was seen in a 3-client run of ~0.1 s) cannot lift the fast system's run time to
    # near the slow one's.
    argv = ["--system", f"fast={FAKE} --token-delay 0.005", "--system", f"slow={FAKE} --token-delay 0.02",
            "--concurrency", "1", "3", "--reps", "2", "--slo", "tpot=0.01", *QUICK, "--output-len", "30",
            "--output", str(output)]
    assert main(argv) == 0
    results = json.loads(output.read_text())
    fast, slow = results["systems"]
    assert (fast["name"], slow["name"]) == ("fast", "slow")
    assert len(fast["runs"]) == len(slow["runs"]) == 4  # 2 loads x 2 reps
    # A B in rep 0, B A in rep 1
    first = {(s["name"], r["rep"]): r["started_at"] for s in (fast, slow) for r in s["runs"] if r["load"]["value"] == 1}
    assert first[("fast", 0)] < first[("slow", 0)] and first[("slow", 1)] < first[("fast", 1)]
    for system in (fast, slow):
        for run in system["runs"]:
            assert run["summary"]["num_succeeded"] == 6
            assert run["summary"]["num_output_tokens"] == run["server_counters"]["generation_tokens"] == 180
            assert run["prompts"]["exact"]
    ratios = {row["load"]: row["metrics"] for row in results["ratios"]}
    assert set(ratios) == {"1 client", "3 clients"}
    for metrics in ratios.values():
        assert metrics["output_throughput"]["n"] == 2
        assert metrics["output_throughput"]["max"] < 0.8  # 4x slower tokens: clearly lower throughput
        assert metrics["mean_per_token_latency"]["min"] > 1.5
        assert metrics["mean_per_token_latency"]["min"] <= metrics["mean_per_token_latency"]["median"] \
            <= metrics["mean_per_token_latency"]["max"]
    assert all(r["summary"]["goodput"] == 0 for r in slow["runs"])  # 20 ms per token misses a 10 ms TPOT
    printed = capsys.readouterr().out
    assert "slow / fast" in printed and "x [" in printed
    assert output.with_suffix(".png").stat().st_size > 10_000


def test_endpoint_that_answers_errors_is_reported(tmp_path, capsys):
    system = RunningSystem(SystemSpec("broken", f"{FAKE} --fail"), tmp_path / "broken.log")
    with system.start(30.0):
        code = main(["--base-url", system.url, *QUICK, "--warmup", "0", "--no-plot", "--output",
                     str(tmp_path / "x.json")])
    assert code == 1
    err = capsys.readouterr().err
    assert "every request" in err and "'500': 6" in err and "fake failure" in err
    assert not (tmp_path / "x.json").exists()


def test_endpoint_down_is_reported(tmp_path, capsys):
    from benchmarks.load.systems import free_port
    assert main(["--base-url", f"http://127.0.0.1:{free_port()}", *QUICK, "--output", str(tmp_path / "x.json")]) == 1
    assert "cannot connect" in capsys.readouterr().err


def test_system_that_cannot_start_is_reported(tmp_path, capsys):
    argv = ["--system", f"bad={sys.executable} -c 'import sys; sys.exit(3)' {{port}}", *QUICK,
            "--output", str(tmp_path / "x.json")]
    assert main(argv) == 1
    assert "exited with 3" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--slo", "latency=1"], "--slo"),
    (["--workload", "no-such"], "no workload"),
    (["--system", "x=serve"], "{port}"),
])
def test_bad_arguments_are_reported(tmp_path, capsys, flags, message):
    assert main([*flags, *QUICK, "--output", str(tmp_path / "x.json")]) == 1
    assert message in capsys.readouterr().err


def test_replay_and_workload_file_runs(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_time,input_tokens,output_tokens\n" +
                     "".join(f"{0.5 * i},{10 + i},{3 + i % 2}\n" for i in range(8)))
    system = RunningSystem(SystemSpec("fake", FAKE), tmp_path / "fake.log")
    with system.start(30.0):
        replay_out = tmp_path / "replay.json"
        assert main(["--base-url", system.url, *QUICK, "--replay", str(trace), "--rate", "40", "--save-requests",
                     "--no-plot", "--output", str(replay_out)]) == 0
        chat_out = tmp_path / "chat.json"
        assert main(["--base-url", system.url, *QUICK, "--workload", "chat", "--all-at-once",
                     "--no-plot", "--output", str(chat_out)]) == 0
    replay = json.loads(replay_out.read_text())
    (run,) = replay["systems"][0]["runs"]
    assert replay["load_kind"] == "replay" and run["summary"]["num_succeeded"] == 6  # --num-requests 6 rows
    assert [r["num_prompt_tokens"] for r in run["requests"]] == [10 + i for i in range(6)]
    scheduled = [r["scheduled_s"] for r in run["requests"]]
    assert scheduled == pytest.approx([i / 40 for i in range(6)])  # 0.5 s gaps rescaled to 40 req/s
    chat = json.loads(chat_out.read_text())
    (run,) = chat["systems"][0]["runs"]
    assert chat["workload"]["endpoint"] == "chat"  # the workload file's choice
    assert run["summary"]["num_prompt_tokens"] == sum(chat["workload"]["input_tokens"])
    assert run["summary"]["num_output_tokens"] == sum(chat["workload"]["output_tokens"])


@pytest.mark.parametrize("reuse", [False, True])
def test_every_run_sends_fresh_prompts_unless_asked_to_reuse_them(tmp_path, reuse):
    """Fresh prompts per level and repetition (the default), so a server's prompt cache cannot answer
    a later run from an earlier one's KV (llama.cpp's slots and vLLM's prefix cache would); the same
    texts for every system."""
    logs = {name: tmp_path / f"{name}.prompts" for name in ("a", "b")}
    argv = [*(arg for name, log in logs.items() for arg in ("--system", f"{name}={FAKE} --prompt-log {log}")),
            "--concurrency", "1", "2", "--reps", "2", *QUICK, "--warmup", "0", "--no-plot",
            "--output", str(tmp_path / "fresh.json"), *(["--reuse-prompts"] if reuse else [])]
    assert main(argv) == 0
    sent = {name: log.read_text().splitlines() for name, log in logs.items()}
    assert len(sent["a"]) == 6 * 4  # 6 requests x 2 levels x 2 reps
    assert sorted(sent["a"]) == sorted(sent["b"])
    assert len(set(sent["a"])) == (6 if reuse else 24)
