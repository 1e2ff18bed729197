"""Errors the frontend raises to its callers; `tinyvllm.server.errors` maps them to status codes.

A bad request is `tinyvllm.errors.InvalidRequestError`, whichever layer finds it.
"""

from __future__ import annotations


class EngineUnavailableError(RuntimeError):
    """The engine does not take new requests: not ready yet, draining, or gone."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting for the engine (SchedulerConfig.max_waiting_requests)."""


class EngineDeadError(RuntimeError):
    """The engine process failed or exited while this request was in flight."""

    def __init__(self, request_id: str, reason: str):
        super().__init__(f"engine failed while serving request {request_id!r}: {reason}")
        self.request_id = request_id


class EngineRequestError(RuntimeError):
    """The engine refused or failed one request (the engine itself is fine)."""

    def __init__(self, request_id: str, reason: str):
        super().__init__(f"engine error on request {request_id!r}: {reason}")
        self.request_id = request_id


class TooManyStreamsError(QueueFullError):
    """The server-wide limit of concurrent Generate streams (--max-concurrent-streams) is hit."""
