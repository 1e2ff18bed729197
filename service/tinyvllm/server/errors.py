"""The one place where exceptions become gRPC status codes.

`ErrorMappingInterceptor` wraps every Generation method; servicer code just raises. The request id
of the failing call (set by the servicer in `current_request_id`) goes into INTERNAL messages.

It also swaps each method's request deserializer for one that never raises: bytes that are not a
valid message (random bytes, a truncated message, invalid UTF-8 in a string field) become an
`UndecodableRequest`, answered with INVALID_ARGUMENT naming the message type. (Left to gRPC, a
decode error is an UNKNOWN status and a traceback in the log.)
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from tinyvllm.errors import InvalidRequestError
from tinyvllm.frontend.errors import (EngineDeadError, EngineRequestError,
                                      EngineUnavailableError, QueueFullError)

logger = logging.getLogger(__name__)

current_request_id: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
    "current_request_id", default=None)

SERVICE_PREFIX = "/tinyvllm.v1.Generation/"

_STATUS_BY_TYPE: tuple[tuple[type, grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (EngineDeadError, grpc.StatusCode.INTERNAL),
    (EngineRequestError, grpc.StatusCode.INTERNAL),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, details) for an exception raised while serving a call."""
    for exc_type, code in _STATUS_BY_TYPE:
        if isinstance(exc, exc_type):
            return code, str(exc)
    request_id = current_request_id.get()
    logger.exception("internal error on request %s", request_id, exc_info=exc)
    return grpc.StatusCode.INTERNAL, (
        f"internal error on request {request_id!r}: {type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class UndecodableRequest:
    """Stands in for a request message whose bytes did not decode."""

    message_type: str
    error: str

    def as_error(self) -> InvalidRequestError:
        return InvalidRequestError(self.message_type, f"the request is not a valid "
                                    f"{self.message_type} message ({self.error})")


def _safe_deserializer(deserialize: Optional[Callable[[bytes], Any]]
                       ) -> Optional[Callable[[bytes], Any]]:
    if deserialize is None:
        return None
    message_class = getattr(deserialize, "__self__", None)  # `Message.FromString` is bound
    descriptor = getattr(message_class, "DESCRIPTOR", None)
    name = descriptor.full_name if descriptor is not None else "request"

    def safe(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as e:
            return UndecodableRequest(name, str(e) or "decode error")
    return safe


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    code, details = status_for(exc)
    await context.abort(code, details)


def _wrap_unary_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if isinstance(request, UndecodableRequest):
                raise request.as_error()
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - mapped to a status, never swallowed
            await _abort(context, e)
    return wrapper


def _wrap_unary_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if isinstance(request, UndecodableRequest):
                raise request.as_error()
            async for response in behavior(request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)
    return wrapper


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions of the Generation service's methods to status codes."""

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(SERVICE_PREFIX):
            return handler
        handler = handler._replace(
            request_deserializer=_safe_deserializer(handler.request_deserializer))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_wrap_unary_stream(handler.unary_stream))
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_wrap_unary_unary(handler.unary_unary))
        return handler


__all__ = ["ErrorMappingInterceptor", "current_request_id", "status_for"]
