"""Chaos soak (issue #38): ONE `tandem serve` with every mechanism on at once, under a mixed load for
a bounded time, must never answer 5xx, must finish every request it keeps with the tokens asked
for, must end idle with every KV block free or cached, with its memory flat, and must stop cleanly.

The server combines, and accepts at start: Neo on the host-only testbed (CPU attention on, a GPU KV
pool of SOAK_GPU_BLOCKS blocks that overflows into a host pool small enough to fill too, so that
requests swap and are preempted), layers streamed whole from host memory AND from disk, MLP slicing
of the resident layers (CC on the CPU, CG streamed), prefix caching, chunked prefill and INT8 KV.
No combination of these is refused, so all of them run.

The load: NUM_CLIENTS threads for SOAK_S seconds (CHAOS_SOAK_S lengthens it), only to 127.0.0.1,
about a tenth malformed bodies, a fifth streams the client drops mid-stream, the rest completions
and chats (n>1, logprobs/top_logprobs, streamed to the end), most behind long shared prefixes,
prompts that chunk and outputs long enough to fill the GPU pool.
"""
from __future__ import annotations

import json
import math
import os
import random
import signal
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import psutil
import pytest

from offload_costs import write_cost_tables  # tests/ is on sys.path through tests/conftest.py
from tandem_server import MODEL, metric, scrape, wait_idle

pytestmark = pytest.mark.integration

SOAK_S = float(os.environ.get("CHAOS_SOAK_S", "150"))  # not TANDEM_*: the server refuses unknown ones
NUM_CLIENTS = 8
NUM_LAYERS = 30  # SmolLM2-135M: the server refuses cost tables of another depth
SOAK_GPU_BLOCKS = 24  # 384 tokens: two long sequences fill it, so the host pool takes the rest
SOAK_CPU_BLOCKS = 64  # ~8 prompts of 130 tokens: long outputs fill it too, so requests are preempted
MAX_BATCHED_TOKENS = 48  # the shared preambles are 2-3x this: their prompts prefill in chunks
REQUEST_TIMEOUT_S = 120.0  # a long output at full batch takes ~60 s here; a hang takes longer
LONG_OUTPUT_MARGIN_S = 50.0  # no long output starts this close to the end, so the load drains in time
MONITOR_PERIOD_S = 3.0
MAX_SHOWN_SAMPLES = 50
IDLE_AFTER_LOAD_S = 60.0
SHUTDOWN_TIMEOUT_S = 30.0  # --shutdown-grace (10 s) and the engine thread's stop, with headroom
# RSS from the middle of the load to its end: the pools, the weights and the allocator's arenas
# are in place by the middle (the first half ran every kind of request at full batch), so what
# grows after is kept per request or per token. Passing runs grow 3-6 MiB (arenas settling); 24 MiB
# is 4x that and 2% of the ~1.2 GiB server, yet over a second half here (~120 requests, ~2200
# tokens) a leak of one token's int8 KV (12 KiB) per token or 256 KiB per request passes it.
MAX_RSS_GROWTH_BYTES = 24 * 2**20

KIND_WEIGHTS = {"malformed": 10, "dropped_stream": 20, "completion_n": 12, "completion_logprobs": 12,
                "chat_logprobs": 12, "chat_stream": 12, "completion": 12, "long_output": 10}
