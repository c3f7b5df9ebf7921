"""`tandem serve`: the OpenAI-compatible daemon. Flags map onto the frozen configs in one place."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

API_KEY_ENV = "TANDEM_API_KEY"  # one key, or several separated by commas


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="tandem: LLM serving where the CPU helps the GPU")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("--model", default="smollm2-135m",
                       help="a GGUF file, an HF safetensors directory, or a preset name (with --load-format dummy)")
    serve.add_argument("--load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy"])
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    serve.add_argument("--api-key", action="append", default=None,
                       help=f"require this bearer key (repeatable; also ${API_KEY_ENV}, comma-separated)")
    serve.add_argument("--dtype", default="auto", help="auto (measured), float32, bfloat16 or float16")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=64)
    serve.add_argument("--max-num-batched-tokens", type=int, default=None)
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: from --kv-cache-gib)")
    serve.add_argument("--kv-cache-gib", type=float, default=1.0)
    serve.add_argument("--max-waiting-requests", type=int, default=256,
                       help="queued requests beyond this get 429 with Retry-After")
    serve.add_argument("--max-waiting-tokens", type=int, default=262144,
                       help="queued prompt tokens beyond this get 429 with Retry-After")
    serve.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    serve.add_argument("--cors-origins", default="", help="comma-separated allowed origins ('*' for any)")
    serve.add_argument("--shutdown-grace", type=float, default=10.0,
                       help="seconds in-flight requests may finish after SIGTERM/SIGINT")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    bench = sub.add_parser("bench", help="run a benchmark: 'tandem bench serve --help' (needs a source checkout)")
    bench.add_argument("suite", choices=["serve"], help="serve: load-latency sweeps and side-by-side runs")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the suite's own flags")
    return parser


def bench(args: argparse.Namespace) -> int:
    """Forward to benchmarks/<suite>.py, which lives in the source tree next to this package."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if not (root / "benchmarks" / f"{args.suite}.py").is_file():
        print(f"tandem bench: benchmarks/{args.suite}.py is not here; run it from a source checkout",
              file=sys.stderr)
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from benchmarks.serve import main as serve_benchmark
    return serve_benchmark(args.args, prog=f"tandem bench {args.suite}")


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.async_engine import AsyncEngine, QueueBounds
    from engine.engine import EngineConfig, LLMEngine
    from server.app import ServerSettings, create_app
    from server.metrics import Metrics

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keys = list(args.api_key or [])
    keys += [k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    print(f"tandem: loading {args.model} ...", file=sys.stderr, flush=True)
    engine = LLMEngine(EngineConfig(
        model=args.model, load_format=args.load_format, dtype=args.dtype, seed=args.seed,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        num_blocks=args.num_blocks, kv_cache_memory_gib=args.kv_cache_gib, show_progress=True))
    name = args.served_model_name or args.model
    metrics = Metrics(name)
    async_engine = AsyncEngine(engine, QueueBounds(args.max_waiting_requests, args.max_waiting_tokens),
                               on_iteration=metrics.record_iteration, on_abort=metrics.record_abort)
    settings = ServerSettings(served_model_name=name, api_keys=tuple(keys), max_body_bytes=args.max_body_bytes,
                              cors_origins=tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()))
    app = create_app(async_engine, settings, metrics)
    url = f"http://{args.host}:{args.port}"
    auth = ' -H "Authorization: Bearer $TANDEM_API_KEY"' if keys else ""
    print(f"tandem: serving '{name}' ({engine.config.dtype} -> {engine.runner.model.dtype}, "
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
    uvicorn.Server(config).run()
    return 0


def _shutdown_already_done(_signum: int, _frame) -> None:
    """The handler uvicorn re-raises its shutdown signal to: nothing is left to do."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "bench":
        return bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
