"""The Generation servicer: protobuf in, domain objects to the engine client, protobuf out.

It raises; `server.errors.ErrorMappingInterceptor` turns exceptions into status codes.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import AsyncIterator, Optional

import grpc.aio

from tinyvllm.config import ServerConfig
from tinyvllm.errors import InvalidRequestError
from tinyvllm.frontend.engine_client import AsyncEngineClient
from tinyvllm.frontend.prompts import PromptTokenizer, default_max_prompt_bytes
from tinyvllm.frontend.stream_limit import StreamLimiter
from tinyvllm.server import convert
from tinyvllm.server.errors import current_request_id
from tinyvllm.v1 import generation_pb2 as pb
from tinyvllm.v1 import generation_pb2_grpc as pb_grpc


BYTES_PER_TOKEN_ESTIMATE = 4
"""Rough size of a token's work, to decide when a Tokenize/Detokenize reply is built off-loop."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("tinyvllm")
    except PackageNotFoundError:
        return "unknown"


class GenerationServicer(pb_grpc.GenerationServicer):
    """Generation over one engine client.

    Generate streams count against `max_concurrent_streams` for the whole server; prompts are
    tokenized by a `PromptTokenizer` (size limit first, large ones off the event loop).
    """

    def __init__(self, engine: AsyncEngineClient, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.streams = StreamLimiter(config.max_concurrent_streams)
        self.version = _version()
        self._prompts: Optional[PromptTokenizer] = None

    @property
    def prompts(self) -> PromptTokenizer:
        """Made on first use: the tokenizer and context length come with the engine."""
        if self._prompts is None:
            max_bytes = self.config.max_prompt_bytes or default_max_prompt_bytes(
                self.engine.runtime_info.max_model_len)
            self._prompts = PromptTokenizer(
                self.engine.tokenizer, max_prompt_bytes=max_bytes,
                parse_special_in_chat_content=self.config.parse_special_tokens_in_chat)
        return self._prompts

    def close(self) -> None:
        if self._prompts is not None:
            self._prompts.close()

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        # The caller's id is only echoed: the engine client runs the request under its own.
        request_id = request.request_id or uuid.uuid4().hex
        current_request_id.set(request_id)
        with self.streams.open():
            self.engine.check_accepting()
            req = convert.domain_request_from_proto(request)
            prompt, prompt_token_ids = await self.prompts.tokenize(req.prompt)
            outputs = self.engine.generate(request_id, prompt, prompt_token_ids, req.params,
                                           priority=req.priority, cache_salt=req.cache_salt)
            # aclosing: a cancelled stream aborts its engine request now, not at garbage
            # collection.
            async with contextlib.aclosing(outputs):
                first = True
                async for out in outputs:
                    response = convert.response_from_output(out, req.stream, first)
                    if response is not None:
                        first = False
                        yield response

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        self.engine.check_accepting()
        _, ids = await self.prompts.tokenize(convert.prompt_from_proto(request))
        return await self.prompts.run(len(ids) * BYTES_PER_TOKEN_ESTIMATE,
                                      self._tokenize_response, ids, request.return_pieces)

    def _tokenize_response(self, ids: list[int], return_pieces: bool) -> pb.TokenizeResponse:
        tokenizer = self.engine.tokenizer
        pieces = tokenizer.pieces(ids) if return_pieces else []
        return pb.TokenizeResponse(token_ids=ids, tokens=tokenizer.token_texts(ids), pieces=pieces)

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        self.engine.check_accepting()
        ids = list(request.token_ids)
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await self.prompts.run(len(ids) * BYTES_PER_TOKEN_ESTIMATE, self._detokenize,
                                      ids, skip)
        return pb.DetokenizeResponse(text=text)

    def _detokenize(self, ids: list[int], skip_special_tokens: bool) -> str:
        vocab_size = self.engine.runtime_info.vocab_size
        if ids and max(ids) >= vocab_size:
            bad = next(t for t in ids if t >= vocab_size)
            raise InvalidRequestError(
                "token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        return self.engine.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    async def ModelInfo(self, request: pb.ModelInfoRequest,
                        context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        self.engine.check_accepting()
        return convert.model_info_to_proto(self.engine.runtime_info, self.version)
