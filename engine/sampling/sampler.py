"""Turn a batch of next-token logits into tokens, one row per sequence.

Processing follows vLLM V1's order: min_tokens masking and logit_bias, then the repetition,
frequency and presence penalties, then a structured output's grammar mask. Greedy rows take the argmax of those logits; sampled rows are
divided by their temperature, filtered by top_k, top_p and min_p (in that order) and drawn by an
exponential race, argmax(logits - log(noise)) with noise ~ Exp(1), which is a draw from
softmax(logits) without a softmax or a cumulative sum.

A seeded row's noise comes from a generator seeded with a mix of (seed, tokens generated so far),
so its draw does not depend on the rest of the batch, its row, or preemption. Unseeded rows share
the sampler's generator.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine.outputs import TokenLogprob
from engine.structured import apply_token_masks
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence

logger = logging.getLogger(__name__)
_NEG_INF = float("-inf")

# splitmix64 (Steele, Lea and Flood 2014): an odd "golden gamma" increment and two mixing multipliers
_UINT64_MASK = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX_MULTIPLIER_1 = 0xBF58476D1CE4E5B9
_MIX_MULTIPLIER_2 = 0x94D049BB133111EB


@dataclass
class SamplerOutput:
    """What one sampling step chose, one entry per batch row."""

    token_ids: list[int]
    logprobs: list[float | None]  # the sampled token's logprob; None where params.logprobs is None
    top_logprobs: list[list[tuple[int, float]] | None]  # params.logprobs alternatives, highest first
    # rows whose sampling raised, with why (their token ids are placeholders): the engine fails
    # those requests alone
    failed_rows: dict[int, str] = field(default_factory=dict)

    def token_logprobs(self) -> list[TokenLogprob | None]:
        """Each row's logprobs entry for the output, None where they were not asked for."""
        return [None if logprob is None else TokenLogprob(token_id, logprob, top or [])
                for token_id, logprob, top in zip(self.token_ids, self.logprobs, self.top_logprobs)]


class Sampler:
    """Samples one token per row from [batch, vocab] logits, vectorized over the batch."""

    def __init__(self, vocab_size: int, seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.seed = seed  # for the generator the unseeded sequences share; None: seeded from the OS
        self._shared_generators: dict[torch.device, torch.Generator] = {}
        self._seeded_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """Sample a token for each row; row i of `logits` belongs to `seqs[i]`.

        `seqs[i].output_token_ids` must hold the tokens generated before this step. Where the
        batch's sampling raises (one request's grammar, bias or penalties), the rows are sampled one
        by one and those that raise again come back in `failed_rows`: one request's fault is its own.
        """
        try:
            return self._sample_batch(logits, seqs)
        except Exception:  # noqa: BLE001 (whatever one row's processing raised: find the row)
            logger.exception("sampling a batch of %d rows failed; sampling them one by one", len(seqs))
            return self._sample_rows_alone(logits, seqs)

    def _sample_rows_alone(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        merged = SamplerOutput([], [], [])
        for row, seq in enumerate(seqs):
            try:
                one = self._sample_batch(logits[row:row + 1], [seq])
            except Exception as exc:  # noqa: BLE001
                merged.failed_rows[row] = f"sampling failed: {exc!r}"
                one = SamplerOutput([0], [None], [None])
            merged.token_ids += one.token_ids
            merged.logprobs += one.logprobs
            merged.top_logprobs += one.top_logprobs
        return merged

    def _sample_batch(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        logits = self._vocab_logits(logits, seqs)
        params = [seq.sampling_params for seq in seqs]
        if all(p.greedy for p in params) and not needs_processing(seqs):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample(self.process(logits, seqs), params, seqs)
        return _output(logits, token_ids, params)

    def process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """fp32 logits after min_tokens masking, logit_bias, penalties and grammar masks: what greedy
        rows argmax.

        Leaves `logits` untouched; returns a new [batch, vocab] tensor.
        """
        logits = self._vocab_logits(logits, seqs).to(torch.float32, copy=True)
        _mask_stop_tokens_before_min_tokens(logits, seqs)
        _add_logit_bias(logits, seqs)
        logits = _apply_penalties(logits, seqs)
        apply_token_masks(logits, seqs)
        return logits

    def _vocab_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != len(seqs) or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not cover {len(seqs)} sequences "
                             f"over a vocabulary of {self.vocab_size}")
        return logits[:, : self.vocab_size]  # columns past vocab_size are lm_head padding

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                seqs: list[Sequence]) -> torch.Tensor:
        token_ids = logits.argmax(dim=-1)  # [batch]; final for greedy rows
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return token_ids
        device = logits.device
        row_index = torch.tensor(rows, device=device)
        sampled_params = [params[i] for i in rows]
        temperature = torch.tensor([p.temperature for p in sampled_params], device=device)
        scaled = _filter(logits[row_index] / temperature[:, None], sampled_params)  # [num_sampled, vocab]
        noise = self._exponential_noise([seqs[i] for i in rows], scaled.shape[1], device)
        token_ids[row_index] = (scaled - noise.log()).argmax(dim=-1)
        return token_ids

    def _exponential_noise(self, seqs: list[Sequence], vocab_size: int,
                           device: torch.device) -> torch.Tensor:
        """Exp(1) noise, [len(seqs), vocab_size], clamped away from 0 so that log() stays finite."""
        def draw(num_rows: int, generator: torch.Generator) -> torch.Tensor:
            return torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device).exponential_(
                generator=generator)

        unseeded = [i for i, r in enumerate(seqs) if r.sampling_params.seed is None]
        if len(unseeded) == len(seqs):
            noise = draw(len(seqs), self._shared_generator(device))
        else:
            noise = torch.empty(len(seqs), vocab_size, dtype=torch.float32, device=device)
            if unseeded:
                noise[unseeded] = draw(len(unseeded), self._shared_generator(device))
        generator = self._seeded_generator(device)
        for i, seq in enumerate(seqs):
            if seq.sampling_params.seed is not None:
                generator.manual_seed(_step_seed(seq.sampling_params.seed, seq.num_output_tokens))
                # drawn on its own so the stream cannot depend on the row's place in `noise`
                noise[i] = draw(1, generator)[0]
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared_generators:
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()
            else:
                generator.manual_seed(self.seed)
            self._shared_generators[device] = generator
        return self._shared_generators[device]

    def _seeded_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._seeded_generators:
            self._seeded_generators[device] = torch.Generator(device=device)
        return self._seeded_generators[device]


