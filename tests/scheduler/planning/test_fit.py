"""The fit (scheduler/planning/fit): the performance model's decode iteration is the max of its overlapped
tasks, budgets are never exceeded, the lossless option is taken unless memory binds and a lossier
one is predicted MIN_LOSSY_GAIN faster (or nothing else fits), each option's configuration is the
fastest of all its placements, and a refusal names the flags. No torch."""
import dataclasses
import random

import pytest

from scheduler.planning.cost_model import Curve, ModelShape
from scheduler.planning.fit import (
    MIN_LOSSY_GAIN,
    AttentionCosts,
    FitBudgets,
    FitError,
    FitOption,
    FitProbes,
    FitRequest,
    FixedChoices,
    KVCapacity,
    fit,
    predict,
)
from scheduler.planning.fit.search import placements_of, with_predictions
from scheduler.planning.kv_format import kv_format
from scheduler.planning import (GIB_BYTES, ComputeCosts, MemoryBudgets, PlannerInputs, TransferRates, WeightFormat,
                                 Workload)
from scheduler.planning.memory import layer_image_bytes, resident_global_bytes
from scheduler.planning.placement import PlacementMode
from scheduler.planning.tiers import Tier

# A 1B Llama-3.2 shape: 16 layers of ~116 MiB in bf16
SHAPE = ModelShape(num_layers=16, hidden_size=2048, intermediate_size=8192, num_heads=32, num_kv_heads=8,
                   head_dim=64, vocab_size=128256, tie_word_embeddings=True)
BF16, INT8, INT4 = kv_format("bfloat16"), kv_format("int8"), kv_format("int4")
OPTIONS = (FitOption("none", BF16, 0), FitOption("none", INT8, 1), FitOption("int4", BF16, 2),
           FitOption("int4", INT8, 3), FitOption("none", INT4, 4), FitOption("int4", INT4, 5))
WORKLOAD = Workload(max_num_seqs=32, max_model_len=2048, max_num_batched_tokens=1024, block_size=16, context_len=1024)
WEIGHTS_BYTES = resident_global_bytes(SHAPE, 2) + 16 * layer_image_bytes(SHAPE, WeightFormat("none", 2))


def probes(attention_s: dict[str, float] | None = None, int4_speedup: float = 2.0) -> FitProbes:
    """Weight-bound linear work (INT4 `int4_speedup` x faster), attention per KV format."""
    def compute(quantization: str) -> ComputeCosts:
        layer_s = 0.004 / (int4_speedup if quantization == "int4" else 1)
        return ComputeCosts(Curve.from_points([(1, layer_s), (64, layer_s * 1.2)]), 1e-9,
                            Curve.from_points([(1, 1e-3), (64, 2e-3)]))
    per_token = attention_s or {"bfloat16": 2e-8, "int8": 1.2e-8, "int4": 0.8e-8}
    cpu = {name: 3 * seconds for name, seconds in per_token.items()}
    return FitProbes(TransferRates(10e9, 2e9), compute, AttentionCosts(per_token, cpu))


def request(gpu_gib: float, host_gib: float = 8.0, options=OPTIONS, measured=None, fixed=FixedChoices(),
            disk: bool = True, neo: bool = True, workload: Workload = WORKLOAD, by_budget: bool = True,
            calls: list | None = None) -> FitRequest:
    """`calls` gets an entry each time the fit measures."""
    def measure() -> FitProbes:
        if calls is not None:
            calls.append(1)
        return measured or probes()
    return FitRequest(SHAPE, 2, options, workload,
                      FitBudgets(int(gpu_gib * GIB_BYTES), int(host_gib * GIB_BYTES),
                                 100 * GIB_BYTES if disk else None, pools_by_budget=by_budget, neo=neo), measure, fixed)


def test_a_model_that_fits_with_room_is_taken_lossless_without_measuring():
    calls = []
    c = fit(request(gpu_gib=20.0, host_gib=40.0, calls=calls)).chosen
    assert c.option == OPTIONS[0] and not c.streams and calls == []
    assert c.gpu_bytes <= 20 * GIB_BYTES and c.host_bytes <= 40 * GIB_BYTES