PREAMBLES = [
    "You are a careful assistant for a small hardware shop. The shop sells screws, nails, hinges, paint, "
    "brushes, ladders, hammers, saws and drills. Customers ask about prices, stock, opening hours and "
    "returns. Prices: screws 5 cents each, nails 3 cents each, hinges 2 dollars, paint 12 dollars a litre, "
    "brushes 4 dollars, ladders 60 dollars, hammers 15 dollars, saws 25 dollars and drills 80 dollars. "
    "The shop opens at nine and closes at six, every day but Sunday. Returns are accepted within thirty "
    "days with a receipt. Answer briefly and politely, and never invent products the shop does not sell.",
    "The following is a transcript of a lecture on the history of bridges. Early bridges were logs laid "
    "across streams, then stone arches that the Romans built across Europe, many of which still stand. "
    "In the eighteenth century iron arrived, and the first iron bridge was cast in England in 1779. Steel "
    "followed, and with it suspension bridges whose decks hang from cables slung between tall towers. "
    "Concrete, reinforced with steel bars, made beam and arch bridges cheaper still. Today engineers model "
    "wind, traffic and earthquakes before a single pile is driven. The lecturer now takes questions.",
    "def parse_config(path):\n    \"\"\"Read a YAML configuration file and return a dictionary of settings, "
    "with defaults filled in for every missing key.\"\"\"\n    import yaml\n    with open(path) as handle:\n"
    "        raw = yaml.safe_load(handle) or {}\n    settings = dict(DEFAULTS)\n    for key, value in "
    "raw.items():\n        if key not in DEFAULTS:\n            raise KeyError(f'unknown setting {key}')\n"
    "        settings[key] = value\n    return settings\n\n\ndef main():\n    settings = parse_config('app.yaml')\n",
]
QUESTIONS = ["What does a hammer cost?", "Summarise this in one line.", "Continue.", "Why?", "Give an example.",
             "What comes next?", "Explain the first part.", "List three facts.", "Translate it to French."]
WORDS = "apple river stone cloud lamp orange window green seven quiet engine paper bridge silver".split()

C, CH = "/v1/completions", "/v1/chat/completions"
MALFORMED = [  # (path, raw body): each must get a 4xx in OpenAI's error shape
    (C, b'{"model": "smollm2-135m", "prompt": '),
    (C, b""),
    (C, b"[1, 2]"),
    (C, json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": "5"}).encode()),
    (C, json.dumps({"model": MODEL, "prompt": "Hi", "temperature": -1}).encode()),
    (C, json.dumps({"model": MODEL, "prompt": "Hi", "n": 0, "stream": True}).encode()),
    (C, json.dumps({"model": MODEL, "prompt": "Hi", "logprobs": 21}).encode()),
    (C, json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 100000}).encode()),
    (C, json.dumps({"model": MODEL, "prompt": [1] * 500}).encode()),  # beyond the 384-token context
    (C, json.dumps({"model": MODEL, "prompt": [1, 49152]}).encode()),  # beyond the vocabulary
    (C, json.dumps({"model": MODEL, "prompt": "Hi", "frobnicate": 1}).encode()),
    (C, b'{"model": "smollm2-135m", "prompt": "Hi", "stream": true, "temperature": NaN}'),
    (CH, json.dumps({"model": MODEL, "messages": "hello"}).encode()),
    (CH, json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                     "top_logprobs": 21}).encode()),
    (CH, json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "Hi"}], "stream": True}).encode()),
    (CH, json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "Hi"}]}).encode()),
]


def serve_flags(tmp_path) -> tuple[str, ...]:
    """Every mechanism at once. The weight budgets leave 24 layers resident and sliced, 3 streamed
    from host memory and 3 from disk (the Makefile's streamed flags stream 26 layers: 4x slower)."""
    return ("--device", "testbed", "--cpu-attention", "on",
            "--num-gpu-blocks", str(SOAK_GPU_BLOCKS), "--num-cpu-blocks", str(SOAK_CPU_BLOCKS),
            "--weights-gpu-gib", "0.45", "--weights-cpu-gib", "0.07", "--offload-dir", str(tmp_path / "offload"),
            "--mlp-slicing", "0.125,0.125", "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS),
            "--max-num-seqs", "32",  # at most the token budget; 8 clients of n<=3 run at most 24
            "--kv-cache-dtype", "int8", "--prefix-caching",
            # the tests' tables make Neo's pipelined plan win often, and skip a minute of profiling
            "--cost-tables", write_cost_tables(tmp_path, NUM_LAYERS))


# ---- the requests ----------------------------------------------------------------------------
@dataclass
class Outcome:
    kind: str
    status: int | None = None  # None: no response (a transport error or a timeout)
    ok: bool = True
    detail: str = ""
    dropped: bool = False


def prompt_text(rng: random.Random) -> str:
    """Mostly one of the long shared preambles (prefix cache hits), else a unique long prompt (a miss)."""
    if rng.random() < 0.8:
        return f"{rng.choice(PREAMBLES)}\n{rng.choice(QUESTIONS)}"
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(90, 140)))


