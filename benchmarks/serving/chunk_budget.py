"""How many tokens one iteration should compute (`--max-num-batched-tokens`) on this machine.

Chunked prefill trades two things. A larger budget prefills a long prompt at the GEMMs' better
rate (fewer, fuller iterations); a smaller one keeps the iterations that carry a chunk short, so
streams already running keep their inter-token latency while the prompt comes in. This measures
both on the engine directly: 8 streams decode, then a 2,048-token prompt arrives; per budget, the
median decode-only step, the median step that carries a chunk, and the prompt's prefill rate.
Budgets are interleaved across repetitions; the medians over them are reported.

Prefill pacing (--max-prefill-slowdown) is off here: it is what keeps chunk steps short while
streams decode, whatever the budget, so the budget's own job is the prefill rate when nothing
decodes. The default for a device (engine/config.py DEFAULT_BATCHED_TOKENS) is the smallest
budget whose prefill rate is within MIN_PREFILL_RATE_VS_BEST of the best measured; the chunk step
over a decode step says what the budget alone would cost running streams.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks.report import RESULTS_DIR

MIN_PREFILL_RATE_VS_BEST = 0.95
NUM_STREAMS = 8
LONG_PROMPT_TOKENS = 2048
NUM_DECODE_STEPS = 12
# --weights: the LLM keyword arguments of each (dense in the compute dtype, INT4 with its default
# prefill through the dequantized weight, and with --int4-prefill int8)
WEIGHTS = {"none": {"quantization": "none"}, "int4": {"quantization": "int4"},
           "int4-int8": {"quantization": "int4", "int4_prefill": "int8"}}


def measure(budget: int, quantization: str, seed: int) -> dict:
    """One engine at `budget`: decode-only step times, then the steps that carry the long
    prompt's chunks (seconds) and its prefill rate."""
    import torch

    from engine import LLM, SamplingParams

    with LLM(**WEIGHTS[quantization], max_num_batched_tokens=budget, prefix_caching=False, max_prefill_slowdown=0,
             max_model_len=LONG_PROMPT_TOKENS + 64, max_num_seqs=NUM_STREAMS + 1) as llm:
        engine = llm.engine
        gen = torch.Generator().manual_seed(seed)
        vocab = engine.model_config.vocab_size
        streams = SamplingParams(max_tokens=LONG_PROMPT_TOKENS, ignore_eos=True)
        for _ in range(NUM_STREAMS):
            engine.add_request(torch.randint(0, vocab, (16,), generator=gen).tolist(), streams)
        for _ in range(3):  # every stream prefilled and decoding
            engine.step()
        decode_steps = []
        for _ in range(NUM_DECODE_STEPS):
            engine.step()
            decode_steps.append(engine.stats.forward_time)
        engine.add_request(torch.randint(0, vocab, (LONG_PROMPT_TOKENS,), generator=gen).tolist(),
                           SamplingParams(max_tokens=1))
        chunk_steps, num_prompt_tokens = [], 0
        while num_prompt_tokens < LONG_PROMPT_TOKENS:
            engine.step()
            num_prompt_tokens += engine.stats.num_prompt_tokens
            chunk_steps.append(engine.stats.forward_time)
        for request_id in list(engine._requests):
            engine.abort_request(request_id)
    return {"decode_step_s": statistics.median(decode_steps), "chunk_step_s": statistics.median(chunk_steps),
            "prefill_tokens_per_s": LONG_PROMPT_TOKENS / sum(chunk_steps)}


def run(budgets: list[int], quantizations: list[str], reps: int) -> list[dict]:
    samples: dict[tuple[str, int], list[dict]] = {}
    for rep in range(reps):  # interleaved: each repetition visits every setting once
        for quantization in quantizations:
            for budget in budgets:
                samples.setdefault((quantization, budget), []).append(measure(budget, quantization, seed=rep))
    rows = []
    for (quantization, budget), runs in samples.items():
        row = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        row.update(quantization=quantization, budget=budget,
                   chunk_step_ratio=row["chunk_step_s"] / row["decode_step_s"])
        rows.append(row)
    for quantization in quantizations:
        best = max(r["prefill_tokens_per_s"] for r in rows if r["quantization"] == quantization)
        for row in rows:
            if row["quantization"] == quantization:
                row["prefill_rate_vs_best"] = row["prefill_tokens_per_s"] / best
    return rows


def chosen_budget(rows: list[dict], quantization: str) -> int:
    """The smallest budget whose prefill rate is within MIN_PREFILL_RATE_VS_BEST of the best."""
    return min(r["budget"] for r in rows if r["quantization"] == quantization
               and r["prefill_rate_vs_best"] >= MIN_PREFILL_RATE_VS_BEST)


def table(rows: list[dict]) -> str:
    lines = ["| weights | budget (tokens) | decode step ms | step with a chunk ms | chunk step / decode step "
             "| prefill tok/s | vs best budget |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['quantization']} | {r['budget']} | {r['decode_step_s'] * 1e3:.1f} | "
                     f"{r['chunk_step_s'] * 1e3:.1f} | {r['chunk_step_ratio']:.2f} | "
                     f"{r['prefill_tokens_per_s']:.0f} | {r['prefill_rate_vs_best']:.2f} |")
    return "\n".join(lines)


def int4_vs_dense(rows: list[dict]) -> str:
    """Each INT4 variant's prefill rate over dense weights' (the compute dtype's) per budget, from
    the same interleaved repetitions."""
    rates = {(r["quantization"], r["budget"]): r["prefill_tokens_per_s"] for r in rows}
    variants = [name for name in WEIGHTS if name != "none" and any(q == name for q, _ in rates)]
    budgets = sorted({budget for q, budget in rates if ("none", budget) in rates and q in variants})
    if not budgets:
        return ""
    lines = ["| budget (tokens) | dense prefill tok/s | " + " | ".join(f"{v} tok/s | {v} / dense" for v in variants)
             + " |", "|---" * (2 + 2 * len(variants)) + "|"]
    for budget in budgets:
        dense_rate = rates["none", budget]
        cells = [f"{rates[v, budget]:.0f} | {rates[v, budget] / dense_rate:.2f}x" for v in variants]
        lines.append(f"| {budget} | {dense_rate:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024, 2048])
    parser.add_argument("--weights", dest="quantization", nargs="+", choices=list(WEIGHTS), default=list(WEIGHTS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "chunk_budget.json")
    args = parser.parse_args()
    rows = run(args.budgets, args.quantization, args.reps)
    choice = {q: chosen_budget(rows, q) for q in args.quantization}
    text = (table(rows) + "\n\nSmallest budget within "
            f"{MIN_PREFILL_RATE_VS_BEST:.0%} of the best prefill rate: " + ", ".join(f"{q}: {b}" for q, b in choice.items())
            + "\n")
    comparison = int4_vs_dense(rows)
    text += f"\nPrefill rate, INT4 against dense weights:\n\n{comparison}" if comparison else ""
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"rows": rows, "chosen": choice, "reps": args.reps,
                                       "num_streams": NUM_STREAMS, "long_prompt_tokens": LONG_PROMPT_TOKENS},
                                      indent=1))
    args.output.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
