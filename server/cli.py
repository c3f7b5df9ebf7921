"""`tandem serve` (the OpenAI-compatible daemon), `profile`, `plan`, `convert` and `bench`. Flags map onto
the frozen configs in one place."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import sys
from typing import Mapping

import kernels  # noqa: F401  (before torch loads: caps its OpenMP spinning, kernels/__init__.py)
from engine.config import GPU_MEMORY_FRACTION
from scheduler.planning.kv_format import KV_CACHE_DTYPES
from scheduler.planning.experts.hot_experts import DEFAULT_SKEW, DEFAULT_WINDOW_TOKENS
from server.flag_sources import CONFIG_ENV, FlagSourceError, RepeatableFlag, add_deprecated_flag, layered_defaults
from server.tool_calls.registry import AUTO_PARSER, PARSER_NAMES

API_KEY_ENV = "TANDEM_API_KEY"  # one key, or several separated by commas


def build_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The `tandem` parser and its `serve` subparser (whose defaults --config and the environment set)."""
    parser = argparse.ArgumentParser(prog="tandem", description="tandem: LLM serving where the CPU helps the GPU")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server", description=SERVE_DESCRIPTION,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument_group("config").add_argument(
        "--config", metavar="FILE.yaml", default=None,
        help=f"flag values from a YAML file, keys named as the flags (max-num-seqs: 8); also ${CONFIG_ENV}")
    add_server_flags(serve)
    add_engine_flags(serve)
    profile = sub.add_parser("profile", help="measure this machine's cost tables for the offloading scheduler",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_flags(profile)
    profile.add_argument("--force", action="store_true", help="measure again even if a cached profile exists")
    plan = sub.add_parser("plan", help="where the weights would live, the memory breakdown and the expected speed, "
                          "without loading weights", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_flags(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON after the breakdown")
    plan.add_argument("--expert-skew", type=float, default=DEFAULT_SKEW,
                      help="a MoE model's expert popularity the hot-expert cache's expected hit rate assumes: the "
                           "exponent of a Zipf law over the experts (0: uniform)")
    convert = sub.add_parser("convert", help="write per-layer weight files into --offload-dir for streaming from disk",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_flags(convert)
    convert.add_argument("--verify", action="store_true",
                         help="check every layer file in --offload-dir (its header, model, layer, size and checksum) "
                              "without writing any; exit 2 naming each file that is missing or damaged")
    bench = sub.add_parser("bench", help="run a benchmark: 'tandem bench serve --help'")
    bench.add_argument("suite", choices=["serve"], help="serve: load-latency sweeps and side-by-side runs")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the suite's own flags")
    return parser, serve


SERVE_DESCRIPTION = (
    "Serve a model over the OpenAI API. Every flag can also come from a YAML file (--config) or "
    "from a TANDEM_<FLAG> environment variable (TANDEM_MAX_NUM_SEQS=8); the command line wins over "
    "the environment, which wins over the file.")


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """`serve`'s own flags: the HTTP side and the queue bounds."""
    http = parser.add_argument_group("server")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on")
    http.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    http.add_argument("--api-key", action=RepeatableFlag, default=None,
                      help=f"require this bearer key (repeatable; also ${API_KEY_ENV}, comma-separated)")
    http.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="larger request bodies get 413")
    http.add_argument("--cors-origins", default="", help="comma-separated allowed origins ('*' for any)")
    http.add_argument("--shutdown-grace", type=float, default=10.0,
                      help="seconds in-flight requests may finish after SIGTERM/SIGINT")
    http.add_argument("--dead-engine-grace", type=float, default=2.0,
                      help="once the engine loop has died (a tensor-parallel rank lost), seconds /health answers "
                           "503 with the reason before the server exits 1 for its supervisor to restart it")
    http.add_argument("--tool-call-parser", choices=(AUTO_PARSER, *PARSER_NAMES), default=AUTO_PARSER,
                      help="the format the model writes tool calls in (auto: the one its chat template teaches; "
                           "hermes where the template renders no tools, which tandem then describes itself)")
    admission = parser.add_argument_group("admission (beyond these bounds: 429 with Retry-After)")
    admission.add_argument("--max-waiting-requests", type=int, default=256, help="queued requests")
    admission.add_argument("--max-waiting-tokens", type=int, default=262144, help="queued prompt tokens")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Flags that map onto EngineConfig, shared by `serve` and `profile`, grouped by concern."""
    _add_model_flags(parser)
    batching = parser.add_argument_group("batching")
    batching.add_argument("--max-model-len", type=int, default=None,
                          help="context length (default: the model's, capped by the engine and the KV cache)")
    batching.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once")
    batching.add_argument("--max-num-batched-tokens", type=int, default=None,
                          help="tokens in one iteration; longer prompts are prefilled in chunks "
                               "(default: 2048)")
    batching.add_argument("--max-prefill-slowdown", type=float, default=None,
                          help="while streams decode, an iteration carrying prompt chunks takes at most this "
                               "many decode steps' time, so running streams keep their pace (0: the token budget "
                               "alone; default 3 on cpu and testbed, 0 on cuda)")
    _add_memory_flags(parser)
    _add_cache_flags(parser)
    devices = parser.add_argument_group("device and CPU offloading")
    devices.add_argument("--device", default="cpu",
                         help="the GPU: cpu (the CPU plays both roles), testbed (a GPU thread on its "
                              "own cores beside the CPU attention: Neo's overlap on a CPU-only host), cuda[:N]")
    cpu_attention = devices.add_argument(
        "--cpu-attention", default="auto", choices=["auto", "on", "off"],
        help="Neo: some sequences' KV in a host pool and their decoding attention on the CPU; auto: on for testbed "
             "and cuda, chosen per iteration by the cost model; off: GPU-only")
    add_deprecated_flag(devices, "--offload", cpu_attention)
    gpu_threads = devices.add_argument("--gpu-threads", type=int, default=None,
                                       help="testbed: cores playing the GPU (default: planned from this machine's "
                                            "thread profile, LM-Offload's Algorithm 3)")
    add_deprecated_flag(devices, "--accelerator-threads", gpu_threads)
    devices.add_argument("--cpu-attention-threads", type=int, default=None,
                         help="threads of the CPU side: decoding attention and CPU-computed MLP parts (default: "
                              "planned; device cpu: 1)")
    devices.add_argument("--cost-tables", default=None,
                         help="a JSON file of cost tables instead of this machine's profile")
    devices.add_argument("--profile-cache-dir", default=None,
                         help="where profiles are cached (default: $TANDEM_CACHE_DIR or ~/.cache/tandem/profiles)")
    _add_parallel_flags(parser)
    logs = parser.add_argument_group("logging")
    logs.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                      help="log threshold")
    weights = parser.add_argument_group("weight streaming (PIPO): where decoder layers live")
    weights.add_argument("--weight-placement", default="auto", choices=["auto", "gpu", "cpu", "disk"],
                         help="auto: chosen per layer from the budgets and measured bandwidths; gpu: all resident; "
                              "cpu: all streamed from host memory; disk: all streamed from --offload-dir")
    weights.add_argument("--weights-gpu-gib", type=float, default=None,
                         help="GPU memory for weights (embeddings, head, norms, resident layers and the "
                              "buffers streamed layers pass through); layers beyond it stream")
    weights.add_argument("--weights-cpu-gib", type=float, default=None,
                         help="host memory for streamed layers (default: 80%% of what the host has available); "
                              "layers beyond it stream from --offload-dir")
    weights.add_argument("--offload-dir", default=None,
                         help="where disk-placed layers' files live ('tandem convert' writes them; serve writes "
                              "missing ones)")
    weights.add_argument("--weight-pipeline", default="auto", choices=["auto", "performance", "memory"],
                         help="performance: the next streamed layer preloads (one buffer more); memory: one "
                              "buffer per layer in use; auto: by estimated throughput")
    weights.add_argument("--weight-io-threads", type=int, default=None,
                         help="disk reads in flight per layer load (default: planned)")
    weights.add_argument("--weight-copy-threads", type=int, default=None,
                         help="threads of the host copy engine streamed layers pass through (default: planned)")
    weights.add_argument("--expected-context-len", type=int, default=None,
                         help="tokens per sequence the placement's throughput estimate assumes (default: max-model-len)")
    weights.add_argument("--mlp-slicing", default="off", metavar="off|auto|CC,CG",
                         help="ScheInfer's MLP slicing: off; auto (rates solved within --weights-gpu-gib for decode "
                              "batches of --max-num-seqs); or CC,CG: the fractions of each layer's MLP (of a MoE "
                              "layer's experts, whole) computed on the CPU and streamed to the GPU (the rest "
                              "resident), e.g. 0.25,0.5")
    weights.add_argument("--mlp-prefill-moving", default="on", choices=["on", "off"],
                         help="under --mlp-slicing, ScheInfer's prefill token assignment: each forward moves the "
                              "tokens the slicing models say to the GPU with CC's weights copied over (CG'); "
                              "off: the CPU computes its slices for every token")
    weights.add_argument("--hot-experts", default="auto", metavar="auto|off|N",
                         help="a MoE model's hot-expert cache: auto (where the experts do not fit --weights-gpu-gib, "
                              "each routed layer keeps as many of its most-routed experts on the GPU as the budget "
                              "leaves; the CPU computes the rest); off; or N experts per layer")
    weights.add_argument("--expert-window-tokens", type=int, default=DEFAULT_WINDOW_TOKENS,
                         help="the routed tokens per layer whose expert counts choose the hot experts (a sliding "
                              "window: the hot set follows a shift in popularity within about this many tokens)")


def _add_memory_flags(parser: argparse.ArgumentParser) -> None:
    """The fit's two budgets (engine/planning/fit.py)."""
    memory = parser.add_argument_group(
        "memory: the fit divides two budgets among weights, layer buffers and both KV pools, and picks the "
        "weight and KV formats (the older knobs below stay as overrides)")
    memory.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="the GPU's memory for weights, layer buffers, activations and its KV pool (default: "
                             f"cuda {GPU_MEMORY_FRACTION:.0%}% of the device's total memory; cpu and testbed, the "
                             "host's memory)")
    memory.add_argument("--host-memory-gib", type=float, default=None,
                        help="host memory for streamed layers and the host KV pool (default: 80%% of what the host "
                             "has available)")


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The model, its weights' format and how its layers run."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", default="smollm2-135m",
                       help="a GGUF file, an HF safetensors directory, or a preset name (with --load-format dummy)")
    model.add_argument("--load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy"],
                       help="auto: from --model (a .gguf file, a directory, a preset)")
    model.add_argument("--dtype", default="auto", help="auto (measured), float32, bfloat16 or float16")
    model.add_argument("--quantization", default="auto", choices=["auto", "none", "int4"],
                       help="decoder-layer weights: auto (a GGUF's 4-bit blocks stay packed; 16-bit weights become "
                            "int4 only where memory binds and the fit predicts a gain), none (dense in --dtype), int4 "
                            "(packed; round-to-nearest in groups of 32 where not stored so; devices cpu and cuda)")
    model.add_argument("--cpu-ops", default="layers", choices=["layers", "fused", "torch"],
                       help="how the decoder layers run on a CPU device: layers (a decode batch's layers in one "
                            "C++ call), fused (op by op, RMSNorm, RoPE and SiLU*up as C++ kernels), torch (torch ops)")
    model.add_argument("--enforce-eager", action="store_true",
                       help="on CUDA, run every decode step op by op instead of replaying CUDA graphs of it")
    model.add_argument("--seed", type=int, default=0, help="dummy weights and unseeded requests' sampling")


def _add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    """Tensor parallelism over Ray actors (engine/distributed)."""
    parallel = parser.add_argument_group("tensor parallelism (Ray)")
    parallel.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                          help="split the model's heads, MLP units and LM head over this many ranks, one Ray actor "
                               "each with its own GPU (one per rank on cuda) or its own share of the host's cores, "
                               "and its own GPU and host KV pools")
    parallel.add_argument("--ray-address", default=None,
                          help="the Ray cluster the ranks run on (default: a local one, started with the server)")


def _add_cache_flags(parser: argparse.ArgumentParser) -> None:
    """The KV cache's block size, pool sizes, format and prefix caching."""
    cache = parser.add_argument_group("KV cache")
    cache.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    cache.add_argument("--num-gpu-blocks", "--num-blocks", dest="num_blocks", type=int, default=None,
                       help="GPU KV pool blocks (default: from --kv-cache-gib); caps it to emulate a small GPU")
    cache.add_argument("--kv-cache-gib", type=float, default=None,
                       help=f"GPU KV pool size (default: from --memory-gib, else 1; on cuda what "
                            f"{GPU_MEMORY_FRACTION:.0%}% of the device's total memory leaves)")
    cache.add_argument("--memory-gib", type=float, default=None,
                       help="GPU memory for weights and KV pool together: the pool gets what the weights leave")
    cache.add_argument("--num-cpu-blocks", type=int, default=None,
                       help="host KV pool blocks (default: --cpu-kv-cache-gib)")
    cache.add_argument("--cpu-kv-cache-gib", type=float, default=None,
                       help="host KV pool size (default: 4, or what --host-memory-gib leaves)")
    cache.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                       help="how both KV pools store keys and values: auto (the compute dtype; int8 or int4 only "
                            "where memory binds and the fit predicts a gain), a float dtype, or int8 / int4 codes with a scale per 64 channels of a token (about 1.9x / 3.6x "
                            "the sequences in the same memory)")
    cache.add_argument("--prefix-caching", dest="enable_prefix_caching", action=argparse.BooleanOptionalAction,
                       default=True, help="reuse the KV of prompt prefixes seen before, in both KV pools "
                                          "(--no-prefix-caching: compute every prompt in full)")


def engine_config(args: argparse.Namespace, **overrides):
    """The flags' EngineConfig (with `overrides` on top), through its one flat-name mapping."""
    from engine.config import EngineConfig

    return EngineConfig.from_flat(**{**dict(
        model=args.model, load_format=args.load_format, dtype=args.dtype, seed=args.seed,
        quantization=args.quantization, cpu_ops=args.cpu_ops, enforce_eager=args.enforce_eager,
        gpu_memory_gib=args.gpu_memory_gib, host_memory_gib=args.host_memory_gib,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_prefill_slowdown=args.max_prefill_slowdown,
        block_size=args.block_size,
        num_blocks=args.num_blocks, kv_cache_memory_gib=args.kv_cache_gib, memory_gib=args.memory_gib,
        device=args.device, cpu_attention=args.cpu_attention,
        num_cpu_blocks=args.num_cpu_blocks, cpu_kv_cache_memory_gib=args.cpu_kv_cache_gib,
        enable_prefix_caching=args.enable_prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
        gpu_threads=args.gpu_threads, cpu_attention_threads=args.cpu_attention_threads,
        cost_tables=args.cost_tables, profile_cache_dir=args.profile_cache_dir, show_progress=True,
        weight_placement=args.weight_placement, weights_gpu_gib=args.weights_gpu_gib,
        weights_cpu_gib=args.weights_cpu_gib, offload_dir=args.offload_dir, weight_pipeline=args.weight_pipeline,
        weight_io_threads=args.weight_io_threads, weight_copy_threads=args.weight_copy_threads,
        expected_context_len=args.expected_context_len,
        mlp_slicing=args.mlp_slicing, mlp_prefill_moving=args.mlp_prefill_moving,
        hot_experts=args.hot_experts, expert_window_tokens=args.expert_window_tokens,
        tensor_parallel_size=args.tensor_parallel_size, ray_address=args.ray_address), **overrides})


def profile(args: argparse.Namespace) -> int:
    """Build (or with --force rebuild) the cached cost tables the engine would use, and print them."""
    import json

    from engine.engine import LLMEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cpu_attention = "on" if args.cpu_attention == "auto" else args.cpu_attention
    if cpu_attention == "off":
        print("tandem profile: the cost tables serve the Neo scheduler; drop --cpu-attention off", file=sys.stderr)
        return 2
    engine = LLMEngine(engine_config(args, cpu_attention=cpu_attention, cost_tables=None, force_profile=args.force))
    try:
        print(f"tandem: cost tables for {args.model} on {args.device}: {engine.profile_path}", file=sys.stderr)
        print(json.dumps(engine.cost_model.to_dict(), indent=1))
    finally:
        engine.close()
    return 0


def plan(args: argparse.Namespace) -> int:
    """Each decoder layer's plan (resident, sliced, or streamed whole), the memory breakdown and the
    expected speed, from the model's shape and this machine's measurements, after the scheduler's
    token budget and whether prefix caching is on; no weight is loaded."""
    import json

    from engine.distributed.partition import describe_ranks, rank_memories
    from engine.engine import describe_scheduler, model_max_len
    from engine.planning.fit import describe_fit, fit_config
    from engine.planning.threads import plan_thread_split
    from engine.kv.layouts import resolve_kv_format
    from scheduler.planning.cost_model import kv_bytes_per_token
    from engine.planning.weights import plan_model, slicing_costs, weight_format
    from scheduler.planning.experts.hot_experts import describe_expert_speeds
    from engine.profiling import compute_dtype
    from engine.weights import create_loader
    from scheduler.planning import describe_model_plan

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = engine_config(args)
    loader = create_loader(config.model, config.load_format, seed=config.seed)  # the shape only
    model_config = loader.config
    dtype, reason = compute_dtype(config.dtype, config.torch_device)
    config, fitted = fit_config(config, loader, dtype, model_max_len(config, model_config), predict_always=True)
    print(f"tandem plan: {args.model}, {str(dtype).removeprefix('torch.')} ({reason}), "
          f"{'int4 ' if config.quantization == 'int4' else ''}weights, on {args.device}")
    print(describe_fit(fitted, config))
    print(f"as flags: {' '.join(fitted_flags(config))}")
    print(f"scheduler: {describe_scheduler(config)}")
    kv_format = resolve_kv_format(config.cache.kv_cache_dtype, dtype)
    kv_token_bytes = kv_bytes_per_token(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim,
                                        kv_format.element_bytes)
    print(f"kv cache: {kv_format.describe()}; {kv_token_bytes} bytes a token")
    model_plan, costs = plan_model(config, model_config, dtype, model_max_len(config, model_config),
                                   expert_skew=args.expert_skew)
    print(describe_model_plan(model_plan, config.weights.offload_dir))
    if model_plan.experts is not None:
        costs = slicing_costs(config, model_config, dtype)
        print(describe_expert_speeds(model_plan.experts, model_config.shape, weight_format(config, dtype), costs,
                                     config.max_num_seqs, config.batched_tokens_budget))
    thread_plan = plan_thread_split(config, model_config, dtype, model_plan, model_max_len(config, model_config),
                                    copy_threads=config.weights.num_copy_threads)
    print(f"threads: {thread_plan.describe()}")
    ranks = rank_memories(model_config, config.parallel.tensor_parallel_size, weight_format(config, dtype),
                          kv_format.element_bytes)
    if config.parallel.enabled:
        print(describe_ranks(ranks))
    if args.json:
        scheduler = {"max_num_batched_tokens": config.batched_tokens_budget,
                     "enable_prefix_caching": config.cache.enable_prefix_caching,
                     "max_prefill_slowdown": config.prefill_slowdown_limit}
        report = {"model": args.model, "dtype": str(dtype).removeprefix("torch."), "scheduler": scheduler,
                  "kv_cache": {"format": kv_format.name, "bytes_per_token": kv_token_bytes},
                  "fit": None if fitted is None else fitted.to_dict(), "threads": thread_plan.to_dict(),
                  "ranks": [memory.to_dict() for memory in ranks], **model_plan.to_dict()}
        if costs is not None:
            report["slicing_costs"] = costs.to_dict()
        print(json.dumps(report, indent=1))
    return 0


