"""The simulator drives the real NeoScheduler in simulated time: every request ends with exactly
its tokens, runs repeat exactly, the GPU-only baseline never plans CPU work, and offloading pays
where GPU memory is short. Small workloads on Neo's real shapes; no torch."""
import math
import subprocess
import sys

import pytest

from engine.model_config import ModelConfig, load_model_preset
from scheduler.neo import NeoConfig
from scheduler.simulation.roofline import HardwareProfile, RooflineCostModel
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence
from scheduler.iteration_plan import IterationPlan, PlanMode
from scheduler.simulation.simulator import Workload, build_scheduler, compare, iteration_time, percentile, simulate

T4 = "t4-g4dn.4xlarge"


def run(profile=T4, model="llama-2-7b", cpu_attention=True, **workload):
    shape, dtype_bytes = load_model_preset(model)
    work = Workload(**{"num_requests": 40, "input_len": 200, "output_len": 32, "seed": 3, **workload})
    scheduler, setup = build_scheduler(shape, HardwareProfile.load(profile), work, cpu_attention=cpu_attention,
                                       dtype_bytes=dtype_bytes)
    return simulate(scheduler, work), work, setup


@pytest.mark.parametrize("cpu_attention", [True, False])
def test_every_request_finishes_with_exactly_its_output_tokens(cpu_attention):
    result, work, _ = run(cpu_attention=cpu_attention)
    lengths = {str(i): (input_len, output_len) for i, (_, input_len, output_len) in enumerate(work.sample())}
    assert sorted(r.request_id for r in result.records) == sorted(lengths)
    for record in result.records:
        assert (record.num_prompt_tokens, record.num_output_tokens) == lengths[record.request_id]
        assert record.arrival_time <= record.first_token_time <= record.finish_time <= result.makespan_s
    assert result.num_output_tokens == sum(out for _, out in lengths.values())
    assert result.num_estimate_mismatches == 0  # the scheduler's estimate is this simulator's clock


def test_same_seed_same_run_other_seed_other_run():
    first, _, _ = run(seed=11)
    again, _, _ = run(seed=11)
    other, _, _ = run(seed=12)
    assert first.summary() == again.summary() and first.records == again.records
    assert other.records != first.records


def test_workload_lengths_stay_within_ten_percent():
    work = Workload(num_requests=500, input_len=1000, output_len=100, seed=0)
    samples = work.sample()
    inputs = [i for _, i, _ in samples]
    outputs = [o for _, _, o in samples]
    assert min(inputs) >= 900 and max(inputs) <= 1100 and min(outputs) >= 90 and max(outputs) <= 110
    assert max(inputs) - min(inputs) > 150  # spread over the range, not one value
    assert all(arrival == 0 for arrival, _, _ in samples)  # all at once without a rate


def test_poisson_arrivals_idle_the_clock_between_requests():
    rate = 0.5  # one sequence every 2 s, far slower than a 32-token request takes on a T4
    result, work, _ = run(num_requests=30, request_rate=rate)
    arrivals = [a for a, _, _ in work.sample()]
    assert all(b > a for a, b in zip(arrivals, arrivals[1:]))
    assert (arrivals[-1] / (len(arrivals) - 1)) == pytest.approx(1 / rate, rel=0.5)
    assert result.makespan_s > arrivals[-1]
    # unloaded, a sequence's per-token time is its own prefill and decodes, not a queue
    loaded, _, _ = run(num_requests=30)
    assert result.per_token_latency(0.9) < loaded.per_token_latency(0.5)


def test_gpu_only_baseline_never_plans_cpu_work():
    result, _, setup = run(cpu_attention=False, num_requests=60, output_len=64)
    assert setup.num_cpu_blocks == 0
    assert result.iterations_by_mode[PlanMode.PIPELINED] == 0
    assert result.mean_cpu_batch == 0 and result.num_cpu_prefills == 0 and result.peak_cpu_requests == 0
    assert result.num_swap_out == result.num_swap_in == result.num_swap_blocks == 0
    assert result.num_preemptions > 0  # the T4 pool is short: the baseline recomputes instead


