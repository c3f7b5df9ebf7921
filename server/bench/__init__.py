"""`tandem bench serve`, the serving benchmark for any OpenAI-compatible endpoint (serve.py), and
its pieces: workloads, prompts, client, statistics, reports, plots. It lives in the installed
package so the CLI can run it; benchmarks/serve.py is the same entry point for `make bench`."""
