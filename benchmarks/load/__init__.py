"""The HTTP load generator for any OpenAI-compatible endpoint (`tandem bench serve`, serve.py) and its
pieces: workloads, prompts, client, runner, the systems it starts, statistics, reports, plots.
It imports nothing of the server: what it measures is whatever answers at the other end."""
