"""Speculative decoding's parts without a model: the flag's parsing, n-gram lookup, the row-cost
fit and which drafts pay, and sequences' adaptive k."""
import pytest

from engine.config import EngineConfig
from engine.model_config import ConfigError
from engine.speculative.budget import Acceptance, ProposerCosts, StepCosts, drafts_that_pay
from engine.speculative_config import SpeculativeConfig
from engine.speculative.ngram import NgramIndex, ngram_drafts
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence


def test_the_flag_takes_vllms_json_and_names_what_is_wrong():
    config = EngineConfig.from_flat(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                                                       '"prompt_lookup_max": 5}').speculative_config
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == \
        ("ngram", 3, 2, 5)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_max == 4
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).adaptive
    assert not SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "adaptive": False}).adaptive
    for text, named in [('{"method": "ngram"}', "num_speculative_tokens is required"),
                        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
                        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
                        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, '
                         '"prompt_lookup_max": 3}', "prompt_lookup_min (5) must not exceed"),
                        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "unknown: model"),
                        ('{"method": "draft_model", "num_speculative_tokens": 2}', "draft_model needs a model"),
                        ('{"method": "draft_model", "model": "m", "num_speculative_tokens": 2, "quantization": "fp8"}',
                         "quantization must be one of"),
                        ('{"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}', "adaptive must be"),
                        ("ngram", "must be a JSON object")]:
        with pytest.raises(ConfigError, match="--speculative-config") as error:
            EngineConfig.from_flat(speculative_config=text)
        assert named in str(error.value)


@pytest.mark.parametrize("tokens, expected", [
    ([1, 2, 3, 4, 5, 1, 2, 3], [4, 5, 1]),  # the longest suffix, 3 tokens, recurs
    ([9, 2, 3, 7, 1, 2, 3, 8, 2, 3], [8, 2, 3]),  # the latest of two matches
    ([1, 2, 3, 4, 5, 6, 7, 3], []),  # one recurring token is below prompt_lookup_min
    ([5, 6, 5, 6, 5, 6], [5, 6]),  # a match overlapping the suffix: what follows it
    ([7], []),
])
def test_ngram_drafts_follow_the_latest_longest_match(tokens, expected):
    assert ngram_drafts(tokens, 3, 2, 4) == expected


def test_the_growing_index_answers_as_the_plain_search(gen):
    """A sequence's index, grown token by token as a decode grows it, on random strings with repeats."""
    import torch

    for _ in range(20):
        tokens = torch.randint(0, 4, (60,), generator=gen).tolist()
        index = NgramIndex(2, 4)
        for length in range(1, len(tokens) + 1, int(torch.randint(1, 4, (1,), generator=gen))):
            assert index.drafts(tokens[:length], 3) == ngram_drafts(tokens[:length], 3, 2, 4)


def test_step_costs_keep_each_row_counts_time_interpolate_and_never_extrapolate_cheaper():
    costs = StepCosts()
    for seconds in (0.300, 0.008, 0.012, 0.008):  # a first step's warm-up does not count
        costs.observe(4, seconds)
    assert not costs.known and costs.seconds(4) == pytest.approx(0.008)  # every step had 4 rows
    observe_warm(costs, 1, 0.005)
    observe_warm(costs, 5, 0.020)  # a kernel's row block ends at 4: the fifth row costs a second pass
    assert costs.known and costs.seconds(5) == pytest.approx(0.020) and costs.seconds(4) == pytest.approx(0.008)
    assert costs.seconds(2) == pytest.approx(0.006) and costs.seconds(7) == pytest.approx(0.044)  # 4 -> 5's slope
    observe_warm(costs, 2, 4.8)  # a rare count's one stalled step: fewer rows never cost more than more
    assert costs.seconds(2) == pytest.approx(0.008) and costs.seconds(5) == pytest.approx(0.020)


def observe_warm(costs: StepCosts, rows: int, seconds: float) -> None:
    """A step of `rows` rows after its first (warm-up) one."""
    costs.observe(rows, 10 * seconds)
    costs.observe(rows, seconds)


def steps(rows_seconds) -> StepCosts:
    costs = StepCosts()
    for rows, seconds in rows_seconds:
        observe_warm(costs, rows, seconds)
    return costs


