"""A server-wide cap on concurrent generation streams, whatever connection they come on.

HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS is per connection (a client opening four connections
gets four times the streams); this counts every stream of the process.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from tinyvllm.frontend.errors import TooManyStreamsError


class StreamLimiter:
    """Counts open streams; `open()` refuses one past `max_streams`. Event-loop use only."""

    def __init__(self, max_streams: int) -> None:
        if max_streams <= 0:
            raise ValueError(f"max_concurrent_streams must be positive, got {max_streams}")
        self.max_streams = max_streams
        self.num_open = 0

    @contextlib.contextmanager
    def open(self) -> Iterator[None]:
        """Hold one stream slot for the duration of the `with` block.

        Raises:
            TooManyStreamsError: `max_streams` streams are open already.
        """
        if self.num_open >= self.max_streams:
            raise TooManyStreamsError(
                f"{self.num_open} streams are open, the server's limit "
                f"(--max-concurrent-streams {self.max_streams}); retry later or elsewhere")
        self.num_open += 1
        try:
            yield
        finally:
            self.num_open -= 1
