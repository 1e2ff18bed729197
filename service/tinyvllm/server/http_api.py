"""The OpenAI-compatible HTTP API (FastAPI): thin routes over the gRPC `GenerationServicer`.

```
POST /v1/completions, /v1/chat/completions ─▶ openai_protocol: body → GenerateRequest
    ─▶ GenerationServicer.Generate (the gRPC path: tokenize, validate, limits, engine, metrics)
    ─▶ ResponseBuilder: GenerateResponse → JSON, or server-sent events ending `data: [DONE]`
GET /v1/models · POST /tokenize · POST /detokenize · GET /health
```
Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`; the status comes from
the same exception table as gRPC's (`server.errors.status_for`): a bad request is an
`InvalidRequestError` wherever it is found (pydantic's body checks included), answered 400 with
its `field_name` as `param`. A client that disconnects has its
request aborted in the engine: streams are cancelled by Starlette, and waits before the first
byte of a response race a disconnect watcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, TypeVar

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError as BodyValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tinyvllm.errors import InvalidRequestError
from tinyvllm.server import openai_protocol as oai
from tinyvllm.server.errors import status_for
from tinyvllm.server.security import ApiKeyAuth
from tinyvllm.server.servicer import GenerationServicer
from tinyvllm.v1 import generation_pb2 as pb

T = TypeVar("T")

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def from_exception(cls, exc: BaseException) -> "ApiError":
        code, details = status_for(exc)
        param = exc.field_name if isinstance(exc, InvalidRequestError) else None
        return cls(HTTP_STATUS.get(code, 500), details, param)

    def body(self) -> dict:
        return oai.error_body(self.message, ERROR_TYPES.get(self.status, "server_error"),
                              self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class ClientDisconnected(Exception):
    """The client went away before its response began; the engine request is aborted."""


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request its client abandoned


def bearer_check(auth: Optional[ApiKeyAuth]) -> Callable[[Request], None]:
    """A FastAPI dependency: 401 unless the request carries a valid API key (none configured:
    everything passes)."""
    def check(request: Request) -> None:
        if auth is not None and not auth.check(request.headers.get("authorization")):
            raise ApiError(401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key")
    return check


def build_api_app(servicer: GenerationServicer, auth: Optional[ApiKeyAuth], auth_health: bool,
                  is_healthy: Callable[[], bool]) -> FastAPI:
    """The HTTP API's ASGI app (served by uvicorn, see `server.http_server`)."""
    app = FastAPI(title="tinyvllm", docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)
    routes = _Routes(servicer)
    guarded = [Depends(bearer_check(auth))]
    app.add_api_route("/v1/models", routes.models, methods=["GET"], dependencies=guarded)
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"],
                      dependencies=guarded)
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"], dependencies=guarded)
    app.add_api_route("/tokenize", routes.tokenize, methods=["POST"], dependencies=guarded)
    app.add_api_route("/detokenize", routes.detokenize, methods=["POST"], dependencies=guarded)

    async def health() -> PlainTextResponse:
        ok = is_healthy()
        return PlainTextResponse("SERVING\n" if ok else "NOT_SERVING\n", 200 if ok else 503)

    app.add_api_route("/health", health, methods=["GET"],
                      dependencies=guarded if auth_health else [])
    return app


def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    async def invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return ApiError.from_exception(exc).response()

    async def invalid_body(request: Request, exc: BodyValidationError) -> JSONResponse:
        return ApiError.from_exception(_body_error(exc)).response()

    async def client_gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it; ends quietly

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(ClientDisconnected, client_gone)
    app.add_exception_handler(InvalidRequestError, invalid_request)
    app.add_exception_handler(BodyValidationError, invalid_body)


