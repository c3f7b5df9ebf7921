"""Where a decode step's time goes: weight-bound matmuls against everything else, beside the
roofline (the step's weight bytes / the read bandwidth measured in the same run).

The embedded model through LLMEngine.step, batches of 1, 8 and 32 requests (~240-token prompts,
greedy, ignore_eos), after their prefill. Each decode step's wall time is split by timers wrapped
around the engine's own functions for the run:
  matmuls     every LinearWeight.apply (the layers' and the LM head's, whatever their format)
  attention   the model's attention call (KV append and paged decode attention)
  model other the rest of the model's forward: embeddings, RMSNorm, RoPE, SiLU, residuals, glue
  sampler     the sampler on the step's logits
  scheduler   schedule() and update()
  engine other the rest of step(): batch building, metrics, detokenizing, outputs
With the C++ layers (EngineConfig.cpu_ops = "layers") a decode step's layers are one C++ call,
which times its own matmuls and attention (kernels/cpu/decoder.h's profile). The prefills before
the steps are timed too, their matmuls' rate beside torch's GEMM on the model's shape: at batch
32 the prefill is most of a served request's time.
The server and SSE are outside LLMEngine.step and not counted here (benchmarks/load/serve.py measures
them end to end). Timers cost about a microsecond per call, small beside what they time.

    .venv/bin/python -m benchmarks.serving.step_breakdown [--quantization int4] [--batches 1]
        [--kv-cache-dtype auto int8] [--prompt-tokens 3000] [--variants 'C++ layers']
Each code state in VARIANTS (the model's small ops as torch ops, or fused C++ kernels) is measured
in the same run, repetitions interleaved. Writes benchmarks/results/step_breakdown.json and .md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import kernels  # noqa: F401  (before torch: the engine's OpenMP spin cap)
import torch

from benchmarks.kernels.cpu_attention import ReadBandwidth
from benchmarks.report import RESULTS_DIR, write_results
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model.llama import LlamaModel
from engine.profiling.cache import host_cpu_model
from engine.quant.base import LinearWeight
from engine.sampling import Sampler
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler

RESULTS = RESULTS_DIR / "step_breakdown.json"
BATCHES = [1, 8, 32]
PROMPT_TOKENS = 240
DECODE_STEPS = 48
CATEGORIES = ["matmuls", "attention", "model other", "sampler", "scheduler", "engine other"]


class StepTimers:
    """Seconds spent inside wrapped functions, accumulated per category; nested calls are counted
    once, in the outermost category only for the same category."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._patches: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, category: str) -> None:
        original = getattr(owner, name)
        timers = self

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timers.seconds[category] += time.perf_counter() - start

        self._patches.append((owner, name, original))
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches.clear()


def linear_weight_classes() -> list[type]:
    """Every LinearWeight subclass with its own apply (ConcatWeight's parts are counted inside)."""
    found, pending = [], [LinearWeight]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if "apply" in vars(cls) and not getattr(cls.apply, "__isabstractmethod__", False):
            found.append(cls)
    return found


@contextmanager
def timed_engine(timers: StepTimers):
    for cls in linear_weight_classes():
        if cls.__name__ not in ("ConcatWeight", "StreamedWeight"):  # their parts are timed themselves
            timers.wrap(cls, "apply", "matmuls")
    timers.wrap(LlamaModel, "attention", "attention")
    timers.wrap(LlamaModel, "forward", "forward")
    timers.wrap(Sampler, "__call__", "sampler")
    timers.wrap(Scheduler, "schedule", "scheduler")
    timers.wrap(Scheduler, "update", "scheduler")
    try:
        yield
    finally:
        timers.restore()


