"""uvicorn, embedded in the server's event loop, for the HTTP API and the metrics port.

uvicorn (with h11) parses HTTP; malformed requests get a 4xx, never silence: a bad request line
or header 400, an oversized head 431, a head cut off by EOF 400, a head never completed 408. The server, not uvicorn, owns SIGTERM/SIGINT: drain order and
exit code are decided in `server.app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from typing import Any, Iterator, Optional

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
"""Largest request line + headers accepted; longer ones get 400 (h11's incomplete-event limit)."""

HEAD_TIMEOUT_S = 10.0
"""A connection whose first request head is not complete after this gets 408 and is closed."""

KEEP_ALIVE_S = 5
"""An idle keep-alive connection is closed after this (shorter than HEAD_TIMEOUT_S: silence
then means idle, and only a started, unfinished head gets the 408)."""

START_POLL_S = 0.01


class _StrictH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus answers for two requests it would meet with silence.

    - The client ends its side (EOF) mid-head: h11 reports the truncated request, uvicorn sends
      400 (stock uvicorn ignores the EOF and hangs up without a word).
    - A head does not complete within HEAD_TIMEOUT_S of the connection opening or of the last
      response (slow or never-ending request): 408.
    """

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: Optional[asyncio.TimerHandle] = None
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_pending_cycle is not self.cycle:  # a new request's head is complete
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()

    def eof_received(self) -> Optional[bool]:
        idle = self.cycle is None or self.cycle.response_complete
        if idle and self.conn.trailing_data[0]:
            self.conn.receive_data(b"")  # h11: "peer closed mid-request" -> uvicorn's 400
            self.handle_events()
        return None

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_pending_cycle = self.cycle
        self._head_timer = asyncio.get_running_loop().call_later(HEAD_TIMEOUT_S,
                                                                 self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._head_pending_cycle is self.cycle and not self.transport.is_closing():
            # h11 cannot answer a request it has not parsed yet: the bytes are written directly.
            self.transport.write(_REQUEST_TIMEOUT_RESPONSE)
            self.transport.close()


_REQUEST_TIMEOUT_BODY = b"request head not received in time\n"
_REQUEST_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s"
    % (len(_REQUEST_TIMEOUT_BODY), _REQUEST_TIMEOUT_BODY))


class _HeaderLimit:
    """ASGI middleware: 431 when the request head exceeds MAX_HEAD_BYTES (h11 only limits
    heads that arrive in pieces)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and _head_bytes(scope) > MAX_HEAD_BYTES:
            body = b"request header fields too large\n"
            await send({"type": "http.response.start", "status": 431, "headers": [
                (b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close"),
                (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def _head_bytes(scope: dict) -> int:
    return len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + sum(
        len(k) + len(v) + 4 for k, v in scope.get("headers", ()))


class _EmbeddedUvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # signals are the application's: see server.app


class HttpServer:
    """One uvicorn server for `app` on host:port, TLS when `ssl_context` is given.

    The context is used as is (not copied), so that reloading a certificate into it reaches
    every later handshake.
    """

    def __init__(self, app: Any, host: str, port: int, name: str,
                 ssl_context: Optional[ssl.SSLContext] = None,
                 graceful_timeout_s: float = 1.0) -> None:
        self.name = name
        self.config = uvicorn.Config(
            _HeaderLimit(app), host=host, port=port, http=_StrictH11Protocol, lifespan="off",
            log_config=None, access_log=False, h11_max_incomplete_event_size=MAX_HEAD_BYTES,
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=max(1, int(graceful_timeout_s)))
        self.config.load()
        self.config.ssl = ssl_context  # ours, used as is: reloads reach later handshakes
        self.scheme = "https" if ssl_context is not None else "http"
        self._server = _EmbeddedUvicorn(self.config)
        self._task: Optional[asyncio.Task] = None

    async def start(self) -> None:
        """Returns once the port is listening.

        Raises:
            OSError: the port could not be bound (uvicorn logs why, then stops its task).
        """
        self._task = asyncio.create_task(self._serve(), name=f"http-{self.name}")
        while not self._server.started:
            if self._task.done():
                raise OSError(f"{self.name}: could not listen on "
                              f"{self.config.host}:{self.config.port}")
            await asyncio.sleep(START_POLL_S)
        logger.info("%s on %s://%s:%d", self.name, self.scheme, self.config.host,
                    self.config.port)

    async def _serve(self) -> None:
        try:
            await self._server.serve()
        except SystemExit:  # uvicorn's way of saying "could not start": not the process's exit
            logger.error("%s stopped at start-up", self.name)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, SystemExit):
            await self._task
