"""The two-tier KV cache and Neo's asymmetric two-batch forward against Hugging Face logits.

Plans are written by hand here (the scheduler has its own tests): CPU-bound prefills copied out
layer by layer, CPU decodes in both sub-batches beside GPU decodes and a prefill, swaps both
ways. Every row's logits must match the HF model on the request's whole token sequence, on the
inline queue (everything serial) and on the host-only testbed (a GPU thread).
"""
import os

import pytest
import torch
import transformers

from engine.kv import KVCache, block_runs
from engine.runtime import ModelRunner
from engine.device.cores import CoreAssignment
from engine.device.queues import InlineQueue, WorkerThreadQueue
from engine.weights import create_loader
from scheduler.block_pool import BlockPool, blocks_for
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence, Tier
from scheduler.iteration_plan import BlockCopy, IterationPlan, PlanMode, ScheduledSeq, Swap
from tiny_moe import randomize_routers_norms_and_biases

BLOCK_SIZE = 4
TOLERANCE = 1e-4
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=3,
            max_position_embeddings=256, rms_norm_eps=1e-5, num_attention_heads=8, num_key_value_heads=2,
            tie_word_embeddings=False, rope_theta=10000.0)
TWO_CORES = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2
# Every device the pipeline runs on: serial inline, the host-only testbed, and real CUDA streams.
DEVICES = ["cpu",
           pytest.param("testbed", marks=pytest.mark.skipif(not TWO_CORES, reason="the testbed needs 2 cores")),
           pytest.param("cuda", marks=pytest.mark.cuda)]


# The pipeline drives a model's stages only: a dense Llama, and a Qwen3-MoE (routed experts, per-head Q/K norms).
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen3-moe": (transformers.Qwen3MoeConfig, dict(moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                                    norm_topk_prob=True, head_dim=16)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny_model(request, tmp_path_factory):
    config_cls, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(
        config_cls(**TINY, **extra), torch_dtype=torch.float32, attn_implementation="eager").eval()
    if extra:
        randomize_routers_norms_and_biases(hf_model)
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf_model.save_pretrained(path, safe_serialization=True)
    return hf_model, str(path)


class Pools:
    """Hand-made block accounting for both tiers."""

    def __init__(self, num_gpu_blocks, num_cpu_blocks):
        self.pools = {Tier.GPU: BlockPool(num_gpu_blocks, BLOCK_SIZE), Tier.CPU: BlockPool(num_cpu_blocks, BLOCK_SIZE)}

    def grow(self, request, num_tokens):
        need = blocks_for(num_tokens, BLOCK_SIZE) - len(request.block_ids)
        if need > 0:
            request.block_ids += self.pools[request.tier].allocate(need)

    def move(self, request, tier):
        new = self.pools[tier].allocate(len(request.block_ids))
        swap = Swap(request, tuple(request.block_ids), tuple(new))
        self.pools[request.tier].free(request.block_ids)
        request.block_ids, request.tier = new, tier
        return swap


def copy_of(swap, to_cpu):
    return BlockCopy(swap.src_blocks, swap.dst_blocks, to_cpu)


def prefill(request, pools):
    pools.grow(request, request.num_tokens)
    return ScheduledSeq(request, 0, request.num_tokens)


def decode(request, pools):
    pools.grow(request, request.num_tokens)
    return ScheduledSeq(request, request.num_tokens - 1, 1)


