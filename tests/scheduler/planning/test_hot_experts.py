"""The hot-expert cache's planning side: the sliding window of routing counts, the changes it asks
for, the expected hit rate under a Zipf popularity, the slots a budget leaves, and the choice of
which misses to fetch."""
import random

import pytest

from scheduler.planning.cost_model import ModelShape
from scheduler.planning import PlacementError, WeightFormat
from scheduler.planning.experts.split import ExpertShape, SideFit, SplitModel
from scheduler.planning.experts.hot_experts import (
    ExpertWindow,
    choose_changes,
    expected_hit_rate,
    expert_image_bytes,
    inclusion_probabilities,
    layer_resident_bytes,
    plan_expert_cache,
    routed_layer_time_s,
    zipf_popularity,
)
from scheduler.planning.memory import layer_image_bytes
from scheduler.planning.slicing.cost import GemmCost, LinearCost, SlicingCosts

MOE = ModelShape(num_layers=4, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64,
                 vocab_size=1000, num_experts=16, num_experts_per_token=4, expert_intermediate_size=128,
                 dense_mlp_layers=(0,))
FP32 = WeightFormat("none", 4)


# ---- the window ------------------------------------------------------------------------------
def test_the_window_sums_what_it_holds_and_forgets_in_buckets():
    window = ExpertWindow(num_experts=4, num_experts_per_token=2, window_tokens=8, num_buckets=4)  # 2 tokens a bucket
    window.add([4, 0, 0, 0])  # 2 tokens: closes bucket 1
    assert window.counts == [4, 0, 0, 0]
    for _ in range(3):
        window.add([0, 4, 0, 0])  # buckets 2-4: bucket 1 leaves when the 4th closes (3 full kept + current)
    assert window.counts == [0, 12, 0, 0]
    window.add([0, 0, 2, 0])  # half a bucket, counted at once
    assert window.counts == [0, 12, 2, 0]
    assert window.num_pairs_seen == 18


def test_a_window_against_a_brute_force_recount_of_its_last_buckets():
    rng = random.Random(3)
    num_experts, k, buckets, window_tokens = 6, 2, 4, 40
    window = ExpertWindow(num_experts, k, window_tokens, buckets)
    bucket_pairs = window_tokens // buckets * k
    closed, current = [], [0] * num_experts
    for _ in range(200):
        counts = [0] * num_experts
        for expert in rng.sample(range(num_experts), k):
            counts[expert] += rng.randint(1, 3)
        window.add(counts)
        current = [a + b for a, b in zip(current, counts)]
        if sum(current) >= bucket_pairs:
            closed.append(current)
            current = [0] * num_experts
        kept = closed[-(buckets - 1):] + [current]
        assert window.counts == [sum(b[e] for b in kept) for e in range(num_experts)]


def test_a_window_starts_from_saved_counts():
    window = ExpertWindow(3, 1, window_tokens=8, num_buckets=8)
    window.seed([5, 0, 9])
    assert window.counts == [5, 0, 9]
    with pytest.raises(ValueError, match="3 experts"):
        window.seed([1, 2])


# ---- the changes -----------------------------------------------------------------------------
def test_free_slots_take_the_hottest_experts_not_resident():
    assert choose_changes([5, 9, 0, 7], hot={1}, pending=set(), num_slots=3) == [(None, 3), (None, 0)]


def test_a_candidate_displaces_the_coldest_resident_only_by_a_margin():
    counts = [10, 1, 12, 30]
    # 30 displaces 1; 12 against 10 is within the 25% margin: no trade between near-equals
    assert choose_changes(counts, hot={0, 1}, pending=set(), num_slots=2) == [(1, 3)]
    assert choose_changes(counts, hot={0, 3}, pending=set(), num_slots=2) == []


def test_changes_in_flight_are_capped_and_hold_their_slots():
    counts = [0, 0, 50, 40, 30, 1]
    # ties between victims: the higher index goes
    assert choose_changes(counts, hot={0, 1}, pending={2}, num_slots=3, max_new=2) == [(1, 3)]
    assert choose_changes(counts, hot={0, 1}, pending={2, 3}, num_slots=4, max_new=2) == []


def test_an_expert_no_token_routes_to_is_never_promoted():
    assert choose_changes([0, 0, 0, 3], hot={3}, pending=set(), num_slots=3) == []


# ---- expectations ------------------------------------------------------------------------------
def test_zipf_popularity_sums_to_one_hottest_first_and_uniform_at_zero():
    popularity = zipf_popularity(8, 1.2)
    assert sum(popularity) == pytest.approx(1.0)
    assert popularity == sorted(popularity, reverse=True)
    assert zipf_popularity(4, 0.0) == [0.25] * 4


def test_inclusion_probabilities_sum_to_k_and_saturate_for_popular_experts():
    popularity = zipf_popularity(16, 1.0)
    inclusion = inclusion_probabilities(popularity, 4)
    assert sum(inclusion) == pytest.approx(4.0)
    assert popularity[0] < inclusion[0] <= 1.0  # in more than its share of tokens, never twice in one
    assert inclusion[0] > inclusion[4] > inclusion[15]


def test_the_expected_hit_rate_is_the_slots_share_when_uniform_and_more_when_skewed():
    assert expected_hit_rate(zipf_popularity(16, 0.0), 4, 4) == pytest.approx(0.25, abs=0.03)
    skewed = expected_hit_rate(zipf_popularity(16, 1.0), 4, 4)
    assert 0.4 < skewed < 1.0
    assert expected_hit_rate(zipf_popularity(16, 1.0), 4, 16) == pytest.approx(1.0)


