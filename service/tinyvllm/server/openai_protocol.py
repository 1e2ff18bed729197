"""OpenAI request bodies (pydantic) → `GenerateRequest`, and `GenerateResponse` → OpenAI JSON.

The HTTP API converts each body into the gRPC request message and hands it to the same
`GenerationServicer`, so both APIs share one conversion, tokenization, validation and limit path.
Unknown fields are refused (400 naming the field) rather than silently ignored; OpenAI fields
that tinyvllm cannot honour (n > 1, echo, logit_bias, tools, ...) are refused the same way.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from tinyvllm.errors import InvalidRequestError
from tinyvllm.scheduling.request import FinishReason
from tinyvllm.v1 import generation_pb2 as pb

FINISH_REASONS = {pb.FINISH_REASON_STOP: FinishReason.STOP,
                  pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
                  pb.FINISH_REASON_ABORT: FinishReason.ABORT}
"""The proto's finish reasons; OpenAI's JSON carries their values ("stop", "length")."""

# Sampling fields with the same name and meaning in OpenAI/vLLM JSON and SamplingParameters.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "min_tokens", "skip_special_tokens",
                    "ignore_eos", "include_stop_str_in_output")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields common to completions and chat: OpenAI's, then vLLM's extra sampling fields."""

    model: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stop: Union[str, list[str], None] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[int] = None
    user: Optional[str] = None  # accepted for compatibility; not used
    # vLLM's extra sampling parameters
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    priority: int = 0
    cache_salt: Optional[str] = None
    prompt_logprobs: Optional[int] = None  # vLLM's: each prompt token's logprob and top-N


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False


class ChatMessage(_Strict):
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None


class TokenizeRequest(_Strict):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True  # only True: prompts are tokenized as Generate does


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int] = Field(default_factory=list)
    skip_special_tokens: Optional[bool] = None


# --- requests -----------------------------------------------------------------------------------

def completion_to_proto(req: CompletionRequest) -> pb.GenerateRequest:
    msg = _base_request(req, req.max_tokens, req.logprobs)
    if req.echo:
        raise InvalidRequestError("echo", "echoing the prompt is not supported")
    _set_completion_prompt(msg, req.prompt)
    return msg


def chat_to_proto(req: ChatCompletionRequest) -> pb.GenerateRequest:
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise InvalidRequestError("max_completion_tokens", "give it or max_tokens, not both")
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs", "needs logprobs: true")
    max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    msg = _base_request(req, max_tokens, num_logprobs)
    if not req.messages:
        raise InvalidRequestError("messages", "must not be empty")
    for i, m in enumerate(req.messages):
        msg.chat.messages.append(pb.ChatMessage(role=m.role, content=message_text(m, i)))
    return msg


def message_text(m: ChatMessage, index: int) -> str:
    """A message's content as text: a string, or the concatenated `text` parts."""
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    texts = []
    for j, part in enumerate(m.content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"messages[{index}].content[{j}]",
                                       "only parts of type 'text' with a string 'text' are "
                                       "supported")
        texts.append(part["text"])
    return "".join(texts)


def chat_messages_to_proto(messages: list[ChatMessage]) -> pb.ChatPrompt:
    return pb.ChatPrompt(messages=[pb.ChatMessage(role=m.role, content=message_text(m, i))
                                   for i, m in enumerate(messages)])


def _base_request(req: _SamplingRequest, max_tokens: Optional[int],
                  num_logprobs: Optional[int]) -> pb.GenerateRequest:
    if req.n != 1:
        raise InvalidRequestError("n", f"only 1 choice per request is supported, got {req.n}")
    msg = pb.GenerateRequest(priority=_checked(req.priority, "priority", _INT32),
                             cache_salt=req.cache_salt or "")
    s = msg.sampling
    for name in _SAMPLING_FIELDS:
        value = getattr(req, name)
        if value is not None:
            _assign(s, name, value)
    if max_tokens is not None:
        _assign(s, "max_tokens", max_tokens)
    if req.stop is not None:
        s.stop.extend([req.stop] if isinstance(req.stop, str) else req.stop)
    if req.stop_token_ids:
        _assign(s, "stop_token_ids", req.stop_token_ids)
    msg.stream.text = True
    msg.stream.token_ids = True
    if num_logprobs is not None:
        _assign(msg.stream, "logprobs", num_logprobs)
    if req.prompt_logprobs is not None:
        _assign(msg.stream, "prompt_logprobs", req.prompt_logprobs)
    return msg


_INT32 = (-(2**31), 2**31 - 1)


def _checked(value: int, name: str, bounds: tuple[int, int]) -> int:
    if not bounds[0] <= value <= bounds[1]:
        raise InvalidRequestError(name, f"{value} is out of range [{bounds[0]}, {bounds[1]}]")
    return value


