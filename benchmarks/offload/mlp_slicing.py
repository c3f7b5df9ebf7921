"""ScheInfer's MLP slicing on the host-only testbed: the solver's rates against fixed rates, side
by side in one run, on a dense shape and a MoE shape.

Each shape (random weights, bf16) gets a weight budget that holds the attention weights,
embeddings (and a MoE layer's router) and a quarter of the MLPs (a quarter of each MoE layer's
experts), plus one MLP's bytes for the streamed parts' buffers. Configurations:
  solved       --mlp-slicing auto within that budget (rates from this machine's slicing profile;
               a prefill moves the tokens the solver gives it to CG')
  CPU share s  the three quarters of each MLP off the GPU split s on the CPU (CC) and
               1 - s streamed (CG), GG a quarter: s = 0 is all streamed (PIPO-like), s = 1 all
               computed by the CPU (llama.cpp-like), 0.25/0.5/0.75 the paper's fixed-rate
               ablation. These run without a budget: their stream buffers take what they need,
               more than the solved rates get where CG is large.
  resident     no budget, nothing sliced: the reference the budget takes away
Measured per configuration (a fresh engine each, configurations interleaved per repetition,
medians): decode tokens/s at batch 1 (the median step of DECODE_STEPS after a short prompt),
prefill tokens/s of one PREFILL_TOKENS-token prompt (after one other, which pays the engine's
first-forward costs), and each layer's MLP time in the decode
steps (the median over steps of its MLP call plus any wait for its streamed weights), against the
slicing model's prediction for that layer at those rates: the planner's own numbers.

    nice -n 10 .venv/bin/python -m benchmarks.offload.mlp_slicing [--reps 2] [--models llama-3.2-1b,qwen3-moe-1b-a400m]

Writes benchmarks/results/mlp_slicing.json and .md (its block in docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.report import RESULTS_DIR, median_rows, run_interleaved, write_results

RESULTS = RESULTS_DIR / "mlp_slicing.json"
DEFAULT_MODELS = ("llama-3.2-1b", "qwen3-moe-1b-a400m")
DECODE_STEPS = 16
PROMPT_TOKENS = 32
PREFILL_TOKENS = 128
RESIDENT_MLP_SHARE = 0.25  # of every MLP, what the budget keeps on the GPU
CPU_SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)  # of the rest, computed on the CPU in the fixed configurations
SOLVED = "solved (auto)"


def budget_gib(model: str, dtype_name: str) -> float:
    """Attention, embeddings, head and norms (MoE routers), a quarter of the MLPs and one MLP's
    bytes for the buffers."""
    from engine.config import EngineConfig
    from engine.planning.weights import weight_format
    from engine.profiling import compute_dtype
    from engine.weights import create_loader
    from scheduler.planning.slicing.plan import fixed_weight_bytes, layer_works

    config = EngineConfig.from_flat(**common(model, dtype_name))
    shape = create_loader(config.model, config.load_format).config.shape
    dtype, _ = compute_dtype(config.dtype, config.torch_device)
    fmt = weight_format(config, dtype)
    mlp_bytes = [work.weight_bytes for work in layer_works(shape, fmt, 1)]
    total = fixed_weight_bytes(shape, fmt) + RESIDENT_MLP_SHARE * sum(mlp_bytes) + max(mlp_bytes)
    return total / 2**30


def configurations(model: str, dtype_name: str) -> dict[str, dict]:
    off_gpu = 1.0 - RESIDENT_MLP_SHARE
    configs = {SOLVED: dict(mlp_slicing="auto", weights_gpu_gib=budget_gib(model, dtype_name))}
    for share in CPU_SHARES:
        cc = share * off_gpu
        configs[f"CPU share {share:g}"] = dict(mlp_slicing=f"{cc:g},{off_gpu - cc:g}")
    configs["resident"] = {}
    return {name: {**common(model, dtype_name), **flags} for name, flags in configs.items()}


def common(model: str, dtype_name: str) -> dict:
    return dict(model=model, load_format="dummy", dtype=dtype_name, device="testbed", cpu_attention="off",
                max_num_seqs=1, max_model_len=PREFILL_TOKENS + DECODE_STEPS + 8, kv_cache_memory_gib=0.25)


class LayerTimer:
    """Each layer's MLP time per forward of `num_tokens` rows: its `_mlp` call, plus the wait in
    acquiring its streamed weights (the layer store preloads them; a wait is the link's share
    the overlap did not hide). Wraps the model's own methods in place."""

    def __init__(self, model) -> None:
        self.times_s: dict[tuple[int, int], list[float]] = defaultdict(list)  # (num_tokens, layer) -> per forward
        self._acquire_s: dict[int, float] = {}
        mlp, store = model._mlp, model.layer_store
        acquire = store.acquire

        def timed_mlp(layer, x):
            start = time.perf_counter()
            out = mlp(layer, x)
            self.times_s[x.shape[0], layer].append(time.perf_counter() - start + self._acquire_s.pop(layer, 0.0))
            return out

        def timed_acquire(layer):
            start = time.perf_counter()
            acquire(layer)
            self._acquire_s[layer] = time.perf_counter() - start
        model._mlp, store.acquire = timed_mlp, timed_acquire
        self._wrapped = (model, store)

    def detach(self) -> None:
        """The model's own methods back (the wrappers hold the model: a cycle that kept engines alive)."""
        model, store = self._wrapped
        del model._mlp, store.acquire

    def medians_s(self, num_tokens: int, num_layers: int) -> list[float] | None:
        """None where the layers' MLPs were not called one by one (the C++ decoder ran whole steps)."""
        if not self.times_s.get((num_tokens, 0)):
            return None
        return [statistics.median(self.times_s[num_tokens, layer]) for layer in range(num_layers)]


