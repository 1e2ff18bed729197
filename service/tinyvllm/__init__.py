"""tinyvllm: a small, fast LLM inference server."""
