"""`AsyncClient`: an asyncio client for a tinyvllm server.

```python
async with AsyncClient("127.0.0.1:50051") as client:
    async for chunk in client.generate("Hello", max_tokens=32):
        print(chunk.text, end="", flush=True)
    result = await client.complete([{"role": "user", "content": "Hi"}], temperature=0)
```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence, Union

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tinyvllm.v1 import generation_pb2 as pb
from tinyvllm.v1 import generation_pb2_grpc as pb_grpc

Prompt = Union[str, Sequence[int], Sequence[dict]]
"""Text, token ids, or chat messages (`[{"role": ..., "content": ...}]`)."""

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                  pb.FINISH_REASON_ABORT: "abort"}

_SAMPLING_FIELDS = frozenset(pb.SamplingParameters.DESCRIPTOR.fields_by_name)


@dataclass
class Completion:
    """A whole completion, gathered from a stream."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    usage: Optional[pb.Usage] = None
    timing: Optional[pb.Timing] = None


def build_request(prompt: Prompt, *, request_id: str = "", stream_token_ids: bool = False,
                  stream_text: bool = True, logprobs: Optional[int] = None, priority: int = 0,
                  cache_salt: str = "", **sampling: Any) -> pb.GenerateRequest:
    """A GenerateRequest; `sampling` takes any SamplingParameters field (None = unset).

    Raises:
        TypeError: an unknown sampling parameter.
    """
    unknown = set(sampling) - _SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
    req = pb.GenerateRequest(
        request_id=request_id, priority=priority, cache_salt=cache_salt,
        sampling=pb.SamplingParameters(**{k: v for k, v in sampling.items() if v is not None}),
        stream=pb.StreamOptions(text=stream_text, token_ids=stream_token_ids, logprobs=logprobs))
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"])
                                 for m in prompt)
    else:
        req.token_ids.ids.extend(prompt)
    return req


class AsyncClient:
    """One channel to a tinyvllm server; use as an async context manager or call `close()`.

    Args:
        target: "host:port".
        options: extra grpc channel options.
    """

    def __init__(self, target: str = "127.0.0.1:50051",
                 options: Optional[Sequence[tuple[str, Any]]] = None) -> None:
        self.target = target
        self.channel = grpc.aio.insecure_channel(target, options=list(options or ()))
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def generate(self, prompt: Prompt, *, timeout: Optional[float] = None,
                       **kwargs: Any) -> AsyncIterator[pb.GenerateResponse]:
        """Stream GenerateResponses; kwargs as for `build_request`.

        Raises:
            grpc.aio.AioRpcError: the server's status (INVALID_ARGUMENT, UNAVAILABLE...).
        """
        call = self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()  # no-op when finished; aborts the request when the caller stops early

    async def complete(self, prompt: Prompt, *, timeout: Optional[float] = None,
                       **kwargs: Any) -> Completion:
        """Generate and gather the whole completion."""
        result = Completion()
        async for r in self.generate(prompt, timeout=timeout, stream_token_ids=True, **kwargs):
            result.request_id = r.request_id
            result.text += r.text
            result.token_ids.extend(r.token_ids)
            if r.finish_reason:
                result.finish_reason = FINISH_REASONS.get(r.finish_reason)
                kind = r.WhichOneof("stop_reason")
                result.stop_reason = getattr(r, kind) if kind else None
                result.usage, result.timing = r.usage, r.timing
        return result

    async def tokenize(self, prompt: Union[str, Sequence[dict]]) -> list[int]:
        req = pb.TokenizeRequest()
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.chat.messages.extend(pb.ChatMessage(**m) for m in prompt)
        return list((await self.stub.Tokenize(req)).token_ids)

    async def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        req = pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return (await self.stub.Detokenize(req)).text

    async def model_info(self) -> pb.ModelInfoResponse:
        return await self.stub.ModelInfo(pb.ModelInfoRequest())

    async def health(self, service: str = "") -> str:
        """"SERVING", "NOT_SERVING"... of `service` ("" = the whole server)."""
        resp = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def wait_until_serving(self, timeout: float = 600.0) -> None:
        """Wait until the server reports SERVING (connection errors while it starts are retried)."""
        import asyncio
        import time

        deadline = time.monotonic() + timeout
        while True:
            try:
                if await self.health() == "SERVING":
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.target} not SERVING after {timeout:.0f}s")
            await asyncio.sleep(0.2)
