"""Soak: hundreds of concurrent streams with random cancels and a 4 MB prompt in the middle, on a
real server whose stream limit is below the load. Every stream ends with a finish reason or a
documented status, health stays fast, and afterwards nothing is left: no running or waiting
request, no KV block in use, no stream slot held, memory back where it was."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import grpc
import grpc.aio
import pytest

from tinyvllm.client import AsyncClient

from .conftest import IDLE, start_server, wait_for_metrics
from .test_edge import FOUR_MB, HealthProbe, _big_text

pytestmark = pytest.mark.slow

# CI runs 200 streams against a limit of 150; the 500-stream run is the same test with
# TINYVLLM_SOAK_STREAMS=500 TINYVLLM_SOAK_MAX_STREAMS=600.
MAX_STREAMS = int(os.environ.get("TINYVLLM_SOAK_MAX_STREAMS", "150"))
NUM_STREAMS = int(os.environ.get("TINYVLLM_SOAK_STREAMS", "200"))
CANCEL_FRACTION = 0.3
HEALTH_LIMIT_S = 0.1
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "Water boils at", "My favourite book is", "Translate to French: cat"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A long stall timeout: on a shared, overloaded machine one step of 150 sequences can take
    # longer than the default, and this test is about the frontend, not stall detection.
    srv = start_server(tmp_path_factory.mktemp("soak"),
                       "--max-concurrent-streams", str(MAX_STREAMS),
                       "--engine-stall-timeout-s", "600")
    yield srv
    srv.stop()


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def _one_stream(clients: list[AsyncClient], i: int, rng: random.Random,
                      outcomes: dict[str, int]) -> None:
    client = clients[i % len(clients)]
    chat = i % 3 == 0
    prompt = PROMPTS[i % len(PROMPTS)] + f" {i}"
    task = asyncio.ensure_future(client.complete(
        [{"role": "user", "content": prompt}] if chat else prompt,
        max_tokens=rng.randint(1, 8), temperature=rng.choice([0.0, 0.8]), seed=i,
        request_id=f"soak-{i % 7}"))  # ids shared on purpose: they must not interfere
    if rng.random() < CANCEL_FRACTION:
        await asyncio.sleep(rng.uniform(0.0, 1.0))
        task.cancel()
    try:
        r = await task
        assert r.finish_reason in ("length", "stop") and r.request_id == f"soak-{i % 7}"
        outcomes["finished"] += 1
    except asyncio.CancelledError:
        outcomes["cancelled"] += 1
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())
        assert "--max-concurrent-streams" in e.details()
        outcomes["limited"] += 1


async def _big_prompt(client: AsyncClient) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.complete(_big_text(FOUR_MB), max_tokens=4)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def _soak(server, seed: int, num_streams: int = NUM_STREAMS) -> dict[str, int]:
    rng = random.Random(seed)
    outcomes = {"finished": 0, "cancelled": 0, "limited": 0}
    clients = [AsyncClient(server.target) for _ in range(4)]
    try:
        tasks = []
        for i in range(num_streams):
            tasks.append(asyncio.ensure_future(_one_stream(clients, i, rng, outcomes)))
            if i == num_streams // 2:
                tasks.append(asyncio.ensure_future(_big_prompt(clients[0])))
            await asyncio.sleep(0.002)
        await asyncio.gather(*tasks)
    finally:
        for c in clients:
            await c.close()
    assert sum(outcomes.values()) == num_streams
    return outcomes


async def _fill_stream_limit(server) -> None:
    """Every stream slot was given back: MAX_STREAMS streams fit at once."""
    async with AsyncClient(server.target) as client:
        results = await asyncio.gather(*(client.complete("Hi", max_tokens=1)
                                         for _ in range(MAX_STREAMS)))
    assert all(r.finish_reason == "length" for r in results)
    wait_for_metrics(server, IDLE, timeout_s=30.0)


async def test_soak_with_random_cancels_and_a_4mb_prompt(server):
    # Warm-up at the full load: the allocator, gRPC's buffers and the frontend's pools grow to
    # their peak concurrency here, so the memory check below sees only what a round leaves behind.
    await _soak(server, seed=100)
    wait_for_metrics(server, IDLE, timeout_s=30.0)
    await _fill_stream_limit(server)
    rss_before = _rss_bytes(server.proc.pid)
    async with HealthProbe(server.target, interval_s=0.05) as probe:
        outcomes = await _soak(server, seed=0)
    assert outcomes["finished"] > 0 and outcomes["cancelled"] > 10, outcomes
    wait_for_metrics(server, IDLE, timeout_s=30.0)
    probe.assert_fast(HEALTH_LIMIT_S)
    await _fill_stream_limit(server)
    rss_after = _rss_bytes(server.proc.pid)
    # glibc's arenas move RSS by several per cent from round to round at a steady state (seen:
    # -15% to +11% over six rounds of one server); a leak of 50 KB per stream would pass 10% after
    # one round and further after each. So a round past 10% is followed by another, and the
    # lower of the two must stay within 10%: noise falls back, a leak grows on.
    if rss_after > 1.10 * rss_before:
        await _soak(server, seed=1)
        wait_for_metrics(server, IDLE, timeout_s=30.0)
        await _fill_stream_limit(server)
        rss_after = min(rss_after, _rss_bytes(server.proc.pid))
    assert rss_after <= 1.10 * rss_before, (
        f"RSS {rss_before / 2**20:.1f} MiB before a round, {rss_after / 2**20:.1f} MiB after")