def _timed_steps(engine, prompt: list[int], max_tokens: int) -> list[float]:
    from scheduler.sampling_params import SamplingParams

    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return steps


def predicted_layers_s(engine) -> list[float]:
    """The slicing model's time of each layer's MLP in a batch-1 decode step at the engine's rates
    (every MLP resident when nothing is sliced)."""
    from engine.planning.weights import slicing_costs, weight_format
    from scheduler.planning.slicing.rates import SliceRates
    from scheduler.planning.slicing.model import layer_time_s
    from scheduler.planning.slicing.plan import layer_works

    config, model_config = engine.config, engine.model_config
    rates = engine.plan.layers.slicing.rates if engine.plan.layers.slicing else config.weights.slice_rates(model_config.num_layers)
    rates = rates or [SliceRates.resident()] * model_config.num_layers
    costs = engine.plan.slicing_costs or slicing_costs(config, model_config, engine.dtype)
    works = layer_works(model_config.shape, weight_format(config, engine.dtype), 1)
    return [layer_time_s(work, costs, layer_rates) for work, layer_rates in zip(works, rates)]


def measure_one(flags: dict) -> dict:
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_flat(**flags))
    timer = LayerTimer(engine.runner.model)
    try:
        num_layers, vocab = engine.model_config.num_layers, engine.model_config.vocab_size
        _timed_steps(engine, [(5 * j + 1) % vocab for j in range(PREFILL_TOKENS)], 1)  # first-forward costs
        prefill_s = _timed_steps(engine, [(7 * j + 3) % vocab for j in range(PREFILL_TOKENS)], 1)[0]
        decode = _timed_steps(engine, [(11 * j + 5) % vocab for j in range(PROMPT_TOKENS)], DECODE_STEPS + 1)[1:]
        rates = engine.plan.layers.slicing.rates if engine.plan.layers.slicing else engine.config.weights.slice_rates(num_layers)
        predicted = predicted_layers_s(engine)
        measured = timer.medians_s(1, num_layers)
        return {"decode_tokens_per_s": 1.0 / statistics.median(decode), "prefill_tokens_per_s": PREFILL_TOKENS / prefill_s,
                "predicted_mlp_step_s": sum(predicted),
                "measured_mlp_step_s": None if measured is None else sum(measured),
                "layer_errors": None if measured is None else [p / m - 1.0 for p, m in zip(predicted, measured)],
                "mean_rates": None if rates is None else [sum(getattr(r, k) for r in rates) / len(rates)
                                                           for k in ("cc", "cg", "gg")]}
    finally:
        timer.detach()
        engine.close()
        del engine
        gc.collect()  # the next configuration's engine gets this one's memory


