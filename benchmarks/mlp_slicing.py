"""ScheInfer's MLP slicing on the host-only testbed: the solver's rates against fixed rates, side
by side in one run.

A 1B Llama shape (random weights, bf16) with a weight budget that holds the attention weights,
embeddings and a quarter of the MLPs (plus one MLP's buffer for the streamed parts). Configurations:
  solved       --mlp-slicing auto within that budget (rates from this machine's slicing profile)
  CPU share s  the three quarters of each MLP off the accelerator split s on the CPU (CC) and
               1 - s streamed (CG), GG a quarter: s = 0 is all streamed (PIPO-like), s = 1 all
               computed by the CPU (llama.cpp-like), 0.25/0.5/0.75 the paper's fixed-rate ablation
  resident     no budget, nothing sliced: the reference the budget takes away
Measured per configuration (a fresh engine each, configurations interleaved per repetition,
medians): decode tokens/s at batch 1 (the median step of DECODE_STEPS after a short prompt) and
prefill tokens/s of one PREFILL_TOKENS-token prompt; beside them the slicing model's predicted MLP
time per decode step (every layer's predicted time summed; the planner's own numbers).

    nice -n 10 .venv/bin/python benchmarks/mlp_slicing.py [--reps 2]

Writes benchmarks/results/mlp_slicing.json and .md (the README's block).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

RESULTS = Path(__file__).resolve().parent / "results" / "mlp_slicing.json"
DECODE_STEPS = 16
PROMPT_TOKENS = 32
PREFILL_TOKENS = 128
RESIDENT_MLP_SHARE = 0.25  # of every MLP, what the budget keeps on the accelerator
CPU_SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)  # of the rest, computed on the CPU in the fixed configurations


def budget_gib(args) -> float:
    """Attention, embeddings, head and norms, a quarter of the MLPs and one MLP's buffer."""
    from engine.config import EngineConfig
    from engine.execution.weight_plan import weight_format
    from engine.profiling import compute_dtype
    from engine.weights import create_loader
    from scheduler.placement.slicing_plan import fixed_weight_bytes, layer_work

    config = EngineConfig.from_flat(**common(args))
    shape = create_loader(config.model, config.load_format).config.shape
    dtype, _ = compute_dtype(config.dtype, config.torch_device)
    fmt = weight_format(config, dtype)
    mlp_bytes = layer_work(shape, fmt, 1).weight_bytes
    total = fixed_weight_bytes(shape, fmt) + RESIDENT_MLP_SHARE * shape.num_layers * mlp_bytes + mlp_bytes
    return total / 2**30


def configurations(args) -> dict[str, dict]:
    off_accelerator = 1.0 - RESIDENT_MLP_SHARE
    configs = {"solved (auto)": dict(mlp_slicing="auto", weights_gpu_gib=budget_gib(args))}
    for share in CPU_SHARES:
        cc = share * off_accelerator
        configs[f"CPU share {share:g}"] = dict(mlp_slicing=f"{cc:g},{off_accelerator - cc:g}")
    configs["resident"] = {}
    return configs


def common(args) -> dict:
    return dict(model=args.model, load_format="dummy", dtype=args.dtype, device="testbed", offload="off",
                max_num_seqs=1, max_model_len=PREFILL_TOKENS + DECODE_STEPS + 8, kv_cache_memory_gib=0.25)


def predicted_mlp_step_s(engine) -> float | None:
    """The slicing model's MLP time of one batch-1 decode step, summed over the layers."""
    from engine.execution.weight_plan import plan_mlp_slicing

    if engine.config.weights.mlp_slicing == "off":
        return None
    plan = engine.slicing
    if plan is None:
        plan, _ = plan_mlp_slicing(engine.config, engine.model_config, engine.dtype, engine.max_model_len, 1)
    return sum(plan.layer_time_s)


def _timed_steps(engine, prompt: list[int], max_tokens: int) -> list[float]:
    from scheduler.sampling_params import SamplingParams

    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return steps


def measure_one(flags: dict) -> dict:
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_flat(**flags))
    try:
        vocab = engine.model_config.vocab_size
        prefill_s = _timed_steps(engine, [(7 * j + 3) % vocab for j in range(PREFILL_TOKENS)], 1)[0]
        decode = _timed_steps(engine, [(11 * j + 5) % vocab for j in range(PROMPT_TOKENS)], DECODE_STEPS + 1)[1:]
        rates = engine.slicing.rates if engine.slicing else engine.config.weights.slice_rates(
            engine.model_config.num_layers)
        return {"decode_tokens_per_s": 1.0 / statistics.median(decode), "prefill_tokens_per_s": PREFILL_TOKENS / prefill_s,
                "predicted_mlp_step_s": predicted_mlp_step_s(engine),
                "mean_rates": None if rates is None else [sum(getattr(r, k) for r in rates) / len(rates)
                                                           for k in ("cc", "cg", "gg")]}
    finally:
        engine.close()


def to_markdown(result: dict) -> str:
    lines = [f"{result['cpu']}, host-only testbed, {result['model']} random weights in {result['dtype']}; weight "
             f"budget {result['budget_gib']:.2f} GiB (attention, embeddings, a quarter of the MLPs, one MLP's buffer) "
             f"for the solved rates; decode at batch 1, prefill of {PREFILL_TOKENS} tokens; medians of "
             f"{result['reps']} interleaved repetitions, a fresh engine each.", "",
             "| configuration | mean CC / CG / GG | decode tokens/s | prefill tokens/s | predicted MLP ms per decode step |"
             " measured decode step ms |", "|---|---|---|---|---|---|"]
    for name, row in result["rows"].items():
        rates = "-" if row["mean_rates"] is None else " / ".join(f"{r:.2f}" for r in row["mean_rates"])
        predicted = "-" if row["predicted_mlp_step_s"] is None else f"{row['predicted_mlp_step_s'] * 1e3:.1f}"
        lines.append(f"| {name} | {rates} | {row['decode_tokens_per_s']:.2f} | {row['prefill_tokens_per_s']:.1f} | "
                     f"{predicted} | {1e3 / row['decode_tokens_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import kernels  # noqa: F401  (before torch)

    from benchmarks.report import median_rows, run_interleaved, write_results
    from engine.profiling.cache import host_cpu_model

    configs = configurations(args)
    samples = run_interleaved(configs, args.reps, lambda config: measure_one({**common(args), **config}))
    rows = median_rows(samples, ("decode_tokens_per_s", "prefill_tokens_per_s"))
    result = {"cpu": host_cpu_model(), "model": args.model, "dtype": args.dtype, "reps": args.reps,
              "budget_gib": configs["solved (auto)"]["weights_gpu_gib"], "rows": rows, "samples": samples}
    write_results(args.output, result, to_markdown(result))
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
