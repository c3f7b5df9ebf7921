"""Greedy tokens with CPU offloading (Neo) equal GPU-only ones, end to end through the engine.

The accelerator pool is made small so the scheduler must swap requests out and back in, admit
prefills straight into the host pool, and place CPU decodes in both sub-batches; the cost tables
are given (a GPU whose linear work is memory-bound, a CPU whose attention is cheap) so the
pipelined plan wins often. The same prompts through the plain GPU-only engine must give the same
tokens, on the serial inline queue and on the host-only testbed.
"""
import json
import os

import pytest

from engine import LLM, SamplingParams
from engine.weights import EMBEDDED_MODEL, create_loader
from scheduler.request import Tier
from scheduler.scheduler import PlanMode

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


def cost_tables(num_layers: int) -> dict:
    """Per-layer seconds: linear work flat in tokens (weight reads dominate), cheap CPU attention."""
    return {
        "num_layers": num_layers,
        "linear": [[1, 1e-3], [64, 1.05e-3], [2048, 4e-3]],
        "prefill_attention": [[1, 1e-6], [2048, 1e-3]],
        "gpu_decode_attention": [[1, 1e-7], [100000, 1e-3]],
        "cpu_decode_attention": {"xs": [1, 64], "ys": [1, 100000], "zs": [[1e-6, 2e-3], [2e-6, 2e-3]]},
        "head": [[1, 1e-4], [64, 2e-4]],
        "swap_per_block": 1e-6,
    }


@pytest.fixture(scope="module")
def reference():
    with LLM(dtype="float32", offload="off") as llm:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("testbed", marks=pytest.mark.skipif(
    not TWO_CORES, reason="the testbed needs 2 cores"))])
def test_offloaded_greedy_tokens_equal_gpu_only(reference, device, tmp_path):
    tables = tmp_path / "costs.json"
    tables.write_text(json.dumps(cost_tables(create_loader(EMBEDDED_MODEL).config.num_layers)))
    # 16 blocks of 4 tokens: the accelerator pool holds one full-length request
    with LLM(dtype="float32", offload="on", device=device, num_blocks=16, num_cpu_blocks=128, block_size=4,
             max_model_len=64, max_num_seqs=8, cost_tables=str(tables)) as llm:
        seen = set()
        scheduler = llm.engine.scheduler
        schedule = scheduler.schedule

        def recording_schedule():
            plan = schedule()
            seen.update(name for name, happened in (
                ("swap-out", plan.swap_out), ("swap-in", plan.swap_in),
                ("CPU-bound prefill", any(s.request.tier is Tier.CPU for s in plan.prefills)),
                ("CPU decode in batch-0", plan.mode == PlanMode.PIPELINED and plan.cpu_decodes),
                ("CPU decode in batch-1", plan.mode == PlanMode.PIPELINED and plan.cpu_decodes1)) if happened)
            return plan

        scheduler.schedule = recording_schedule
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
        outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        # every block of both pools is back
        assert scheduler.block_pool.num_free_blocks == scheduler.block_pool.num_blocks
        assert scheduler.cpu_pool.num_free_blocks == scheduler.cpu_pool.num_blocks
    assert seen == {"swap-out", "swap-in", "CPU-bound prefill", "CPU decode in batch-0", "CPU decode in batch-1"}
    assert outputs == reference
