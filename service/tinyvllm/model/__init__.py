"""Model definitions (Llama family) and weight loading (HF safetensors, GGUF).

Names are imported lazily: `import tinyvllm.model` alone loads no torch. The tokenizer and the
model-file helpers, which the frontend needs without torch, live in `tinyvllm.tokenization` and
`tinyvllm.model_files`.
"""

import importlib

_WHERE = {"LlamaArch": "arch", "LlamaForCausalLM": "llama", "LoadedModel": "loader",
          "load_model": "loader"}

__all__ = ["LlamaArch", "LlamaForCausalLM", "LoadedModel", "load_model"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"tinyvllm.model.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'tinyvllm.model' has no attribute {name!r}")
