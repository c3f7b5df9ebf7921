"""The MoE block's pieces on fresh random inputs: top-k routing against its definition, the
grouping of a batch's tokens by expert, and the block's output against a token-by-token sum."""
import pytest
import torch

from engine.model.layers import silu_mul
from engine.model.moe import Routing, SharedExpert, SparseMoe, SwiGluMlp, TopKRouter, group_by_expert
from engine.quant import LinearWeight, create_linear_method

HIDDEN, INTERMEDIATE, NUM_EXPERTS = 32, 24, 6


def dense(weight: torch.Tensor) -> LinearWeight:
    return create_linear_method("dense").create_weight(weight, None, dtype=torch.float32, device=torch.device("cpu"))


class CountingWeight(LinearWeight):
    """A dense weight that counts its applications (the real object does the work)."""

    def __init__(self, inner: LinearWeight) -> None:
        self.inner, self.num_calls, self.num_rows = inner, 0, 0
        self.method, self.out_features, self.in_features = inner.method, inner.out_features, inner.in_features

    def apply(self, x):
        self.num_calls += 1
        self.num_rows += x.shape[0]
        return self.inner.apply(x)

    nbytes = property(lambda self: self.inner.nbytes)
    format = property(lambda self: self.inner.format)

    def tensors(self):
        return self.inner.tensors()

    def with_tensors(self, tensors):
        return CountingWeight(self.inner.with_tensors(tensors))


def random_mlp(gen: torch.Generator, width: int = INTERMEDIATE) -> SwiGluMlp:
    return SwiGluMlp(CountingWeight(dense(torch.randn(2 * width, HIDDEN, generator=gen) * 0.2)),
                     dense(torch.randn(HIDDEN, width, generator=gen) * 0.2))


def reference_moe(x, router_weight, experts, top_k, normalize, shared=None):
    """Token by token, expert by expert, straight from the definition."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(router_weight @ x[t], dim=-1)
        chosen = probs.argsort(descending=True)[:top_k]
        weights = probs[chosen] / probs[chosen].sum() if normalize else probs[chosen]
        for e, w in zip(chosen.tolist(), weights):
            out[t] += w * experts[e].apply(x[t:t + 1], silu_mul)[0]
        if shared is not None:
            out[t] += shared.apply(x[t:t + 1], silu_mul)[0]
    return out


@pytest.mark.parametrize("top_k,normalize", [(1, True), (2, True), (2, False), (4, False)])
def test_router_keeps_the_top_k_probabilities(top_k, normalize):
    gen = torch.Generator().manual_seed(top_k)
    router_weight = torch.randn(NUM_EXPERTS, HIDDEN, generator=gen)
    x = torch.randn(9, HIDDEN, generator=gen)
    routing = TopKRouter(dense(router_weight), top_k, normalize).route(x)
    probs = torch.softmax(x @ router_weight.T, dim=-1)
    assert routing.expert_ids.shape == routing.weights.shape == (9, top_k)
    assert routing.weights.dtype == torch.float32
    for t in range(9):
        kept = set(routing.expert_ids[t].tolist())
        assert len(kept) == top_k and min(probs[t, list(kept)]) >= max(
            [p for e, p in enumerate(probs[t].tolist()) if e not in kept], default=0.0)
        expected = probs[t, routing.expert_ids[t]]
        expected = expected / expected.sum() if normalize else expected
        torch.testing.assert_close(routing.weights[t], expected)


def test_group_by_expert_lists_each_pair_once_under_its_expert():
    gen = torch.Generator().manual_seed(5)
    num_tokens, top_k = 11, 3
    expert_ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    groups = group_by_expert(Routing(expert_ids, weights), NUM_EXPERTS)
    assert sum(groups.counts) == num_tokens * top_k and len(groups.counts) == NUM_EXPERTS
    seen = set()
    for expert, pairs in groups.spans():
        rows, row_weights = groups.token_rows[pairs], groups.weights[pairs]
        assert rows.tolist() == sorted(rows.tolist())  # tokens in order within an expert
        for token, w in zip(rows.tolist(), row_weights.tolist()):
            slot = expert_ids[token].tolist().index(expert)
            assert w == weights[token, slot].item()
            seen.add((token, expert))
    assert seen == {(t, e) for t in range(num_tokens) for e in expert_ids[t].tolist()}


@pytest.mark.parametrize("num_tokens", [1, 3, 40])
@pytest.mark.parametrize("with_shared", [False, True])
def test_sparse_moe_matches_token_by_token_and_applies_each_expert_once(num_tokens, with_shared):
    """Each expert's weights are applied once per call, to all the rows routed to it, and the
    result is the routing-weighted sum of the definition."""
    gen = torch.Generator().manual_seed(num_tokens)
    router_weight = torch.randn(NUM_EXPERTS, HIDDEN, generator=gen)
    experts = [random_mlp(gen) for _ in range(NUM_EXPERTS)]
    shared = None
    if with_shared:
        shared = SharedExpert(random_mlp(gen, 16), dense(torch.randn(1, HIDDEN, generator=gen)))
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    moe = SparseMoe(TopKRouter(dense(router_weight), 2, True), experts, shared)
    out = moe.apply(x, silu_mul)
    calls = [expert.gate_up.num_calls for expert in experts]
    assert all(n <= 1 for n in calls) and sum(e.gate_up.num_rows for e in experts) == 2 * num_tokens
    if num_tokens == 40:
        assert sum(calls) == NUM_EXPERTS  # 80 picks reach every one of 6 experts
    torch.testing.assert_close(out, reference_moe(x, router_weight, experts, 2, True, shared), atol=1e-5, rtol=1e-5)


def test_sparse_moe_reports_every_weight():
    gen = torch.Generator().manual_seed(0)
    experts = [random_mlp(gen) for _ in range(NUM_EXPERTS)]
    shared = SharedExpert(random_mlp(gen, 16), None)
    router = TopKRouter(dense(torch.randn(NUM_EXPERTS, HIDDEN, generator=gen)), 2, True)
    weights = SparseMoe(router, experts, shared).linear_weights()
    assert len(weights) == 1 + 2 * NUM_EXPERTS + 2 and weights[0] is router.gate
