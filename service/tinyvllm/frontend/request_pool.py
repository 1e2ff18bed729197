"""Frontend state of in-flight requests, taken from a pool and reset instead of allocated.

A `RequestState` lives from `EngineClient.generate()` to the end of its stream. Its collector (with
its `asyncio.Event`) and timing fields are reused by the next request.
"""

from __future__ import annotations

from typing import Optional

from tinyvllm.frontend.collector import RequestOutputCollector
from tinyvllm.scheduling.request import FinishReason


class RequestState:
    """One in-flight request as the frontend sees it. Times are `time.monotonic()` seconds."""

    __slots__ = ("request_id", "external_request_id", "arrival_time", "collector",
                 "first_token_time", "last_token_time", "queue_s", "finished", "num_prompt_tokens", "num_output_tokens",
                 "num_cached_tokens", "finish_reason")

    def __init__(self) -> None:
        self.collector = RequestOutputCollector()
        self.reset("", 0.0)

    def reset(self, request_id: str, arrival_time: float, external_request_id: str = "") -> None:
        self.request_id = request_id
        """The engine-side id: assigned by the engine client, unique in this process."""
        self.external_request_id = external_request_id
        """The caller's id: echoed back, need not be unique."""
        self.arrival_time = arrival_time
        self.collector.reset()
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.queue_s: Optional[float] = None
        self.finished = False
        # For the access log: counts so far, and how it ended.
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: Optional[FinishReason] = None

    @property
    def waiting(self) -> bool:
        """No token yet: queued in the engine or still prefilling."""
        return self.first_token_time is None and not self.finished


class RequestPool:
    """Free list of `RequestState`s. Not thread-safe: used from the event loop only."""

    def __init__(self, max_free: int = 4096) -> None:
        self._free: list[RequestState] = []
        self._max_free = max_free
        self.num_allocated = 0

    def acquire(self, request_id: str, arrival_time: float,
                external_request_id: str = "") -> RequestState:
        if self._free:
            state = self._free.pop()
        else:
            state = RequestState()
            self.num_allocated += 1
        state.reset(request_id, arrival_time, external_request_id)
        return state

    def release(self, state: RequestState) -> None:
        if len(self._free) < self._max_free:
            state.reset("", 0.0)  # drop references to outputs and errors now
            self._free.append(state)

    @property
    def num_free(self) -> int:
        return len(self._free)
