"""The real model, loaded once per session, and helpers that run the engine to completion."""

from __future__ import annotations

import pytest

from tinyvllm.config import EngineConfig
from tinyvllm.engine.engine_core import EngineCore
from tinyvllm.engine.request import EngineCoreRequest
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.model_runner import ModelRunner


@pytest.fixture(scope="session")
def smollm2(smollm2_model):
    """LoadedModel of the bundled SmolLM2-135M-Instruct in float32 on the CPU (loaded once)."""
    return smollm2_model


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
