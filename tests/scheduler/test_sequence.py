"""A sequence's end is decided in one place (`stop_check`), through the scheduler's update:
EOS, stop token ids, length, stop strings. No torch, no tokenizer: a text stream that matches
a stop string on a chosen token stands in for the detokenizer (scheduler.sequence.TextStream)."""
import pytest

from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sequence import Sequence, SequenceStatus, stop_check

EOS = 2
STOP_TOKEN = 9  # the token on which the stream below "sees" its stop string


class StopOnToken:
    """Spells token t as "<t>" and matches the stop string "<9>" when token 9 arrives."""

    def __init__(self) -> None:
        self.stop_string = None
        self.added: list[int] = []
        self.num_finish_calls = 0

    def add(self, token_id: int) -> str:
        self.added.append(token_id)
        if token_id == STOP_TOKEN:
            self.stop_string = f"<{token_id}>"
            return ""
        return f"<{token_id}>"

    def finish(self) -> str:
        self.num_finish_calls += 1
        return ""


def make_sequence(seq_id="s", num_prompt_tokens=4, text=None, logprobs=None, **params):
    params.setdefault("max_tokens", 8)
    return Sequence(seq_id, list(range(100, 100 + num_prompt_tokens)), SamplingParams(**params),
                    eos_token_ids=(EOS,), text=text, logprobs=logprobs)


def run_tokens(seq, tokens, max_model_len=64, logprobs=None):
    sched = Scheduler(SchedulerConfig(num_blocks=32, block_size=4, max_model_len=max_model_len))
    sched.add_sequence(seq)
    for i, token in enumerate(tokens):
        plan = sched.schedule()
        sched.update(plan, [token], None if logprobs is None else [logprobs[i]])
        if seq.finished:
            break
    return sched


def test_a_stop_string_finishes_through_update_and_frees_blocks():
    stream = StopOnToken()
    seq = make_sequence(text=stream)
    sched = run_tokens(seq, [5, 6, STOP_TOKEN, 7])
    assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.stop_reason == "<9>"
    assert stream.added == [5, 6, STOP_TOKEN]  # fed every token, nothing after the end
    assert sched.block_pool.num_free_blocks == sched.config.num_blocks


@pytest.mark.parametrize("tokens, status, reason", [
    ([EOS], SequenceStatus.FINISHED_STOPPED, None),  # EOS wins over the stop string below
    ([STOP_TOKEN], SequenceStatus.FINISHED_STOPPED, STOP_TOKEN),  # a stop token id too
    ([5, 5, 5], SequenceStatus.FINISHED_LENGTH, None),  # max_tokens before any stop
])
def test_stop_check_order(tokens, status, reason):
    seq = make_sequence(text=StopOnToken(), stop_token_ids=[STOP_TOKEN], max_tokens=3)
    for token in tokens:
        seq.append_token(token)
    assert stop_check(seq, max_model_len=64) == (status, reason)


def test_length_beats_a_stop_string_on_the_same_token():
    seq = make_sequence(text=StopOnToken(), max_tokens=1)
    seq.append_token(STOP_TOKEN)
    assert stop_check(seq, max_model_len=64) == (SequenceStatus.FINISHED_LENGTH, None)


def test_the_text_is_flushed_once_when_another_reason_ends_it():
    stream = StopOnToken()
    seq = make_sequence(text=stream, max_tokens=2)
    run_tokens(seq, [5, 6])
    assert seq.status is SequenceStatus.FINISHED_LENGTH and stream.num_finish_calls == 1


def test_min_tokens_hold_back_eos():
    seq = make_sequence(min_tokens=2)
    seq.append_token(EOS)
    assert stop_check(seq, max_model_len=64) is None
    seq.append_token(EOS)
    assert stop_check(seq, max_model_len=64) == (SequenceStatus.FINISHED_STOPPED, None)


def test_logprob_entries_follow_their_rows():
    seq = make_sequence(logprobs=[], max_tokens=3)
    run_tokens(seq, [5, 6, 7], logprobs=["a", "b", "c"])
    assert seq.output_token_ids == [5, 6, 7] and seq.logprobs == ["a", "b", "c"]


def test_an_aborted_sequence_takes_no_token():
    seq = make_sequence(text=StopOnToken())
    sched = Scheduler(SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64))
    sched.add_sequence(seq)
    plan = sched.schedule()
    sched.abort_sequences([seq.seq_id])
    assert sched.update(plan, [5]) == []
    assert seq.output_token_ids == [] and seq.text.added == []


@pytest.mark.parametrize("params, eos_in_text", [({}, False), ({"ignore_eos": True}, True),
                                                  ({"min_tokens": 3}, True)])
def test_an_eos_that_ends_the_sequence_is_not_fed_to_its_text(params, eos_in_text):
    text = StopOnToken()
    seq = make_sequence(text=text, **params)
    seq.append_token(5)
    seq.append_token(EOS)
    assert text.added == ([5, EOS] if eos_in_text else [5])
