"""The Generation servicer: protobuf in, domain objects to the engine client, protobuf out.

It raises; `server.errors.ErrorMappingInterceptor` turns exceptions into status codes.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import AsyncIterator

import grpc.aio

from tinyvllm.engine.validation import RequestValidationError
from tinyvllm.frontend.engine_client import AsyncEngineClient
from tinyvllm.server import convert
from tinyvllm.server.errors import current_request_id
from tinyvllm.v1 import generation_pb2 as pb
from tinyvllm.v1 import generation_pb2_grpc as pb_grpc


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("tinyvllm")
    except PackageNotFoundError:
        return "unknown"


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, engine: AsyncEngineClient) -> None:
        self.engine = engine
        self.version = _version()

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        current_request_id.set(request_id)
        self.engine.check_accepting()
        req = convert.domain_request_from_proto(request, self.engine.tokenizer)
        outputs = self.engine.generate(request_id, req.prompt, req.prompt_token_ids, req.params,
                                       priority=req.priority, cache_salt=req.cache_salt)
        # aclosing: a cancelled stream aborts its engine request now, not at garbage collection.
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                timing = self.engine.timing(request_id) if out.finished else None
                response = convert.response_from_output(out, req.stream, timing)
                if response is not None:
                    yield response

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        self.engine.check_accepting()
        tokenizer = self.engine.tokenizer
        _, ids = convert.tokenize_prompt(tokenizer, request)
        pieces = tokenizer.pieces(ids) if request.return_pieces else []
        return pb.TokenizeResponse(token_ids=ids, tokens=tokenizer.token_texts(ids), pieces=pieces)

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        self.engine.check_accepting()
        vocab_size = self.engine.runtime_info.vocab_size
        bad = next((t for t in request.token_ids if t >= vocab_size), None)
        if bad is not None:
            raise RequestValidationError(
                "token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = self.engine.tokenizer.decode(list(request.token_ids), skip_special_tokens=skip)
        return pb.DetokenizeResponse(text=text)

    async def ModelInfo(self, request: pb.ModelInfoRequest,
                        context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        self.engine.check_accepting()
        return convert.model_info_to_proto(self.engine.runtime_info, self.version)


