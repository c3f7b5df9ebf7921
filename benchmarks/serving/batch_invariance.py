"""What `--batch-invariant` costs: the embedded model on device cpu with and without it, side by side.

Batch invariance sends a prompt's rows through decode's kernels (INT4 x as int16 instead of the
dequantized weight and torch's GEMM, attention row by row over the KV blocks instead of SDPA), so
it costs prefill most and decode nothing. Per repetition, each engine (both built once, then
interleaved) prefills a fresh prompt of each length (one output token) and decodes 64 tokens for
1 and for 8 short prompts, after one unmeasured round each; the medians over repetitions and the ratio of rates (invariant /
default) are reported.

    python -m benchmarks.serving.batch_invariance [--reps 5] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.report import RESULTS_DIR, run_interleaved, write_results

RESULTS = RESULTS_DIR / "batch_invariance.json"
PROMPT_TOKENS = (128, 512, 2000)
DECODE_TOKENS = 64
DECODE_BATCHES = (1, 8)
MODES = {"default": {}, "batch-invariant": {"batch_invariant": True}}


def measure(llm, seed: int) -> dict:
    """Tokens per second of each prefill length and each decode batch, on fresh random prompts."""
    import torch

    from engine import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    vocab = llm.engine.model_config.vocab_size

    def rate(prompts: list[list[int]], params: SamplingParams, num_tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, params)
        return num_tokens / (time.perf_counter() - start)

    row = {}
    for length in PROMPT_TOKENS:
        prompt = torch.randint(0, vocab, (length,), generator=gen).tolist()
        row[f"prefill_{length}"] = rate([prompt], SamplingParams(max_tokens=1), length)
    decode = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True)
    for batch in DECODE_BATCHES:
        prompts = [torch.randint(0, vocab, (16,), generator=gen).tolist() for _ in range(batch)]
        row[f"decode_{batch}"] = rate(prompts, decode, batch * DECODE_TOKENS)
    return row


def table(medians: dict[str, dict]) -> str:
    keys = list(medians["default"])
    lines = ["| tokens/s | default | batch-invariant | invariant / default |", "|---|---|---|---|"]
    for key in keys:
        kind, size = key.split("_")
        label = f"prefill, {size}-token prompt" if kind == "prefill" else f"decode, {size} sequence(s)"
        default, invariant = medians["default"][key], medians["batch-invariant"][key]
        lines.append(f"| {label} | {default:.0f} | {invariant:.0f} | {invariant / default:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from engine import LLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    engines = {name: LLM(dtype=args.dtype, prefix_caching=False, max_model_len=max(PROMPT_TOKENS) + 8, **flags)
               for name, flags in MODES.items()}
    try:
        seeds = iter(range(10**6))
        for llm in engines.values():  # warm-up: first calls pay lazy initialisation
            measure(llm, next(seeds))
        samples = run_interleaved(engines, args.reps, lambda llm: measure(llm, next(seeds)))
    finally:
        for llm in engines.values():
            llm.close()
    medians = {name: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
               for name, runs in samples.items()}
    title = (f"The embedded model on device cpu, {args.dtype}, prefix caching off; medians of {args.reps} "
             f"interleaved repetitions (`benchmarks/serving/batch_invariance.py`)")
    write_results(RESULTS, {"samples": samples, "medians": medians}, f"{title}\n\n{table(medians)}\n")
    print(table(medians))


if __name__ == "__main__":
    main()
