import dataclasses
import random

import pytest

from scheduler.planning.memory import WeightFormat
from scheduler.planning.slicing.rates import SliceRates
from scheduler.planning.slicing.cost import UNIT_BYTES, GemmCost, LinearCost, SlicingCosts
from scheduler.planning.slicing.model import (
    Affine,
    GemmWork,
    MlpWork,
    SliceTerms,
    cpu_time_s,
    dense_mlp_work,
    expected_active_experts,
    layer_pieces,
    layer_time_s,
    moe_mlp_work,
)

# Round numbers, so the streams can be followed by hand (see each test's comments).
HAND_COSTS = SlicingCosts(GemmCost(1.0, 0.1), GemmCost(2.0, 1.0), LinearCost(3.0, 0.01, UNIT_BYTES), 0.5)
HAND_WORK = MlpWork((GemmWork(100.0, 1000), GemmWork(50.0, 500)), num_tokens=1, hop_bytes=200)


def random_costs(rng: random.Random, fixed_costs: bool = True) -> SlicingCosts:
    """Linear models over the ranges the paper's Table and this machine's profiles span; without
    fixed costs every startup and launch is zero and neither side slows the other (a slowdown
    that starts with a part is a jump too)."""
    def startup() -> float:
        return rng.uniform(0.0, 1e-4) if fixed_costs else 0.0

    def slowdown() -> float:
        return rng.choice([1.0, rng.uniform(1.0, 2.5)]) if fixed_costs else 1.0
    return SlicingCosts(GemmCost(startup(), 10 ** rng.uniform(-13, -10), 10 ** rng.uniform(-12, -10)),
                        GemmCost(startup(), 10 ** rng.uniform(-12, -10), 10 ** rng.uniform(-11, -9)),
                        LinearCost(startup(), 10 ** rng.uniform(-11, -9), UNIT_BYTES), startup(),
                        cpu_gemm_slowdown=slowdown(), gpu_gemm_slowdown=slowdown(), link_slowdown=slowdown())


def random_work(rng: random.Random, fixed_costs: bool = True, num_tokens: int | None = None) -> MlpWork:
    """A dense MLP or a MoE layer of a random shape; without fixed costs the activations' hops are
    free too (they are a fixed cost of having a CC part)."""
    fmt = WeightFormat(rng.choice(["none", "int4"]), rng.choice([2, 4]))
    hidden, tokens = rng.choice([256, 1024, 4096]), num_tokens or rng.choice([1, 3, 16, 64, 512])
    if rng.random() < 0.7:
        work = dense_mlp_work(hidden, rng.choice([512, 2048, 11008]), tokens, fmt)
    else:
        work = moe_mlp_work(hidden, rng.choice([256, 768]), rng.choice([8, 64]), rng.choice([1, 2, 8]), tokens, fmt)
    return work if fixed_costs else dataclasses.replace(work, hop_bytes=0)


def test_all_resident():
    # GG launches end at 0.5 and 1.0; GEMMs 1 + 10 and 1 + 5 one after the other
    assert layer_time_s(HAND_WORK, HAND_COSTS, SliceRates(0.0, 0.0, 1.0)) == pytest.approx(17.5)


def test_all_on_the_cpu():
    # hop 3 + 2, GEMMs 2 + 100 and 2 + 50, hop back 5; the GPU does nothing
    assert layer_time_s(HAND_WORK, HAND_COSTS, SliceRates(1.0, 0.0, 0.0)) == pytest.approx(164.0)


def test_all_streamed():
    # copies launched at 0.5 and 1.0 land at 13.5 and 21.5; computes launched at 1.5 and 2.0
    # run 13.5-24.5 and 24.5-30.5
    assert layer_time_s(HAND_WORK, HAND_COSTS, SliceRates(0.0, 1.0, 0.0)) == pytest.approx(30.5)


def test_mixed_rates():
    # link: 0.5 + 5.5 = 6.0, then 6.0 + 4.25 = 10.25; GPU: GG 1.5-5.0, 5.0-7.25, CG 7.25-10.75,
    # 10.75-13.0; CPU: 5 + 52 + 27 = 84, its result back at 89
    assert layer_time_s(HAND_WORK, HAND_COSTS, SliceRates(0.5, 0.25, 0.25)) == pytest.approx(89.0)


def test_prefill_tokens_moved_to_cg_prime():
    work = MlpWork((GemmWork(400.0, 1000), GemmWork(200.0, 500)), num_tokens=4, hop_bytes=800)
    # link: CG1 8.5, CG'1 16.5, CG2 22, CG'2 27.5; GPU: CG1 -29.5, CG2 -40.5, CG'1 -51.5,
    # CG'2 -57.5; CPU on half the tokens: hop 7, GEMMs 102 and 52, result back at 161 + 7
    assert layer_time_s(work, HAND_COSTS, SliceRates(0.5, 0.5, 0.0), num_moved_tokens=2) == pytest.approx(168.0)
    with pytest.raises(ValueError, match="num_moved_tokens"):
        layer_time_s(work, HAND_COSTS, SliceRates(0.5, 0.5, 0.0), num_moved_tokens=5)