def _assign(msg: Any, name: str, value: Any) -> None:
    """Set a proto field; a value it cannot hold (out of int32 range, negative id) is a 400."""
    try:
        if isinstance(value, list):
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(name, f"{value!r} is not a valid value ({e})") from None


def _set_completion_prompt(msg: pb.GenerateRequest, prompt: Any) -> None:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidRequestError("prompt", f"one prompt per request is supported, got "
                                       f"{len(prompt)}")
        prompt = prompt[0]
    if isinstance(prompt, str):
        msg.text = prompt
    elif not prompt:
        raise InvalidRequestError("prompt", "must not be empty")
    else:
        try:
            msg.token_ids.ids.extend(prompt)
        except (ValueError, TypeError):
            raise InvalidRequestError("prompt", "token ids must be integers in [0, 2^32)") from None


# --- responses ----------------------------------------------------------------------------------

class ResponseBuilder:
    """Turns the servicer's GenerateResponses into OpenAI JSON for one request."""

    def __init__(self, chat: bool, model: str, num_logprobs: Optional[int]) -> None:
        self.chat = chat
        self.model = model
        self.num_logprobs = num_logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def chunk(self, resp: pb.GenerateResponse, first: bool) -> dict:
        """One streamed chunk (`chat.completion.chunk` or `text_completion`)."""
        finish = _finish_reason(resp)
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if resp.text or first:
                delta["content"] = resp.text
            choice["delta"] = delta
        else:
            choice["text"] = resp.text
        choice["logprobs"] = self._logprobs(list(resp.logprobs))
        choice["finish_reason"] = finish
        if finish is not None:
            choice["stop_reason"] = _stop_reason(resp)
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._with_prompt_logprobs(self._envelope(obj, [choice]), resp)

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage}

    def final(self, responses: list[pb.GenerateResponse]) -> dict:
        """The non-streaming body: every delta joined."""
        last = responses[-1]
        text = "".join(r.text for r in responses)
        logprobs = self._logprobs([lp for r in responses for lp in r.logprobs])
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs,
                                  "finish_reason": _finish_reason(last)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["stop_reason"] = _stop_reason(last)
        body = {**self._envelope(self.object, [choice]), "usage": usage_json(last)}
        return self._with_prompt_logprobs(body, responses[0])

    def _with_prompt_logprobs(self, body: dict, resp: pb.GenerateResponse) -> dict:
        """vLLM's `prompt_logprobs` (when the stream's first response carries them): None for
        the first prompt token, then {token id: {logprob, rank, decoded_token}} for the token
        and its alternatives; on the choice for completions, at the top for chat."""
        if not resp.prompt_logprobs:
            return body
        entries: list[Optional[dict]] = [None]
        for e in resp.prompt_logprobs:
            entry = {str(t.token_id): {"logprob": t.logprob, "rank": rank,
                                       "decoded_token": t.token}
                     for rank, t in enumerate(e.top_logprobs, start=1)}
            entry[str(e.token_id)] = {"logprob": e.logprob, "rank": e.rank,
                                      "decoded_token": e.token}
            entries.append(entry)
        (body if self.chat else body["choices"][0])["prompt_logprobs"] = entries
        return body

    def _logprobs(self, entries: list[pb.TokenLogprob]) -> Optional[dict]:
        if self.num_logprobs is None:
            return None
        if self.chat:
            return {"content": [_chat_logprob(e) for e in entries]}
        return {"tokens": [e.token for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in entries]}


def _finish_reason(resp: pb.GenerateResponse) -> Optional[str]:
    """OpenAI's `finish_reason`: None until the last response."""
    reason = FINISH_REASONS.get(resp.finish_reason)
    return None if reason is None else reason.value


def _stop_reason(resp: pb.GenerateResponse) -> Union[str, int, None]:
    """vLLM's `stop_reason`: the stop string or stop token id that ended it; None for EOS/length."""
    kind = resp.WhichOneof("stop_reason")
    return getattr(resp, kind) if kind else None


def _chat_logprob(e: pb.TokenLogprob) -> dict:
    return {"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
            "top_logprobs": [{"token": t.token, "logprob": t.logprob,
                              "bytes": list(t.token.encode())} for t in e.top_logprobs]}


def usage_json(resp: pb.GenerateResponse) -> dict:
    u = resp.usage
    usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
             "total_tokens": u.prompt_tokens + u.completion_tokens}
    if u.cached_prompt_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": u.cached_prompt_tokens}
    return usage


def error_body(message: str, err_type: str, param: Optional[str] = None,
               code: Optional[Union[str, int]] = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}

