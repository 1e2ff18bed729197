"""Model definitions (Llama family), tokenizer, and weight loading (HF safetensors, GGUF)."""

from tinyvllm.model.arch import LlamaArch
from tinyvllm.model.llama import LlamaForCausalLM
from tinyvllm.model.loader import LoadedModel, load_model, resolve_model_path
from tinyvllm.model.tokenizer import Tokenizer, load_tokenizer

__all__ = ["LlamaArch", "LlamaForCausalLM", "LoadedModel", "load_model", "resolve_model_path",
           "Tokenizer", "load_tokenizer"]
