"""The one error type for a bad request, shared by every layer that checks one.

Sampling parameters, the engine's request checks, prompt tokenization, protobuf and OpenAI JSON
conversion all raise `InvalidRequestError`; `server.errors` maps it to INVALID_ARGUMENT (gRPC) and
the HTTP API to 400 with `param` = `field_name`. The module imports nothing, so any layer may
raise it (the engine process, the frontend, the offline `LLM`).
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request field is invalid.

    Attributes:
        field_name: the offending field as the client wrote it (`top_p`, `prompt`,
            `chat.messages[2].role`); the message starts with it.
        reason: the message without the field name.
    """

    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"{field_name}: {reason}")
        self.field_name = field_name
        self.reason = reason

    def __reduce__(self):  # pickles (e.g. across multiprocessing) with both arguments
        return type(self), (self.field_name, self.reason)
