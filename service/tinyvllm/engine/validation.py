"""Checks on a request that both the offline API and the gRPC frontend run before the engine sees it.

Each failure raises `InvalidRequestError` whose `field_name` names the offending field, so the
server can map it to INVALID_ARGUMENT with that name.
"""

from __future__ import annotations

from tinyvllm.config import RuntimeInfo
from tinyvllm.errors import InvalidRequestError
from tinyvllm.scheduling.request import EngineCoreRequest


def validate_request(req: EngineCoreRequest, info: RuntimeInfo) -> None:
    ids = req.prompt_token_ids
    if not req.request_id:
        raise InvalidRequestError("request_id", "must not be empty")
    if len(ids) == 0:
        raise InvalidRequestError("prompt", "must not be empty")
    if len(ids) >= info.max_model_len:
        raise InvalidRequestError(
            "prompt", f"is {len(ids)} tokens; the model's context length is {info.max_model_len} "
            "and at least one token must be generated")
    bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            "prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {info.vocab_size})")
    bad_stop = next((t for t in req.sampling_params.stop_token_ids
                     if not 0 <= t < info.vocab_size), None)
    if bad_stop is not None:
        raise InvalidRequestError(
            "stop_token_ids", f"token id {bad_stop} is outside the vocabulary [0, {info.vocab_size})")