def test_each_side_slows_while_the_other_computes():
    costs = dataclasses.replace(HAND_COSTS, cpu_gemm_slowdown=2.0, gpu_gemm_slowdown=3.0)
    # GPU GEMMs 3x: GG 1.5-12.0, 12.0-18.75, CG 18.75-29.25, 29.25-36.0; CPU GEMMs 2x:
    # 5 + 104 + 54, back at 168
    assert layer_time_s(HAND_WORK, costs, SliceRates(0.5, 0.25, 0.25)) == pytest.approx(168.0)
    # a side alone is not slowed
    assert layer_time_s(HAND_WORK, costs, SliceRates(1.0, 0.0, 0.0)) == pytest.approx(164.0)
    assert layer_time_s(HAND_WORK, costs, SliceRates(0.0, 0.0, 1.0)) == pytest.approx(17.5)


def test_copies_slow_beside_gemms_but_not_alone():
    costs = dataclasses.replace(HAND_COSTS, link_slowdown=2.0)
    # all streamed: nothing computes beside the copies (CG waits for them), as test_all_streamed
    assert layer_time_s(HAND_WORK, costs, SliceRates(0.0, 1.0, 0.0)) == pytest.approx(30.5)
    # beside GG (1.5-10.0, 10.0-14.75): copies of 2 x 5.5 and 2 x 4.25 land at 11.5 and 20.0, so
    # CG runs 14.75-18.25 and then waits for its second slice: 20.0-22.25 (alone it would end at 20.5)
    assert layer_time_s(HAND_WORK, costs, SliceRates(0.0, 0.25, 0.75)) == pytest.approx(22.25)
    assert layer_time_s(HAND_WORK, HAND_COSTS, SliceRates(0.0, 0.25, 0.75)) == pytest.approx(20.5)


def test_gemms_pay_for_the_weight_bytes_they_read():
    costs = dataclasses.replace(HAND_COSTS, gpu_gemm=GemmCost(1.0, 0.1, 0.002), cpu_gemm=GemmCost(2.0, 1.0, 0.004))
    # resident: GEMMs 1 + 10 + 2 and 1 + 5 + 1 after launches at 0.5 and 1.0
    assert layer_time_s(HAND_WORK, costs, SliceRates(0.0, 0.0, 1.0)) == pytest.approx(20.5)
    # the CPU: hop 5, GEMMs 2 + 100 + 4 and 2 + 50 + 2, hop back 5
    assert layer_time_s(HAND_WORK, costs, SliceRates(1.0, 0.0, 0.0)) == pytest.approx(170.0)


def test_experts_pay_startup_per_expert_they_run():
    work = MlpWork((GemmWork(100.0, 1000, num_experts=4, num_active_experts=4),), num_tokens=1, hop_bytes=0)
    costs = dataclasses.replace(HAND_COSTS, launch_s=0.0)
    # CPU: hop 3, 2 experts x 2 + 50; link: one copy 3 + 5 = 8; GPU 8 + 2 x 1 + 5; back at 57 + 3
    assert layer_time_s(work, costs, SliceRates(0.5, 0.5, 0.0)) == pytest.approx(60.0)


def test_unused_experts_are_copied_but_neither_called_nor_read():
    work = MlpWork((GemmWork(100.0, 1000, num_experts=4, num_active_experts=2),), num_tokens=1, hop_bytes=0)
    costs = dataclasses.replace(HAND_COSTS, cpu_gemm=GemmCost(2.0, 1.0, 0.01), launch_s=0.0)
    # CPU: hop 3, 1 expert's call 2, multiply-adds 50, half of its 500 bytes read at 0.01; link 8 as above
    assert cpu_time_s(work, costs, SliceRates(0.5, 0.5, 0.0)) == pytest.approx(3 + 2 + 50 + 2.5)
    assert work.gemms[0].read_bytes == 500


def test_expected_active_experts():
    assert expected_active_experts(32, 8, 1) == pytest.approx(8.0)
    assert expected_active_experts(32, 8, 2) == pytest.approx(32 * (1 - 0.75 ** 2))
    assert expected_active_experts(8, 2, 512) == pytest.approx(8.0)


def test_shapes_give_the_layers_multiply_adds_and_bytes():
    fmt = WeightFormat("none", 2)
    dense = dense_mlp_work(64, 256, 3, fmt)
    assert [g.multiply_adds for g in dense.gemms] == [3 * 512 * 64, 3 * 64 * 256]
    assert dense.weight_bytes == 3 * 64 * 256 * 2 and dense.hop_bytes == 3 * 64 * 2
    moe = moe_mlp_work(64, 32, 8, 2, 3, fmt)
    assert [g.multiply_adds for g in moe.gemms] == [6 * 64 * 64, 6 * 64 * 32]
    assert moe.weight_bytes == 8 * 3 * 64 * 32 * 2 and {g.num_experts for g in moe.gemms} == {8}


def test_the_pieces_are_the_time_inside_the_interval():
    """The max of lines the solver crosses is the very time layer_time_s gives at each inner point."""
    rng = random.Random(11)
    for _ in range(200):
        work, costs = random_work(rng), random_costs(rng)
        gg = rng.choice([0.0, 0.25, rng.random()])
        free = 1.0 - gg
        terms = SliceTerms(Affine(0.0, 1.0), Affine(free, -1.0), Affine(gg), Affine(0.0), True, True, gg > 0, False)
        pieces = layer_pieces(work, costs, terms)
        for cc in (free * rng.uniform(0.01, 0.99) for _ in range(5)):
            rates = SliceRates(cc, free - cc, gg)
            assert pieces.at(cc) == pytest.approx(layer_time_s(work, costs, rates), rel=1e-9)


def test_a_product_of_two_unknowns_is_refused():
    with pytest.raises(ValueError, match="times"):
        Affine(0.0, 1.0).times(Affine(1.0, 1.0))
