"""A model-free stand-in for `EngineCore` (same interface), for frontend tests of the IPC path.

Each step emits one token per request: the request's last prompt token + 1. A prompt containing
`FAIL_TOKEN` makes `step()` raise, which must take the engine process down cleanly.
"""

from __future__ import annotations

from tinyvllm.config import EngineConfig, RuntimeInfo
from tinyvllm.engine.stats import EngineStats
from tinyvllm.scheduling.request import EngineCoreOutput, EngineCoreRequest, FinishReason
from tinyvllm.engine.validation import validate_request

FAIL_TOKEN = 13


class FakeEngineCore:
    def __init__(self, config: EngineConfig):
        self.runtime_info = RuntimeInfo(
            num_kv_blocks=100, block_size=16, max_model_len=256, vocab_size=49152,
            eos_token_ids=(2,), model_name="fake", device="cpu", dtype="float32")
        self.requests: dict[str, tuple[EngineCoreRequest, list[int]]] = {}

    def add_request(self, req: EngineCoreRequest) -> None:
        validate_request(req, self.runtime_info)
        self.requests[req.request_id] = (req, [])

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[EngineCoreOutput]:
        outputs = []
        for request_id, (req, out) in list(self.requests.items()):
            if FAIL_TOKEN in req.prompt_token_ids:
                raise RuntimeError("injected engine fault")
            out.append(req.prompt_token_ids[-1] + 1 + len(out))
            done = len(out) >= req.sampling_params.max_tokens
            outputs.append(EngineCoreOutput(request_id=request_id, new_token_ids=[out[-1]],
                                            finish_reason=FinishReason.LENGTH if done else None))
            if done:
                del self.requests[request_id]
        return outputs

    def get_stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.requests), num_kv_blocks=100,
                           num_free_kv_blocks=100, kv_cache_usage=0.01 * len(self.requests))

    def shutdown(self) -> None:
        self.requests.clear()
