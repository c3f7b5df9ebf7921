"""Offline throughput: tandem's engine vs Hugging Face transformers `generate`, side by side.

For each batch size, both systems generate `--new-tokens` tokens (ignore_eos) for prompts of
about `--prompt-tokens` tokens with the same weights (the embedded SmolLM2 GGUF). Repetitions
interleave the systems so machine noise hits both alike; the table reports medians and the
ratio. Also compares tandem's compute dtypes, which is how the CPU default was chosen.

    .venv/bin/python -m benchmarks.serving.offline [--batch-sizes 1 8 32] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from benchmarks.report import RESULTS_DIR

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine import LLM, SamplingParams  # noqa: E402
from engine.weights import embedded_gguf_path  # noqa: E402

RESULTS = RESULTS_DIR / "offline.json"
WORDS = ("the quick brown fox jumps over a lazy dog while seventeen curious engineers measure "
         "memory bandwidth on small machines and argue about schedulers").split()


def make_prompts(tokenizer, count: int, num_tokens: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        words = [WORDS[(i * 7 + j) % len(WORDS)] for j in range(num_tokens * 2)]
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[:num_tokens - (i % 8)]
        prompts.append(ids)
    return prompts


def run_tandem(llm: LLM, prompts, new_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == new_tokens * len(prompts)
    return produced / elapsed


@torch.inference_mode()
def run_hf(model, prompts, new_tokens: int, pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - width) * len(prompts) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-tokens", type=int, default=240)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()

    import transformers
    gguf = embedded_gguf_path()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    engines = {dtype: LLM("smollm2-135m", dtype=dtype, max_num_seqs=max(args.batch_sizes)) for dtype in args.dtypes}
    tokenizer = next(iter(engines.values())).tokenizer
    pad_id = tokenizer.eos_token_ids[0]

    rows = []
    for batch in args.batch_sizes:
        prompts = make_prompts(tokenizer, batch, args.prompt_tokens)
        samples: dict[str, list[float]] = {"transformers": [], **{f"tandem-{d}": [] for d in engines}}
        for rep in range(args.reps):  # interleaved so drift hits every system alike
            samples["transformers"].append(run_hf(hf_model, prompts, args.new_tokens, pad_id))
            for dtype, llm in engines.items():
                samples[f"tandem-{dtype}"].append(run_tandem(llm, prompts, args.new_tokens))
            print(f"batch {batch} rep {rep}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in samples.items()),
                  file=sys.stderr)
        medians = {k: statistics.median(v) for k, v in samples.items()}
        rows.append({"batch": batch, "tokens_per_s": medians, "samples": samples,
                     "ratio_vs_transformers": {k: v / medians["transformers"] for k, v in medians.items()
                                               if k != "transformers"}})

    systems = list(rows[0]["tokens_per_s"])
    lines = [f"Output tokens/s, median of {args.reps} (prompts ~{args.prompt_tokens} tokens, {args.new_tokens} new, "
             f"greedy, ignore_eos; {torch.get_num_threads()} threads, {platform.machine()})", "",
             "| batch | " + " | ".join(systems) + " | "
             + " | ".join(f"{s} / transformers" for s in systems[1:]) + " |",
             "|---" * (2 * len(systems)) + "|"]
    for row in rows:
        tps = row["tokens_per_s"]
        lines.append(f"| {row['batch']} | " + " | ".join(f"{tps[s]:.1f}" for s in systems) + " | "
                     + " | ".join(f"{row['ratio_vs_transformers'][s]:.2f}x" for s in systems[1:]) + " |")
    table = "\n".join(lines)
    print("\n" + table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                   "threads": torch.get_num_threads(), "args": vars(args), "rows": rows}, indent=2))
    RESULTS.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
