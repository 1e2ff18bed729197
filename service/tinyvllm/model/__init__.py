"""Model definitions (Llama family), tokenizer, and weight loading (HF safetensors, GGUF).

Names are imported lazily, so that the server's frontend, which only needs the tokenizer, does not
import torch (seconds of start-up with the event loop blocked, and its memory).
"""

import importlib

_WHERE = {"LlamaArch": "arch", "LlamaForCausalLM": "llama", "LoadedModel": "loader",
          "load_model": "loader", "resolve_model_path": "loader", "Tokenizer": "tokenizer",
          "load_tokenizer": "tokenizer"}

__all__ = ["LlamaArch", "LlamaForCausalLM", "LoadedModel", "load_model", "resolve_model_path",
           "Tokenizer", "load_tokenizer"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"tinyvllm.model.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'tinyvllm.model' has no attribute {name!r}")
