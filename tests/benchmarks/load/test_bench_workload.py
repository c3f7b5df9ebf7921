"""Request lengths, arrival processes and CSV replay of the serving benchmark."""
from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.load.workload import (WORKLOADS_DIR, Load, RequestSpec, WorkloadError, WorkloadFile,
                                         poisson_arrivals, read_replay_csv, replay_arrivals, synthetic_lengths,
                                         workload_lengths)


# ---- lengths ------------------------------------------------------------------------------
def test_synthetic_lengths_output_spread_of_its_own():
    specs = synthetic_lengths(3000, 240, 320, 0.1, seed=2, output_spread=0.6)
    inputs = [s.num_input_tokens for s in specs]
    outputs = [s.num_output_tokens for s in specs]
    assert 216 <= min(inputs) and max(inputs) <= 264
    assert min(outputs) == 128 and max(outputs) == 512  # 320 +-60%, endpoints included
    with pytest.raises(WorkloadError):
        synthetic_lengths(5, 240, 320, 0.1, seed=2, output_spread=1.0)


def test_synthetic_lengths_fixed_and_neo_spread():
    fixed = synthetic_lengths(50, 200, 30, 0.0, seed=1)
    assert {(s.num_input_tokens, s.num_output_tokens) for s in fixed} == {(200, 30)}
    spread = synthetic_lengths(4000, 1000, 100, 0.1, seed=1)
    inputs = np.array([s.num_input_tokens for s in spread])
    outputs = np.array([s.num_output_tokens for s in spread])
    assert inputs.min() >= 900 and inputs.max() <= 1100
    assert outputs.min() >= 90 and outputs.max() <= 110
    assert inputs.min() < 905 and inputs.max() > 1095  # uniform reaches both ends
    assert abs(inputs.mean() - 1000) < 5
    assert [s.index for s in spread[:3]] == [0, 1, 2]
    assert synthetic_lengths(20, 100, 10, 0.1, seed=3) == synthetic_lengths(20, 100, 10, 0.1, seed=3)
    assert synthetic_lengths(20, 100, 10, 0.1, seed=3) != synthetic_lengths(20, 100, 10, 0.1, seed=4)
    with pytest.raises(WorkloadError):
        synthetic_lengths(5, 100, 10, 1.5, seed=0)


@pytest.mark.parametrize("name", ["chat", "code-completion", "summarization"])
def test_workload_files_load_and_sample_their_medians(name):
    workload = WorkloadFile.load(name)
    assert workload.name == name and workload.description
    raw = json.loads((WORKLOADS_DIR / f"{name}.json").read_text())
    specs = workload_lengths(workload, 4000, seed=0)
    inputs = np.array([s.num_input_tokens for s in specs])
    outputs = np.array([s.num_output_tokens for s in specs])
    assert inputs.min() >= raw["input"]["min"] and inputs.max() <= raw["input"]["max"]
    assert outputs.min() >= raw["output"]["min"] and outputs.max() <= raw["output"]["max"]
    assert np.median(inputs) == pytest.approx(raw["input"]["median"], rel=0.08)
    assert np.median(outputs) == pytest.approx(raw["output"]["median"], rel=0.08)


def test_code_completion_is_long_prompt_short_output():
    code = WorkloadFile.load("code-completion")
    assert code.input.median > 20 * code.output.median


def test_workload_file_errors_name_the_problem(tmp_path):
    with pytest.raises(WorkloadError, match="chat"):
        WorkloadFile.load("no-such-workload")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"input": {"median": 10}}))
    with pytest.raises(WorkloadError, match="bad.json"):
        WorkloadFile.load(str(bad))


# ---- arrivals -----------------------------------------------------------------------------
def test_poisson_arrivals_are_seeded_with_the_right_rate_and_shape():
    times = poisson_arrivals(20000, rate=4.0, seed=5)
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    # memoryless: about e^-1 of the gaps exceed the mean
    assert np.mean(gaps > 0.25) == pytest.approx(np.exp(-1), abs=0.02)
    assert np.array_equal(times, poisson_arrivals(20000, 4.0, seed=5))
    assert not np.array_equal(times[:10], poisson_arrivals(10, 4.0, seed=6))
    assert np.array_equal(poisson_arrivals(3, float("inf"), seed=0), np.zeros(3))


