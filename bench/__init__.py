"""llmq benchmark: `make bench` (python -m bench.bench) measures the raw model, the served
stack under closed-loop load and continuous vs static batching on a mixed Poisson workload."""
