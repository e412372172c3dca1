# vToken front door. Every target installs what it needs first (into .venv/).
SHELL := /bin/bash
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
NPROC   := $(shell nproc 2>/dev/null || echo 2)
export OMP_NUM_THREADS ?= $(NPROC)
HOST    ?= 127.0.0.1
PORT    ?= 8000
# make serve: SmolLM2 with vToken on (H2O; a budget that evicts on ShareGPT-length chats)
VTOKEN_CONFIG ?= {"vtoken": {"policy": "h2o", "budget": 192}}
SERVE_ARGS ?= --dtype bfloat16 --max-model-len 4096 --block-size 32 --enforce-eager --kv-cache-memory-bytes 536870912

.PHONY: install install-gpu assets serve test test-fast bench bench-full patches-check device-check clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[test]'
	@# PyPI's torchvision/torchaudio/torchcodec break transformers beside the CPU torch build.
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

install: $(VENV)/.installed

# NVIDIA machines: the same code on the CUDA build of vLLM 0.32.x (Triton kernels).
install-gpu:
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q 'vllm>=0.32.0,<0.33'
	$(VPY) -m pip install -q --no-deps -e .
	$(VPY) -m pip install -q pydantic prometheus_client tqdm gguf accelerate matplotlib pytest pytest-timeout hypothesis

assets: install
	$(VENV)/bin/vtoken assets

serve: assets
	$(VPY) -m vllm.entrypoints.openai.api_server --model "$$($(VPY) -c 'from vtoken.assets.paths import smollm2_dir; print(smollm2_dir())')" \
	  --served-model-name smollm2 --host $(HOST) --port $(PORT) $(SERVE_ARGS) --additional-config '$(VTOKEN_CONFIG)'

test: assets
	$(VPY) -m pytest -q -ra tests

test-fast: install
	$(VPY) -m pytest -q -ra tests/core

# Small versions of every benchmark (< 20 min on 2 cores); results in benchmarks/results/.
bench: assets
	$(VPY) benchmarks/bench_all.py --small

# Full versions (hours on 2 cores; see benchmarks/README.md for each one's run time).
bench-full: assets
	$(VPY) benchmarks/bench_all.py

# One prepared GPU check (<= 8 min on one GPU; docs/gpu-kernels.md): Triton kernel tests on CUDA
# tensors, move bandwidth vs a device copy, scorer timing -> benchmarks/results/device_check.json.
# Without CUDA it says so in one line and runs the interpreter subset (no JSON).
# Needs an installed .venv (make install-gpu on NVIDIA machines; make install on CPU ones).
device-check:
	@test -x $(VPY) || { echo "device-check: no $(VPY); run make install-gpu (NVIDIA) or make install"; exit 1; }
	$(VPY) benchmarks/device_check.py

patches-check: install
	$(VPY) -m vtoken.patches check

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