def test_load_schedules():
    specs = synthetic_lengths(6, 50, 5, 0.0, seed=0)
    burst = Load("burst").schedule(specs, seed=0)
    assert [s.arrival_s for s in burst] == [0.0] * 6
    closed = Load("concurrency", 3).schedule(specs, seed=0)
    assert all(s.arrival_s is None for s in closed) and Load("concurrency", 3).concurrency == 3
    poisson = Load("rate", 2.0).schedule(specs, seed=9)
    assert [s.arrival_s for s in poisson] == pytest.approx(list(poisson_arrivals(6, 2.0, 9)))
    assert [(s.num_input_tokens, s.num_output_tokens) for s in poisson] == [(50, 5)] * 6
    assert Load("rate", 2.0).concurrency is None
    assert (Load("rate", 2.5).label, Load("concurrency", 1).label, Load("concurrency", 8).label) == \
        ("2.5 req/s", "1 client", "8 clients")
    with pytest.raises(WorkloadError):
        Load("rate", 0)
    with pytest.raises(WorkloadError):
        Load("sometimes")


def test_replay_arrivals_keep_or_rescale_the_trace():
    times = [0.0, 1.0, 3.0, 4.0]
    assert list(replay_arrivals(times, None)) == times
    scaled = replay_arrivals(times, rate=3.0)  # 3 gaps over the span -> span of 1 s
    assert list(scaled) == pytest.approx([0.0, 0.25, 0.75, 1.0])
    with pytest.raises(WorkloadError):
        replay_arrivals([None, None], None)
    specs = [RequestSpec(i, 10, 2, t) for i, t in enumerate(times)]
    assert [s.arrival_s for s in Load("replay").schedule(specs, 0)] == times


# ---- CSV replay ---------------------------------------------------------------------------
def test_replay_csv_with_header_any_column_order(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("output_tokens,arrival_time,input_tokens\n5,10.5,100\n7,10.0,200\n\n9,12.0,300\n")
    specs = read_replay_csv(path)
    assert [(s.arrival_s, s.num_input_tokens, s.num_output_tokens) for s in specs] == \
        [(0.0, 200, 7), (0.5, 100, 5), (2.0, 300, 9)]  # sorted, relative to the first arrival
    assert [s.index for s in specs] == [0, 1, 2]
    assert len(read_replay_csv(path, limit=2)) == 2


def test_replay_csv_without_header_and_azure_spelling(tmp_path):
    plain = tmp_path / "plain.csv"
    plain.write_text("0,12,3\n0.25,40,8\n")
    assert [(s.arrival_s, s.num_input_tokens, s.num_output_tokens) for s in read_replay_csv(plain)] == \
        [(0.0, 12, 3), (0.25, 40, 8)]
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,4808,10\n2023-11-16 18:15:50.9951690,3180,8\n")
    specs = read_replay_csv(azure)
    assert specs[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    assert (specs[0].num_input_tokens, specs[0].num_output_tokens) == (4808, 10)


def test_replay_csv_errors_name_file_and_line(tmp_path):
    path = tmp_path / "broken.csv"
    path.write_text("arrival_time,input_tokens,output_tokens\n0,10,2\n1,ten,2\n")
    with pytest.raises(WorkloadError, match=r"broken.csv:3"):
        read_replay_csv(path)
    path.write_text("when,how_many,out\n0,1,1\n")
    with pytest.raises(WorkloadError, match="columns"):
        read_replay_csv(path)
    path.write_text("0,0,5\n")
    with pytest.raises(WorkloadError, match="positive"):
        read_replay_csv(path)
    with pytest.raises(WorkloadError, match="cannot read"):
        read_replay_csv(tmp_path / "missing.csv")