def messages(rng: random.Random) -> list[dict]:
    if rng.random() < 0.8:
        return [{"role": "system", "content": rng.choice(PREAMBLES)},
                {"role": "user", "content": rng.choice(QUESTIONS)}]
    return [{"role": "user", "content": prompt_text(rng)}]


def request_for(kind: str, rng: random.Random) -> tuple[str, dict]:
    """(path, body) of a well-formed request of `kind`; ignore_eos where the count must be exact."""
    max_tokens = rng.randint(6, 16)
    sampling = {"model": MODEL, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.7, 1.0]),
                "seed": rng.randint(0, 99)}
    if kind == "completion_n":
        return C, {**sampling, "prompt": prompt_text(rng), "n": rng.randint(2, 3), "ignore_eos": True}
    if kind == "completion_logprobs":
        return C, {**sampling, "prompt": prompt_text(rng), "logprobs": rng.randint(0, 5)}
    if kind == "chat_logprobs":
        return CH, {**sampling, "messages": messages(rng), "logprobs": True, "top_logprobs": rng.randint(0, 5),
                    "n": rng.choice([1, 1, 2])}
    if kind == "chat_stream":
        return CH, {**sampling, "messages": messages(rng), "stream": True, "stream_options": {"include_usage": True},
                    "n": rng.choice([1, 1, 2]), "logprobs": True, "top_logprobs": rng.randint(0, 3)}
    if kind == "dropped_stream":  # n>1 and logprobs too: more per-request state for the abort to free
        path = rng.choice([C, CH])
        body = {"prompt": prompt_text(rng), "logprobs": rng.choice([None, 2])} if path == C else {
            "messages": messages(rng), "logprobs": rng.random() < 0.5}
        return path, {**sampling, **body, "max_tokens": rng.randint(24, 64), "stream": True, "ignore_eos": True,
                      "n": rng.choice([1, 1, 2])}
    if kind == "long_output":  # ~20 blocks a sequence: a few of them overflow the GPU pool into the host's
        return C, {**sampling, "prompt": f"{rng.choice(PREAMBLES)}\n{rng.choice(QUESTIONS)}",
                   "max_tokens": rng.randint(128, 190), "ignore_eos": True}
    return C, {**sampling, "prompt": prompt_text(rng), "ignore_eos": True}


def check_counts(body: dict, choices: list[dict], usage: dict | None, per_choice: list[int] | None) -> str:
    """'' when every choice finished (length: exactly max_tokens; stop: at most) and usage agrees."""
    max_tokens, n = body["max_tokens"], body.get("n", 1)
    reasons = [choice["finish_reason"] for choice in choices]
    if len(choices) != n or any(reason not in ("length", "stop") for reason in reasons):
        return f"finish reasons {reasons} for n={n}"
    if body.get("ignore_eos") and reasons != ["length"] * n:
        return f"ignore_eos but finish reasons {reasons}"
    if usage is None:
        return "no usage"
    total, num_length = usage["completion_tokens"], reasons.count("length")
    if not num_length * max_tokens <= total <= n * max_tokens or (num_length == n and total != n * max_tokens):
        return f"completion_tokens {total} for {reasons} of max_tokens {max_tokens}"
    for reason, count in zip(reasons, per_choice or []):
        if count > max_tokens or (reason == "length" and count != max_tokens):
            return f"a choice of {count} tokens finished by {reason} (max_tokens {max_tokens})"
    return ""


def logprob_counts(path: str, body: dict, choices: list[dict]) -> list[int] | str:
    """Tokens per choice from its logprobs, each with as many alternatives as asked (or an error)."""
    counts = []
    for choice in sorted(choices, key=lambda c: c["index"]):
        if path == C:
            logprobs = choice["logprobs"]
            tops, wanted = logprobs["top_logprobs"], body["logprobs"]
            if len(tops) != len(logprobs["tokens"]) or any(len(top) < min(wanted, 1) for top in tops):
                return f"completion logprobs of {len(tops)} tops for {len(logprobs['tokens'])} tokens"
            counts.append(len(logprobs["tokens"]))
        else:
            content = choice["logprobs"]["content"]
            if any(len(entry["top_logprobs"]) != body["top_logprobs"] for entry in content):
                return f"chat top_logprobs not {body['top_logprobs']} each"
            counts.append(len(content))
    return counts


