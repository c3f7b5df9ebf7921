"""Structured outputs: the bitmask against a plain reference, the sampler's masking of only the
constrained rows, xgrammar's compile errors, and the embedded model held to schemas, regexes,
choices and grammars, greedy and sampled."""
import json

import jsonschema
import pytest
import torch

from engine import LLM, ParamError, SamplingParams
from engine.sampling.sampler import Sampler
from engine.structured import GrammarError, apply_token_masks, create_grammar_backend
from engine.structured.mask import unpack_bitmask
from scheduler.sequence import Sequence, SequenceStatus, stop_check
from scheduler.structured_output import StructuredOutput
from json_schemas import PERSON_SCHEMA  # tests/ is on sys.path through tests/conftest.py

PERSON = StructuredOutput("json_schema", json.dumps(PERSON_SCHEMA))


class AllowSet:
    """A grammar state that allows a fixed set of tokens."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed
        self.accepted: list[int] = []

    def fill_mask(self, bitmask, row):
        bitmask[row] = 0
        for token in self.allowed:
            bitmask[row, token // 32] |= torch.tensor(1 << (token % 32), dtype=torch.int64).to(torch.int32)

    def accept(self, token_id):
        self.accepted.append(token_id)
        return token_id in self.allowed

    def is_terminated(self):
        return False


def test_unpack_bitmask_matches_a_bit_by_bit_reference(gen):
    vocab_size = 100  # not a multiple of 32: the last word is partly padding
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), generator=gen, dtype=torch.int64).to(torch.int32)
    expected = torch.tensor([[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab_size)]
                             for r in range(3)])
    assert torch.equal(unpack_bitmask(bitmask, vocab_size), expected)


def test_masks_touch_only_constrained_rows(gen):
    logits = torch.randn(3, 70, generator=gen)
    seqs = [Sequence(str(i), [1], SamplingParams()) for i in range(3)]
    seqs[1].grammar = AllowSet({5, 33, 69})
    masked = logits.clone()
    apply_token_masks(masked, seqs)
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [5, 33, 69]
    assert torch.equal(masked[1, [5, 33, 69]], logits[1, [5, 33, 69]])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_draws_only_allowed_tokens_even_before_min_tokens(gen, temperature):
    eos = 7
    seqs = [Sequence(str(i), [1], SamplingParams(temperature=temperature, seed=i, min_tokens=5),
                     eos_token_ids=(eos,)) for i in range(4)]
    for seq in seqs[::2]:
        seq.grammar = AllowSet({eos})  # a finished grammar allows only its end, min_tokens or not
    sampled = Sampler(64)(torch.randn(4, 64, generator=gen), seqs)
    assert sampled.token_ids[0] == sampled.token_ids[2] == eos
    assert eos not in sampled.token_ids[1::2]  # min_tokens holds back the unconstrained rows' EOS


def test_a_terminated_grammar_stops_the_sequence_despite_ignore_eos():
    seq = Sequence("s", [1], SamplingParams(ignore_eos=True, max_tokens=10))

    class Done(AllowSet):
        def is_terminated(self):
            return True
    seq.grammar = Done({2})
    seq.append_token(2)
    assert seq.grammar.accepted == [2]
    assert stop_check(seq, 100) == (SequenceStatus.FINISHED_STOPPED, None)


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m")


@pytest.fixture(scope="module")
def backend(llm):
    return create_grammar_backend(llm.tokenizer, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids)


@pytest.mark.parametrize("structured, message", [
    (StructuredOutput("json_schema", '{"type": "nonsense"}'), 'Unsupported type "nonsense"'),
    (StructuredOutput("json_schema", '{"type": "integer", "minimum": 5, "maximum": 3}'), "minimum greater"),
    (StructuredOutput("regex", "[a-"), "Unclosed"),
    (StructuredOutput("grammar", "root ::= undefined_rule"), "undefined_rule"),
])
def test_uncompilable_specs_raise_the_librarys_reason(backend, structured, message):
    with pytest.raises(GrammarError, match=message) as caught:
        backend.compile(structured)
    assert ".cc:" not in str(caught.value)  # the C++ source location is stripped


def test_a_bad_schema_is_a_param_error_naming_the_field(llm):
    bad = StructuredOutput("json_schema", '{"type": "nonsense"}', param="tools")
    with pytest.raises(ParamError) as caught:
        llm.engine.add_request("hi", SamplingParams(structured=bad))
    assert caught.value.param == "tools"


def chat_prompt(llm, text):
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_schema_outputs_validate_greedy_and_sampled(llm):
    prompt = chat_prompt(llm, "Describe a person as JSON with name, age, tags and address.")
    params = [SamplingParams(temperature=0.0, max_tokens=200, structured=PERSON)]
    params += [SamplingParams(temperature=1.0, seed=seed, max_tokens=200, structured=PERSON) for seed in range(6)]
    for output in llm.generate([prompt] * len(params), params):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), PERSON_SCHEMA)


def test_unconstrained_rows_keep_their_greedy_tokens_beside_constrained_ones(llm):
    prompt = chat_prompt(llm, "Name three colors.")
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    alone = llm.generate([prompt], greedy)[0].outputs[0].token_ids
    mixed = llm.generate([prompt] * 3, [greedy, SamplingParams(temperature=0.0, max_tokens=24, structured=PERSON),
                                        greedy])
    assert mixed[0].outputs[0].token_ids == alone == mixed[2].outputs[0].token_ids
    assert mixed[1].outputs[0].text.startswith('{"name": ')


@pytest.mark.parametrize("structured, check", [
    (StructuredOutput("regex", r"[0-9]{3}-[a-z]{2}"), lambda text: len(text) == 6 and text[3] == "-"),
    (StructuredOutput("choice", json.dumps(["yes", "no", "maybe"])), lambda text: text in ("yes", "no", "maybe")),
    (StructuredOutput("grammar", 'root ::= "hello " ("world" | "there")'),
     lambda text: text in ("hello world", "hello there")),
    (StructuredOutput("json_object"), lambda text: isinstance(json.loads(text), dict)),
])
def test_other_kinds_hold_the_output(llm, structured, check):
    prompt = chat_prompt(llm, "Answer the question: is the sky blue?")
    params = SamplingParams(temperature=0.0, max_tokens=120, min_tokens=2, structured=structured)
    completion = llm.generate([prompt], params)[0].outputs[0]
    assert completion.finish_reason == "stop", completion.text
    assert check(completion.text), completion.text
