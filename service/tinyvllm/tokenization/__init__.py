"""Tokenizers, chat templates and the model files they come from, without torch.

The frontend process tokenizes, detokenizes and renders chat templates with these while the
engine process loads the weights; nothing here imports torch (tested by
`tests/frontend/test_no_torch.py`), and `tinyvllm.model` builds its `LoadedModel.tokenizer`
from the same functions.
"""

from tinyvllm.tokenization.tokenizer import (Tokenizer, load_tokenizer,
                                             tokenizer_from_gguf_metadata, tokenizer_from_hf_dir)

__all__ = ["Tokenizer", "load_tokenizer", "tokenizer_from_gguf_metadata", "tokenizer_from_hf_dir"]
