"""`load_tokenizer("llama3-8b-shape")` returns the synthetic byte-level tokenizer (so that
`tinyvllm serve --model llama3-8b-shape` can tokenize without a model file)."""

from __future__ import annotations

from tinyvllm.model.synthetic import LLAMA3_8B_SHAPE
from tinyvllm.tokenization import load_tokenizer
from tinyvllm.tokenization.synthetic import synthetic_tokenizer


def test_load_tokenizer_for_synthetic_model():
    tok = load_tokenizer("llama3-8b-shape")
    assert tok.vocab_size == LLAMA3_8B_SHAPE.vocab_size
    same = synthetic_tokenizer(LLAMA3_8B_SHAPE.vocab_size, "llama3-8b-shape")
    text = "Hello, world! héllo 123"
    ids = tok.encode(text)
    assert ids == same.encode(text)
    assert all(0 <= i < LLAMA3_8B_SHAPE.vocab_size for i in ids)
    assert tok.decode(ids) == text