def test_drafts_pay_where_rows_are_cheap_and_not_where_the_step_is_compute_bound():
    cheap = steps((rows, 0.010 + 0.0002 * rows) for rows in range(1, 12))  # weight-bound: a row is 2% of a step
    # 0.3^3 yields less per row's cost than the step already does
    assert drafts_that_pay([4, 4], [0.8, 0.3], 2, 2, cheap) == [4, 2]
    bound = steps((rows, 0.001 + 0.001 * rows) for rows in range(30, 40))  # a row costs as much as the fixed part
    assert drafts_that_pay([4, 4], [0.9, 0.9], 32, 32, bound) == [0, 0]
    unknown = StepCosts()
    assert drafts_that_pay([4, 4], [0.5, 0.9], 2, 2, unknown) == [0, 0]  # first a step without drafts
    observe_warm(unknown, 2, 0.010)
    assert drafts_that_pay([4, 4, 0], [0.5, 0.9, 1.0], 2, 2, unknown) == [0, 4, 0]  # then the likeliest's
    assert drafts_that_pay([4], [0.9], 32, 32, steps([(1, 0.005), (32, 0.040)])) == [0]  # past 32: 1 -> 32's slope
    assert drafts_that_pay([0, 2], [0.9, 0.9], 2, 2, cheap) == [0, 2]
    assert drafts_that_pay([4], [0.9], 40, 40, cheap) == [0]  # 40 rows never seen: measured without drafts first


def test_a_row_block_boundary_stops_the_drafts_before_it():
    """A step of 5 rows costing twice one of 4 (the kernels' row block): 3 drafts, not 4."""
    staircase = steps([(1, 0.005), (2, 0.0055), (3, 0.006), (4, 0.0065), (5, 0.012), (6, 0.0125)])
    assert drafts_that_pay([4], [0.8], 1, 1, staircase) == [3]


def test_a_proposer_whose_steps_cost_a_forward_drafts_only_where_its_steps_are_cheap():
    """A draft model's step costs about what the target's does at 32 sequences: drafting for all
    of them never pays, while one sequence's cheap draft steps still do."""
    forward = steps((rows, 0.004 + 0.0001 * rows) for rows in range(1, 200))
    draft = ProposerCosts()
    assert draft.step_s(8) == 0 and draft.catch_up_s(500) == 0  # an n-gram lookup: free
    draft.observe_step(32, 0.160)  # warm-up
    draft.observe_step(32, 0.016)
    assert drafts_that_pay([4] * 32, [0.7] * 32, 32, 32, forward, draft) == [0] * 32
    assert drafts_that_pay([4] * 32, [0.7] * 32, 32, 32, forward) != [0] * 32  # the forward alone would pay
    draft.observe_step(1, 0.005)
    draft.observe_step(1, 0.0005)
    assert drafts_that_pay([4], [0.8], 1, 1, forward, draft) == [4]
    assert draft.step_s(0) == 0 and draft.step_s(16) == pytest.approx(0.0005 + 15 / 31 * 0.0155)


def test_a_prompt_to_catch_up_on_is_paid_once_spread_over_the_steps_left():
    forward = steps((rows, 0.010 + 0.0001 * rows) for rows in range(1, 20))
    draft = ProposerCosts()
    draft.observe_step(1, 0.01)
    draft.observe_step(1, 0.001)
    draft.observe_catch_up(400, 0.4)  # 1 ms a prompt token
    assert draft.catch_up_s(500) == pytest.approx(0.5)
    assert drafts_that_pay([4], [0.8], 1, 1, forward, draft, entry_s=[0.5 / 150]) == [4]  # many steps left
    assert drafts_that_pay([4], [0.8], 1, 1, forward, draft, entry_s=[0.5 / 5]) == [0]  # a few


def test_acceptance_rates_follow_verifications_and_new_sequences_start_from_the_pool():
    seq, other = Sequence("s", [1, 2], SamplingParams()), Sequence("t", [1, 2], SamplingParams())
    acceptance = Acceptance()
    start = acceptance.rate(seq)
    acceptance.observe(seq, 4, 2)  # 2 of the 3 checked
    assert acceptance.rate(seq) > start
    acceptance.observe(seq, 4, 0)
    lowered = acceptance.rate(seq)
    assert lowered < start and acceptance.rate(other) == acceptance.pooled != start
    acceptance.observe(seq, 0, 0)  # no drafts: nothing learnt
    assert acceptance.rate(seq) == lowered
