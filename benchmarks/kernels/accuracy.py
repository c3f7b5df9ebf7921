"""Teacher-forced accuracy of a quantized model against its reference, on a shipped held text.

The held text (tests/data/held_text.txt: the first three chapters of Jane Austen's Pride and
Prejudice, 1813, public domain) is tokenized, cut into windows, and each window goes through the
engine's public path as a prompt with `prompt_logprobs=1` and `max_tokens=0`: every position's
log-probability of the true next token (perplexity) and its most likely token (top-1 agreement
with the reference at that position). Both engines compute in fp32.

    python -m benchmarks.kernels.accuracy                     # embedded GGUF: int4 kept packed vs dequantized
                                                              # fp32, its int8-activation prefill vs int16, and
                                                              # int8 / k8v4 / int4 KV caches vs a float16 one
    python -m benchmarks.kernels.accuracy --model qwen2-0.5b  # a dummy preset: RTN int4 vs its dense weights

On a CPU whose decode attention has integer dot products (kernels.cpu.integer_dot_isas()), rows
per quantized KV format also hold that kernel against the same kernel in fp32, every prompt row
attended by it (`batch_invariant`), and the int8 query alone (emulated) against fp32.

Prints a table and writes benchmarks/results/accuracy.json and .md; `update_benchmarks_doc.py` puts the
table in docs/benchmarks.md. Windows of 64 tokens (engine.quant.int4.MAX_INT16_ROWS) send every int4
matmul through the CPU's packed kernel with x quantized to int16; the prefill row runs windows of
PREFILL_WINDOW_TOKENS, above it, with `--int4-prefill int8` against the default (the dequantized
weight and the dense GEMM).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.report import REPO, RESULTS_DIR, write_results

HELD_TEXT = REPO / "tests" / "data" / "held_text.txt"
RESULTS = RESULTS_DIR / "accuracy.json"
DEFAULT_WINDOW_TOKENS = 64
PREFILL_WINDOW_TOKENS = 256  # above MAX_INT16_ROWS: the int8 kernel's rows
DUMMY_VOCAB_TOKENS_SEED = 0
# Quantized KV caches against a 16-bit one: a prefill attends K/V as the pool stores them
# (engine/kv/layouts.py: as_stored), so teacher-forced prompts measure the cache's format.
KV_FORMATS = ("int8", "k8v4", "int4")
KV_REFERENCE = "float16"


@dataclass
class Scores:
    """Per-position results of one engine over the held text's windows."""

    logprobs: list[float]  # of the true next token
    top1: list[int]  # the most likely next token

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.logprobs) / len(self.logprobs))


@dataclass
class Comparison:
    model: str
    variant: str
    reference: str
    num_positions: int
    perplexity: float
    reference_perplexity: float
    top1_agreement: float

    @property
    def perplexity_change(self) -> float:
        """Relative: +0.004 is 0.4% higher than the reference."""
        return self.perplexity / self.reference_perplexity - 1


def held_windows(tokenizer, vocab_size: int, window_tokens: int, max_windows: int | None = None) -> list[list[int]]:
    """The held text's token ids in consecutive windows (the last, shorter one dropped). A model
    without a tokenizer (dummy weights) reads the text's bytes as token ids, folded into its vocabulary."""
    text = HELD_TEXT.read_text()
    ids = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else [
        byte % vocab_size for byte in text.encode()]
    windows = [ids[i:i + window_tokens] for i in range(0, len(ids) - window_tokens + 1, window_tokens)]
    return windows[:max_windows] if max_windows else windows


def teacher_forced(llm, windows: list[list[int]]) -> Scores:
    """Each window as one prompt, prefilled whole: the logprob and the argmax at every position."""
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    logprobs, top1 = [], []
    for output in llm.generate(windows, params):
        for entry in output.prompt_logprobs[1:]:
            logprobs.append(entry.logprob)
            top1.append(entry.top[0][0])
    return Scores(logprobs, top1)


def teacher_forced_engine(model: str, window_tokens: int, **kwargs):
    """An LLM that prefills one window per forward (one sequence at a time, its whole window in one
    chunk), computing in fp32."""
    from engine.llm import LLM

    return LLM(model=model, dtype="float32", max_model_len=window_tokens + 1, max_num_batched_tokens=window_tokens,
               max_num_seqs=1, **kwargs)


def comparison(model: str, variant: str, reference: str, scores: Scores, reference_scores: Scores) -> Comparison:
    """`scores` against `reference_scores`, position by position."""
    agree = sum(a == b for a, b in zip(scores.top1, reference_scores.top1))
    return Comparison(model, variant, reference, len(scores.top1), scores.perplexity, reference_scores.perplexity,
                      agree / len(scores.top1))


def compare(model: str, variant: dict, reference: dict, window_tokens: int = DEFAULT_WINDOW_TOKENS,
            max_windows: int | None = None, **engine_kwargs) -> Comparison:
    """`variant` and `reference` are LLM keyword arguments (e.g. quantization="int4" / "none")."""
    scores, names = {}, {}
    windows = None
    for role, kwargs in (("variant", variant), ("reference", reference)):
        with teacher_forced_engine(model, window_tokens, **engine_kwargs, **kwargs) as llm:
            if windows is None:
                windows = held_windows(llm.tokenizer, llm.engine.model_config.vocab_size, window_tokens, max_windows)
            scores[role] = teacher_forced(llm, windows)
        names[role] = ",".join(f"{key}={value}" for key, value in kwargs.items())
    return comparison(model, names["variant"], names["reference"], scores["variant"], scores["reference"])


