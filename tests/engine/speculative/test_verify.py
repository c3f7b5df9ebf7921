"""Verification keeps the target's distribution: on a vocabulary of 6, a share's first token is
a draw from its first row's processed distribution (temperature, top-k, penalties) whatever the
draft, and its second, after the first draft was accepted, a draw from the second row's, with
the accepted draft counted by the penalties; greedy shares stop at the first disagreement."""
import pytest
import torch

from engine.sampling import Sampler
from engine.speculative.verify import verify
from scheduler.iteration_plan import ScheduledSeq
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence

VOCAB = 6
NUM_TRIALS = 6000
DRAFTS = (2, 3)
ROWS = torch.tensor([[1.0, 0.5, 1.5, 0.0, -1.0, 0.8],
                     [0.2, 1.1, 0.9, 1.4, -0.5, 0.0],
                     [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
# chi-square with 5 degrees of freedom exceeds this with probability 1e-4
CHI_SQUARE_LIMIT = 25.7


def run(params: SamplingParams, rows: torch.Tensor = ROWS, drafts=DRAFTS):
    shares = [ScheduledSeq(Sequence(f"s{i}", [0, 1], params), 1, 1 + len(drafts), samples=False,
                           draft_token_ids=drafts) for i in range(NUM_TRIALS)]

    def take(share, position, token):
        share.sequence.append_token(token[0])
        return True

    counts = verify(shares, [rows] * NUM_TRIALS, Sampler(VOCAB, seed=0), take, lambda seq, why: None)
    return [share.sequence.output_token_ids for share in shares], counts


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    observed = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    expected = probs.double() * len(tokens)
    kept = expected > 0
    assert observed[~kept].sum() == 0, "a token the processed distribution rules out was drawn"
    return float(((observed[kept] - expected[kept]) ** 2 / expected[kept]).sum())


@pytest.mark.parametrize("params, processed", [
    (SamplingParams(temperature=0.7, max_tokens=8), lambda row, output: row / 0.7),
    (SamplingParams(temperature=1.0, top_k=4, max_tokens=8),
     lambda row, output: row.masked_fill(row < row.topk(4).values[-1], float("-inf"))),
    (SamplingParams(temperature=1.0, frequency_penalty=1.5, max_tokens=8),
     lambda row, output: row - 1.5 * torch.bincount(torch.tensor(output, dtype=torch.long), minlength=VOCAB)),
])
def test_each_position_draws_from_the_targets_processed_distribution(params, processed):
    outputs, counts = run(params)
    first = [output[0] for output in outputs]
    assert chi_square(first, torch.softmax(processed(ROWS[0], []), -1)) < CHI_SQUARE_LIMIT
    after_accept = [output[1] for output in outputs if output[0] == DRAFTS[0]]
    assert len(after_accept) > NUM_TRIALS // 5
    assert chi_square(after_accept, torch.softmax(processed(ROWS[1], [DRAFTS[0]]), -1)) < CHI_SQUARE_LIMIT
    assert counts.num_accepted_tokens == sum(counts.accepted_per_position)
    assert counts.num_emitted_tokens == sum(map(len, outputs))
    assert all(len(output) == 1 or output[0] == DRAFTS[0] for output in outputs)  # a rejection ends the share


def test_greedy_shares_take_drafts_up_to_the_first_disagreement():
    rows = torch.tensor([[0.0, 0.0, 5.0, 0.0, 0.0, 0.0],   # agrees with draft 2
                         [0.0, 0.0, 0.0, 0.0, 5.0, 0.0],   # disagrees with draft 3: 4 instead
                         [9.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    shares = [ScheduledSeq(Sequence("g", [0, 1], SamplingParams(temperature=0.0, max_tokens=8)), 1, 3,
                           samples=False, draft_token_ids=DRAFTS)]
    taken = []
    counts = verify(shares, [rows], Sampler(VOCAB, seed=0), lambda s, p, t: taken.append((p, t[0])) or True,
                    lambda seq, why: None)
    assert taken == [(0, 2), (1, 4)] and counts.accepted_by_share == [1]
    assert counts.accepted_per_position == [1] and counts.num_draft_tokens == 2