def check_and_advance(runner, hf_model, plan, gen):
    forward = runner.forward(plan)
    logits = forward.rows.cpu()
    num_prompt_rows = sum(num_rows for _, num_rows in forward.prompt_spans)
    assert logits.shape[0] == len(plan.scheduled) + num_prompt_rows
    for row, seq in enumerate(plan.scheduled):
        expected = hf_model(torch.tensor([seq.sequence.all_token_ids])).logits[0, -1].float()
        torch.testing.assert_close(logits[row], expected, atol=TOLERANCE, rtol=TOLERANCE,
                                   msg=lambda m: f"sequence {seq.sequence.seq_id}: {m}")
    first_row = len(plan.scheduled)  # prompt rows follow: every position but the last, in order
    for row, num_rows in forward.prompt_spans:
        prompt = plan.scheduled[row].sequence.prompt_token_ids
        expected = hf_model(torch.tensor([prompt])).logits[0, :-1].float()
        torch.testing.assert_close(logits[first_row:first_row + num_rows], expected, atol=TOLERANCE,
                                   rtol=TOLERANCE)
        first_row += num_rows
    for seq in plan.scheduled:  # teacher forcing: random next tokens
        seq.sequence.output_token_ids.append(int(torch.randint(0, 256, (1,), generator=gen)))


@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_two_tier_pipeline_matches_hf(tiny_model, device):
    hf_model, path = tiny_model
    loader = create_loader(path)
    runner = ModelRunner(loader.config, loader, dtype=torch.float32, device=device, num_blocks=40,
                         num_cpu_blocks=40, block_size=BLOCK_SIZE, max_model_len=128)
    try:
        gen = torch.Generator().manual_seed(3)
        pools = Pools(40, 40)

        def new(name, length, tier):
            return Sequence(name, torch.randint(0, 256, (length,), generator=gen).tolist(),
                           SamplingParams(max_tokens=50), tier=tier)

        gpu_a, gpu_b = new("gpu-a", 7, Tier.GPU), new("gpu-b", 12, Tier.GPU)
        cpu_c, cpu_d, cpu_e = new("cpu-c", 5, Tier.CPU), new("cpu-d", 16, Tier.CPU), new("cpu-e", 9, Tier.CPU)
        # 1. GPU-only plan whose prefills go to both pools (CPU ones copied out layer by layer)
        plan = IterationPlan(prefills=[prefill(r, pools) for r in (gpu_a, cpu_c, gpu_b, cpu_d, cpu_e)])
        check_and_advance(runner, hf_model, plan, gen)
        # 2. pipelined: a prefill and GPU decodes in batch-0 with one CPU decode, two CPU decodes in batch-1
        late = new("late", 6, Tier.GPU)
        late.sampling_params = SamplingParams(max_tokens=50, prompt_logprobs=2)  # its prompt rows ride along
        for _ in range(2):
            plan = IterationPlan(prefills=[prefill(late, pools)] if not late.output_token_ids else [],
                                 decodes=[decode(r, pools) for r in (gpu_a, gpu_b) + ((late,) if late.output_token_ids else ())],
                                 batch0_cpu_decodes=[decode(cpu_c, pools)],
                                 batch1_cpu_decodes=[decode(cpu_d, pools), decode(cpu_e, pools)],
                                 mode=PlanMode.PIPELINED)
            check_and_advance(runner, hf_model, plan, gen)
        # 3. swap gpu-b out: it decodes on the CPU (batch-1) in the same iteration
        swap = pools.move(gpu_b, Tier.CPU)
        plan = IterationPlan(decodes=[decode(gpu_a, pools), decode(late, pools)],
                             batch1_cpu_decodes=[decode(r, pools) for r in (gpu_b, cpu_c, cpu_d, cpu_e)],
                             swap_out=[swap], copies=[copy_of(swap, to_cpu=True)], mode=PlanMode.PIPELINED)
        check_and_advance(runner, hf_model, plan, gen)
        # 4. swap cpu-d in; only batch-0 has CPU work; then a GPU-only plan over the GPU-requests
        swap = pools.move(cpu_d, Tier.GPU)
        plan = IterationPlan(decodes=[decode(r, pools) for r in (gpu_a, late, cpu_d)],
                             batch0_cpu_decodes=[decode(r, pools) for r in (gpu_b, cpu_e)],
                             swap_in=[swap], copies=[copy_of(swap, to_cpu=False)], mode=PlanMode.PIPELINED)
        check_and_advance(runner, hf_model, plan, gen)
        plan = IterationPlan(decodes=[decode(r, pools) for r in (gpu_a, late, cpu_d)])
        check_and_advance(runner, hf_model, plan, gen)
    finally:
        runner.close()


