"""engine/core_proc: once the engine is loaded and serving, its start-up heap is frozen (out of
the cyclic collector's sight), observed from inside a real spawned engine process."""

from __future__ import annotations

import gc

from tests.server.fake_engine import FakeEngineCore
from tinyvllm.config import EngineConfig
from tinyvllm.frontend.engine_client import AsyncEngineClient
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.scheduling.request import EngineCoreOutput, FinishReason

FREEZE_PROBE_ENGINE = "tests.engine.test_core_proc:FreezeProbeEngineCore"


class FreezeProbeEngineCore(FakeEngineCore):
    """Answers each request, in one step, with what the collector of the engine process sees:
    [1 if any object is frozen else 0, 1 if this engine (made at start-up) is frozen else 0]."""

    def step(self) -> list[EngineCoreOutput]:
        # gc.get_objects() lists the collector's generations, never the frozen (permanent) one.
        self_frozen = not any(obj is self for obj in gc.get_objects())
        flags = [int(gc.get_freeze_count() > 0), int(self_frozen)]
        outputs = [EngineCoreOutput(request_id=request_id, new_token_ids=flags,
                                    finish_reason=FinishReason.LENGTH)
                   for request_id in self.requests]
        self.requests.clear()
        return outputs


async def test_a_serving_engine_process_has_its_start_up_heap_frozen():
    client = AsyncEngineClient(EngineConfig.from_kwargs(), engine_class=FREEZE_PROBE_ENGINE)
    await client.start(ready_timeout_s=120)
    try:
        flags: list[int] = []
        async for out in client.generate("probe", None, [5], SamplingParams(max_tokens=2)):
            flags.extend(out.outputs[0].delta_token_ids)
        assert flags == [1, 1]
    finally:
        await client.shutdown()