@pytest.mark.parametrize("gpu_gib", [2.0, 2.5, 3.0, 4.0])
def test_budgets_are_never_exceeded_and_pools_hold_a_sequence(gpu_gib):
    result = fit(request(gpu_gib, host_gib=3.0))
    for c in (result.chosen, *result.options):
        assert c.gpu_bytes <= gpu_gib * GIB_BYTES and c.host_bytes <= 3.0 * GIB_BYTES
        seq_bytes = WORKLOAD.max_model_len * SHAPE.kv_bytes_per_token_layer(c.option.kv.element_bytes) * 16
        assert c.gpu_kv_bytes >= seq_bytes * 0.99


def test_a_lossy_option_needs_its_gain_while_memory_binds():
    # 2.6 GiB and no host pool: the bf16 weights (2.3 GiB) leave room for a few sequences only: memory binds
    slow_int8 = probes({"bfloat16": 2e-8, "int8": 2e-8, "int4": 2e-8}, int4_speedup=1.0)
    small_gain = fit(request(2.6, measured=slow_int8, options=OPTIONS[:2], neo=False))
    one, two = small_gain.options
    gain = two.prediction.tokens_per_s / one.prediction.tokens_per_s
    assert (small_gain.chosen.option == OPTIONS[1]) == (gain >= 1 + MIN_LOSSY_GAIN)
    fast_int8 = probes({"bfloat16": 4e-7, "int8": 1e-7, "int4": 1e-7})
    big = fit(request(2.6, measured=fast_int8, options=OPTIONS[:2], neo=False))
    gain = big.options[1].prediction.tokens_per_s / big.options[0].prediction.tokens_per_s
    assert gain >= 1 + MIN_LOSSY_GAIN and big.chosen.option == OPTIONS[1] and "predicted" in big.reason


def test_no_lossy_option_where_memory_does_not_bind():
    fast_int8 = probes({"bfloat16": 4e-7, "int8": 1e-7, "int4": 1e-7})
    r = request(40.0, host_gib=40.0, measured=fast_int8)
    assert fit(r).chosen.option == OPTIONS[0]
    # pools at their defaults (no budget sizes them): a small pool is not memory binding
    r = request(3.6, measured=fast_int8, by_budget=False)
    assert fit(r).chosen.option.kv == BF16


def test_the_first_option_that_fits_is_taken_when_nothing_less_lossy_does():
    # 1.6 GiB holds INT4 weights with a pool, never the bf16 ones (no disk, no host room for layers)
    result = fit(request(1.6, host_gib=0.5, disk=False, neo=False, options=OPTIONS[:3]))
    assert result.chosen.option.quantization == "int4" and "nothing less lossy fits" in result.reason
    assert "weights none, bfloat16 KV" in result.refused


def test_nothing_fits_names_the_flags():
    with pytest.raises(FitError) as error:
        fit(request(0.3, host_gib=0.2, disk=False, neo=False))
    message = str(error.value)
    assert "--gpu-memory-gib" in message and "--offload-dir" in message and "--max-model-len" in message


def test_each_option_takes_its_fastest_placement():
    """Brute force: every placement of an option predicted, the fit's pick among them the fastest."""
    rng = random.Random(7)
    for _ in range(8):
        gpu_gib, host_gib = rng.uniform(1.0, 3.0), rng.uniform(1.0, 4.0)
        measured = probes(int4_speedup=rng.uniform(1.0, 3.0))
        r = request(gpu_gib, host_gib, measured=measured)
        try:
            result = fit(r)
        except FitError:
            continue
        for chosen in result.options:
            every = [c for c in with_predictions(r, placements_of(r, chosen.option, None), measured)
                     if not isinstance(c, str)]
            best = max(c.prediction.tokens_per_s for c in every)
            assert chosen.prediction.tokens_per_s == pytest.approx(best)


