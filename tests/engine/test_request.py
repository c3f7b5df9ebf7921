"""A user request and its samples: inputs checked once against the model, n sequences fanned
out, and outputs whose deltas add up to the whole. No model, no tokenizer: token ids only."""
import pytest

from engine.outputs import RequestMetrics
from engine.request import InputProcessor, Request
from scheduler.sampling_params import ParamError, SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig

VOCAB, CONTEXT = 100, 32
EOS = 3


def prepare(prompt, **params):
    return InputProcessor(None, VOCAB, CONTEXT).prepare(prompt, SamplingParams(**params))


@pytest.mark.parametrize("prompt, params, field", [
    ("text", {}, "prompt"),  # no tokenizer: token ids only
    ([], {}, "prompt"),
    ([1, VOCAB], {}, "prompt"),
    (list(range(CONTEXT)), {}, "prompt"),  # no room left to generate
    ([1, 2], {"max_tokens": CONTEXT}, "max_tokens"),
    ([1, 2], {"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
    ([1, 2], {"stop_token_ids": [VOCAB]}, "stop_token_ids"),
])
def test_inputs_are_refused_naming_the_field(prompt, params, field):
    with pytest.raises(ParamError) as error:
        prepare(prompt, **params)
    assert error.value.param == field


def test_max_tokens_defaults_to_the_room_left():
    assert prepare([1, 2, 3], max_tokens=None).params.max_tokens == CONTEXT - 3


def test_samples_fan_out_with_their_own_seeds_and_ids():
    request = Request.create("r", prepare([1, 2], n=3, seed=10, logprobs=1), RequestMetrics(0.0), (EOS,), None)
    assert [s.seq_id for s in request.sequences] == ["r#0", "r#1", "r#2"]
    assert [s.sampling_params.seed for s in request.sequences] == [10, 11, 12]
    assert all(s.sampling_params.n == 1 and s.request_id == "r" and s.logprobs == [] for s in request.sequences)
    single = Request.create("one", prepare([1, 2]), RequestMetrics(0.0), (EOS,), None)
    assert [s.seq_id for s in single.sequences] == ["one"] and single.sequences[0].logprobs is None


def test_deltas_add_up_to_the_whole_output():
    request = Request.create("r", prepare([1, 2], n=2, max_tokens=3), RequestMetrics(0.0), (EOS,), None)
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=CONTEXT))
    for seq in request.sequences:
        scheduler.add_sequence(seq)
    deltas = {0: [], 1: []}
    for tokens in ([5, 6], [EOS, 7], [8]):  # sample 0 ends on EOS, sample 1 on length
        plan = scheduler.schedule()
        scheduler.update(plan, tokens[:len(plan.scheduled)])
        output = request.take_output()
        for completion in output.outputs:
            deltas[completion.index] += completion.delta_token_ids
    assert output.finished and request.finished
    assert [c.finish_reason for c in output.outputs] == ["stop", "length"]
    assert deltas == {0: [5, EOS], 1: [6, 7, 8]}
    assert [c.token_ids for c in output.outputs] == [[5, EOS], [6, 7, 8]]