def test_offloading_beats_gpu_only_where_gpu_memory_is_short():
    shape, dtype_bytes = load_model_preset("llama-2-7b")
    comparison = compare(shape, HardwareProfile.load(T4), Workload(60, 200, 64, seed=1), dtype_bytes=dtype_bytes)
    assert comparison.relative_throughput > 1.5
    assert comparison.tandem.iterations_by_mode[PlanMode.PIPELINED] > 0
    assert comparison.tandem.mean_cpu_batch > comparison.tandem.mean_gpu_batch  # most sequences decode on the CPU
    assert comparison.tandem.peak_cpu_requests > comparison.gpu_only.peak_gpu_requests
    assert comparison.tandem.num_output_tokens == comparison.gpu_only.num_output_tokens


@pytest.mark.parametrize("profile, model, input_len", [("a10g-g5.4xlarge", "llama-3.1-8b", 1000),
                                                        ("2xh100-xeon8462y", "llama-3.1-70b", 2000)])
def test_neo_shapes_run_end_to_end(profile, model, input_len):
    result, work, setup = run(profile, model, num_requests=60, input_len=input_len, output_len=50)
    assert len(result.records) == 60 and result.num_estimate_mismatches == 0
    assert setup.max_model_len == work.max_input_len + work.max_output_len
    assert result.output_throughput > 0 and math.isfinite(result.per_token_latency(0.9))


def test_iteration_time_follows_the_plan_mode():
    """Step the scheduler by hand: a pipelined plan never costs less than the GPU-only plan of the
    same batch-0 (CPU work only lengthens a layer's critical path), and every plan's time is the
    scheduler's own estimate."""
    shape, dtype_bytes = load_model_preset("llama-2-7b")
    hardware = HardwareProfile.load(T4)
    work = Workload(12, 300, 40, seed=0)
    scheduler, _ = build_scheduler(shape, hardware, work, cpu_attention=True, dtype_bytes=dtype_bytes)
    cost = RooflineCostModel(shape, hardware, dtype_bytes)
    for index, (_, input_len, output_len) in enumerate(work.sample()):
        scheduler.add_sequence(Sequence(str(index), [0] * input_len,
                                      SamplingParams(max_tokens=output_len, ignore_eos=True)))
    num_pipelined = 0
    while scheduler.has_unfinished_sequences():
        plan = scheduler.schedule()
        seconds = iteration_time(plan, cost)
        assert seconds == pytest.approx(plan.estimated_time, rel=1e-9)
        if plan.mode == PlanMode.PIPELINED:
            batch0_alone = IterationPlan(prefills=plan.prefills, decodes=plan.decodes, swap_out=plan.swap_out,
                                         swap_in=plan.swap_in, mode=PlanMode.GPU_ONLY)
            assert seconds >= iteration_time(batch0_alone, cost)
            num_pipelined += 1
        scheduler.update(plan, [0] * len(plan.sampling))
    assert num_pipelined > 0


def test_bounded_wait_setting_reaches_the_scheduler():
    shape, dtype_bytes = load_model_preset("llama-2-7b")
    work = Workload(8, 200, 16)
    scheduler, _ = build_scheduler(shape, HardwareProfile.load(T4), work, cpu_attention=True, dtype_bytes=dtype_bytes,
                                   neo=NeoConfig(max_cpu_wait_iterations=3, num_cpu_blocks=5))
    assert scheduler.neo.max_cpu_wait_iterations == 3
    assert scheduler.neo.num_cpu_blocks > 5  # sized from the host, not taken from `neo`


@pytest.mark.parametrize("bad, message", [
    ({"num_requests": 0}, "num_requests must be an integer >= 1"),
    ({"spread": 1.0}, r"spread must be in \[0, 1\)"),
    ({"request_rate": 0}, "request_rate must be a number > 0 or None"),
])
def test_bad_workloads_are_rejected(bad, message):
    with pytest.raises(ValueError, match=message):
        Workload(**{"num_requests": 4, "input_len": 10, "output_len": 10, **bad})


def test_unknown_model_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown model preset 'gpt-5'.*llama-2-7b"):
        load_model_preset("gpt-5")


def test_model_presets_are_read_by_the_engines_torch_free_parser():
    code = "import sys, engine.model; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    shape, dtype_bytes = load_model_preset("llama-3.1-70b")
    assert shape == ModelConfig.from_preset("llama-3.1-70b").shape
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim, dtype_bytes) == (80, 64, 8, 128, 2)


def test_percentile_interpolates_between_ranks():
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0], 0.9) == pytest.approx(1.9)
    assert percentile([5.0], 0.9) == 5.0
    assert math.isnan(percentile([], 0.5))
