"""Structured outputs: what a JSON-schema grammar costs a batch's decode, and the two grammar
libraries side by side.

Decode: one engine on the embedded model decodes NUM_STREAMS streams at once, with none, half or
all of them held to a JSON schema (an array of at least 200 integers, so a constrained stream runs
to max_tokens like an unconstrained one with ignore_eos). Decode tokens/s counts the iterations
after every stream's prefill, until all finish. Configurations interleave per repetition; medians.
Target (issue 34): half constrained at least 0.9x none constrained.

Libraries: xgrammar (what the engine uses) and llguidance compile each schema for the embedded
model's tokenizer, then follow a valid document's tokens, filling the next-token mask before each;
compile time and the fill's median and p99 per token.

    nice -n 10 .venv/bin/python -m benchmarks.serving.structured_decode [--reps 5] [--output-tokens 96]

Writes benchmarks/results/structured_decode.json and .md (its block in docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import kernels  # noqa: F401  (before torch: the engine's OpenMP spin cap)

from benchmarks.report import RESULTS_DIR, median_rows, run_interleaved, write_results
from engine import LLM, SamplingParams
from engine.profiling.cache import host_cpu_model
from scheduler.structured_output import StructuredOutput

NUM_STREAMS = 8
# llguidance's JSON options for what xgrammar's any_whitespace=False writes: json.dumps's separators
COMPACT_LLGUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
LONG_ARRAY_SCHEMA = {"type": "object", "required": ["values"],
                     "properties": {"values": {"type": "array", "minItems": 200,
                                               "items": {"type": "integer", "minimum": 0, "maximum": 999}}}}
LIBRARY_CASES = {
    "nested object": ({"type": "object", "required": ["name", "age", "tags", "address"], "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}},
        "address": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
        {"name": "Alice Smith", "age": 42, "tags": ["red", "blue"], "address": {"city": "Paris", "zip": "75001"}}),
    "integer array": (LONG_ARRAY_SCHEMA, {"values": list(range(100, 300))}),
    "free text": ({"type": "object", "required": ["story"], "properties": {"story": {"type": "string"}}},
                  {"story": "Once upon a time, in a land far away, there lived a small robot who loved to "
                            "read every book in the library, twice, and then write its own."}),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--output-tokens", type=int, default=96)
    parser.add_argument("--output", type=Path,
                        default=RESULTS_DIR / "structured_decode.json")
    return parser.parse_args(argv)


def stream_params(num_constrained: int, output_tokens: int) -> list[SamplingParams]:
    structured = StructuredOutput("json_schema", json.dumps(LONG_ARRAY_SCHEMA))
    return [SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True,
                           structured=structured if i < num_constrained else None) for i in range(NUM_STREAMS)]


def measure_decode(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> dict:
    """Decode tokens/s of the streams together, from the first iteration after every prefill."""
    engine = llm.engine
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    outputs: dict[str, int] = {}
    while len(outputs) < len(ids) or min(outputs.values()) < 1:
        for output in engine.step():
            outputs[output.request_id] = len(output.outputs[0].token_ids)
    tokens_before, start = sum(outputs.values()), time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = len(output.outputs[0].token_ids)
    elapsed_s = time.perf_counter() - start
    return {"decode_tokens_per_s": (sum(outputs.values()) - tokens_before) / elapsed_s}


def decode_rows(args: argparse.Namespace) -> dict[str, dict]:
    llm = LLM("smollm2-135m")
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": f"List {200 + i} numbers as JSON."}])
               for i in range(NUM_STREAMS)]
    configs = {f"{n} of {NUM_STREAMS} constrained": stream_params(n, args.output_tokens)
               for n in (0, NUM_STREAMS // 2, NUM_STREAMS)}
    measure_decode(llm, prompts, configs[next(iter(configs))])  # warm-up: kernels, grammar compiler
    samples = run_interleaved(configs, args.reps, lambda params: measure_decode(llm, prompts, params))
    rows = median_rows(samples, ["decode_tokens_per_s"])
    baseline = rows[next(iter(rows))]["decode_tokens_per_s"]
    for row in rows.values():
        row["vs_none"] = row["decode_tokens_per_s"] / baseline
    return rows


def library_rows(tokenizer) -> list[dict]:
    """Per library and schema: compile time and the next-token mask's fill time per token."""
    rows = []
    for name, start in library_matchers(tokenizer).items():
        for case, (schema, document) in LIBRARY_CASES.items():
            compile_start = time.perf_counter()
            fill, accept = start(json.dumps(schema))
            compile_s = time.perf_counter() - compile_start
            fill_s = []
            for token in tokenizer.encode(json.dumps(document), add_special_tokens=False):
                fill_start = time.perf_counter()
                fill()
                fill_s.append(time.perf_counter() - fill_start)
                if not accept(token):
                    raise RuntimeError(f"{name} refused a token of the valid {case} document")
            fill_s.sort()
            rows.append({"library": name, "schema": case, "compile_ms": compile_s * 1e3, "num_tokens": len(fill_s),
                         "fill_us_median": statistics.median(fill_s) * 1e6,
                         "fill_us_p99": fill_s[int(0.99 * (len(fill_s) - 1))] * 1e6})
    return rows


def library_matchers(tokenizer) -> dict:
    """Library name -> start(schema_json) -> (fill, accept), both with compact JSON whitespace."""
    import llguidance
    import llguidance.hf
    import llguidance.torch
    import xgrammar as xgr

    vocab_size = tokenizer.vocab_size
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer.hf_tokenizer, vocab_size=vocab_size),
                                   cache_enabled=False)
    guidance_tokenizer = llguidance.hf.from_tokenizer(tokenizer.hf_tokenizer, n_vocab=vocab_size)

    def start_xgrammar(schema: str):
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(schema, any_whitespace=False))
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        return (lambda: matcher.fill_next_token_bitmask(bitmask, 0)), matcher.accept_token

    def start_llguidance(schema: str):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT_LLGUIDANCE)
        matcher = llguidance.LLMatcher(guidance_tokenizer, grammar)
        bitmask = llguidance.torch.allocate_token_bitmask(1, guidance_tokenizer.vocab_size)
        return (lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)), matcher.consume_token

    return {"xgrammar": start_xgrammar, "llguidance": start_llguidance}


def to_markdown(result: dict) -> str:
    lines = [f"{result['cpu']}, {NUM_STREAMS} streams, greedy, {result['output_tokens']} output tokens each, "
             f"medians of {result['reps']}.", "",
             "| streams held to a JSON schema | decode tokens/s | vs none |", "|---|---|---|"]
    lines += [f"| {name} | {row['decode_tokens_per_s']:.1f} | {row['vs_none']:.2f}x |"
              for name, row in result["decode"].items()]
    lines += ["", "| library | schema | compile ms | tokens | mask fill us, median | p99 |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['library']} | {r['schema']} | {r['compile_ms']:.1f} | {r['num_tokens']} | "
              f"{r['fill_us_median']:.1f} | {r['fill_us_p99']:.1f} |" for r in result["libraries"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = decode_rows(args)
    from engine.text import Tokenizer
    from engine.weights import embedded_gguf_path
    libraries = library_rows(Tokenizer.from_source(embedded_gguf_path()))
    result = {"cpu": host_cpu_model(), "reps": args.reps, "output_tokens": args.output_tokens,
              "num_streams": NUM_STREAMS, "decode": rows, "libraries": libraries}
    write_results(args.output, result, to_markdown(result))
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
