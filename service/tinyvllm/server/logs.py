"""The server's log: text or JSON lines, the per-request access log and periodic engine stats.

```
text: 2026-01-01 12:00:00,000 INFO tinyvllm.access: request request_id=ab12 prompt_tokens=5 ...
json: {"time": "2026-01-01T12:00:00.000Z", "level": "INFO", "logger": "tinyvllm.access",
       "message": "request request_id=ab12 ...", "request_id": "ab12", "prompt_tokens": 5, ...}
```

The access log is written by the frontend (`tinyvllm.access`, one line per finished stream);
the stats line (`tinyvllm.stats`) every `log_stats_interval_s` while the engine has work, with
the numbers vLLM prints: prompt and generation throughput over the interval, running and
waiting requests, KV-cache usage and prefix-cache hit rate.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from datetime import datetime, timezone
from typing import Any, Callable, Optional

from tinyvllm.engine.stats import EngineStats

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

stats_logger = logging.getLogger("tinyvllm.stats")


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a record's `fields` (dict) are merged in as top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, tz=timezone.utc)
        entry: dict[str, Any] = {
            "time": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        entry.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, log_format: str) -> None:
    """Root logging to stderr at `level` ("info"...) in `log_format` ("text" or "json")."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else
                         logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


class StatsLogger:
    """Logs engine throughput and load every `interval_s` (silent while the engine is idle).

    Args:
        get_stats: the engine's latest `EngineStats` (None before its first message).
        interval_s: seconds between lines.
    """

    def __init__(self, get_stats: Callable[[], Optional[EngineStats]], interval_s: float) -> None:
        self.get_stats = get_stats
        self.interval_s = interval_s
        self._last: Optional[EngineStats] = None
        self._last_time = time.monotonic()
        self._was_idle = True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.log_once(time.monotonic())

    def log_once(self, now: float) -> Optional[dict[str, float]]:
        """Log the interval ending `now`; returns its fields (None when idle, nothing logged)."""
        stats = self.get_stats() or EngineStats()
        last = self._last or EngineStats()
        elapsed = max(now - self._last_time, 1e-9)
        self._last, self._last_time = stats, now
        num_prompt_tokens = stats.num_prompt_tokens - last.num_prompt_tokens
        num_generation_tokens = stats.num_generation_tokens - last.num_generation_tokens
        busy = stats.num_running or stats.num_waiting
        moved = num_prompt_tokens or num_generation_tokens
        if not busy and not moved and self._was_idle:
            return None  # one line after work ends, then silence until there is more
        self._was_idle = not busy and not moved
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        fields = {
            "avg_prompt_throughput_tok_s": round(num_prompt_tokens / elapsed, 1),
            "avg_generation_throughput_tok_s": round(num_generation_tokens / elapsed, 1),
            "num_requests_running": stats.num_running,
            "num_requests_waiting": stats.num_waiting,
            "kv_cache_usage_perc": round(100 * stats.kv_cache_usage, 1),
            "prefix_cache_hit_rate_perc": round(100 * hits / queries if queries else 0.0, 1)}
        stats_logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%", *fields.values(), extra={"fields": fields})
        return fields