def test_block_runs_merge_adjacent_moves():
    assert block_runs([3, 4, 5, 9], [10, 11, 12, 13]) == [(3, 10, 3), (9, 13, 1)]
    assert block_runs([5, 4], [1, 0]) == [(4, 0, 2)]  # sorted by source first
    assert block_runs([1, 2], [7, 5]) == [(1, 7, 1), (2, 5, 1)]
    assert block_runs([], []) == []


def test_write_blocks_places_tokens_like_slot_writes(tiny_model):
    loader = create_loader(tiny_model[1])
    config = loader.config
    by_slots, by_blocks = (KVCache(config, 8, BLOCK_SIZE, torch.float32) for _ in range(2))
    key = torch.randn(10, config.num_kv_heads, config.head_dim)
    value = torch.randn(10, config.num_kv_heads, config.head_dim)
    blocks = [5, 6, 2]  # a run of two and a lone block
    slots = torch.tensor([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(10)])
    by_slots.write(1, key, value, slots // BLOCK_SIZE, slots % BLOCK_SIZE)
    by_blocks.write_blocks(1, key, value, blocks)
    for cache in ("key", "value"):
        a, b = getattr(by_slots, cache)[1], getattr(by_blocks, cache)[1]
        torch.testing.assert_close(a[[5, 6]], b[[5, 6]], rtol=0, atol=0)
        torch.testing.assert_close(a[2, :, :2], b[2, :, :2], rtol=0, atol=0)  # the tail is padding


def test_chunks_written_from_any_position_gather_back_in_order(tiny_model):
    """A prefill bound for the host pool copies each chunk out from where the last one ended
    (mid-block too); gathering the table gives every position back."""
    config = create_loader(tiny_model[1]).config
    cache = KVCache(config, 8, BLOCK_SIZE, torch.float32)
    key = torch.randn(11, config.num_kv_heads, config.head_dim)
    value = torch.randn(11, config.num_kv_heads, config.head_dim)
    blocks = [5, 6, 2]
    for start, end in ((0, 3), (3, 9), (9, 10), (10, 11)):
        cache.write_blocks(2, key[start:end], value[start:end], blocks, start)
    gathered_key, gathered_value = cache.gather(2, blocks, 11)
    torch.testing.assert_close(gathered_key, key, rtol=0, atol=0)
    torch.testing.assert_close(gathered_value, value, rtol=0, atol=0)


def test_worker_queue_runs_in_order_and_fails_later_items_after_an_error():
    worker = WorkerThreadQueue(None, 1)
    try:
        order = []
        futures = [worker.submit(lambda i=i: order.append(i) or i) for i in range(5)]
        assert [f.result() for f in futures] == list(range(5)) and order == list(range(5))
        bad = worker.submit(lambda: 1 / 0)
        later = worker.submit(lambda: "never runs")
        with pytest.raises(ZeroDivisionError):
            later.result()  # skipped: it may depend on the failed item
        with pytest.raises(ZeroDivisionError):
            bad.result()
        worker.recover()
        assert worker.submit(lambda: 42).result() == 42
    finally:
        worker.close()


def test_inline_queue_runs_at_once():
    queue = InlineQueue()
    assert queue.submit(lambda: 7).result() == 7


def test_testbed_placement_splits_cores():
    if not TWO_CORES:
        pytest.skip("needs 2 cores")
    placement = CoreAssignment.for_device("testbed")
    assert placement.gpu_cores and placement.cpu_attention_cores
    assert not placement.gpu_cores & placement.cpu_attention_cores
    with pytest.raises(ValueError, match="no core"):
        CoreAssignment.for_device("testbed", gpu_threads=len(os.sched_getaffinity(0)))
