"""Prometheus metrics (`tinyvllm:` prefix, own registry) and the metrics port's app (/metrics, /health).

Engine-side numbers (running, waiting, KV usage, prefix cache, preemptions, token counts) are read
from the latest `EngineStats` at scrape time; request latencies are observed by the frontend as
outputs arrive (`EngineObserver` hooks). Every series carries a `model_name` label, as vLLM's do, so
that dashboards and autoscalers can tell models apart; the engine's series appear once the model
is loaded and its name known.
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

from tinyvllm.engine.stats import EngineStats
from tinyvllm.frontend.engine_client import EngineObserver
from tinyvllm.scheduling.request import FinishReason

logger = logging.getLogger(__name__)

PREFIX = "tinyvllm:"

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                 120.0, 240.0, 480.0, 960.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# (metric suffix, EngineStats field, help)
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
    ("spec_decode_num_drafts", "spec_num_drafts", "Speculative verification steps of requests."),
    ("spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Draft tokens proposed."),
    ("spec_decode_num_accepted_tokens", "spec_num_accepted_tokens", "Draft tokens accepted."),
)
assert {field for _, field, _ in _GAUGES + _COUNTERS} <= set(EngineStats.__struct_fields__)


MODEL_LABEL = "model_name"


class _EngineStatsCollector(Collector):
    """The engine's series, read from its latest `EngineStats` (zeros before the first one)."""

    def __init__(self, get_stats: Callable[[], Optional[EngineStats]],
                 get_model_name: Callable[[], Optional[str]]) -> None:
        self._get_stats = get_stats
        self._get_model_name = get_model_name

    def collect(self) -> Iterator[Metric]:
        model_name = self._get_model_name()
        stats = self._get_stats() or EngineStats()
        for kind, table in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
            for suffix, field, help_text in table:
                family = kind(PREFIX + suffix, help_text, labels=[MODEL_LABEL])
                if model_name is not None:  # no sample before the model is loaded
                    family.add_metric([model_name], getattr(stats, field))
                yield family
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0: the first).",
            labels=[MODEL_LABEL, "position"])
        if model_name is not None:
            for position, value in enumerate(stats.spec_num_accepted_per_position):
                per_position.add_metric([model_name, str(position)], value)
        yield per_position


class ServerMetrics(EngineObserver):
    """All metrics of one server, in their own registry.

    Args:
        model_name: the `model_name` label of every series; None until the engine reports the
            loaded model's name (`set_model_name`), and no engine series is exported before.
    """

    def __init__(self, model_name: Optional[str] = None) -> None:
        disable_created_metrics()  # `*_created` series only confuse dashboards
        self.registry = CollectorRegistry()
        self.stats: Optional[EngineStats] = None
        self.model_name = model_name
        self.registry.register(_EngineStatsCollector(lambda: self.stats, lambda: self.model_name))
        r, m = self.registry, [MODEL_LABEL]
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.",
            m + ["finished_reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from arrival to the first token.", m,
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between consecutive outputs of a request.", m,
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from arrival to the last token.", m, buckets=E2E_BUCKETS_S,
                             registry=r)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds",
                               "Time from arrival to the start of the step that produced the "
                               "first token.", m, buckets=LATENCY_BUCKETS_S, registry=r)
        self.iteration_tokens = Histogram(PREFIX + "iteration_tokens_total",
                                          "Tokens scheduled per engine step.", m,
                                          buckets=ITERATION_TOKEN_BUCKETS, registry=r)

    def set_model_name(self, model_name: str) -> None:
        """Label every series with the loaded model's name (called once the engine is ready).

        The histograms get their series now, so that they read zero rather than absent before
        the first request."""
        self.model_name = model_name
        for histogram in (self.ttft, self.itl, self.e2e, self.queue, self.iteration_tokens):
            histogram.labels(model_name)

    def _label(self) -> str:
        # Observations come from requests, and requests only run once the engine (and so the
        # model name) is known; the fallback keeps a stray observation from raising.
        return self.model_name or "unknown"

    def on_step(self, stats: EngineStats) -> None:
        self.stats = stats
        if stats.num_scheduled_tokens:
            self.iteration_tokens.labels(self._label()).observe(stats.num_scheduled_tokens)

    def on_first_token(self, ttft_s: float, queue_s: float) -> None:
        self.ttft.labels(self._label()).observe(ttft_s)
        self.queue.labels(self._label()).observe(queue_s)

    def on_inter_token(self, latency_s: float) -> None:
        self.itl.labels(self._label()).observe(latency_s)

    def on_finished(self, finish_reason: FinishReason, e2e_s: float) -> None:
        self.request_success.labels(self._label(), finish_reason.value).inc()
        self.e2e.labels(self._label()).observe(e2e_s)

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
