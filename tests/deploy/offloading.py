"""A live `tandem serve` with offloading on, as the deployment tests use it: its flags and the
requests that overflow its GPU pool."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx

from tandem_server import REQUEST_TIMEOUT_S

TWO_CORES = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2
PROMPTS = [f"Count from {i} to {i + 20}, one number per line:" for i in range(8)]
MAX_TOKENS = 32
# 8 blocks of 16 tokens hold about two of these requests: the rest go to the host pool
OFFLOADING_FLAGS = ("--device", "testbed", "--num-gpu-blocks", "8", "--num-cpu-blocks", "256",
                    "--max-model-len", "128")


def send_requests(url: str, prompts: list[str] = PROMPTS) -> list[str]:
    """Completions for `prompts`, all at once; their texts."""
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as http:
        def complete(prompt: str) -> str:
            response = http.post("/v1/completions", json={
                "model": "smollm2-135m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True})
            response.raise_for_status()
            return response.json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(complete, prompts))
