"""Queue limit and graceful drain on a real server that runs one sequence at a time."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import grpc.aio
import pytest

from tinyvllm.client import AsyncClient

from .conftest import start_server

pytestmark = pytest.mark.slow

MAX_WAITING = 2
LONG_TOKENS = 256  # outlasts the 0.5 s window below even at 15 ms a token (fused CPU step)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("lifecycle"), "--max-num-seqs", "1",
                       "--max-waiting-requests", str(MAX_WAITING), "--drain-timeout-s", "120")
    yield srv
    srv.stop()


async def _wait_health(client: AsyncClient, status: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while await client.health() != status:
        assert time.monotonic() < deadline, f"health did not turn {status} in {timeout_s}s"
        await asyncio.sleep(0.02)


async def test_queue_full_then_sigterm_drains_and_exits_zero(server):
    async with AsyncClient(server.target) as client:
        # One running request (max_num_seqs=1) that is past its first token...
        long_stream = client.generate("Tell me a story.", max_tokens=LONG_TOKENS, ignore_eos=True,
                                      temperature=0.0, stream_token_ids=True)
        first = await long_stream.__anext__()
        # ...then MAX_WAITING queued behind it: the next request is refused.
        waiting = [asyncio.ensure_future(client.complete(f"Queued {i}", max_tokens=2))
                   for i in range(MAX_WAITING)]
        await asyncio.sleep(0.5)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.complete("One too many", max_tokens=2)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        server.proc.send_signal(signal.SIGTERM)
        await _wait_health(client, "NOT_SERVING", timeout_s=2.0)
        assert server.http_get("/health")[0] == 503
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.complete("Too late", max_tokens=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        # Every in-flight stream still completes.
        num_tokens = len(first.token_ids)
        async for r in long_stream:
            num_tokens += len(r.token_ids)
            last = r
        assert last.finish_reason and last.usage.completion_tokens == LONG_TOKENS == num_tokens
        for r in await asyncio.gather(*waiting):
            assert r.finish_reason in ("length", "stop")
    assert server.wait_exit(timeout_s=60) == 0
