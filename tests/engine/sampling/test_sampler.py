"""The sampler against plain references: argmax, per-row Python penalties, softmax frequencies."""
from __future__ import annotations

import itertools

import pytest
import torch

from engine.sampling import Sampler
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence

VOCAB = 64
_ids = itertools.count()


def make_request(prompt: list[int] | None = None, output: list[int] | None = None,
                 eos: tuple[int, ...] = (), **params) -> Sequence:
    return Sequence(seq_id=f"r{next(_ids)}", prompt_token_ids=list(prompt or [1, 2, 3]),
                   sampling_params=SamplingParams(**params), eos_token_ids=eos,
                   output_token_ids=list(output or []))


def random_logits(batch: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def frequencies(token_ids: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(token_ids), minlength=vocab).float() / len(token_ids)


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0) -> torch.Tensor:
    """Plain reference for one row: top_k, then top_p, then min_p, renormalized."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k else order
    mass = sum(probs[t].item() for t in kept)
    by_top_p, mass_before = [], 0.0
    for t in kept:
        if mass_before >= top_p:
            break
        by_top_p.append(t)
        mass_before += probs[t].item() / mass
    best = probs[by_top_p[0]].item()
    allowed = [t for t in by_top_p if probs[t].item() >= min_p * best]
    out = torch.zeros_like(probs)
    out[allowed] = probs[allowed]
    return out / out.sum()


def reference_process(logits: torch.Tensor, requests: list[Sequence]) -> torch.Tensor:
    """Per-row Python: min_tokens masking, logit_bias, repetition, frequency and presence penalties."""
    out = logits.float().clone()
    for i, request in enumerate(requests):
        p = request.sampling_params
        row = out[i].tolist()
        if len(request.output_token_ids) < p.min_tokens:
            for t in list(p.stop_token_ids) + ([] if p.ignore_eos else list(request.eos_token_ids)):
                row[t] = float("-inf")
        for t, bias in (p.logit_bias or {}).items():
            row[t] += bias
        for t in set(request.prompt_token_ids) | set(request.output_token_ids):
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        for t in set(request.output_token_ids):
            count = request.output_token_ids.count(t)
            row[t] -= p.frequency_penalty * count + p.presence_penalty
        out[i] = torch.tensor(row)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = random_logits(6).to(dtype)
    requests = [make_request(temperature=0.0) for _ in range(6)]
    out = Sampler(VOCAB)(logits, requests)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6 and out.top_logprobs == [None] * 6


def test_top_k_one_is_greedy():
    logits = random_logits(8, seed=1)
    requests = [make_request(temperature=1.3, top_k=1, seed=s) for s in range(4)]
    requests += [make_request(temperature=1.3, top_k=1, top_p=0.9) for _ in range(4)]
    assert Sampler(VOCAB, seed=0)(logits, requests).token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_takes_top_token():
    logits = random_logits(8, seed=2)
    requests = [make_request(temperature=2.0, top_p=1e-6) for _ in range(8)]
    sampler = Sampler(VOCAB, seed=0)
    for _ in range(20):
        assert sampler(logits, requests).token_ids == logits.argmax(dim=-1).tolist()


def test_min_p_one_takes_top_token():
    logits = random_logits(8, seed=3)
    requests = [make_request(temperature=1.0, min_p=1.0) for _ in range(8)]
    assert Sampler(VOCAB, seed=0)(logits, requests).token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("filters", [
    {"top_k": 3},
    {"top_p": 0.6},
    {"min_p": 0.15},
    {"top_k": 5, "top_p": 0.7},
    {"top_k": 6, "top_p": 0.9, "min_p": 0.1},
])
def test_filters_never_emit_filtered_tokens_and_keep_proportions(filters):
    vocab, draws, temperature = 16, 20000, 1.5
    row = random_logits(1, vocab, seed=4, scale=1.5)[0]
    expected = filtered_probs(row, temperature, **filters).float()
    out = Sampler(vocab, seed=5)(row.expand(draws, vocab),
                                 [make_request(temperature=temperature, **filters)] * draws)
    assert set(out.token_ids) <= set(torch.nonzero(expected).flatten().tolist())
    torch.testing.assert_close(frequencies(out.token_ids, vocab), expected, atol=0.015, rtol=0)


def test_top_k_rows_with_different_k_in_one_batch():
    vocab = 32
    logits = random_logits(4, vocab, seed=6, scale=0.5).repeat_interleave(500, dim=0)
    ks = [2, 0, 7, 31]
    requests = [make_request(temperature=1.0, top_k=k) for k in ks for _ in range(500)]
    out = Sampler(vocab, seed=7)(logits, requests)
    for j, k in enumerate(ks):
        allowed = set(logits[j * 500].topk(k or vocab).indices.tolist())
        assert set(out.token_ids[j * 500:(j + 1) * 500]) <= allowed


def test_unseeded_frequencies_match_softmax():
    vocab, draws, temperature = 6, 30000, 0.7
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.8, -2.0])
    out = Sampler(vocab, seed=11)(row.expand(draws, vocab), [make_request(temperature=temperature)] * draws)
    torch.testing.assert_close(frequencies(out.token_ids, vocab), torch.softmax(row / temperature, dim=-1),
                               atol=0.01, rtol=0)


def test_seeded_frequencies_match_softmax():
    """Across seeds and steps, seeded draws still follow softmax(logits / T)."""
    vocab, draws, temperature = 6, 20000, 1.2
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.8, -2.0])
    requests = [make_request(temperature=temperature, seed=s, output=[0] * (s % 7)) for s in range(draws)]
    out = Sampler(vocab)(row.expand(draws, vocab), requests)
    torch.testing.assert_close(frequencies(out.token_ids, vocab), torch.softmax(row / temperature, dim=-1),
                               atol=0.01, rtol=0)


def _logits_for(tag: int, step: int, vocab: int = VOCAB) -> torch.Tensor:
    """Logits that depend only on (request, step), whichever batch the request sits in."""
    return random_logits(1, vocab, seed=1000 * tag + step, scale=1.0)[0]


def _run_seeded(batch_layouts: list[list[int]], sampler_seed: int, steps: int) -> list[list[int]]:
    """Generate `steps` tokens for each layout's requests; -1 marks the seeded request under test.

    Returns the tokens the seeded request drew, one list per layout.
    """
    results = []
    for layout in batch_layouts:
        sampler = Sampler(VOCAB, seed=sampler_seed)
        requests = {}
        for tag in layout:
            if tag == -1:
                requests[tag] = make_request(temperature=0.9, top_p=0.95, top_k=40, seed=1234)
            elif tag % 2:
                requests[tag] = make_request(temperature=1.0, seed=tag)
            else:
                requests[tag] = make_request(temperature=0.8 + 0.1 * tag)
        for step in range(steps):
            logits = torch.stack([_logits_for(tag, step) for tag in layout])
            out = sampler(logits, [requests[tag] for tag in layout])
            for tag, token in zip(layout, out.token_ids):
                requests[tag].output_token_ids.append(token)
        results.append(requests[-1].output_token_ids)
    return results


def test_seeded_request_is_independent_of_batch_and_row():
    layouts = [[-1], [-1, 1, 2], [3, 2, -1], [4, 5, -1, 6, 7, 8], [9, -1]]
    alone, *batched = _run_seeded(layouts, sampler_seed=0, steps=40)
    assert len(set(alone)) > 5  # actually sampled, not near-greedy
    for tokens in batched:
        assert tokens == alone
    assert _run_seeded([[2, -1]], sampler_seed=99, steps=40)[0] == alone


def test_seeded_request_resumes_identically_after_preemption():
    first = make_request(temperature=1.0, seed=77)
    sampler = Sampler(VOCAB)
    for step in range(30):
        first.output_token_ids.append(sampler(_logits_for(0, step)[None], [first]).token_ids[0])
    # a recomputed request keeps its output; a fresh sampler continues from step 15
    resumed = make_request(temperature=1.0, seed=77, output=first.output_token_ids[:15])
    sampler = Sampler(VOCAB, seed=123)
    for step in range(15, 30):
        resumed.output_token_ids.append(sampler(_logits_for(0, step)[None], [resumed]).token_ids[0])
    assert resumed.output_token_ids == first.output_token_ids


def test_different_seeds_differ():
    logits = torch.zeros(2, 1000)
    requests = [make_request(temperature=1.0, seed=1), make_request(temperature=1.0, seed=2)]
    sampler = Sampler(1000)
    draws = []
    for _ in range(10):
        draws.append(sampler(logits, requests).token_ids)
        for request, token in zip(requests, draws[-1]):
            request.output_token_ids.append(token)
    assert sum(a != b for a, b in draws) >= 9
    assert len({a for a, _ in draws}) >= 9  # a seeded request also varies from step to step


def test_penalties_match_python_reference():
    gen = torch.Generator().manual_seed(8)
    batch, vocab = 6, 30
    logits = torch.randn(batch, vocab, generator=gen) * 4

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    requests = [
        make_request(prompt=tokens(10), output=tokens(12), repetition_penalty=1.3),
        make_request(prompt=tokens(5), output=tokens(20), presence_penalty=0.7, frequency_penalty=0.4),
        make_request(prompt=tokens(8), output=tokens(15), repetition_penalty=0.8, presence_penalty=-0.5,
                     frequency_penalty=1.5),
        make_request(prompt=tokens(3), output=[], repetition_penalty=1.7, frequency_penalty=2.0),
        make_request(prompt=tokens(7), output=tokens(4)),
        make_request(prompt=tokens(4), output=tokens(9), frequency_penalty=-1.0,
                     logit_bias={3: 5.0, 11: -20.0}),
    ]
    sampler = Sampler(vocab)
    expected = reference_process(logits, requests)
    torch.testing.assert_close(sampler.process(logits, requests), expected)
    greedy = [make_request(prompt=r.prompt_token_ids, output=r.output_token_ids, temperature=0.0,
                           **{k: getattr(r.sampling_params, k) for k in
                              ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")})
              for r in requests]
    assert sampler(logits, greedy).token_ids == expected.argmax(dim=-1).tolist()


def test_processing_leaves_input_logits_untouched():
    logits = random_logits(2)
    before = logits.clone()
    requests = [make_request(output=[5, 5], frequency_penalty=1.0, logit_bias={1: 10.0}, seed=3),
                make_request(output=[1], min_tokens=4, eos=(2,), repetition_penalty=2.0, temperature=0.0)]
    Sampler(VOCAB)(logits, requests)
    assert torch.equal(logits, before)


def test_logit_bias_forces_a_token():
    logits = random_logits(4, seed=9)
    requests = [make_request(temperature=1.0, logit_bias={17: 100.0}, seed=s) for s in range(2)]
    requests += [make_request(temperature=0.0, logit_bias={42: 100.0}), make_request(logit_bias={5: 100.0})]
    assert Sampler(VOCAB, seed=0)(logits, requests).token_ids == [17, 17, 42, 5]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(temperature):
    eos, stop = 5, 9
    logits = torch.zeros(1, VOCAB)
    logits[0, eos], logits[0, stop] = 50.0, 40.0
    sampler = Sampler(VOCAB, seed=0)
    for num_output in range(3):
        request = make_request(output=[1] * num_output, eos=(eos,), min_tokens=3, stop_token_ids=(stop,),
                               temperature=temperature)
        assert sampler(logits, [request]).token_ids[0] not in (eos, stop)
        processed = sampler.process(logits, [request])[0]
        assert processed[eos] == float("-inf") and processed[stop] == float("-inf")
    done = make_request(output=[1] * 3, eos=(eos,), min_tokens=3, stop_token_ids=(stop,), temperature=temperature)
    assert sampler(logits, [done]).token_ids == [eos]


def test_ignore_eos_leaves_eos_unmasked_under_min_tokens():
    eos, stop = 5, 9
    logits = torch.zeros(1, VOCAB)
    logits[0, stop], logits[0, eos] = 50.0, 40.0
    request = make_request(eos=(eos,), min_tokens=3, stop_token_ids=(stop,), ignore_eos=True, temperature=0.0)
    assert Sampler(VOCAB)(logits, [request]).token_ids == [eos]


def test_logprobs_come_from_raw_logits():
    logits = random_logits(4, seed=10).to(torch.bfloat16)
    requests = [
        make_request(temperature=0.7, logprobs=5, frequency_penalty=1.0, output=[1, 2, 2], seed=1),
        make_request(temperature=0.0, logprobs=0, logit_bias={3: 50.0}),
        make_request(temperature=1.0, logprobs=20, repetition_penalty=1.5),
        make_request(temperature=1.0),
    ]
    out = Sampler(VOCAB, seed=0)(logits, requests)
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out.token_ids[1] == 3
    for i, request in enumerate(requests[:3]):
        num_top = request.sampling_params.logprobs
        assert out.logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
        top = out.top_logprobs[i]
        assert len(top) == num_top
        assert [t for t, _ in top] == raw[i].topk(num_top).indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), raw[i].topk(num_top).values)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert out.logprobs[3] is None and out.top_logprobs[3] is None


def test_mixed_batch_of_greedy_and_sampled_rows():
    logits = random_logits(200, seed=12)
    requests = [make_request(temperature=0.0) if i % 2 else make_request(temperature=1.0, top_k=2,
                                                                            seed=i if i % 4 else None)
                for i in range(200)]
    out = Sampler(VOCAB, seed=0)(logits, requests)
    top2 = logits.topk(2, dim=-1).indices
    for i, token in enumerate(out.token_ids):
        if i % 2:
            assert token == top2[i, 0].item()
        else:
            assert token in top2[i].tolist()
    assert any(out.token_ids[i] == top2[i, 1].item() for i in range(0, 200, 2))


def test_padding_columns_past_vocab_are_never_sampled():
    logits = torch.zeros(3, VOCAB + 8)
    logits[:, VOCAB:] = 100.0
    requests = [make_request(temperature=0.0), make_request(temperature=1.0), make_request(temperature=1.0, seed=1)]
    assert all(t < VOCAB for t in Sampler(VOCAB, seed=0)(logits, requests).token_ids)