def needs_processing(seqs: list[Sequence]) -> bool:
    """Whether any row's logits change with its sequence's state (min_tokens, penalties, bias, grammar)."""
    return any(_min_tokens_active(r) or _uses_penalties(r.sampling_params) or r.sampling_params.logit_bias
               or r.grammar is not None for r in seqs)


def _uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _min_tokens_active(seq: Sequence) -> bool:
    return seq.num_output_tokens < seq.sampling_params.min_tokens


def _mask_stop_tokens_before_min_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    vocab_size = logits.shape[1]
    for i, seq in enumerate(seqs):
        # a grammar decides when a structured output ends: it may allow nothing but the end token
        if not _min_tokens_active(seq) or seq.grammar is not None:
            continue
        params = seq.sampling_params
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(seq.eos_token_ids)
        for token in stop_ids:
            if token < vocab_size:  # an id past the vocabulary can never be sampled anyway
                rows.append(i)
                cols.append(token)
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = _NEG_INF


def _add_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    biases: list[float] = []
    for i, seq in enumerate(seqs):
        for token, bias in (seq.sampling_params.logit_bias or {}).items():
            rows.append(i)
            cols.append(token)
            biases.append(bias)
    if rows:
        device = logits.device
        logits.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                          torch.tensor(biases, device=device), accumulate=True)


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    params = [r.sampling_params for r in seqs]
    use_repetition = any(p.repetition_penalty != 1.0 for p in params)
    use_additive = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
    if not (use_repetition or use_additive):
        return logits
    device = logits.device
    output_counts = _token_counts([r.output_token_ids for r in seqs], logits.shape[1], device)
    if use_repetition:
        seen = (output_counts > 0) | (_token_counts([r.prompt_token_ids for r in seqs],
                                                    logits.shape[1], device) > 0)
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if use_additive:
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        logits = logits - frequency * output_counts - presence * (output_counts > 0)
    return logits


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each list: [len(token_lists), vocab_size] fp32."""
    longest = max((len(tokens) for tokens in token_lists), default=0)
    # one extra column takes the padding ids and is dropped
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    if longest:
        padded = [tokens + [vocab_size] * (longest - len(tokens)) for tokens in token_lists]
        ids = torch.tensor(padded, device=device)  # [len(token_lists), longest]
        counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab_size]


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Set to -inf what top_k, top_p and min_p rule out. logits: [rows, vocab], temperature-scaled."""
    vocab_size = logits.shape[1]
    device = logits.device
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    if any(p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, torch.tensor(top_k, device=device),
                              # inf for rows without top_p: fp rounding in the cumsum must not drop their tail
                              torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params],
                                           device=device))
    elif any(k < vocab_size for k in top_k):
        logits = _top_k(logits, top_k)
    if any(p.min_p > 0.0 for p in params):
        # prob >= min_p * max_prob  <=>  logit >= max_logit + log(min_p); log(0) = -inf keeps all
        min_p = torch.tensor([p.min_p for p in params], device=device)
        threshold = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]
        logits = logits.masked_fill(logits < threshold, _NEG_INF)
    return logits


