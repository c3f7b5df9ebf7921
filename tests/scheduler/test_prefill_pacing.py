"""Prefill pacing (scheduler/prefill_pacing.py): the costs it learns from measured forwards, the
cap it puts on an iteration's prefill tokens while sequences decode, and the scheduler using it."""
import pytest

from scheduler.prefill_pacing import PrefillPacer
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerConfigError
from scheduler.sequence import Sequence


def test_cap_fits_prefill_in_the_slowdown_left_by_the_decodes():
    pacer = PrefillPacer(max_slowdown=3.0, min_tokens=4)
    assert pacer.max_prefill_tokens(8) is None  # nothing measured yet
    pacer.observe(num_decodes=0, num_prefill_tokens=200, seconds=1.0)  # 5 ms a prompt token
    pacer.observe(num_decodes=8, num_prefill_tokens=0, seconds=0.1)
    assert pacer.max_prefill_tokens(0) is None  # nothing decodes: the token budget alone
    assert pacer.max_prefill_tokens(8) == 40  # (3 - 1) * 100 ms of 5 ms tokens
    pacer.observe(num_decodes=8, num_prefill_tokens=40, seconds=0.1 + 40 * 0.02)  # a deeper prefix: 20 ms a token
    assert pacer.prefill_token_s == pytest.approx(0.005 + 0.3 * (0.02 - 0.005))
    for _ in range(30):  # the decode steps got much cheaper
        pacer.observe(num_decodes=8, num_prefill_tokens=0, seconds=0.0001)
    assert pacer.max_prefill_tokens(8) == 4  # never below the floor: the prompt moves on
    assert PrefillPacer(max_slowdown=0).max_prefill_tokens(8) is None


def test_a_stall_bound_in_seconds_holds_however_fast_a_decode_step_is():
    pacer = PrefillPacer(max_slowdown=0, min_tokens=4, max_stall_s=0.2)
    pacer.observe(num_decodes=0, num_prefill_tokens=200, seconds=1.0)  # 5 ms a prompt token
    pacer.observe(num_decodes=8, num_prefill_tokens=0, seconds=0.01)
    assert pacer.max_prefill_tokens(8) == 40  # 200 ms of 5 ms tokens, whatever the 10 ms decode step
    both = PrefillPacer(max_slowdown=3.0, min_tokens=4, max_stall_s=0.2)
    both.observe(num_decodes=0, num_prefill_tokens=200, seconds=1.0)
    both.observe(num_decodes=8, num_prefill_tokens=0, seconds=0.01)
    assert both.max_prefill_tokens(8) == 4  # the smaller allowance, (3 - 1) * 10 ms, and the floor
    with pytest.raises(SchedulerConfigError, match="max_prefill_stall_s"):
        SchedulerConfig(num_blocks=64, max_prefill_stall_s=-1.0)


def test_scheduler_caps_chunks_while_sequences_decode():
    config = SchedulerConfig(num_blocks=64, block_size=4, max_model_len=200, max_num_batched_tokens=128,
                             max_prefill_slowdown=2.0, enable_prefix_caching=False)
    sched = Scheduler(config)
    running = Sequence("running", list(range(10)), SamplingParams(max_tokens=50))
    sched.add_sequence(running)
    plan = sched.schedule()
    sched.observe_step(plan, 10 * 0.001)  # 1 ms a prompt token
    sched.update(plan, [7])
    plan = sched.schedule()
    sched.observe_step(plan, 0.02)  # a decode step: 20 ms
    sched.update(plan, [7])
    sched.add_sequence(Sequence("long", list(range(100, 250)), SamplingParams(max_tokens=1)))
    plan = sched.schedule()
    assert [s.num_new_tokens for s in plan.prefills] == [20]  # (2 - 1) * 20 ms of 1 ms tokens
    with pytest.raises(SchedulerConfigError, match="max_prefill_slowdown"):
        SchedulerConfig(num_blocks=64, max_prefill_slowdown=0.5)
