"""Greedy tokens with CPU offloading (Neo) equal GPU-only ones, end to end through the engine.

The GPU pool is made small so the scheduler must swap requests out and back in, admit
prefills straight into the host pool, and place CPU decodes in both sub-batches; the cost tables
are given (a GPU whose linear work is memory-bound, a CPU whose attention is cheap) so the
pipelined plan wins often. The same prompts through the plain GPU-only engine must give the same
tokens, on the serial inline queue and on the host-only testbed.
"""
import os

import pytest
import torch

from engine import LLM, SamplingParams
from offload_costs import write_cost_tables
from engine.weights import EMBEDDED_MODEL, create_loader
from scheduler.sequence import Tier
from scheduler.iteration_plan import PlanMode

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Explain gravity to a child.",
    "Once upon a time, in a small village,",
    "The quick brown fox",
    "Translate 'good morning' into Spanish:",
]
MAX_TOKENS = [40, 24, 48, 32, 44, 28, 36, 20]
TWO_CORES = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2


ALL_PATHS = {"swap-out", "swap-in", "CPU-bound prefill", "CPU decode in batch-0", "CPU decode in batch-1"}
# 16 blocks of 4 tokens: the GPU pool holds one full-length request
SMALL_POOLS = dict(num_blocks=16, num_cpu_blocks=128, block_size=4, max_model_len=64, max_num_seqs=8)


def greedy(max_tokens):
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]


def generate_recording_paths(llm, prompts, params):
    """-> (token ids per prompt, which offloading paths the scheduler's plans took); checks that
    every block of both pools is back afterwards."""
    seen = set()
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def recording_schedule():
        plan = schedule()
        seen.update(name for name, happened in (
            ("swap-out", plan.swap_out), ("swap-in", plan.swap_in),
            ("CPU-bound prefill", any(s.sequence.tier is Tier.CPU for s in plan.prefills)),
            ("CPU decode in batch-0", plan.mode == PlanMode.PIPELINED and plan.batch0_cpu_decodes),
            ("CPU decode in batch-1", plan.mode == PlanMode.PIPELINED and plan.batch1_cpu_decodes)) if happened)
        return plan

    scheduler.schedule = recording_schedule
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert scheduler.block_pool.num_free_blocks == scheduler.block_pool.num_blocks
    assert scheduler.cpu_pool.num_free_blocks == scheduler.cpu_pool.num_blocks
    return outputs, seen


@pytest.fixture(scope="module")
def reference():
    with LLM(dtype="float32", cpu_attention="off") as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(MAX_TOKENS))]


@pytest.mark.parametrize("device", ["cpu", pytest.param("testbed", marks=pytest.mark.skipif(
    not TWO_CORES, reason="the testbed needs 2 cores"))])
def test_offloaded_greedy_tokens_equal_gpu_only(reference, device, tmp_path):
    tables = write_cost_tables(tmp_path, create_loader(EMBEDDED_MODEL).config.num_layers)
    with LLM(dtype="float32", cpu_attention="on", device=device, cost_tables=tables, **SMALL_POOLS) as llm:
        outputs, seen = generate_recording_paths(llm, PROMPTS, greedy(MAX_TOKENS))
    assert seen == ALL_PATHS
    assert outputs == reference


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_offloaded_greedy_tokens_equal_gpu_only_with_random_weights(device, tmp_path):
    """On CUDA: real streams, events and pinned host blocks. The embedded model's shape with seeded
    random weights (a GPU machine need not have the embedded package) and token-id prompts; the
    plans depend on the cost tables alone, so the CPU run shows the CUDA run takes every path."""
    model = dict(model=EMBEDDED_MODEL, load_format="dummy", dtype="float32", device=device)
    gen = torch.Generator().manual_seed(0)
    config = create_loader(EMBEDDED_MODEL, "dummy").config
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (4, 6, 5, 7, 8, 9, 5, 6)]
    with LLM(cpu_attention="off", **model) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(MAX_TOKENS))]
    tables = write_cost_tables(tmp_path, config.num_layers)
    with LLM(cpu_attention="on", cost_tables=tables, **SMALL_POOLS, **model) as llm:
        outputs, seen = generate_recording_paths(llm, prompts, greedy(MAX_TOKENS))
    assert seen == ALL_PATHS
    assert outputs == reference