def _body_error(exc: BodyValidationError) -> InvalidRequestError:
    """pydantic's first error, naming the field (`messages[0].role`; `body` for the whole)."""
    err = exc.errors()[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return InvalidRequestError("body", f"is not valid JSON: {err.get('msg')}")
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _is_union_tag(part):
            param += ("." if param else "") + part
    message = err.get("msg", "invalid value")
    if err.get("type") == "extra_forbidden":
        message = "unknown field (not supported by tinyvllm)"
    return InvalidRequestError(param or "body", message)


_UNION_TAGS = {"str", "int", "float", "bool", "none", "dict"}


def _is_union_tag(part: str) -> bool:
    """pydantic names the branch of a Union that failed (`list[int]`, `str`): not a field."""
    return part in _UNION_TAGS or "[" in part or part.startswith("function-")


class _Routes:
    def __init__(self, servicer: GenerationServicer) -> None:
        self.servicer = servicer
        self.engine = servicer.engine

    def _model_name(self, requested: Optional[str]) -> str:
        self._call(self.engine.check_accepting)
        name = self.engine.runtime_info.model_name
        if requested is not None and requested != name:
            raise ApiError(404, f"the model {requested!r} does not exist; this server serves "
                           f"{name!r}", "model", "model_not_found")
        return name

    @staticmethod
    def _call(fn: Callable[[], T]) -> T:
        try:
            return fn()
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - mapped to a status like gRPC's
            raise ApiError.from_exception(e) from None

    async def models(self) -> dict:
        name = self._model_name(None)
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "tinyvllm",
            "root": name, "max_model_len": self.engine.runtime_info.max_model_len}]}

    async def completions(self, body: oai.CompletionRequest, request: Request) -> Any:
        model = self._model_name(body.model)
        msg = self._call(lambda: oai.completion_to_proto(body))
        builder = oai.ResponseBuilder(False, model, body.logprobs)
        return await self._generate(request, msg, builder, body)

    async def chat(self, body: oai.ChatCompletionRequest, request: Request) -> Any:
        model = self._model_name(body.model)
        msg = self._call(lambda: oai.chat_to_proto(body))
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        builder = oai.ResponseBuilder(True, model, num_logprobs)
        return await self._generate(request, msg, builder, body)

    async def _generate(self, request: Request, msg: pb.GenerateRequest,
                        builder: oai.ResponseBuilder, body: Any) -> Any:
        responses = self.servicer.Generate(msg, None)
        if not body.stream:
            collected = await _unless_disconnected(request, _collect(responses))
            return builder.final(collected)
        # Wait for the first response before the 200: admission errors keep their status.
        first = await _unless_disconnected(request, _first(responses))
        options = body.stream_options or oai.StreamOptions()
        return StreamingResponse(_sse(responses, first, builder, options),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def tokenize(self, body: oai.TokenizeRequest) -> dict:
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("prompt", "give exactly one of prompt or messages")
        if not body.add_special_tokens:
            raise InvalidRequestError("add_special_tokens", "false is not supported")
        self._model_name(body.model)
        msg = (pb.TokenizeRequest(text=body.prompt) if body.prompt is not None else
               pb.TokenizeRequest(chat=self._call(lambda: oai.chat_messages_to_proto(
                   body.messages))))
        resp = await _mapped(self.servicer.Tokenize(msg, None))
        return {"count": len(resp.token_ids), "max_model_len":
                self.engine.runtime_info.max_model_len, "tokens": list(resp.token_ids),
                "token_strs": list(resp.tokens)}

    async def detokenize(self, body: oai.DetokenizeRequest) -> dict:
        self._model_name(body.model)
        msg = pb.DetokenizeRequest()
        try:
            msg.token_ids.extend(body.tokens)
        except (ValueError, TypeError):
            raise InvalidRequestError("tokens", "token ids must be integers in [0, 2^32)") from None
        if body.skip_special_tokens is not None:
            msg.skip_special_tokens = body.skip_special_tokens
        resp = await _mapped(self.servicer.Detokenize(msg, None))
        return {"prompt": resp.text}


# --- generation helpers -------------------------------------------------------------------------

async def _mapped(aw: Awaitable[T]) -> T:
    try:
        return await aw
    except Exception as e:  # noqa: BLE001
        raise ApiError.from_exception(e) from None


async def _collect(responses: AsyncIterator[pb.GenerateResponse]) -> list[pb.GenerateResponse]:
    # aclosing: a cancelled wait (client gone) aborts the engine request at once.
    async with contextlib.aclosing(responses):
        return [r async for r in responses]


async def _first(responses: AsyncIterator[pb.GenerateResponse]) -> pb.GenerateResponse:
    try:
        return await responses.__anext__()
    except BaseException:
        await responses.aclose()
        raise


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, coro: Awaitable[T]) -> T:
    """Await `coro`, cancelling it if the client disconnects first; errors become ApiError."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
            raise ClientDisconnected()
    try:
        return work.result()
    except StopAsyncIteration:
        raise ApiError(500, "the stream ended without a response") from None
    except Exception as e:  # noqa: BLE001
        raise ApiError.from_exception(e) from None


def _event(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _sse(responses: AsyncIterator[pb.GenerateResponse], first: pb.GenerateResponse,
               builder: oai.ResponseBuilder, options: oai.StreamOptions) -> AsyncIterator[str]:
    """Server-sent events; a disconnect cancels this generator, and aclosing aborts the request."""
    async with contextlib.aclosing(responses):
        try:
            resp, is_first = first, True
            while True:
                yield _event(builder.chunk(resp, is_first))
                if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    break
                resp, is_first = await responses.__anext__(), False
        except Exception as e:  # noqa: BLE001 - headers are sent: the error goes in the stream
            yield _event(ApiError.from_exception(e).body())
            yield "data: [DONE]\n\n"
            return
    if options.include_usage:
        yield _event(builder.usage_chunk(oai.usage_json(resp)))
    yield "data: [DONE]\n\n"
