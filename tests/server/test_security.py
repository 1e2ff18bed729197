"""TLS, mutual TLS, certificate reload and API keys on every port of a real server process.

The servers run the model-free FakeEngineCore (tests/server/fake_serve.py): what is tested here is
the transport and authentication, which do not depend on the model. Certificates are made in the
test (tests/server/certs.py).
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tinyvllm.v1 import generation_pb2 as pb
from tinyvllm.v1 import generation_pb2_grpc as pb_grpc

from .certs import CertificateAuthority, Issued, serial_of, write_pair
from .conftest import HOST, free_port, stop_process

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-test-7b0c1f"
START_TIMEOUT_S = 120.0


@dataclass
class TlsServer:
    proc: subprocess.Popen
    port: int
    http_port: int
    metrics_port: int
    dir: Path
    ca: CertificateAuthority
    client: Issued

    def log(self) -> str:
        return (self.dir / "server.log").read_text(errors="replace")

    def ssl_context(self, client_cert: bool = True) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cadata=self.ca.pem.decode())
        if client_cert:
            ctx.load_cert_chain(self.dir / "client.pem", self.dir / "client.key")
        return ctx

    def channel(self, client_cert: bool = True) -> grpc.Channel:
        creds = grpc.ssl_channel_credentials(
            self.ca.pem, self.client.key_pem if client_cert else None,
            self.client.cert_pem if client_cert else None)
        return grpc.secure_channel(f"{HOST}:{self.port}", creds)

    def https_get(self, port: int, path: str, key: str | None = None,
                  client_cert: bool = False) -> tuple[int, str]:
        req = urllib.request.Request(f"https://{HOST}:{port}{path}")
        if key is not None:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=10,
                                        context=self.ssl_context(client_cert)) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def served_serial(self, port: int, alpn: str | None = None) -> int:
        """Serial number of the certificate a new TLS connection to `port` is given."""
        ctx = self.ssl_context()
        if alpn:
            ctx.set_alpn_protocols([alpn])
        with socket.create_connection((HOST, port), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname=HOST) as tls:
                return serial_of(tls.getpeercert(binary_form=True))

    def openai(self, key: str = API_KEY, client_cert: bool = True) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"https://{HOST}:{self.http_port}/v1", api_key=key, max_retries=0,
            http_client=openai.DefaultHttpxClient(verify=self.ssl_context(client_cert)))

    def stop(self) -> None:
        stop_process(self.proc)


def start_tls_server(d: Path, *extra: str) -> TlsServer:
    ca = CertificateAuthority()
    write_pair(ca.issue("127.0.0.1", server=True), d / "server.pem", d / "server.key")
    client = ca.issue("client-a", server=False)
    write_pair(client, d / "client.pem", d / "client.key")
    (d / "ca.pem").write_bytes(ca.pem)
    (d / "keys.txt").write_text(f"# API keys\n\nsk-other-key\n{API_KEY}\n")
    port, http_port, metrics_port = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "tests.server.fake_serve", "--host", HOST, "--port", str(port),
           "--http-port", str(http_port), "--metrics-port", str(metrics_port),
           "--tls-cert-file", str(d / "server.pem"), "--tls-key-file", str(d / "server.key"),
           "--tls-client-ca-file", str(d / "ca.pem"), "--api-key-file", str(d / "keys.txt"),
           *extra]
    with open(d / "server.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "TQDM_DISABLE": "1"})
    server = TlsServer(proc, port, http_port, metrics_port, d, ca, client)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if server.https_get(metrics_port, "/health")[0] == 200:
                return server
        except (OSError, urllib.error.URLError):
            pass
        if time.monotonic() > deadline:
            server.stop()
            pytest.fail(f"server not healthy after {START_TIMEOUT_S}s:\n{server.log()[-4000:]}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_tls_server(tmp_path_factory.mktemp("tls"), "--auth-metrics",
                           "--tls-reload-interval-s", "0")
    yield srv
    srv.stop()


def _generate(channel: grpc.Channel, metadata=(), max_tokens: int = 4) -> list[pb.GenerateResponse]:
    stub = pb_grpc.GenerationStub(channel)
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[100, 200]),
                             sampling=pb.SamplingParameters(max_tokens=max_tokens))
    return list(stub.Generate(req, metadata=metadata, timeout=30))


# --- API keys -----------------------------------------------------------------------------------

@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),),
                                      (("authorization", API_KEY),),
                                      (("authorization", f"Basic {API_KEY}"),)],
                         ids=["none", "wrong-key", "no-scheme", "basic-scheme"])
def test_grpc_without_valid_key_is_unauthenticated(server, metadata):
    with server.channel() as channel:
        with pytest.raises(grpc.RpcError) as info:
            _generate(channel, metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.GenerationStub(channel).ModelInfo(pb.ModelInfoRequest(), metadata=metadata,
                                                      timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_with_key_from_file_generates_and_health_stays_open(server):
    with server.channel() as channel:
        for key in (API_KEY, "sk-other-key"):  # every key of the file is accepted
            responses = _generate(channel, (("authorization", f"Bearer {key}"),), max_tokens=4)
            assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert responses[-1].usage.completion_tokens == 4
        # grpc.health.v1 answers without a key (--no-auth-health is the default).
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_http_api_key_and_openai_error_shape(server):
    with server.openai(key="wrong") as client:
        with pytest.raises(openai.AuthenticationError) as info:
            client.models.list()
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key"
    assert info.value.body["type"] == "authentication_error"
    with server.openai() as client:
        completion = client.completions.create(model=_model(client), prompt="Hi", max_tokens=3)
    assert completion.usage.completion_tokens == 3
    assert completion.choices[0].finish_reason == "length"


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_metrics_port_health_open_metrics_need_key(server):
    # No client certificate and no key: /health still answers (kubelet probes have neither).
    assert server.https_get(server.metrics_port, "/health") == (200, "SERVING\n")
    status, _ = server.https_get(server.metrics_port, "/metrics")
    assert status == 401  # --auth-metrics
    status, text = server.https_get(server.metrics_port, "/metrics", key=API_KEY)
    assert status == 200 and "tinyvllm:num_requests_running" in text


# --- mutual TLS ---------------------------------------------------------------------------------

def test_grpc_and_http_refuse_clients_without_certificate(server):
    with server.channel(client_cert=False) as channel:
        with pytest.raises(grpc.RpcError) as info:
            _generate(channel, (("authorization", f"Bearer {API_KEY}"),))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with server.openai(client_cert=False) as client:
        with pytest.raises(openai.APIConnectionError):
            client.models.list()
    # A client that does not trust our CA fails the handshake too.
    with socket.create_connection((HOST, server.http_port), timeout=10) as raw:
        with pytest.raises(ssl.SSLCertVerificationError):
            ssl.create_default_context().wrap_socket(raw, server_hostname=HOST)


def test_plaintext_to_tls_port_gets_nothing_useful(server):
    with grpc.insecure_channel(f"{HOST}:{server.port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            _generate(channel, (("authorization", f"Bearer {API_KEY}"),))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# --- certificate reload -------------------------------------------------------------------------

def _wait_serial(server: TlsServer, port: int, serial: int, alpn: str | None = None,
                 timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := server.served_serial(port, alpn)) != serial:
        assert time.monotonic() < deadline, f"port {port} still serves serial {got}"
        time.sleep(0.1)


def test_sighup_reloads_certificate_on_every_port_keeping_open_streams(server):
    old_serial = server.served_serial(server.http_port)
    key_md = (("authorization", f"Bearer {API_KEY}"),)
    with server.channel() as channel:
        stub = pb_grpc.GenerationStub(channel)
        stream = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]),
                                                  sampling=pb.SamplingParameters(max_tokens=40),
                                                  stream=pb.StreamOptions(token_ids=True)),
                               metadata=key_md, timeout=30)
        first = next(stream)
        new = server.ca.issue("127.0.0.1", server=True)
        write_pair(new, server.dir / "server.pem", server.dir / "server.key")
        time.sleep(0.5)
        # --tls-reload-interval-s 0: nothing happens until SIGHUP.
        assert server.served_serial(server.http_port) == old_serial
        server.proc.send_signal(signal.SIGHUP)
        _wait_serial(server, server.http_port, new.serial)
        _wait_serial(server, server.metrics_port, new.serial)
        _wait_serial(server, server.port, new.serial, alpn="h2")
        # The stream opened before the reload runs to its end on its connection.
        responses = [first, *stream]
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(r.token_ids) for r in responses) == 40
        assert responses[-1].usage.completion_tokens == 40
        # New connections work with the new certificate.
        assert _generate(channel, key_md)[-1].finish_reason == pb.FINISH_REASON_LENGTH
    with server.openai() as client:
        completion = client.completions.create(model=_model(client), prompt="Hi", max_tokens=2)
    assert completion.usage.completion_tokens == 2
    assert "TLS certificate reloaded" in server.log()


def test_broken_new_certificate_keeps_the_old_one(server):
    serial = server.served_serial(server.http_port)
    other = server.ca.issue("127.0.0.1", server=True)
    (server.dir / "server.key").write_bytes(other.key_pem)  # key no longer matches the cert
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "TLS reload failed" not in server.log():
        assert time.monotonic() < deadline, "the failed reload was not logged"
        time.sleep(0.1)
    assert server.served_serial(server.http_port) == serial
    assert server.https_get(server.metrics_port, "/health")[0] == 200
    write_pair(other, server.dir / "server.pem", server.dir / "server.key")
    server.proc.send_signal(signal.SIGHUP)
    _wait_serial(server, server.http_port, other.serial)


def test_changed_files_are_reloaded_without_signal(tmp_path):
    server = start_tls_server(tmp_path, "--tls-reload-interval-s", "0.2")
    try:
        new = server.ca.issue("127.0.0.1", server=True)
        write_pair(new, server.dir / "server.pem", server.dir / "server.key")
        _wait_serial(server, server.http_port, new.serial)
        _wait_serial(server, server.port, new.serial, alpn="h2")
    finally:
        server.stop()
    assert server.proc.returncode == 0


def test_http_port_in_use_exits_1_naming_it(tmp_path):
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "tests.server.fake_serve", "--host", HOST, "--port", "0",
             "--metrics-port", "0", "--http-port", str(port)],
            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 1
    assert f"could not listen on {HOST}:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr
