"""`tandem serve` (the OpenAI-compatible daemon), `profile`, `plan`, `convert` and `bench`. Their flags
are made from knob declarations: the engine's in engine/config.py, the server's and each
command's own below; flags map onto the frozen configs in one place (`engine_config`)."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import sys
from typing import Mapping, Sequence

import kernels  # noqa: F401  (before torch loads: caps its OpenMP spinning, kernels/__init__.py)
from engine.config import ENGINE_KNOBS
from engine.knobs import Group, Knob
from scheduler.planning.experts.hot_experts import DEFAULT_SKEW
from server.flag_sources import CONFIG_ENV, FlagSourceError, add_knob_flags, layered_defaults
from server.replicas import ROUTINGS
from server.tool_calls.registry import AUTO_PARSER, PARSER_NAMES

API_KEY_ENV = "TANDEM_API_KEY"  # one key, or several separated by commas

# ---- the server's knobs and each command's own (the engine's: engine/config.py) ----------------
SERVER = "server"
ADMISSION = "admission (beyond these bounds: 429 with Retry-After)"
DATA_PARALLEL = "data parallelism (replicas)"
LOGGING = "logging"
CONFIG_KNOB = Knob("--config", "flag values from a YAML file, keys named as the flags (max-num-seqs: 8); also "
                   f"${CONFIG_ENV}", "config", metavar="FILE.yaml")
SERVER_KNOBS = (
    Knob("--host", "address to listen on (0.0.0.0: every interface)", SERVER, default="127.0.0.1"),
    Knob("--port", "port to listen on", SERVER, default=8000, type=int),
    Knob("--served-model-name", "the name clients use (default: --model)", SERVER),
    Knob("--api-key", f"require this bearer key (repeatable; also ${API_KEY_ENV}, comma-separated)", SERVER,
         repeatable=True),
    Knob("--max-body-bytes", "larger request bodies get 413", SERVER, default=4 * 2**20, type=int),
    Knob("--cors-origins", "comma-separated allowed origins ('*' for any)", SERVER, default=""),
    Knob("--shutdown-grace", "seconds in-flight requests may finish after SIGTERM/SIGINT", SERVER, default=10.0,
         type=float),
    Knob("--dead-engine-grace", "once the engine loop has died (a tensor-parallel rank lost), seconds /health "
         "answers 503 with the reason before the server exits 1 for its supervisor to restart it", SERVER,
         default=2.0, type=float),
    Knob("--tool-call-parser", "the format the model writes tool calls in (auto: the one its chat template teaches; "
         "hermes where the template renders no tools, which tandem then describes itself)", SERVER,
         default=AUTO_PARSER, choices=(AUTO_PARSER, *PARSER_NAMES)),
    Knob("--max-waiting-requests", "queued requests", ADMISSION, default=256, type=int),
    Knob("--max-waiting-tokens", "queued prompt tokens", ADMISSION, default=262144, type=int),
    Knob("--data-parallel-size", "serve from this many replicas of the whole engine, one Ray actor each with its own "
         "KV cache and share of the host's cores (or a GPU each), behind this one server", DATA_PARALLEL, default=1,
         type=int, short="-dp"),
    Knob("--data-parallel-routing", "prefix: each request to the replica that was sent the longest prefix of its "
         "prompt (a conversation stays where its history is cached), the least loaded among equals; round-robin: "
         "in turn", DATA_PARALLEL, default="prefix", choices=ROUTINGS),
)
LOG_LEVEL = Knob("--log-level", "log threshold", LOGGING, default="info", choices=("debug", "info", "warning", "error"))
PROFILE_KNOBS = (Knob("--force", "measure again even if a cached profile exists", "profile", default=False,
                      switch=True),)
PLAN_KNOBS = (
    Knob("--json", "print the plan as JSON after the breakdown", "plan", default=False, switch=True),
    Knob("--expert-skew", "a MoE model's expert popularity the hot-expert cache's expected hit rate assumes: the "
         "exponent of a Zipf law over the experts (0: uniform)", "plan", default=DEFAULT_SKEW, type=float),
)
CONVERT_KNOBS = (Knob("--verify", "check every layer file in --offload-dir (its header, model, layer, size and "
                      "checksum) without writing any; exit 2 naming each file that is missing or damaged", "convert",
                      default=False, switch=True),)
# --help's sections: the two memory budgets first, their overrides next
SERVE_GROUPS = (Group.MEMORY, Group.MEMORY_OVERRIDES, CONFIG_KNOB.group, SERVER, ADMISSION, DATA_PARALLEL, *Group,
                LOGGING)
ENGINE_GROUPS = (*Group, LOGGING)


def build_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The `tandem` parser and its `serve` subparser (whose defaults --config and the environment set)."""
    parser = argparse.ArgumentParser(prog="tandem", description="tandem: LLM serving where the CPU helps the GPU")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server", description=SERVE_DESCRIPTION,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_knob_flags(serve, [CONFIG_KNOB, *SERVER_KNOBS, *ENGINE_KNOBS, LOG_LEVEL], SERVE_GROUPS)
    profile = sub.add_parser("profile", help="measure this machine's cost tables for the offloading scheduler",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_flags(profile, PROFILE_KNOBS)
    plan = sub.add_parser("plan", help="where the weights would live, the memory breakdown and the expected speed, "
                          "without loading weights", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_flags(plan, PLAN_KNOBS)
    convert = sub.add_parser("convert", help="write per-layer weight files into --offload-dir for streaming from disk",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_flags(convert, CONVERT_KNOBS)
    bench = sub.add_parser("bench", help="run a benchmark by name: 'tandem bench --help' lists them",
                           epilog=bench_suites_help(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("suite", choices=sorted(BENCH_SUITES), metavar="suite", help="one of the suites below")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the suite's own flags ('tandem bench <suite> --help')")
    return parser, serve


SERVE_DESCRIPTION = (
    "Serve a model over the OpenAI API. Every flag can also come from a YAML file (--config) or "
    "from a TANDEM_<FLAG> environment variable (TANDEM_MAX_NUM_SEQS=8); the command line wins over "
    "the environment, which wins over the file.")


def add_engine_flags(parser: argparse.ArgumentParser, command_knobs: Sequence[Knob] = ()) -> None:
    """The engine's knobs and --log-level, shared by `profile`, `plan` and `convert`, with the
    command's own knobs."""
    add_knob_flags(parser, [*ENGINE_KNOBS, LOG_LEVEL, *command_knobs], ENGINE_GROUPS)


def engine_config(args: argparse.Namespace, **overrides):
    """The flags' EngineConfig (with `overrides` on top): every engine knob by its keyword."""
    from engine.config import EngineConfig

    values = {knob.keyword: getattr(args, knob.keyword) for knob in ENGINE_KNOBS}
    return EngineConfig.from_flat(**{**values, "show_progress": True, **overrides})


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
    """The planning stage's plan (engine/planning/stage.py), exactly the one `tandem serve` builds
    with these flags: formats, each decoder layer's place, the KV pools, threads, the scheduler and
    the expected speed; no weight is loaded."""
    import json

    from engine.planning.stage import plan_engine
    from engine.weights import create_loader

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = engine_config(args)
    loader = create_loader(config.model, config.load_format, seed=config.seed)  # the shape only
    engine_plan = plan_engine(config, loader, predict=True, expert_skew=args.expert_skew)
    print(engine_plan.describe())
    if args.json:
        print(json.dumps(engine_plan.to_dict(), indent=1))
    return 0


def convert(args: argparse.Namespace) -> int:
    """Write the model's decoder layers into --offload-dir as per-layer files for the disk tier."""
    import time

    import torch

    from engine.config import QUANTIZATION_METHODS
    from engine.offload.convert import conversion_key
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


# `tandem bench <suite>`: the benchmark modules by name, each suite named by its module's last part. They are
# imported by name when run, so that no server module imports benchmarks (tests/test_layering.py).
BENCH_MODULES = (
    "benchmarks.load.serve",
    "benchmarks.serving.multi_turn", "benchmarks.serving.long_prompt", "benchmarks.serving.offline",
    "benchmarks.serving.step_breakdown", "benchmarks.serving.chunk_budget", "benchmarks.serving.structured_decode",
    "benchmarks.serving.tensor_parallel", "benchmarks.serving.revisions", "benchmarks.serving.protocols",
    "benchmarks.serving.batch_invariance",
    "benchmarks.kernels.cpu_attention", "benchmarks.kernels.int4_matmul", "benchmarks.kernels.triton_w4a16",
    "benchmarks.kernels.accuracy", "benchmarks.kernels.kv_variants",
    "benchmarks.offload.weight_streaming", "benchmarks.offload.weight_plan", "benchmarks.offload.mlp_slicing",
    "benchmarks.offload.moe_offload", "benchmarks.offload.thread_split", "benchmarks.offload.fit_grid",
    "benchmarks.speculative.spec_decode", "benchmarks.cluster.multinode",
    "benchmarks.gpu.decode_step_gpu", "benchmarks.gpu.neo_gpu", "benchmarks.gpu.gpu_check",
    "benchmarks.simulation.simulate_neo", "benchmarks.simulation.simulate_cluster",
)
BENCH_SUITES = {module.rpartition(".")[2]: module for module in BENCH_MODULES}


def bench_suites_help() -> str:
    width = max(map(len, BENCH_SUITES))
    return "suites (python -m <module> runs the same):\n" + "\n".join(
        f"  {suite:<{width}}  {module}" for suite, module in BENCH_SUITES.items())


def bench(args: argparse.Namespace) -> int:
    """Run a benchmark module's main() as `python -m` would, with the suite's own flags in sys.argv (its
    parser reads them there, and its usage line names `tandem bench <suite>`)."""
    import importlib

    module = importlib.import_module(BENCH_SUITES[args.suite])
    argv = sys.argv
    sys.argv = [f"tandem bench {args.suite}", *args.args]
    try:
        return module.main() or 0
    finally:
        sys.argv = argv


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.async_engine import QueueBounds
    from server.app import ServerSettings, create_app
    from server.replicas.local import serving_engine
    from server.replicas.router import replica_set

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keys = list(args.api_key or [])
    keys += [k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    print(f"tandem: loading {args.model} ...", file=sys.stderr, flush=True)
    name = args.served_model_name or args.model
    exit_when_dead = ExitWhenDead(args.dead_engine_grace)
    bounds = QueueBounds(args.max_waiting_requests, args.max_waiting_tokens)
    if args.data_parallel_size != 1:
        async_engine, metrics = replica_set(engine_config(args), name, bounds, args.data_parallel_size,
                                            args.data_parallel_routing, exit_when_dead)
    else:
        async_engine, metrics = serving_engine(engine_config(args), name, bounds, exit_when_dead)
    engine = async_engine.engine
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