def test_fixed_pools_are_kept_and_a_fixed_max_model_len_must_fit():
    fixed = FixedChoices(gpu_kv_blocks=64, host_kv_blocks=100)
    c = fit(request(40.0, fixed=fixed)).chosen
    block = 16 * SHAPE.kv_bytes_per_token_layer(2) * 16
    assert c.gpu_kv_bytes == 64 * block and c.host_kv_bytes == 100 * block
    assert c.max_model_len == 64 * 16  # the pool caps the length where --max-model-len is not given
    with pytest.raises(FitError, match="holds no 2048-token sequence"):
        fit(request(40.0, fixed=FixedChoices(gpu_kv_blocks=64, max_model_len=True), options=OPTIONS[:1]))


def test_predict_is_the_max_of_the_overlapped_tasks():
    work = Workload(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=256, block_size=16, context_len=1024)
    p = probes()
    inputs = PlannerInputs(SHAPE, WeightFormat("none", 2), work, MemoryBudgets(), p.rates, p.compute("none"))
    tiers = (Tier.GPU,) * 16
    gpu_only = predict(inputs, tiers, 0, 1, BF16, p.attention, KVCapacity(8 * 1024, 0))
    assert gpu_only.batch == 8 and gpu_only.num_cpu_seqs == 0 and gpu_only.cpu_s == 0
    # two sequences fit the GPU pool, six more the host's: their attention on the CPU beside the GPU
    neo = predict(inputs, tiers, 0, 1, BF16, p.attention, KVCapacity(2 * 1024, 6 * 1024))
    expected_cpu = 16 * p.attention.cpu_s_per_token["bfloat16"] * 6 * 1024
    assert neo.num_cpu_seqs == 6
    if neo.cpu_s:  # Neo's two sub-batches: the CPU attends to batch-1 beside the GPU's work
        assert neo.cpu_s == pytest.approx(expected_cpu) and neo.iteration_s == max(neo.gpu_s, neo.cpu_s)
    else:  # one batch: each layer waits for the slower attention
        assert neo.gpu_s >= expected_cpu
    assert neo.tokens_per_s >= predict(inputs, tiers, 0, 1, BF16, p.attention, KVCapacity(2 * 1024, 0)).tokens_per_s
    assert isinstance(predict(inputs, tiers, 0, 1, BF16, p.attention, KVCapacity(512, 0)), str)


def test_speculation_gain_is_the_best_k_where_rows_are_cheap_and_none_where_they_are_not():
    from scheduler.planning.fit.speculation import speculation_gain, tokens_per_verify

    assert tokens_per_verify(0.5, 3) == pytest.approx(1.875) and tokens_per_verify(0.0, 4) == 1
    weight_bound = speculation_gain(lambda seqs, rows: 0.010 + 0.0001 * seqs * rows, 1, 4, acceptance=0.6)
    assert weight_bound.num_drafts == 4 and weight_bound.speedup == pytest.approx(
        tokens_per_verify(0.6, 4) * 0.0101 / 0.0105)
    compute_bound = speculation_gain(lambda seqs, rows: 0.001 * seqs * rows, 32, 4, acceptance=0.6)
    assert compute_bound.num_drafts == 0 and compute_bound.speedup == 1.0


def test_the_prediction_carries_speculations_gain_at_one_sequence_and_the_batch():
    """Streamed layers make a forward's rows cheap beside its loads: drafts pay, more at one sequence
    than at the batch, whose rows cost more."""
    work = Workload(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=256, block_size=16, context_len=512,
                    num_speculative_tokens=4)
    p = probes()
    inputs = PlannerInputs(SHAPE, WeightFormat("none", 2), work, MemoryBudgets(), p.rates, p.compute("none"))
    tiers = (Tier.GPU,) * 4 + (Tier.HOST,) * 12
    prediction = predict(inputs, tiers, 2, 120 << 20, BF16, p.attention, KVCapacity(8 * 1024, 0))
    one, batch = prediction.speculation
    assert (one.num_seqs, batch.num_seqs) == (1, 8)
    assert one.num_drafts == 4 and one.speedup > 2 and 1 <= batch.speedup <= one.speedup
    without = dataclasses.replace(inputs, workload=dataclasses.replace(work, num_speculative_tokens=0))
    assert predict(without, tiers, 2, 120 << 20, BF16, p.attention, KVCapacity(8 * 1024, 0)).speculation == ()