# ---- sizing ------------------------------------------------------------------------------------
def test_expert_and_resident_bytes_add_up_to_the_layer_image():
    routed = layer_resident_bytes(MOE, FP32, 1) + MOE.num_experts * expert_image_bytes(MOE, FP32)
    assert routed == pytest.approx(layer_image_bytes(MOE, FP32), rel=0.01)  # each image pads to 4 KiB once


def test_the_budget_sizes_the_slots_per_routed_layer():
    free = plan_expert_cache(MOE, FP32, global_bytes=1000, gpu_weight_bytes=None)
    assert free.num_slots == 16 and free.num_routed_layers == 3
    budget = free.resident_bytes + free.fetch_bytes + 3 * 5 * free.expert_bytes + 100
    plan = plan_expert_cache(MOE, FP32, global_bytes=1000, gpu_weight_bytes=budget)
    assert plan.num_slots == 5
    assert plan.gpu_bytes <= budget
    assert plan.expected_hit_rate > plan.static_hit_rate == 5 / 16


def test_a_budget_below_the_non_expert_weights_is_refused_naming_the_flag():
    with pytest.raises(PlacementError, match="--weights-gpu-gib"):
        plan_expert_cache(MOE, FP32, global_bytes=1000, gpu_weight_bytes=1000)
    with pytest.raises(PlacementError, match="--hot-experts 17"):
        plan_expert_cache(MOE, FP32, global_bytes=1000, gpu_weight_bytes=None, num_slots=17)


# ---- fetching ----------------------------------------------------------------------------------
def _costs(copies_on_cpu: bool = False) -> SlicingCosts:
    # the CPU reads weights at 50 GB/s, the link copies at 25 GB/s, the GPU multiplies 20x faster
    return SlicingCosts(gpu_gemm=GemmCost(1e-5, 5e-13, 1e-11), cpu_gemm=GemmCost(1e-5, 1e-11, 2e-11),
                        link=LinearCost(1e-5, 4e-11, "bytes"), launch_s=1e-6, copies_on_cpu=copies_on_cpu)


EXPERT = ExpertShape(hidden_size=1024, intermediate_size=512, gate_up_bytes=4 << 20, down_bytes=2 << 20,
                     image_bytes=6 << 20)


@pytest.mark.parametrize("copies_on_cpu", [False, True])
def test_a_decode_fetches_nothing_and_a_prefill_fetches_its_biggest_misses(copies_on_cpu):
    model = SplitModel(_costs(copies_on_cpu), EXPERT)
    assert model.split(hit_rows=[2, 1], miss_rows=[1, 2, 1], max_fetches=4).fetched == []
    split = model.split(hit_rows=[300] * 4, miss_rows=[10, 400, 250, 300], max_fetches=2)
    assert split.fetched and set(split.fetched) <= {1, 3} and split.hits_on_cpu == []


def test_fetching_stops_where_it_no_longer_shortens_the_layer():
    model = SplitModel(_costs(), EXPERT)
    miss_rows = [500, 400, 300, 20, 10]
    chosen = model.split([], miss_rows, max_fetches=5).fetched
    fetched = [miss_rows[i] for i in chosen]
    rest = [r for i, r in enumerate(miss_rows) if i not in chosen]
    best = model.layer_s([], rest, fetched)
    order = sorted(range(5), key=lambda i: -miss_rows[i])
    for count in range(len(miss_rows) + 1):  # every prefix of the most-rows-first order
        others = [miss_rows[i] for i in order[count:]]
        assert best <= model.layer_s([], others, [miss_rows[i] for i in order[:count]]) + 1e-12


def test_a_gpu_no_faster_than_the_cpu_hands_the_cpu_hits_until_the_sides_balance():
    """The testbed: one core plays each side, so a high hit rate leaves the GPU the slower one."""
    same = GemmCost(1e-6, 1e-11, 2e-11)
    model = SplitModel(SlicingCosts(gpu_gemm=same, cpu_gemm=same, link=LinearCost(1e-5, 4e-11, "bytes"),
                                    launch_s=1e-6), EXPERT)
    hit_rows, miss_rows = [2] * 6, [2] * 2
    split = model.split(hit_rows, miss_rows, max_fetches=4)
    assert split.fetched == [] and len(split.hits_on_cpu) == 2  # 4 and 4 experts a side
    before = model.layer_s(hit_rows, miss_rows, [])
    kept = [r for i, r in enumerate(hit_rows) if i not in split.hits_on_cpu]
    assert model.layer_s(kept, miss_rows + [2, 2], []) < before
    # a GPU 20x faster at the math and reading as fast keeps every hit
    assert SplitModel(_costs(), EXPERT).split([300] * 6, [300] * 2, max_fetches=0).hits_on_cpu == []


def test_the_routed_layer_time_falls_as_more_pairs_run_on_the_faster_side():
    costs = _costs()
    times = [routed_layer_time_s(MOE, FP32, costs, 256, share) for share in (0.0, 0.5, 1.0)]
    assert times[0] > times[1] > times[2]


def test_a_side_fit_recovers_both_terms_from_forwards_of_both_kinds():
    fit = SideFit()
    rng = random.Random(0)
    for _ in range(400):  # decodes (mostly reading) and prefills (mostly math), measured 3x and 0.5x the model
        read_s, math_s = rng.uniform(1e-3, 2e-3), rng.choice([1e-4, 5e-3]) * rng.uniform(0.5, 1.5)
        fit.observe(read_s, math_s, 3.0 * read_s + 0.5 * math_s)
    assert fit.read == pytest.approx(3.0, rel=0.05) and fit.math == pytest.approx(0.5, rel=0.1)
