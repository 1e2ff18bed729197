"""The real model, loaded once per session, and helpers that run the engine to completion."""

from __future__ import annotations

import pytest

from tinyvllm.config import EngineConfig
from tinyvllm.engine.engine_core import EngineCore
from tinyvllm.engine.executor import UniProcExecutor
from tinyvllm.scheduling.request import EngineCoreRequest
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.model_runner import ModelRunner


@pytest.fixture(scope="session")
def smollm2(smollm2_model):
    """LoadedModel of the bundled SmolLM2-135M-Instruct in float32 on the CPU (loaded once)."""
    return smollm2_model


def make_engine(loaded, **engine_kwargs) -> EngineCore:
    """An EngineCore over an already loaded model (loading takes seconds; engines are cheap)."""
    config = EngineConfig.from_kwargs(device="cpu", dtype="float32", **engine_kwargs)
    return EngineCore(config, UniProcExecutor(config, ModelRunner(config, loaded=loaded)))


def run_to_completion(engine: EngineCore, prompts: list[list[int]],
                      params: SamplingParams | list[SamplingParams],
                      field: str = "new_token_ids") -> list[list]:
    """Add every prompt at once (with one params for all, or one per prompt), step until done;
    per prompt, in prompt order, what the outputs carried in `field` (token ids, or
    "new_logprobs")."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    outputs: dict[str, list] = {}
    for i, (ids, p) in enumerate(zip(prompts, per_prompt, strict=True)):
        engine.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=ids,
                                             sampling_params=p))
        outputs[str(i)] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(getattr(out, field))
    return [outputs[str(i)] for i in range(len(prompts))]


def assert_all_blocks_free(engine: EngineCore) -> None:
    stats = engine.get_stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