def decode_kernel_scores(kv_cache_dtype: str, window_tokens: int, isa: str, query_round_trip: bool = False,
                         max_windows: int | None = None) -> Scores:
    """Teacher-forced scores with every prompt row attended by the CPU decode kernel
    (`batch_invariant`: rowwise prefill) of instruction set `isa`; `query_round_trip` hands that
    kernel the query as integer dot products read it (kv_quant.query_round_trip), the int8 query's
    effect alone on a kernel that attends in fp32."""
    from kernels import cpu, kv_quant

    kernel = cpu.paged_decode_attention

    def rounded_query(query, key_cache, value_cache, block_tables, context_lens, scale, **kwargs):
        query = (kv_quant.query_round_trip(query.float() * scale) / scale).to(query.dtype)
        return kernel(query, key_cache, value_cache, block_tables, context_lens, scale, **kwargs)

    cpu.paged_decode_attention = rounded_query if query_round_trip else kernel
    try:
        with cpu.using_isa(isa), teacher_forced_engine("smollm2-135m", window_tokens, batch_invariant=True,
                                                       kv_cache_dtype=kv_cache_dtype) as llm:
            windows = held_windows(llm.tokenizer, llm.engine.model_config.vocab_size, window_tokens, max_windows)
            return teacher_forced(llm, windows)
    finally:
        cpu.paged_decode_attention = kernel


def integer_dot_comparisons(window_tokens: int) -> list[Comparison]:
    """Per quantized format, the decode kernel with integer dot products (the int8 query, u8 value
    weights) against the same kernel in fp32 on this CPU, and the int8 query alone (emulated)
    against fp32; none where no usable instruction set has the integer path or none lacks it."""
    from kernels import cpu

    dots = cpu.integer_dot_isas()
    floats = [isa for isa in cpu.usable_isas() if isa not in dots]
    if not dots or not floats:
        return []
    comparisons = []
    for kv in KV_FORMATS:
        fp32 = decode_kernel_scores(kv, window_tokens, floats[0])
        for name, scores in ((f"{dots[0]} integer dots", decode_kernel_scores(kv, window_tokens, dots[0])),
                             ("int8 query alone", decode_kernel_scores(kv, window_tokens, floats[0], True))):
            comparisons.append(comparison("smollm2-135m", f"kv_cache_dtype={kv}, decode kernel: {name}",
                                          f"kv_cache_dtype={kv}, decode kernel: {floats[0]} fp32", scores, fp32))
    return comparisons


def table(comparisons: list[Comparison]) -> str:
    lines = ["| model | variant | reference | positions | perplexity | reference ppl | change | top-1 agreement |",
             "|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        lines.append(f"| {c.model} | {c.variant} | {c.reference} | {c.num_positions} | {c.perplexity:.3f} | "
                     f"{c.reference_perplexity:.3f} | {c.perplexity_change * 100:+.2f}% | {c.top1_agreement * 100:.2f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="model(s); default: the embedded GGUF and qwen2-0.5b dummy")
    parser.add_argument("--window-tokens", type=int, default=DEFAULT_WINDOW_TOKENS)
    parser.add_argument("--max-windows", type=int, default=16, help="dummy presets: this many windows")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    comparisons = []
    for model in args.model or ["smollm2-135m", "qwen2-0.5b"]:
        dummy = {} if model == "smollm2-135m" or model.endswith(".gguf") else {"load_format": "dummy"}
        comparisons.append(compare(model, {"quantization": "int4"}, {"quantization": "none"},
                                   args.window_tokens, args.max_windows if dummy else None, **dummy))
        print(table(comparisons[-1:]), flush=True)
    # windows above MAX_INT16_ROWS: int8 x against the dequantized weight
    comparisons.append(compare("smollm2-135m", {"quantization": "int4", "int4_prefill": "int8"},
                               {"quantization": "int4"}, PREFILL_WINDOW_TOKENS))
    print(table(comparisons[-1:]), flush=True)
    for kv in KV_FORMATS:  # the KV cache's formats against a 16-bit cache, on the embedded model
        comparisons.append(compare("smollm2-135m", {"kv_cache_dtype": kv}, {"kv_cache_dtype": KV_REFERENCE},
                                   args.window_tokens))
        print(table(comparisons[-1:]), flush=True)
    comparisons += integer_dot_comparisons(args.window_tokens)  # the decode kernel's own arithmetic
    rows = [asdict(c) | {"perplexity_change": c.perplexity_change} for c in comparisons]
    title = (f"Held text: {HELD_TEXT.name}, windows of {args.window_tokens} tokens ({PREFILL_WINDOW_TOKENS} for "
             f"int4_prefill), fp32, teacher-forced (`benchmarks/kernels/accuracy.py`)")
    write_results(args.output, rows, f"{title}\n\n{table(comparisons)}\n")
    print(table(comparisons))


if __name__ == "__main__":
    main()
