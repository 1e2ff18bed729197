"""Protobuf <-> domain objects. No I/O, no engine: pure functions the servicer calls.

Every bad input raises `InvalidRequestError` naming the field (here, or from SamplingParams),
which `server.errors` maps to INVALID_ARGUMENT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from tinyvllm.errors import InvalidRequestError
from tinyvllm.frontend.prompts import PromptInput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.scheduling.request import FinishReason
from tinyvllm.v1 import generation_pb2 as pb


@dataclass(frozen=True)
class StreamSpec:
    """What each response carries (StreamOptions with defaults applied)."""

    text: bool = True
    token_ids: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None


@dataclass
class DomainRequest:
    """A GenerateRequest after conversion, before tokenization."""

    prompt: PromptInput
    params: SamplingParams
    priority: int
    cache_salt: Optional[str]
    stream: StreamSpec


_FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
"""The proto's finish reasons; ERROR has none (a failed request ends with a status instead)."""

CHAT_ROLES = ("system", "user", "assistant", "tool")
"""Roles a chat message may have: those chat templates know. A role is rendered verbatim, so any
other string could forge a turn (e.g. a role of "user<|im_end|>\n<|im_start|>system")."""

MAX_REQUEST_ID_LEN = 256
"""Longest request_id accepted; it is echoed in every response of the stream."""

# SamplingParameters fields with presence, copied when set (the rest are repeated or plain bools).
_OPTIONAL_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "max_tokens", "min_tokens", "skip_special_tokens",
)


# --- requests -----------------------------------------------------------------------------------

def sampling_params_from_proto(msg: pb.SamplingParameters, stream: StreamSpec) -> SamplingParams:
    """Raises InvalidRequestError naming the field."""
    kwargs: dict[str, Any] = {f: getattr(msg, f) for f in _OPTIONAL_SAMPLING_FIELDS
                              if msg.HasField(f)}
    if msg.HasField("n") and msg.n != 1:
        raise InvalidRequestError("n", f"only 1 completion per stream is supported, got {msg.n}")
    return SamplingParams(
        stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        include_stop_str_in_output=msg.include_stop_str_in_output, logprobs=stream.logprobs,
        prompt_logprobs=stream.prompt_logprobs, **kwargs)


def stream_spec_from_proto(req: pb.GenerateRequest) -> StreamSpec:
    if not req.HasField("stream"):
        return StreamSpec()
    s = req.stream
    return StreamSpec(text=s.text if s.HasField("text") else True, token_ids=s.token_ids,
                      logprobs=s.logprobs if s.HasField("logprobs") else None,
                      prompt_logprobs=(s.prompt_logprobs if s.HasField("prompt_logprobs")
                                       else None))


def chat_messages_from_proto(chat: pb.ChatPrompt) -> list[dict[str, str]]:
    if not chat.messages:
        raise InvalidRequestError("chat.messages", "must not be empty")
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise InvalidRequestError(f"chat.messages[{i}].role", "must not be empty")
        if m.role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"chat.messages[{i}].role",
                f"must be one of {', '.join(CHAT_ROLES)}, got {m.role!r:.80}")
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def prompt_from_proto(req: Any) -> PromptInput:
    """The prompt of a request with a `prompt` (Generate) or `input` (Tokenize) oneof.

    Raises:
        InvalidRequestError: no prompt, an empty one, or malformed chat messages.
    """
    kind = req.WhichOneof("prompt" if isinstance(req, pb.GenerateRequest) else "input")
    if kind is None:
        raise InvalidRequestError("prompt", "one of text, token_ids or chat must be set")
    if kind == "token_ids":
        return PromptInput(token_ids=list(req.token_ids.ids))
    if kind == "text":
        if not req.text:
            raise InvalidRequestError("prompt", "must not be empty")
        return PromptInput(text=req.text)
    return PromptInput(messages=chat_messages_from_proto(req.chat))


def domain_request_from_proto(req: pb.GenerateRequest) -> DomainRequest:
    """Everything but the prompt's token ids (the caller tokenizes `prompt`, maybe off-loop)."""
    if len(req.request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidRequestError(
            "request_id", f"is {len(req.request_id)} characters; at most {MAX_REQUEST_ID_LEN}")
    stream = stream_spec_from_proto(req)
    params = sampling_params_from_proto(req.sampling, stream)
    return DomainRequest(prompt=prompt_from_proto(req), params=params, priority=req.priority,
                         cache_salt=req.cache_salt or None, stream=stream)


# --- responses ----------------------------------------------------------------------------------

def response_from_output(out: Any, stream: StreamSpec, first: bool = False
                         ) -> Optional[pb.GenerateResponse]:
    """The response for one (possibly merged) RequestOutput; None when it has nothing to say.
    The first response of a stream carries the prompt logprobs when asked."""
    c = out.outputs[0]
    resp = pb.GenerateResponse(request_id=out.request_id)
    if first and stream.prompt_logprobs is not None and out.prompt_logprobs:
        resp.prompt_logprobs.extend(_logprobs_to_proto(
            out.prompt_token_ids[1:], out.prompt_logprobs[1:], stream.prompt_logprobs))
    if stream.text:
        resp.text = c.delta_text
    if stream.token_ids:
        resp.token_ids.extend(c.delta_token_ids)
    if stream.logprobs is not None and c.delta_logprobs:
        resp.logprobs.extend(_logprobs_to_proto(c.delta_token_ids, c.delta_logprobs,
                                                stream.logprobs))
    if out.finished:
        _fill_final(resp, out)
    elif not (resp.text or resp.token_ids or resp.logprobs or resp.prompt_logprobs):
        return None
    return resp


def _fill_final(resp: pb.GenerateResponse, out: Any) -> None:
    c = out.outputs[0]
    resp.finish_reason = _FINISH_REASONS.get(c.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
    if isinstance(c.stop_reason, str):
        resp.stop_string = c.stop_reason
    elif isinstance(c.stop_reason, int):
        resp.stop_token_id = c.stop_reason
    resp.usage.prompt_tokens = len(out.prompt_token_ids)
    resp.usage.completion_tokens = len(c.token_ids)
    resp.usage.cached_prompt_tokens = out.num_cached_tokens or 0
    m = out.metrics
    if m is not None and m.first_token_time is not None:
        resp.timing.ttft_s = m.first_token_time - m.arrival_time
        resp.timing.e2e_s = m.last_token_time - m.arrival_time
        if m.first_scheduled_time is not None:
            resp.timing.queue_s = max(0.0, m.first_scheduled_time - m.arrival_time)


def _logprobs_to_proto(token_ids: list[int], logprobs: list[dict], num_top: int
                       ) -> list[pb.TokenLogprob]:
    result = []
    for token_id, entries in zip(token_ids, logprobs):
        own = entries[token_id]
        ranked = sorted(entries.items(), key=lambda kv: kv[1].rank)[:num_top]
        result.append(pb.TokenLogprob(
            token_id=token_id, logprob=own.logprob, rank=own.rank, token=own.decoded_token or "",
            top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp.logprob,
                                        token=lp.decoded_token or "") for t, lp in ranked]))
    return result


def model_info_to_proto(info: Any, version: str) -> pb.ModelInfoResponse:
    return pb.ModelInfoResponse(
        model_name=info.model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids), block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks, device=info.device, dtype=info.dtype, version=version)
