"""The server's life cycle: start, serve, drain on SIGTERM, exit.

```
start:   gRPC + metrics (+ HTTP API) ports open (health NOT_SERVING) ─▶ engine READY ─▶ health SERVING
SIGTERM: health NOT_SERVING, new streams UNAVAILABLE ─▶ in-flight streams finish (at most
         drain_timeout_s, then UNAVAILABLE) ─▶ engine shut down ─▶ exit 0
engine dies: in-flight streams INTERNAL, health NOT_SERVING ─▶ exit 1 after ENGINE_DEAD_GRACE_S
engine stalls (work in flight, no step for engine_stall_timeout_s): health NOT_SERVING until it
         steps again
SIGTERM before the engine is ready: engine stopped ─▶ exit 0
SIGHUP (or changed TLS files): the certificate is reloaded for new connections on every port
```
"""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
import time
from typing import Optional

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tinyvllm.config import EngineConfig, ServerConfig
from tinyvllm.engine import core_proc
from tinyvllm.frontend.engine_client import SHUTDOWN_TIMEOUT_S, AsyncEngineClient
from tinyvllm.frontend.errors import EngineUnavailableError
from tinyvllm.server.errors import ErrorMappingInterceptor
from tinyvllm.server import security
from tinyvllm.server.http_server import HttpServer
from tinyvllm.server.logs import StatsLogger
from tinyvllm.server.metrics import ServerMetrics, metrics_app
from tinyvllm.server.servicer import GenerationServicer
from tinyvllm.v1 import generation_pb2 as pb
from tinyvllm.v1 import generation_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name

ENGINE_DEAD_GRACE_S = 1.0
"""After the engine dies: time for error statuses to reach clients and probes to see NOT_SERVING."""

STOP_GRACE_S = 1.0
"""Grace given to `grpc.aio.Server.stop` once streams have drained (or timed out)."""

DRAIN_POLL_S = 0.05

HEALTH_POLL_S = 0.1
"""How often health follows the engine client's state (stalled or not)."""


class ExitReason(enum.Enum):
    SIGNAL = 0
    ENGINE_DEAD = 1


