"""A server with JSON logs and a short context: one access-log line per stream, engine-stats lines
while it works, and `max_tokens` defaulting to the rest of the context on every entry point
(gRPC, `tinyvllm client`, `tinyvllm generate`, `LLM`)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import msgspec
import pytest

from tinyvllm.client import AsyncClient
from tinyvllm.engine.stats import EngineStats
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.server.logs import StatsLogger
from tinyvllm.tokenization import load_tokenizer

from .conftest import start_server

pytestmark = pytest.mark.slow

CONTEXT = 48
PROMPT = "The capital of France is"
STATS_INTERVAL_S = 0.5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("server"), "--max-model-len", str(CONTEXT),
                       "--log-format", "json", "--log-stats-interval-s", str(STATS_INTERVAL_S))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def rest_of_context(smollm2_path) -> int:
    return CONTEXT - len(load_tokenizer(None).encode(PROMPT))


def _json_records(server, logger: str, timeout_s: float = 10.0, **match) -> list[dict]:
    """The server log's JSON records of `logger` whose fields match, waiting for at least one."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = [json.loads(line) for line in server.log().splitlines()
                   if line.startswith("{")]
        found = [r for r in records if r["logger"] == logger
                 and all(r.get(k) == v for k, v in match.items())]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


async def test_grpc_default_is_the_rest_of_the_context(server, rest_of_context):
    async with AsyncClient(server.target) as client:
        r = await client.complete(PROMPT, ignore_eos=True, request_id="default-max-tokens")
    assert r.finish_reason == "length" and r.usage.completion_tokens == rest_of_context


async def test_access_log_line_per_stream(server):
    async with AsyncClient(server.target) as client:
        r = await client.complete(PROMPT, max_tokens=5, ignore_eos=True, request_id="logged-1")
        stream = client.generate(PROMPT, ignore_eos=True, request_id="cancelled-1")
        async for _ in stream:
            break  # the client goes away after the first token
        await stream.aclose()
    [line] = _json_records(server, "tinyvllm.access", request_id="logged-1")
    assert line["level"] == "INFO" and line["message"].startswith("request request_id=logged-1")
    assert line["prompt_tokens"] == r.usage.prompt_tokens
    assert line["completion_tokens"] == 5 and line["finish_reason"] == "length"
    assert line["cached_tokens"] == r.usage.cached_prompt_tokens
    assert line["ttft_s"] == pytest.approx(r.timing.ttft_s, abs=1e-3)
    assert line["e2e_s"] == pytest.approx(r.timing.e2e_s, abs=0.05)
    [cancelled] = _json_records(server, "tinyvllm.access", request_id="cancelled-1")
    assert cancelled["finish_reason"] == "abort" and cancelled["completion_tokens"] >= 1


async def test_stats_lines_while_busy(server):
    async with AsyncClient(server.target) as client:
        await asyncio.gather(*[client.complete(f"{PROMPT} {i}", max_tokens=20, ignore_eos=True)
                               for i in range(2)])
    stats = _json_records(server, "tinyvllm.stats")
    assert stats, "no engine-stats line"
    busy = [s for s in stats if s["avg_generation_throughput_tok_s"] > 0]
    assert busy and busy[0]["message"].startswith("Avg prompt throughput: ")
    assert {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
            "prefix_cache_hit_rate_perc"} <= busy[0].keys()


def test_every_log_line_is_json(server):
    lines = [line for line in server.log().splitlines() if line.strip()]
    assert lines and all(isinstance(json.loads(line), dict) for line in lines)


def test_client_cli_default(server, rest_of_context):
    result = subprocess.run(
        [sys.executable, "-m", "tinyvllm.entrypoints.cli", "client", "--port", str(server.port),
         PROMPT, "--ignore-eos", "--usage"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"completion_tokens={rest_of_context} " in result.stderr


def test_generate_cli_default(smollm2_path, rest_of_context):
    env = {**os.environ, "TQDM_DISABLE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "tinyvllm.entrypoints.cli", "generate", "--max-model-len",
         str(CONTEXT), "--kv-cache-memory-gb", "0.1", "--ignore-eos", "--json", PROMPT],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == rest_of_context and out["finish_reason"] == "length"


def test_llm_default(smollm2_path, rest_of_context):
    from tinyvllm import LLM

    llm = LLM(max_model_len=CONTEXT, kv_cache_memory_gb=0.1)
    [out] = llm.generate(PROMPT, SamplingParams(ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == rest_of_context


def test_stats_logger_numbers():
    """Throughput over the interval from the cumulative counters; silent while idle."""
    stats = EngineStats(num_kv_blocks=100, num_free_kv_blocks=100)
    logger = StatsLogger(lambda: stats, interval_s=2.0)
    logger._last_time = 0.0
    assert logger.log_once(2.0) is None  # idle
    stats = msgspec.structs.replace(
        stats, num_prompt_tokens=100, num_generation_tokens=40, num_running=3, num_waiting=1,
        kv_cache_usage=0.25, prefix_cache_queries=100, prefix_cache_hits=75)
    assert logger.log_once(4.0) == {
        "avg_prompt_throughput_tok_s": 50.0, "avg_generation_throughput_tok_s": 20.0,
        "num_requests_running": 3, "num_requests_waiting": 1, "kv_cache_usage_perc": 25.0,
        "prefix_cache_hit_rate_perc": 75.0}
    stats = msgspec.structs.replace(stats, num_running=0, num_waiting=0, kv_cache_usage=0.0)
    assert logger.log_once(6.0)["avg_generation_throughput_tok_s"] == 0.0  # work just ended
    assert logger.log_once(8.0) is None  # then silence
