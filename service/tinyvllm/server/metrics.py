"""Prometheus metrics (`tinyvllm:` prefix, own registry) and the metrics port's app (/metrics, /health).

Engine-side numbers (running, waiting, KV usage, prefix cache, preemptions, token counts) are read
from the latest `EngineStats` at scrape time; request latencies are observed by the frontend as
outputs arrive (`EngineObserver` hooks).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Optional

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram,
                               disable_created_metrics)
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from tinyvllm.frontend.engine_client import EngineObserver

logger = logging.getLogger(__name__)

PREFIX = "tinyvllm:"

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                 120.0, 240.0, 480.0, 960.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# (metric suffix, EngineStats key, help)
_GAUGES = (
    ("num_requests_running", "num_running", "Requests in the engine's running batch."),
    ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV-cache blocks in use (0 to 1)."),
)
_COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("num_preemptions", "num_preemptions", "Requests preempted for lack of KV blocks."),
    ("prompt_tokens", "num_prompt_tokens", "Prompt tokens prefilled."),
    ("generation_tokens", "num_generation_tokens", "Tokens generated."),
)


class _EngineStatsCollector(Collector):
    def __init__(self, get_stats: Callable[[], dict[str, float]]) -> None:
        self._get_stats = get_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._get_stats()
        for suffix, key, help_text in _GAUGES:
            yield GaugeMetricFamily(PREFIX + suffix, help_text, value=stats.get(key, 0))
        for suffix, key, help_text in _COUNTERS:
            yield CounterMetricFamily(PREFIX + suffix, help_text, value=stats.get(key, 0))


class ServerMetrics(EngineObserver):
    """All metrics of one server, in their own registry."""

    def __init__(self) -> None:
        disable_created_metrics()  # `*_created` series only confuse dashboards
        self.registry = CollectorRegistry()
        self.stats: dict[str, float] = {}
        self.registry.register(_EngineStatsCollector(lambda: self.stats))
        r = self.registry
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.", ["finished_reason"],
            registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from arrival to the first token.", buckets=LATENCY_BUCKETS_S,
                              registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between consecutive outputs of a request.",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from arrival to the last token.", buckets=E2E_BUCKETS_S,
                             registry=r)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds",
                               "Time from arrival to the start of the step that produced the "
                               "first token.", buckets=LATENCY_BUCKETS_S, registry=r)
        self.iteration_tokens = Histogram(PREFIX + "iteration_tokens_total",
                                          "Tokens scheduled per engine step.",
                                          buckets=ITERATION_TOKEN_BUCKETS, registry=r)

    def on_step(self, stats: dict[str, float]) -> None:
        self.stats = stats
        if stats.get("num_scheduled_tokens"):
            self.iteration_tokens.observe(stats["num_scheduled_tokens"])

    def on_first_token(self, ttft_s: float, queue_s: float) -> None:
        self.ttft.observe(ttft_s)
        self.queue.observe(queue_s)

    def on_inter_token(self, latency_s: float) -> None:
        self.itl.observe(latency_s)

    def on_finished(self, finish_reason: str, e2e_s: float) -> None:
        self.request_success.labels(finished_reason=finish_reason).inc()
        self.e2e.observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def metrics_app(metrics: ServerMetrics, is_healthy: Callable[[], bool],
                authorized: Callable[[str, Optional[str]], bool]) -> Starlette:
    """The metrics port's ASGI app: GET /metrics (Prometheus text) and GET /health (200 or 503).

    Args:
        authorized: (path, `authorization` header) -> whether to answer; else 401.
    """
    def guard(path: str, handler: Callable[[], Response]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            if not authorized(path, request.headers.get("authorization")):
                return PlainTextResponse("missing or invalid API key\n", 401,
                                         headers={"WWW-Authenticate": "Bearer"})
            return handler()
        return endpoint

    def render() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def health() -> Response:
        ok = is_healthy()
        return PlainTextResponse("SERVING\n" if ok else "NOT_SERVING\n", 200 if ok else 503)

    return Starlette(routes=[Route("/metrics", guard("/metrics", render), methods=["GET"]),
                             Route("/health", guard("/health", health), methods=["GET"])])
