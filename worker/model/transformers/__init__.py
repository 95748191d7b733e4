"""The transformers backend (the default): our batched decode, KV cache and CPU kernels."""
