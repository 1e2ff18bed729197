"""The server's processes under signals: a frozen engine, a SIGKILLed frontend, SIGTERM while
starting. Each test runs its own server."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import grpc
import grpc.aio
import pytest

from tinyvllm.client import AsyncClient

from .conftest import launch_server, start_server

pytestmark = pytest.mark.slow

STALL_TIMEOUT_S = 2.0


def _process_gone(pid: int) -> bool:
    """Exited (a zombie counts: it runs nothing and holds no memory)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return bool(re.search(r"^State:\s+Z", status, re.M))


def _wait_until(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"{what} not within {timeout_s}s"
        time.sleep(0.05)
    return time.monotonic() - start


async def _wait_health(client: AsyncClient, status: str, timeout_s: float) -> float:
    start = time.monotonic()
    while await client.health() != status:
        assert time.monotonic() - start < timeout_s, f"health did not turn {status}"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def test_frozen_engine_turns_health_not_serving_until_it_steps_again(tmp_path):
    server = start_server(tmp_path, "--engine-stall-timeout-s", str(STALL_TIMEOUT_S))
    try:
        engine_pid = server.engine_pid()
        async with AsyncClient(server.target) as client:
            stream = client.generate("Tell me a story.", max_tokens=60, ignore_eos=True,
                                     stream_token_ids=True)
            num_tokens = len((await stream.__anext__()).token_ids)
            os.kill(engine_pid, signal.SIGSTOP)
            try:
                await _wait_health(client, "NOT_SERVING", timeout_s=STALL_TIMEOUT_S + 5)
                assert server.http_get("/health")[0] == 503
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await client.complete("New work", max_tokens=1)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "stalled" in info.value.details()
            finally:
                os.kill(engine_pid, signal.SIGCONT)
            await _wait_health(client, "SERVING", timeout_s=5)
            assert server.http_get("/health")[0] == 200
            async for r in stream:  # the stream survives the stall
                num_tokens += len(r.token_ids)
            assert r.finish_reason and num_tokens == 60
    finally:
        server.stop()
    assert "engine stalled" in server.log() and "stepping again" in server.log()


async def test_engine_exits_when_the_server_is_killed(tmp_path):
    """SIGKILL leaves the frontend no chance to clean up: the engine notices its parent's death
    by itself, exits within seconds, and removes the IPC directory."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    server = start_server(tmp_path, env={"TMPDIR": str(tmp)})
    engine_pid = server.engine_pid()
    assert [p.name for p in tmp.iterdir() if p.name.startswith("tinyvllm-")]
    async with AsyncClient(server.target) as client:
        stream = client.generate("Write an essay.", max_tokens=900, ignore_eos=True)
        await stream.__anext__()  # the engine is busy generating
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        _wait_until(lambda: _process_gone(engine_pid), timeout_s=10.0, what="engine exit")
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in stream:
                pass
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("tinyvllm-")]


def _log_has(server, pattern: str) -> bool:
    return pattern in server.log()


@pytest.mark.parametrize("when", ["importing", "engine loading"])
def test_sigterm_during_start_up_exits_zero(tmp_path, when):
    server = launch_server(tmp_path)
    if when == "importing":
        time.sleep(1.0)
    else:
        _wait_until(lambda: _log_has(server, "gRPC listening"), timeout_s=120,
                    what="gRPC port open")
        time.sleep(0.3)  # the engine process is being spawned or loads the model
    server.proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    code = server.wait_exit(timeout_s=30)
    elapsed = time.monotonic() - start
    assert code == 0, server.log()[-3000:]
    assert elapsed < 10.0
    # Nothing of it is left: the engine process (same process group) is gone too.
    _wait_until(lambda: _group_gone(server.proc.pid), timeout_s=10.0, what="process group exit")


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return all(_process_gone(int(p.name)) for p in Path("/proc").iterdir()
               if p.name.isdigit() and _pgid(int(p.name)) == pgid)


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return -1


async def test_sigterm_to_the_whole_process_group_still_drains(tmp_path):
    """`kill -TERM -<pgid>` (systemd, a shell's job control) reaches the engine too: it keeps
    serving while the server drains, so in-flight streams finish and the exit code is 0."""
    server = start_server(tmp_path, "--drain-timeout-s", "300")
    try:
        async with AsyncClient(server.target) as client:
            stream = client.generate("Tell me a story.", max_tokens=10, ignore_eos=True,
                                     stream_token_ids=True)
            num_tokens = len((await stream.__anext__()).token_ids)
            os.killpg(server.proc.pid, signal.SIGTERM)
            async for r in stream:
                num_tokens += len(r.token_ids)
            assert r.finish_reason and num_tokens == 10
        assert server.wait_exit(timeout_s=120) == 0
    finally:
        server.stop()
    assert "SIGTERM while the frontend lives" in server.log()