def send_plain(http: httpx.Client, kind: str, path: str, body: dict) -> Outcome:
    response = http.post(path, json=body)
    outcome = Outcome(kind, response.status_code)
    if response.status_code != 200:
        return Outcome(kind, response.status_code, False, response.text[:300])
    reply = response.json()
    per_choice = logprob_counts(path, body, reply["choices"]) if "logprobs" in kind else None
    if isinstance(per_choice, str):
        return Outcome(kind, 200, False, per_choice)
    outcome.detail = check_counts(body, reply["choices"], reply.get("usage"), per_choice)
    outcome.ok = not outcome.detail
    return outcome


def send_stream(http: httpx.Client, kind: str, path: str, body: dict, drop_after: int | None) -> Outcome:
    """Streams `body`; with drop_after, leaves after that many data chunks (closing the connection)."""
    reasons, usage, num_chunks, done = {}, None, 0, False
    with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return Outcome(kind, response.status_code, False, response.read().decode(errors="replace")[:300])
        if drop_after == 0:
            return Outcome(kind, 200, dropped=True)  # gone before the first chunk
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                reasons[choice["index"]] = choice.get("finish_reason") or reasons.get(choice["index"])
            num_chunks += 1
            if drop_after is not None and num_chunks >= drop_after:
                return Outcome(kind, 200, dropped=True)  # leaving the block drops the connection
    if drop_after is not None:
        return Outcome(kind, 200, done, "" if done else "the stream ended without [DONE]")
    if not done:
        return Outcome(kind, 200, False, "the stream ended without [DONE]")
    choices = [{"index": i, "finish_reason": reason} for i, reason in sorted(reasons.items())]
    detail = check_counts(body, choices, usage, None)
    return Outcome(kind, 200, not detail, detail)


def send_malformed(http: httpx.Client, path: str, raw: bytes) -> Outcome:
    response = http.post(path, content=raw, headers={"content-type": "application/json"})
    try:
        body = response.json()
        shaped = set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    except (ValueError, KeyError, TypeError):
        shaped = False
    if not (400 <= response.status_code < 500 and shaped):
        return Outcome("malformed", response.status_code, False, f"{raw[:80]!r} -> {response.text[:200]}")
    return Outcome("malformed", response.status_code)


def send_one(http: httpx.Client, kind: str, rng: random.Random) -> Outcome:
    path, body = rng.choice(MALFORMED) if kind == "malformed" else request_for(kind, rng)
    try:
        if kind == "malformed":
            return send_malformed(http, path, body)
        if kind == "dropped_stream":
            return send_stream(http, kind, path, body, drop_after=rng.randint(0, 6))
        if body.get("stream"):
            return send_stream(http, kind, path, body, drop_after=None)
        return send_plain(http, kind, path, body)
    except httpx.TransportError as exc:  # a timeout or a reset: the server hung or died
        return Outcome(kind, None, False, f"{type(exc).__name__}: {exc} on {str(body)[:200]}")
    except (ValueError, KeyError, TypeError) as exc:  # a reply not in OpenAI's shape
        return Outcome(kind, None, False, f"bad reply, {type(exc).__name__}: {exc} on {str(body)[:200]}")


def client_loop(url: str, seed: int, deadline: float, outcomes: list[Outcome]) -> None:
    rng = random.Random(seed)
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as http:
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            if kind == "long_output" and deadline - time.monotonic() < LONG_OUTPUT_MARGIN_S:
                kind = "completion"
            outcomes.append(send_one(http, kind, rng))  # list.append is atomic under the GIL


