"""The vLLM backend (LLMQ_BACKEND=vllm, optional: make vllm)."""
