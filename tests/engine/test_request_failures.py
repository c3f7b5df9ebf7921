"""A fault in one request's work fails that request alone: its sampling (the batch's is retried row
by row), the taking of its token, the making of its output; a failed forward fails the requests in
its batch and no other. The rest run to the tokens they would have had, and no block is left held."""
from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, SamplingParams
from engine.engine import RequestFailedError
from engine.request import Request
from engine.sampling import sampler as sampler_module
from engine.weights import EMBEDDED_MODEL
from scheduler.sequence import Sequence

POISON = "poison"
PROMPTS = {"a": [1, 2, 3, 4, 5], POISON: [6, 7, 8], "b": [9, 10, 11, 12]}
# a bias of 0 changes no token but makes every row go through the processing a fault is planted in
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={5: 0.0})


@pytest.fixture(scope="module")
def llm():
    with LLM(model=EMBEDDED_MODEL, load_format="dummy", dtype="float32", cpu_attention="off",
             max_num_seqs=4) as llm:
        yield llm


def run(llm: LLM, prompts: dict[str, list[int]]) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Every prompt to its end, step by step: the tokens of those that finished, and the failures."""
    engine = llm.engine
    for request_id, prompt in prompts.items():
        engine.add_request(prompt, PARAMS, request_id=request_id)
    finished, failures = {}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        failures.update((f.request_id, f.reason) for f in engine.take_failures())
    pool = engine.scheduler.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    return finished, failures


@pytest.fixture(scope="module")
def clean(llm) -> dict[str, list[int]]:
    finished, failures = run(llm, {k: v for k, v in PROMPTS.items() if k != POISON})
    assert not failures
    return finished


def poisoned(seqs) -> bool:
    return any(seq.request_id == POISON for seq in seqs)


def test_a_request_whose_sampling_raises_fails_alone(llm, clean, monkeypatch):
    bias = sampler_module._add_logit_bias

    def faulty_bias(logits, seqs):
        if poisoned(seqs):
            raise ValueError("a planted fault")
        bias(logits, seqs)

    monkeypatch.setattr(sampler_module, "_add_logit_bias", faulty_bias)
    finished, failures = run(llm, PROMPTS)
    assert finished == clean
    assert list(failures) == [POISON] and "sampling failed" in failures[POISON]


def test_a_request_whose_token_cannot_be_taken_fails_alone(llm, clean, monkeypatch):
    append = Sequence.append_token

    def faulty_append(seq, token_id, logprob=None):
        if seq.request_id == POISON and seq.num_output_tokens >= 2:
            raise ValueError("a planted fault")
        append(seq, token_id, logprob)

    monkeypatch.setattr(Sequence, "append_token", faulty_append)
    finished, failures = run(llm, PROMPTS)
    assert finished == clean
    assert list(failures) == [POISON] and "taking its token failed" in failures[POISON]


def test_a_request_whose_output_cannot_be_made_fails_alone(llm, clean, monkeypatch):
    take = Request.take_output

    def faulty_take(request):
        if request.request_id == POISON:
            raise ValueError("a planted fault")
        return take(request)

    monkeypatch.setattr(Request, "take_output", faulty_take)
    finished, failures = run(llm, PROMPTS)
    assert finished == clean
    assert list(failures) == [POISON] and "making its output failed" in failures[POISON]


def test_a_failed_forward_fails_its_batch_and_no_other_request(llm, clean, monkeypatch):
    """With one sequence at a time, the forward that fails holds the poisoned request alone."""
    runner, scheduler = llm.engine.runner, llm.engine.scheduler
    execute = runner.execute

    def faulty_execute(plan):
        if poisoned(s.sequence for s in plan.scheduled):
            raise RuntimeError("a planted fault")
        return execute(plan)

    monkeypatch.setattr(runner, "execute", faulty_execute)
    monkeypatch.setattr(scheduler, "config", dataclasses.replace(scheduler.config, max_num_seqs=1))
    finished, failures = run(llm, PROMPTS)
    assert finished == clean
    assert list(failures) == [POISON] and "the forward of its batch failed" in failures[POISON]


def test_generate_raises_for_a_failed_request(llm, monkeypatch):
    def faulty_bias(logits, seqs):
        raise ValueError("a planted fault")

    monkeypatch.setattr(sampler_module, "_add_logit_bias", faulty_bias)
    with pytest.raises(RequestFailedError, match="sampling failed"):
        llm.generate([[1, 2, 3]], PARAMS)
    assert not llm.engine.has_unfinished_requests()