def _top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """top_k alone: a partial topk up to the largest k in the batch, no full-vocabulary sort."""
    device = logits.device
    vocab_size = logits.shape[1]
    k = torch.tensor(top_k, device=device)
    max_k = max(row_k for row_k in top_k if row_k < vocab_size)
    largest = logits.topk(max_k, dim=-1).values  # [rows, max_k], descending
    enabled = k < vocab_size
    kth_largest = largest.gather(1, (k.clamp(max=max_k) - 1)[:, None])  # [rows, 1]
    kth_largest.masked_fill_(~enabled[:, None], _NEG_INF)
    return logits.masked_fill(logits < kth_largest, _NEG_INF)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the k best tokens, then the smallest prefix of them whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [rows, vocab]
    rank = torch.arange(logits.shape[1], device=logits.device)
    sorted_logits.masked_fill_(rank[None, :] >= top_k[:, None], _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # the top token has 0 before it, so it always stays
    sorted_logits.masked_fill_(mass_before >= top_p[:, None], _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _step_seed(seed: int, step: int) -> int:
    """A generator seed that depends only on the sequence's seed and how many tokens it has."""
    return _splitmix64((_splitmix64(seed) + step) & _UINT64_MASK)


def _splitmix64(x: int) -> int:
    z = (x + _GOLDEN_GAMMA) & _UINT64_MASK
    z = ((z ^ (z >> 30)) * _MIX_MULTIPLIER_1) & _UINT64_MASK
    z = ((z ^ (z >> 27)) * _MIX_MULTIPLIER_2) & _UINT64_MASK
    return z ^ (z >> 31)


def _output(logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]) -> SamplerOutput:
    batch_size = len(params)
    logprobs: list[float | None] = [None] * batch_size
    top_logprobs: list[list[tuple[int, float]] | None] = [None] * batch_size
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if rows:
        row_index = torch.tensor(rows, device=logits.device)
        # from the raw model logits, before penalties, bias and temperature: vLLM V1's default
        chosen, top = logprobs_of(logits[row_index], token_ids[row_index],
                                  max(params[i].logprobs for i in rows))
        for j, i in enumerate(rows):
            logprobs[i] = chosen[j]
            top_logprobs[i] = top[j][:params[i].logprobs]
    return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs, top_logprobs=top_logprobs)


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor,
                num_top: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The log-probability of each row's token under the row's softmax (fp32), and each row's
    `num_top` most likely tokens with theirs, highest first. logits [rows, vocab], token_ids [rows]."""
    row_logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = row_logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    top_values, top_ids = row_logprobs.topk(num_top, dim=-1)  # descending
    return chosen, [list(zip(ids, values)) for ids, values in zip(top_ids.tolist(), top_values.tolist())]


def prompt_logprobs(logits: torch.Tensor, targets: list[int], num_top: int) -> list[TokenLogprob]:
    """The entries of the prompt tokens `targets`, each from the logits at the position before
    it (a prefill chunk's rows). logits [len(targets), vocab]."""
    if not targets:
        return []
    chosen, top = logprobs_of(logits, torch.tensor(targets, device=logits.device), num_top)
    return [TokenLogprob(token_id, logprob, alternatives)
            for token_id, logprob, alternatives in zip(targets, chosen, top)]