def summarize(rows: dict[str, dict]) -> dict:
    """The targets: solved against the best fixed split (decode and prefill) and both extremes;
    the predictions' error per layer."""
    fixed = {name: row for name, row in rows.items() if name.startswith("CPU share")}
    solved = rows[SOLVED]
    summary = {}
    for metric in ("decode_tokens_per_s", "prefill_tokens_per_s"):
        best = max(fixed, key=lambda name: fixed[name][metric])
        summary[metric] = {"best_fixed": best, "vs_best_fixed": solved[metric] / fixed[best][metric],
                           "vs_all_streamed": solved[metric] / fixed["CPU share 0"][metric],
                           "vs_all_cpu": solved[metric] / fixed["CPU share 1"][metric]}
    errors = [abs(e) for row in rows.values() if row["layer_errors"] for e in row["layer_errors"]]
    summary["layer_error_median"] = statistics.median(errors)
    summary["layer_error_max"] = max(errors)
    summary["layers_within_20_percent"] = sum(e <= 0.2 for e in errors) / len(errors)
    return summary


def shape_markdown(model: str, result: dict) -> str:
    lines = [f"**{model}**, weight budget {result['budget_gib']:.2f} GiB for the solved rates", "",
             "| configuration | mean CC / CG / GG | decode tokens/s | prefill tokens/s | MLP ms per decode step: "
             "predicted / measured | layer error: median / worst |", "|---|---|---|---|---|---|"]
    for name, row in result["rows"].items():
        rates = "-" if row["mean_rates"] is None else " / ".join(f"{r:.2f}" for r in row["mean_rates"])
        mlp = f"{row['predicted_mlp_step_s'] * 1e3:.1f} / -"
        errors = "-"
        if row["layer_errors"]:
            mlp = f"{row['predicted_mlp_step_s'] * 1e3:.1f} / {row['measured_mlp_step_s'] * 1e3:.1f}"
            magnitudes = [abs(e) for e in row["layer_errors"]]
            errors = f"{statistics.median(magnitudes):.0%} / {max(magnitudes):.0%}"
        lines.append(f"| {name} | {rates} | {row['decode_tokens_per_s']:.2f} | {row['prefill_tokens_per_s']:.1f} | "
                     f"{mlp} | {errors} |")
    s = result["summary"]
    decode, prefill = s["decode_tokens_per_s"], s["prefill_tokens_per_s"]
    lines += ["", f"Solved vs best fixed split: decode {decode['vs_best_fixed']:.2f}x ({decode['best_fixed']}), prefill "
              f"{prefill['vs_best_fixed']:.2f}x ({prefill['best_fixed']}); vs all streamed {decode['vs_all_streamed']:.2f}x"
              f" / {prefill['vs_all_streamed']:.2f}x, vs all CPU {decode['vs_all_cpu']:.2f}x / {prefill['vs_all_cpu']:.2f}x "
              f"(decode / prefill). Predicted layer time within 20% of measured for "
              f"{s['layers_within_20_percent']:.0%} of layers (median error {s['layer_error_median']:.0%}).", ""]
    return "\n".join(lines)


def to_markdown(result: dict) -> str:
    head = (f"{result['cpu']}, host-only testbed, random weights in {result['dtype']}; decode at batch 1, prefill of "
            f"{PREFILL_TOKENS} tokens; medians of {result['reps']} interleaved repetitions, a fresh engine each. "
            f"Layer error: predicted / measured - 1 of each layer's MLP time in the decode steps.")
    return "\n".join([head, ""] + [shape_markdown(model, shape) for model, shape in result["shapes"].items()])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated presets")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import kernels  # noqa: F401  (before torch)

    from engine.profiling.cache import host_cpu_model

    result = {"cpu": host_cpu_model(), "dtype": args.dtype, "reps": args.reps, "shapes": {}}
    for model in args.models.split(","):
        configs = configurations(model, args.dtype)
        samples = run_interleaved(configs, args.reps, measure_one)
        rows = median_rows(samples, ("decode_tokens_per_s", "prefill_tokens_per_s"))
        for name, row in rows.items():  # each layer's error: its median over the repetitions
            if row["layer_errors"]:
                runs = samples[name]
                row["layer_errors"] = [statistics.median(errors) for errors in zip(*(run["layer_errors"] for run in runs))]
                row["measured_mlp_step_s"] = statistics.median(run["measured_mlp_step_s"] for run in runs)
        result["shapes"][model] = {"budget_gib": configs[SOLVED]["weights_gpu_gib"], "rows": rows,
                                   "summary": summarize(rows), "samples": samples}
    write_results(args.output, result, to_markdown(result))
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
