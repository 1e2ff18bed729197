"""The one place where exceptions become gRPC status codes.

`ErrorMappingInterceptor` wraps every Generation method; servicer code just raises. The request id
of the failing call (set by the servicer in `current_request_id`) goes into INTERNAL messages.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any, Awaitable, Callable, Optional

import grpc
import grpc.aio

from tinyvllm.engine.validation import RequestValidationError
from tinyvllm.frontend.errors import (EngineDeadError, EngineRequestError,
                                      EngineUnavailableError, QueueFullError)
from tinyvllm.sampling_params import SamplingParamsError
from tinyvllm.server.convert import InvalidArgumentError

logger = logging.getLogger(__name__)

current_request_id: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
    "current_request_id", default=None)

SERVICE_PREFIX = "/tinyvllm.v1.Generation/"

_STATUS_BY_TYPE: tuple[tuple[type, grpc.StatusCode], ...] = (
    (RequestValidationError, grpc.StatusCode.INVALID_ARGUMENT),
    (SamplingParamsError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
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


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    code, details = status_for(exc)
    await context.abort(code, details)


def _wrap_unary_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - mapped to a status, never swallowed
            await _abort(context, e)
    return wrapper


def _wrap_unary_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
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
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_wrap_unary_stream(handler.unary_stream))
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_wrap_unary_unary(handler.unary_unary))
        return handler


__all__ = ["ErrorMappingInterceptor", "current_request_id", "status_for"]