class Server:
    """One tinyvllm server: gRPC (Generation, health, reflection), metrics HTTP, the optional
    OpenAI-compatible HTTP API (the same servicer), engine process."""

    def __init__(self, server_config: ServerConfig, engine_config: EngineConfig,
                 engine_class: str = core_proc.DEFAULT_ENGINE_CLASS) -> None:
        self.config = server_config
        self.metrics = ServerMetrics()
        self.engine = AsyncEngineClient(
            engine_config, observer=self.metrics, on_dead=self._on_engine_dead,
            engine_class=engine_class, stall_timeout_s=server_config.engine_stall_timeout_s,
            # An engine SIGTERMed with this process (one process group) outlives the drain.
            sigterm_grace_s=server_config.drain_timeout_s + STOP_GRACE_S + SHUTDOWN_TIMEOUT_S)
        self.servicer = GenerationServicer(self.engine, server_config)
        self.health = health.aio.HealthServicer()
        self.auth = security.ApiKeyAuth.from_config(server_config.api_key,
                                                    server_config.api_key_file)
        self.tls = security.tls_files_from_config(server_config.tls_cert_file,
                                                  server_config.tls_key_file,
                                                  server_config.tls_client_ca_file)
        self._exit: Optional[asyncio.Future] = None
        self._serving = False  # gRPC health SERVING; HTTP /health follows it
        self.port: Optional[int] = None

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT (exit code 0) or engine death (exit code 1)."""
        loop = asyncio.get_running_loop()
        self._exit = loop.create_future()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._request_exit, ExitReason.SIGNAL)
        tls_watch = self._watch_tls(loop)
        grpc_server = await self._start_grpc()
        try:
            http = await self._start_http()
        except OSError as e:
            logger.error("%s", e)
            await grpc_server.stop(None)
            return 1
        code = 1
        stats_task: Optional[asyncio.Task] = None
        try:
            if await self._start_engine():
                stats_task = self._start_stats_logger()
                code = await self._serve(grpc_server)
            elif self._exit.done() and self._exit.result() is ExitReason.SIGNAL:
                code = 0  # asked to stop while starting: a clean exit
        finally:
            if stats_task is not None:
                stats_task.cancel()
            await grpc_server.stop(STOP_GRACE_S)
            await self.engine.shutdown()
            self.servicer.close()
            for server in reversed(http):  # the metrics port last: probes see the end
                await server.stop()
            if tls_watch is not None:
                tls_watch.cancel()
        logger.info("tinyvllm server exiting with code %d", code)
        return code

    async def _start_grpc(self) -> grpc.aio.Server:
        # No per-connection HTTP/2 stream cap: the servicer enforces max_concurrent_streams for
        # the whole server, with a RESOURCE_EXHAUSTED clients can act on.
        interceptors: list[grpc.aio.ServerInterceptor] = [ErrorMappingInterceptor()]
        if self.auth is not None:
            interceptors.insert(0, security.AuthInterceptor(self.auth, self.config.auth_health))
        server = grpc.aio.server(interceptors=interceptors)
        pb_grpc.add_GenerationServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.config.host}:{self.config.port}"
        if self.tls is not None:
            self.port = server.add_secure_port(address, self.tls.grpc_credentials())
        else:
            self.port = server.add_insecure_port(address)
        await server.start()
        logger.info("gRPC listening on %s:%d (not serving until the engine is ready)",
                    self.config.host, self.port)
        return server

    def _is_healthy(self) -> bool:
        return self._serving and self.engine.is_healthy

    async def _start_http(self) -> list[HttpServer]:
        """The metrics port, then the OpenAI-compatible API port (each when configured)."""
        servers = []
        if self.config.metrics_port:
            app = metrics_app(self.metrics, self._is_healthy, self._metrics_authorized)
            # Metrics port: client certificates asked for, not required (kubelet probes have none).
            ctx = self.tls.ssl_context(client_required=False) if self.tls else None
            servers.append(HttpServer(app, self.config.host, self.config.metrics_port,
                                      "metrics", ctx))
        if self.config.http_port:
            from tinyvllm.server.http_api import build_api_app  # FastAPI only when asked for
            app = build_api_app(self.servicer, self.auth, self.config.auth_health,
                                self._is_healthy)
            ctx = self.tls.ssl_context(client_required=True) if self.tls else None
            servers.append(HttpServer(app, self.config.host, self.config.http_port,
                                      "OpenAI-compatible HTTP API", ctx, STOP_GRACE_S))
        for i, server in enumerate(servers):
            try:
                await server.start()
            except OSError:
                for started in servers[:i]:
                    await started.stop()
                raise
        return servers

    def _metrics_authorized(self, path: str, authorization: Optional[str]) -> bool:
        needed = self.config.auth_health if path == "/health" else self.config.auth_metrics
        return self.auth is None or not needed or self.auth.check(authorization)

    def _watch_tls(self, loop: asyncio.AbstractEventLoop) -> Optional[asyncio.Task]:
        """SIGHUP reloads the certificate; so does a change of its files (polled)."""
        if self.tls is None:
            return None
        loop.add_signal_handler(signal.SIGHUP, self.tls.reload)
        return asyncio.create_task(security.watch_tls_files(
            self.tls, self.config.tls_reload_interval_s), name="tls-watch")

    async def _start_engine(self) -> bool:
        """Start the engine unless a signal arrives first; False if serving should not begin."""
        start = asyncio.ensure_future(self.engine.start())
        await asyncio.wait({start, self._exit}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():
            start.cancel()
            return False
        try:
            start.result()
        except EngineUnavailableError as e:
            logger.error("engine failed to start: %s", e)
            return False
        self.metrics.set_model_name(self.engine.runtime_info.model_name)
        if self._exit.done():
            return False
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._serving = True
        info = self.engine.runtime_info
        logger.info("tinyvllm serving %s on %s:%d (engine pid %d, %d KV blocks of %d tokens)",
                    info.model_name, self.config.host, self.port, self.engine.engine_pid,
                    info.num_kv_blocks, info.block_size)
        return True

    def _start_stats_logger(self) -> Optional[asyncio.Task]:
        if self.config.log_stats_interval_s <= 0:
            return None
        stats = StatsLogger(lambda: self.engine.stats, self.config.log_stats_interval_s)
        return asyncio.create_task(stats.run(), name="stats-logger")

    async def _serve(self, grpc_server: grpc.aio.Server) -> int:
        watch = asyncio.create_task(self._follow_engine_health(), name="health")
        reason = await self._exit
        watch.cancel()
        await self.health.enter_graceful_shutdown()  # NOT_SERVING everywhere, from now on
        if reason is ExitReason.ENGINE_DEAD:
            await asyncio.sleep(ENGINE_DEAD_GRACE_S)
            return 1
        await self._drain()
        return 0 if self.engine.dead_reason is None else 1

    async def _follow_engine_health(self) -> None:
        """SERVING <-> NOT_SERVING as the engine stalls (work in flight, no step) and recovers."""
        serving = True
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            now_serving = self.engine.is_healthy
            if now_serving == serving:
                continue
            serving = now_serving
            if serving:
                logger.warning("engine stepping again: SERVING")
            else:
                logger.error("engine stalled: no step for over %gs with %d requests in flight; "
                             "NOT_SERVING", self.config.engine_stall_timeout_s,
                             self.engine.num_in_flight)
            status = (health_pb2.HealthCheckResponse.SERVING if serving
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            for name in ("", SERVICE_NAME):
                await self.health.set(name, status)

    async def _drain(self) -> None:
        self.engine.draining = True
        n = self.engine.num_in_flight
        logger.info("draining: %d streams in flight, up to %.1fs", n, self.config.drain_timeout_s)
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.engine.num_in_flight and time.monotonic() < deadline:
            if self.engine.dead_reason is not None:
                return
            await asyncio.sleep(DRAIN_POLL_S)
        if self.engine.num_in_flight:
            logger.warning("drain timeout: ending %d streams", self.engine.num_in_flight)
            # They end with UNAVAILABLE (retry elsewhere) rather than a bare CANCELLED.
            self.engine.abort_all(f"server shut down after a {self.config.drain_timeout_s:.0f}s "
                                  "drain before the request finished")

    def _on_engine_dead(self, reason: str) -> None:
        self._request_exit(ExitReason.ENGINE_DEAD)

    def _request_exit(self, reason: ExitReason) -> None:
        if self._exit is not None and not self._exit.done():
            if reason is ExitReason.SIGNAL:
                logger.info("signal received: stopping")
            self._exit.set_result(reason)
        elif reason is ExitReason.SIGNAL:
            logger.info("already stopping")


async def serve(server_config: ServerConfig, engine_config: EngineConfig,
                engine_class: str = core_proc.DEFAULT_ENGINE_CLASS) -> int:
    return await Server(server_config, engine_config, engine_class).run()
