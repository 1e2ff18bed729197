"""Checks on a request that both the offline API and the gRPC frontend run before the engine sees it.

Each failure raises `RequestValidationError` whose `field_name` names the offending field, so the
server can map it to INVALID_ARGUMENT with that name.
"""

from __future__ import annotations

from tinyvllm.config import RuntimeInfo
from tinyvllm.scheduling.request import EngineCoreRequest


class RequestValidationError(ValueError):
    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name


def validate_request(req: EngineCoreRequest, info: RuntimeInfo) -> None:
    ids = req.prompt_token_ids
    if not req.request_id:
        raise RequestValidationError("request_id", "must not be empty")
    if len(ids) == 0:
        raise RequestValidationError("prompt", "must not be empty")
    if len(ids) >= info.max_model_len:
        raise RequestValidationError(
            "prompt", f"is {len(ids)} tokens; the model's context length is {info.max_model_len} "
            "and at least one token must be generated")
    bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise RequestValidationError(
            "prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {info.vocab_size})")
    bad_stop = next((t for t in req.sampling_params.stop_token_ids
                     if not 0 <= t < info.vocab_size), None)
    if bad_stop is not None:
        raise RequestValidationError(
            "stop_token_ids", f"token id {bad_stop} is outside the vocabulary [0, {info.vocab_size})")
