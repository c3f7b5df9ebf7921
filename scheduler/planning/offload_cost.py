"""The scheduler's view of streamed weights (PIPO meets Neo): a cost model whose linear time is
max(compute, transfer) for the layers that stream, so while transfers bound the forward the
scheduler sees a bigger batch cost almost nothing more, and grows it; and of sliced MLPs
(ScheInfer meets Neo): the CPU's share of each linear stage on the CPU's time line."""
from __future__ import annotations

from typing import Callable, Sequence

from scheduler.planning.cost_model import CostModel
from scheduler.planning.placement import PIPELINE_PERFORMANCE, TIER_GPU, WeightPlacement
from scheduler.planning.slicing.rates import SliceRates
from scheduler.planning.slicing.cost import SlicingCosts
from scheduler.planning.slicing.model import MlpWork, cpu_time_s


class WrappedCostModel(CostModel):
    """A cost model over `base`: every time is base's unless a subclass says otherwise."""

    def __init__(self, base: CostModel) -> None:
        self.base = base
        self.num_layers = base.num_layers

    def linear(self, num_tokens: int) -> float:
        return self.base.linear(num_tokens)

    def linear_again(self, num_tokens: int) -> float:
        return self.base.linear_again(num_tokens)

    def cpu_linear(self, num_tokens: int) -> float:
        return self.base.cpu_linear(num_tokens)

    def prefill_attention(self, seq_lens: Sequence[int]) -> float:
        return self.base.prefill_attention(seq_lens)

    def gpu_decode_attention(self, num_seqs: int, context_tokens: int) -> float:
        return self.base.gpu_decode_attention(num_seqs, context_tokens)

    def cpu_decode_attention(self, num_seqs: int, context_tokens: int) -> float:
        return self.base.cpu_decode_attention(num_seqs, context_tokens)

    def head(self, num_seqs: int) -> float:
        return self.base.head(num_seqs)

    def swap(self, num_blocks: int) -> float:
        return self.base.swap(num_blocks)

    def handoff(self) -> float:
        return self.base.handoff()


class StreamingCostModel(WrappedCostModel):
    """`base`'s times (measured with every weight present), the linear stage stretched to the
    transfers a streamed placement adds. Per layer (the scheduler multiplies by num_layers):

        performance-optimised pipeline: max(compute, share)   loads run under computes
        memory-efficient pipeline:      compute + share       a load starts when the buffer frees

    where share = the streamed layers' loads over all layers (streamed layers are spread between
    resident ones, so a load hides behind every layer computed before its turn, not only the one
    before it). A second pass over a layer (Neo's batch-1) finds its weights present."""

    def __init__(self, base: CostModel, transfer_share_s: float, overlapped: bool) -> None:
        super().__init__(base)
        self.transfer_share_s = transfer_share_s
        self.overlapped = overlapped

    @classmethod
    def for_placement(cls, base: CostModel, placement: WeightPlacement) -> "StreamingCostModel":
        loads = sum(placement.load_s[tier] for tier in placement.tiers if tier != TIER_GPU)
        return cls(base, loads / len(placement.tiers), placement.pipeline == PIPELINE_PERFORMANCE)

    def linear(self, num_tokens: int) -> float:
        compute = self.base.linear(num_tokens)
        if num_tokens <= 0:
            return compute
        if self.overlapped:
            return max(compute, self.transfer_share_s)
        return compute + self.transfer_share_s

    def linear_again(self, num_tokens: int) -> float:
        return self.base.linear(num_tokens)



class SlicedMlpCostModel(WrappedCostModel):
    """`base`'s times, profiled on the model as loaded, sliced MLPs included (the profile's key
    names the slicing), with the CPU's share of each linear stage from the slicing model: the CC
    parts' time (`cpu_linear`), which the CPU spends in the same window as the other sub-batch's
    CPU attention. Averaged over the layers' rates, as the scheduler multiplies by num_layers."""

    def __init__(self, base: CostModel, works: Callable[[int], Sequence[MlpWork]], costs: SlicingCosts,
                 rates: Sequence[SliceRates]) -> None:
        if not rates:
            raise ValueError("SlicedMlpCostModel needs one SliceRates per layer, got none")
        super().__init__(base)
        self.works = works
        self.costs = costs
        self.rates = tuple(rates)

    def cpu_linear(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        works = self.works(num_tokens)  # each layer's
        return sum(cpu_time_s(work, self.costs, rates) for work, rates in zip(works, self.rates)) / len(self.rates)

