"""The llama.cpp backend (LLMQ_BACKEND=llama_cpp, optional: make llama-cpp)."""
