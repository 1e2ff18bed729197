"""Per-request hand-off from the output loop to the stream that consumes it.

The output loop `put`s one `RequestOutput` per engine step; the consumer `get`s whenever it is
ready. A consumer slower than the engine does not grow a queue: pending deltas are merged into the
newest output (text, token ids and logprobs concatenated), so it receives one coalesced delta.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional


def merge_outputs(pending: Any, new: Any) -> Any:
    """Return `new` carrying `pending`'s not-yet-consumed deltas in front of its own.

    Cumulative fields (text, token_ids, finish_reason, finished) are `new`'s already.
    """
    if pending is new:  # the processor updated the same object in place
        return new
    old_c, new_c = pending.outputs[0], new.outputs[0]
    new_c.delta_text = old_c.delta_text + new_c.delta_text
    new_c.delta_token_ids = list(old_c.delta_token_ids) + list(new_c.delta_token_ids)
    if old_c.delta_logprobs is not None:
        new_c.delta_logprobs = list(old_c.delta_logprobs) + list(new_c.delta_logprobs or [])
    return new


class RequestOutputCollector:
    """Holds at most one (merged) output or an error for one request; reusable after `reset`."""

    __slots__ = ("_output", "_error", "_ready")

    def __init__(self) -> None:
        self._output: Optional[Any] = None
        self._error: Optional[BaseException] = None
        self._ready = asyncio.Event()

    def reset(self) -> None:
        self._output = None
        self._error = None
        self._ready.clear()

    def put(self, output: Any) -> None:
        self._output = output if self._output is None else merge_outputs(self._output, output)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """Make the next `get` raise `error` (pending output is dropped: the stream has failed)."""
        self._error = error
        self._ready.set()

    async def get(self) -> Any:
        """The next (possibly merged) output; raises the error given to `fail`."""
        while self._output is None and self._error is None:
            await self._ready.wait()
        self._ready.clear()
        if self._error is not None:
            raise self._error
        output, self._output = self._output, None
        return output