def fitted_flags(config) -> list[str]:
    """The flags that run what the fit chose (`tandem serve` with them skips nothing it decides)."""
    cache, weights = config.cache, config.weights
    flags = [f"--quantization {config.quantization}", f"--kv-cache-dtype {cache.kv_cache_dtype}"]
    if cache.num_blocks is not None:
        flags.append(f"--num-gpu-blocks {cache.num_blocks}")
    if cache.num_cpu_blocks is not None:
        flags.append(f"--num-cpu-blocks {cache.num_cpu_blocks}")
    if weights.gpu_gib is not None:
        flags.append(f"--weights-gpu-gib {weights.gpu_gib:.6g}")
    if weights.host_gib is not None:
        flags.append(f"--weights-cpu-gib {weights.host_gib:.6g}")
    if weights.pipeline != "auto":
        flags.append(f"--weight-pipeline {weights.pipeline}")
    if weights.offload_dir:
        flags.append(f"--offload-dir {weights.offload_dir}")
    return flags


def convert(args: argparse.Namespace) -> int:
    """Write the model's decoder layers into --offload-dir as per-layer files for the disk tier."""
    import time

    import torch

    from engine.config import QUANTIZATION_METHODS
    from engine.planning.weights import conversion_key
    from engine.profiling import compute_dtype
    from engine.quant import create_linear_method
    from engine.weights import create_loader
    from engine.offload.convert import convert as convert_layers
    from engine.offload.convert import verify
    from engine.weights.layer_files import LayerFiles

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.offload_dir:
        print("tandem convert: give --offload-dir, the directory the layer files go to", file=sys.stderr)
        return 2
    config = engine_config(args)
    loader = create_loader(config.model, config.load_format, seed=config.seed)
    dtype, _ = compute_dtype(config.dtype, config.torch_device)
    files = LayerFiles(config.weights.offload_dir, conversion_key(config, loader.source, dtype),
                       loader.config.num_layers)
    start = time.perf_counter()
    if args.verify:
        num_files = verify(files)
        print(f"tandem convert --verify: {files.directory}: all {num_files} layer files intact for {loader.source} "
              f"in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        return 0
    written, kept = convert_layers(loader, files, create_linear_method(QUANTIZATION_METHODS[config.quantization]),
                                   dtype, torch.device(config.torch_device), show_progress=True)
    print(f"tandem convert: {loader.source} -> {files.directory}: {written} layer files written, {kept} already "
          f"there ({str(dtype).removeprefix('torch.')}, quantization {config.quantization}) in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def bench(args: argparse.Namespace) -> int:
    """Run the serving benchmark (server/bench) with the suite's own flags."""
    from server.bench.serve import main as serve_benchmark

    return serve_benchmark(args.args, prog=f"tandem bench {args.suite}")


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.async_engine import AsyncEngine, QueueBounds
    from engine.engine import LLMEngine
    from server.app import ServerSettings, create_app
    from server.metrics import Metrics

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keys = list(args.api_key or [])
    keys += [k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    print(f"tandem: loading {args.model} ...", file=sys.stderr, flush=True)
    engine = LLMEngine(engine_config(args))
    name = args.served_model_name or args.model
    metrics = Metrics(name)
    metrics.record_weights(engine.runner.weight_bytes())
    metrics.record_kv_format(engine.kv_format.name, engine.kv_bytes_per_token)
    metrics.record_threads(engine.thread_plan.split)
    metrics.watch_experts(engine.expert_heat)
    exit_when_dead = ExitWhenDead(args.dead_engine_grace)
    async_engine = AsyncEngine(engine, QueueBounds(args.max_waiting_requests, args.max_waiting_tokens),
                               on_iteration=metrics.record_iteration, on_abort=metrics.record_abort,
                               on_dead=exit_when_dead)
    settings = ServerSettings(served_model_name=name, api_keys=tuple(keys), max_body_bytes=args.max_body_bytes,
                              cors_origins=tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()),
                              tool_call_parser=args.tool_call_parser)
    app = create_app(async_engine, settings, metrics)
    url = f"http://{args.host}:{args.port}"
    auth = ' -H "Authorization: Bearer $TANDEM_API_KEY"' if keys else ""
    print(f"tandem: serving '{name}' ({engine.config.dtype} -> {engine.dtype}, "
          f"max_model_len {engine.max_model_len}) at {url}\n"
          f"try:  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
          f"-d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_grace)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again for the handler
    # it found; with the default one the process would die by the signal instead of exiting 0
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _shutdown_already_done)
    server = exit_when_dead.server = uvicorn.Server(config)
    server.run()
    if exit_when_dead.reason is not None:
        print(f"tandem serve: exiting: {exit_when_dead.reason}", file=sys.stderr)
        return 1
    return 0


class ExitWhenDead:
    """Once the engine loop has died (a tensor-parallel rank lost), /health answers 503 for
    `grace_s` so probes see why, then the server shuts down and the process exits 1."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.server = None
        self.reason: str | None = None

    def __call__(self, reason: str) -> None:
        self.reason = reason
        threading.Timer(self.grace_s, self._stop).start()

    def _stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


def _shutdown_already_done(_signum: int, _frame) -> None:
    """The handler uvicorn re-raises its shutdown signal to: nothing is left to do."""


def parse_command_line(argv: list[str], environ: Mapping[str, str]) -> argparse.Namespace:
    """`argv` parsed; for `serve`, over the defaults its --config file and `environ` set
    (FlagSourceError naming the key when one cannot)."""
    parser, serve_parser = build_parsers()
    if argv[:1] == ["serve"]:
        serve_parser.set_defaults(**layered_defaults(serve_parser, argv[1:], environ))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_command_line(argv, os.environ)
    except FlagSourceError as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 2
    commands = {"serve": serve, "bench": bench, "profile": profile, "plan": plan, "convert": convert}
    try:
        return commands[args.command](args)
    except _startup_errors() as exc:  # a flag or a model that cannot work: say what, not a traceback
        print(f"tandem {args.command}: {exc}", file=sys.stderr)
        return 2


def _startup_errors() -> tuple[type[BaseException], ...]:
    """What a bad flag value or model raises while the engine is built."""
    from engine.model_config import ConfigError
    from engine.text import TokenizerError
    from engine.weights import WeightLoadError
    from scheduler.planning import PlacementError
    from scheduler.scheduler import SchedulerConfigError

    return ConfigError, SchedulerConfigError, WeightLoadError, TokenizerError, PlacementError


if __name__ == "__main__":
    sys.exit(main())