class NativeProfile:
    """The C++ decoder's own split of its calls (kernels/cpu/decoder.h: matmuls, attention),
    added to the timers' categories: one call runs a whole decode step's layers, which the Python
    timers see only as part of the forward."""

    def __init__(self, native) -> None:
        self.decoder = None if native is None else native.decoder

    def __enter__(self) -> "NativeProfile":
        if self.decoder is not None:
            self.decoder.set_profiling(True)
        return self

    def __exit__(self, *exc) -> None:
        if self.decoder is not None:
            self.decoder.set_profiling(False)

    @contextmanager
    def step(self, seconds: dict[str, float]):
        before = (0.0, 0.0) if self.decoder is None else self.decoder.profile()
        yield
        if self.decoder is not None:
            after = self.decoder.profile()
            seconds["matmuls"] += after[0] - before[0]
            seconds["attention"] += after[1] - before[1]


def measure(engine: LLMEngine, batch: int, prompt_tokens: int = PROMPT_TOKENS) -> dict:
    """Median per-step seconds of each category over DECODE_STEPS decode steps of `batch` requests."""
    gen = torch.Generator().manual_seed(batch)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=DECODE_STEPS + 8, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist(), params)
    prefill_timers = StepTimers()
    with timed_engine(prefill_timers):
        start = time.perf_counter()
        engine.step()
        while engine.stats.num_prompt_tokens or engine.scheduler.num_waiting:
            engine.step()  # the prefills
        prefill_s = time.perf_counter() - start
    per_step: dict[str, list[float]] = defaultdict(list)
    timers = StepTimers()
    native = NativeProfile(engine.runner.model.native)
    with timed_engine(timers), native:
        for _ in range(DECODE_STEPS):
            timers.seconds.clear()
            start = time.perf_counter()
            with native.step(timers.seconds):
                engine.step()
            total = time.perf_counter() - start
            s = timers.seconds
            per_step["total"].append(total)
            per_step["matmuls"].append(s["matmuls"])
            per_step["attention"].append(s["attention"])
            per_step["model other"].append(s["forward"] - s["matmuls"] - s["attention"])
            per_step["sampler"].append(s["sampler"])
            per_step["scheduler"].append(s["scheduler"])
            per_step["engine other"].append(total - s["forward"] - s["sampler"] - s["scheduler"])
    while engine.scheduler.has_unfinished_sequences():
        engine.step()
    return {**{name: statistics.median(values) for name, values in per_step.items()},
            "prefill": prefill_s, "prefill matmuls": prefill_timers.seconds["matmuls"]}


def linear_flops_per_token(config) -> int:
    """Multiply-adds x 2 of one token through the decoder layers' matmuls (the LM head runs on
    one row per sequence only, so it is left out)."""
    per_layer = config.hidden_size * (config.q_size + 2 * config.kv_size) + config.q_size * config.hidden_size \
        + 3 * config.hidden_size * config.intermediate_size
    return 2 * config.num_layers * per_layer


def gemm_flops_per_s(config, num_tokens: int, dtype: torch.dtype, reps: int = 5) -> float:
    """torch's GEMM on the model's gate/up shape for a prefill of num_tokens, in the compute dtype:
    the rate a prefill's matmuls could reach at best here, measured in the same run."""
    x = torch.randn(num_tokens, config.hidden_size).to(dtype)
    weight = torch.randn(2 * config.intermediate_size, config.hidden_size).to(dtype)
    torch.nn.functional.linear(x, weight)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        torch.nn.functional.linear(x, weight)
        times.append(time.perf_counter() - start)
    return 2 * x.shape[0] * weight.shape[0] * weight.shape[1] / min(times)