def drive_load(url: str, duration_s: float) -> list[Outcome]:
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + duration_s
    threads = [threading.Thread(target=client_loop, args=(url, seed, deadline, outcomes), daemon=True)
               for seed in range(NUM_CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:  # a request in flight at the deadline finishes within its timeout
        thread.join(max(deadline + REQUEST_TIMEOUT_S + 30 - time.monotonic(), 0))
    assert not any(thread.is_alive() for thread in threads), "a client still waits on the server: a hang"
    return outcomes


# ---- watching the server -----------------------------------------------------------------------
@dataclass
class Sample:
    t_s: float
    rss_bytes: int
    num_threads: int
    gauges: dict[str, float] = field(default_factory=dict)


def proc_status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as status:
        return dict(line.rstrip("\n").split(":\t", 1) for line in status if ":\t" in line)


class Monitor(threading.Thread):
    """Samples the server's RSS and threads (/proc/<pid>/status) and its load gauges every few seconds."""

    def __init__(self, url: str, pid: int) -> None:
        super().__init__(daemon=True)
        self.url, self.pid = url, pid
        self.samples: list[Sample] = []
        self.stopping = threading.Event()
        self.start_s = time.monotonic()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30.0) as http:
            while not self.stopping.wait(MONITOR_PERIOD_S):
                status = proc_status(self.pid)
                samples = scrape(http)
                gauges = {f"{name}_{tier}": metric(samples, name, tier=tier)
                          for name in ("kv_cache_usage_perc_by_tier", "num_requests_running_by_tier")
                          for tier in ("gpu", "cpu")}
                gauges["generation_tokens_total"] = metric(samples, "generation_tokens_total")
                self.samples.append(Sample(time.monotonic() - self.start_s, int(status["VmRSS"].split()[0]) * 1024,
                                           int(status["Threads"]), gauges))

    def stop(self) -> None:
        self.stopping.set()
        self.join(30.0)


def second_half(samples: list[Sample]) -> tuple[int, int, float]:
    """(RSS at the middle, RSS at the end, tokens generated between): each RSS the median of three
    samples, around the load's middle and its last three."""
    middle = min(range(len(samples)), key=lambda i: abs(samples[i].t_s - SOAK_S / 2))
    rss_middle = int(statistics.median(s.rss_bytes for s in samples[max(middle - 1, 0):middle + 2]))
    rss_end = int(statistics.median(s.rss_bytes for s in samples[-3:]))
    tokens = samples[-1].gauges["generation_tokens_total"] - samples[middle].gauges["generation_tokens_total"]
    return rss_middle, rss_end, tokens


# ---- the test ----------------------------------------------------------------------------------
def check_prompts_chunk(url: str) -> None:
    """The shared preambles are longer than one iteration's token budget: their prefills chunk."""
    with httpx.Client(base_url=url, timeout=30.0) as http:
        for preamble in PREAMBLES:
            count = http.post("/tokenize", json={"model": MODEL, "prompt": preamble}).json()["count"]
            assert count > 2 * MAX_BATCHED_TOKENS, count


def summary(outcomes: list[Outcome], samples: list[Sample], metrics: dict, wall_s: float) -> str:
    by_kind = Counter(o.kind for o in outcomes)
    step = math.ceil(len(samples) / MAX_SHOWN_SAMPLES)  # a lengthened soak's log stays short
    shown = samples[::step]
    lines = [f"chaos soak: {len(outcomes)} requests in {wall_s:.0f} s from {NUM_CLIENTS} clients",
             "  by kind: " + ", ".join(f"{kind} {count}" for kind, count in sorted(by_kind.items())),
             "  statuses: " + ", ".join(f"{status} {count}" for status, count in
                                        sorted(Counter(str(o.status) for o in outcomes).items())),
             f"  dropped mid-stream: {sum(o.dropped for o in outcomes)}; failed: {sum(not o.ok for o in outcomes)}",
             f"  every {MONITOR_PERIOD_S * step:.0f} s, RSS MiB: "
             + " ".join(f"{s.rss_bytes / 2**20:.0f}" for s in shown),
             "  second half: RSS {:.1f} -> {:.1f} MiB over {:.0f} generated tokens".format(
                 *(value / 2**20 for value in second_half(samples)[:2]), second_half(samples)[2]),
             "  threads: " + " ".join(str(s.num_threads) for s in shown),
             "  host KV pool usage: " + " ".join(f"{s.gauges['kv_cache_usage_perc_by_tier_cpu']:.2f}"
                                                 for s in shown)]
    lines += [f"  {name}: {value:g}" for name, value in metrics.items()]
    lines += [f"  FAILED {o.kind} {o.status}: {o.detail}" for o in outcomes if not o.ok][:10]
    return "\n".join(lines)


def mechanism_metrics(samples: dict) -> dict[str, float]:
    """What each mechanism did, from /metrics once idle."""
    return {
        "pipelined iterations (Neo)": metric(samples, "iterations_total", mode="pipelined"),
        "prefix cache hit tokens": sum(metric(samples, "prefix_cache_hits_total", tier=t) for t in ("gpu", "cpu")),
        "swapped out requests": metric(samples, "swapped_requests_total", direction="out"),
        "swapped in requests": metric(samples, "swapped_requests_total", direction="in"),
        "preemptions": metric(samples, "num_preemptions_total"),
        "streamed bytes from host": metric(samples, "weight_streamed_bytes_total", tier="host"),
        "streamed bytes from disk": metric(samples, "weight_streamed_bytes_total", tier="disk"),
        "CPU MLP slice seconds": metric(samples, "mlp_cpu_seconds_total"),
        "cached blocks gpu": metric(samples, "kv_cached_blocks", tier="gpu"),
        "cached blocks cpu": metric(samples, "kv_cached_blocks", tier="cpu"),
    }


def test_chaos_soak_every_mechanism_at_once(start_server, tmp_path, capsys):
    server = start_server(*serve_flags(tmp_path))
    check_prompts_chunk(server.url)
    process = psutil.Process(server.proc.pid)
    monitor = Monitor(server.url, process.pid)
    monitor.start()
    start_s = time.monotonic()
    outcomes = drive_load(server.url, SOAK_S)
    monitor.stop()
    wall_s = time.monotonic() - start_s
    with httpx.Client(base_url=server.url, timeout=30.0) as http:
        idle = wait_idle(http, IDLE_AFTER_LOAD_S)  # nothing running or waiting, no GPU block held
    mechanisms = mechanism_metrics(idle)
    with capsys.disabled():  # CI's log shows it, passing or not
        print("\n" + summary(outcomes, monitor.samples, mechanisms, wall_s))

    assert [o for o in outcomes if o.status is not None and o.status >= 500] == []
    assert [o for o in outcomes if not o.ok] == []
    assert 0.03 < sum(o.kind == "malformed" for o in outcomes) / len(outcomes) < 0.25  # the load is as described
    assert sum(o.dropped for o in outcomes) > 0.1 * len(outcomes)
    assert metric(idle, "kv_cache_usage_perc_by_tier", tier="cpu") == 0  # the host pool's blocks free too
    assert metric(idle, "num_requests_running_by_tier", tier="cpu") == 0
    for name in ("pipelined iterations (Neo)", "prefix cache hit tokens", "streamed bytes from host",
                 "streamed bytes from disk", "CPU MLP slice seconds"):
        assert mechanisms[name] > 0, name
    assert max(s.gauges["kv_cache_usage_perc_by_tier_cpu"] for s in monitor.samples) > 0  # the host tier held KV
    assert mechanisms["swapped out requests"] + mechanisms["swapped in requests"] > 0  # the long outputs moved
    rss_middle, rss_end, _ = second_half(monitor.samples)
    assert rss_end - rss_middle < MAX_RSS_GROWTH_BYTES, f"RSS {rss_middle / 2**20:.0f} -> {rss_end / 2**20:.0f} MiB"

    # no thread per request or connection stays behind: the count once idle is one the load's first half had
    first_half = monitor.samples[:len(monitor.samples) // 2]
    assert int(proc_status(process.pid)["Threads"]) <= max(s.num_threads for s in first_half)
    assert process.children(recursive=True) == []  # the testbed's GPU and CPU sides are threads, not processes
    server.signal(signal.SIGTERM)
    assert server.wait(SHUTDOWN_TIMEOUT_S) == 0, server.log_tail()
    assert "Traceback" not in server.log_path.read_text(), server.log_tail()
