"""The pieces of the serving benchmark (benchmarks/serve.py): workloads, prompts, client, statistics."""