def to_markdown(result: dict) -> str:
    lines = [f"{result['cpu']}, {result['threads']} threads, prompts of {result['prompt_tokens']} tokens, ms per decode step: "
             f"median of {DECODE_STEPS} steps, median of {result['reps']} interleaved repetitions; "
             f"roofline = weight bytes / read bandwidth "
             f"({result['read_bw_gbs']:.1f} GB/s, torch.sum over 2 GiB in the same run)", "",
             "| label | weights | KV | batch | step | " + " | ".join(CATEGORIES) + " | non-weight | roofline |",
             "|---|---|---|---|---|" + "---|" * len(CATEGORIES) + "---|---|"]
    for row in result["rows"]:
        cells = " | ".join(f"{row[c] * 1e3:.2f}" for c in CATEGORIES)
        lines.append(f"| {row['label']} | {row['quantization']} | {row['kv']} | {row['batch']} | {row['total'] * 1e3:.2f} | "
                     f"{cells} | {(row['total'] - row['matmuls']) * 1e3:.2f} | {row['roofline'] * 1e3:.2f} |")
    lines += ["", f"The prefills before those steps (all prompts of a batch; the C++ layers take decode batches "
              f"only, so the three states prefill alike). GEMM bound: torch's {result['dtype']} GEMM on the model's "
              f"gate/up shape at the batch's prompt tokens, measured in the same run.", "",
              "| label | weights | KV | batch | prompt tokens | prefill s | tokens/s | matmuls s | matmul GFLOP/s | "
              "GEMM bound GFLOP/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        tokens = row["batch"] * result["prompt_tokens"]
        lines.append(f"| {row['label']} | {row['quantization']} | {row['kv']} | {row['batch']} | {tokens} | {row['prefill']:.2f} | "
                     f"{tokens / row['prefill']:.0f} | {row['prefill matmuls']:.2f} | "
                     f"{tokens * result['flops_per_token'] / row['prefill matmuls'] / 1e9:.0f} | "
                     f"{result['gemm_flops_per_s'][str(row['batch'])] / 1e9:.0f} |")
    return "\n".join(lines) + "\n"


# Code states measured side by side in one run (the machine's speed drifts between runs): the
# model's small ops as torch ops, as fused C++ kernels, and a decode batch's layers in one C++ call
# (EngineConfig.cpu_ops).
VARIANTS = {"torch ops": {"cpu_ops": "torch"}, "fused ops": {"cpu_ops": "fused"}, "C++ layers": {"cpu_ops": "layers"}}
REPS = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", nargs="+", default=["int4", "none"])
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], help="KV formats, side by side")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="each request's context")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--reps", type=int, default=REPS, help="interleaved repetitions of every variant")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    bandwidth = ReadBandwidth(torch.get_num_threads()).sample()
    samples: dict[tuple, list[dict]] = defaultdict(list)
    long_context = {"max_model_len": args.prompt_tokens + DECODE_STEPS + 8} if args.prompt_tokens > PROMPT_TOKENS else {}
    for rep in range(args.reps):
        states = [(label, VARIANTS[label], kv) for label in args.variants for kv in args.kv_cache_dtype]
        for quantization in args.quantization:
            for label, knobs, kv in states if rep % 2 == 0 else reversed(states):  # A B, then B A: drift hits both alike
                engine = LLMEngine(EngineConfig.from_flat(quantization=quantization, max_num_seqs=max(args.batches),
                                                          kv_cache_dtype=kv, **long_context, **knobs))
                try:
                    weight_bytes = engine.runner.model.gpu_weight_bytes()
                    for batch in args.batches:
                        row = measure(engine, batch, args.prompt_tokens)
                        row["roofline"] = weight_bytes / bandwidth
                        samples[label, quantization, kv, batch].append(row)
                        print(label, quantization, kv, batch, row, file=sys.stderr, flush=True)
                finally:
                    engine.close()
    rows = [{"label": label, "quantization": quantization, "kv": kv, "batch": batch,
             **{name: statistics.median(r[name] for r in reps) for name in reps[0]}}
            for (label, quantization, kv, batch), reps in sorted(samples.items(),
                                                                 key=lambda item: (item[0][1], item[0][3]))]
    config, dtype = engine.model_config, engine.dtype
    result = {"cpu": host_cpu_model(), "threads": torch.get_num_threads(), "read_bw_gbs": bandwidth / 1e9, "reps": args.reps,
              "prompt_tokens": args.prompt_tokens,
              "rows": rows, "dtype": str(dtype).removeprefix("torch."), "flops_per_token": linear_flops_per_token(config),
              "gemm_flops_per_s": {str(b): gemm_flops_per_s(config, b * args.prompt_tokens, dtype) for b in args.batches}}
    write_results(args.output, result, to_markdown(result))
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