def test_a_ttft_target_takes_a_plan_that_meets_it_before_a_faster_decode():
    """Memory binding: with no target the fit takes an option's fastest decode; with a target
    between the options' predicted TTFTs it takes one that meets it, and says when none does."""
    fast_int8 = probes({"bfloat16": 4e-7, "int8": 1e-7, "int4": 1e-7})
    free = fit(request(2.6, measured=fast_int8, options=OPTIONS[:3], neo=False))
    ttfts = sorted({c.prediction.ttft_s for c in free.options})
    assert len(ttfts) > 1  # INT4 weights prefill faster here
    if free.chosen.prediction.ttft_s == ttfts[0]:
        pytest.skip("the fastest decode already has the shortest TTFT")
    target = (ttfts[0] + ttfts[1]) / 2
    bound = fit(dataclasses.replace(request(2.6, measured=fast_int8, options=OPTIONS[:3], neo=False),
                                    ttft_target_s=target))
    assert bound.chosen.prediction.ttft_s <= target and "TTFT target" in bound.reason
    unmet = fit(dataclasses.replace(request(2.6, measured=fast_int8, options=OPTIONS[:3], neo=False),
                                    ttft_target_s=ttfts[0] / 2))
    assert "no plan weighed meets the TTFT target" in unmet.reason


def test_a_ttft_target_where_everything_fits_is_checked_and_reported():
    calls = []
    result = fit(dataclasses.replace(request(gpu_gib=20.0, host_gib=40.0, calls=calls), ttft_target_s=1e-9))
    assert result.chosen.option == OPTIONS[0] and calls  # measured, to predict the TTFT
    assert "no plan weighed meets the TTFT target of 1e-09 s" in result.reason


def test_a_missed_ttft_target_raises_the_chunk_budget_unless_a_flag_fixes_it():
    """Every layer streamed (placement cpu): they load once a forward, so a long prompt in fewer,
    larger chunks prefills sooner; the budget doubles until a plan meets the target."""
    work = dataclasses.replace(WORKLOAD, max_num_batched_tokens=256, context_len=2048)
    streamed = FixedChoices(placement=PlacementMode.CPU)
    base = request(1.2, options=OPTIONS[:1], neo=False, workload=work, fixed=streamed)
    unbound = fit(dataclasses.replace(base, predict_always=True))
    assert unbound.chosen.num_resident == 0 and unbound.max_num_batched_tokens is None
    target = unbound.chosen.prediction.ttft_s / 2
    raised = fit(dataclasses.replace(base, ttft_target_s=target))
    assert raised.max_num_batched_tokens in (512, 1024, 2048) and raised.chosen.prediction.ttft_s <= target
    assert f"chunks of {raised.max_num_batched_tokens} tokens" in raised.reason
    fixed = fit(dataclasses.replace(base, ttft_target_s=target,
                                    fixed=dataclasses.replace(streamed, max_num_batched_tokens=True)))
    assert fixed.max_num_batched_tokens is None and "no plan weighed meets the TTFT target" in fixed.reason


def test_a_ttft_target_can_keep_layers_resident_at_the_decodes_cost():
    """Among one option's placements, one that meets the target before a faster decode."""
    work = dataclasses.replace(WORKLOAD, max_num_batched_tokens=256, context_len=2048)
    base = request(1.2, options=OPTIONS[:1], neo=False, workload=work)
    fastest = fit(dataclasses.replace(base, predict_always=True)).chosen
    every = [c for c in with_predictions(base, placements_of(base, OPTIONS[0], None), probes())
             if not isinstance(c, str)]
    target = min(c.prediction.ttft_s for c in every) * 1.01
    assert fastest.prediction.ttft_s > target  # the fastest decode misses it
    bound = fit(dataclasses.replace(base, ttft_target_s=target))
    assert bound.chosen.prediction.ttft_s <= target and "meets the TTFT target" in bound.reason
    assert bound.chosen.prediction.tokens_per_s < fastest.prediction.tokens_per_s
