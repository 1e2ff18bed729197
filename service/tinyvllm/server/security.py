"""API-key authentication and TLS for every port (gRPC, HTTP API, metrics).

```
ApiKeyAuth      keys from --api-key / --api-key-file; `authorization: Bearer <key>`,
                compared in constant time (hmac.compare_digest) against every key
AuthInterceptor gRPC: a call without a valid key ends UNAUTHENTICATED before the servicer runs
TlsFiles        cert/key/CA read from disk; reload() on SIGHUP or when a file's mtime changes
  ├─ grpc_credentials(): dynamic credentials; the fetcher hands gRPC the newest pair at each
  │                      new handshake, open connections (and their streams) keep theirs
  └─ ssl_context(...):   one live SSLContext per HTTP port, refreshed in place by reload()
```
A reload validates the new files first (the key must match the certificate); on failure the
old certificate stays in use and the error is logged.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import ssl
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Optional

import grpc
import grpc.aio

logger = logging.getLogger(__name__)

BEARER_PREFIX = "bearer "
HEALTH_SERVICE_PREFIX = "/grpc.health.v1.Health/"


class ApiKeyAuth:
    """The accepted API keys; `check` compares a presented `authorization` value to each."""

    def __init__(self, keys: list[str]) -> None:
        if not keys:
            raise ValueError("an API key file must hold at least one key")
        self._keys = [k.encode() for k in keys]

    @classmethod
    def from_config(cls, api_key: Optional[str], api_key_file: Optional[str]
                    ) -> Optional["ApiKeyAuth"]:
        """None when no key is configured (authentication off)."""
        if api_key is not None:
            return cls([api_key.strip()])
        if api_key_file is None:
            return None
        with open(api_key_file, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
        return cls([line for line in lines if line and not line.startswith("#")])

    def check(self, authorization: Optional[str]) -> bool:
        """True if `authorization` is `Bearer <one of the keys>` (scheme case-insensitive)."""
        if not authorization or not authorization[:len(BEARER_PREFIX)].lower() == BEARER_PREFIX:
            return False
        presented = authorization[len(BEARER_PREFIX):].strip().encode()
        # Compare with every key (no early exit) so that timing tells nothing about which matched.
        matches = [hmac.compare_digest(presented, key) for key in self._keys]
        return any(matches)


# --- gRPC ---------------------------------------------------------------------------------------

UNAUTHENTICATED_DETAILS = "missing or invalid API key: send metadata `authorization: Bearer <key>`"


async def _deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)


async def _deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)
    yield  # pragma: no cover - an async generator, as stream handlers must be


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Ends calls without a valid API key UNAUTHENTICATED; health stays open unless asked."""

    def __init__(self, auth: ApiKeyAuth, auth_health: bool) -> None:
        self.auth = auth
        self.auth_health = auth_health

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        if not self.auth_health and details.method.startswith(HEALTH_SERVICE_PREFIX):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if self.auth.check(metadata.get("authorization")):
            return handler
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_deny_unary)
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_deny_stream)
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=_deny_unary)
        return handler._replace(stream_stream=_deny_stream)


# --- TLS ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Material:
    cert: bytes
    key: bytes
    client_ca: Optional[bytes]
    mtimes: tuple[float, ...]


class TlsFiles:
    """The server's certificate, key and client CA, reloaded from disk when asked.

    Args:
        cert_file, key_file: PEM chain and private key.
        client_ca_file: PEM CA bundle; when set, gRPC and the HTTP API demand client certificates.
    """

    def __init__(self, cert_file: str, key_file: str, client_ca_file: Optional[str]) -> None:
        self.paths = tuple(p for p in (cert_file, key_file, client_ca_file) if p)
        self.cert_file, self.key_file, self.client_ca_file = cert_file, key_file, client_ca_file
        self._lock = threading.Lock()  # the gRPC fetcher runs on a gRPC thread
        self._contexts: list[tuple[ssl.SSLContext, bool]] = []
        self.generation = 0
        self.material = self._read()  # raises on a bad pair: start-up fails loudly
        _check_pair(self.material)

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None

    def _read(self) -> _Material:
        mtimes = tuple(os.stat(p).st_mtime_ns for p in self.paths)
        with open(self.cert_file, "rb") as f:
            cert = f.read()
        with open(self.key_file, "rb") as f:
            key = f.read()
        ca = None
        if self.client_ca_file:
            with open(self.client_ca_file, "rb") as f:
                ca = f.read()
        return _Material(cert, key, ca, mtimes)

    def changed_on_disk(self) -> bool:
        try:
            return tuple(os.stat(p).st_mtime_ns for p in self.paths) != self.material.mtimes
        except OSError:
            return False  # mid-rotation (file replaced): look again next time

    def reload(self) -> bool:
        """Read the files again and switch every port to them; False (old ones kept) on error."""
        try:
            material = self._read()
            _check_pair(material)
        except (OSError, ssl.SSLError, ValueError) as e:
            logger.error("TLS reload failed, keeping the current certificate: %s", e)
            return False
        with self._lock:
            self.material = material
            self.generation += 1
            for ctx, client_required in self._contexts:
                _load_into(ctx, material, client_required)
        logger.info("TLS certificate reloaded from %s", self.cert_file)
        return True

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Credentials whose fetcher returns the newest pair whenever a reload happened."""
        seen = {"generation": self.generation}

        def fetch() -> Optional[grpc.ServerCertificateConfiguration]:
            with self._lock:
                if self.generation == seen["generation"]:
                    return None  # unchanged: gRPC keeps the current configuration
                seen["generation"] = self.generation
                return self._grpc_config(self.material)

        return grpc.dynamic_ssl_server_credentials(
            self._grpc_config(self.material), fetch,
            require_client_authentication=self.mutual)

    @staticmethod
    def _grpc_config(m: _Material) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(m.key, m.cert)],
                                                         root_certificates=m.client_ca)

    def ssl_context(self, client_required: bool) -> ssl.SSLContext:
        """A server SSLContext that `reload` refreshes in place.

        Args:
            client_required: with a client CA, demand a client certificate (else ask for one
                and verify it when given: probes without one still get in).
        """
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        with self._lock:
            _load_into(ctx, self.material, client_required)
            self._contexts.append((ctx, client_required))
        return ctx


def _load_into(ctx: ssl.SSLContext, m: _Material, client_required: bool) -> None:
    """Put `m` into a live context: later handshakes use it, open connections keep theirs."""
    _load_pair(ctx, m)
    if m.client_ca is not None:
        ctx.load_verify_locations(cadata=m.client_ca.decode())
        ctx.verify_mode = ssl.CERT_REQUIRED if client_required else ssl.CERT_OPTIONAL


def _load_pair(ctx: ssl.SSLContext, m: _Material) -> None:
    # load_cert_chain reads only files: hand it the bytes already read (and checked) through
    # a private temporary directory, so that the context holds exactly what gRPC got.
    with tempfile.TemporaryDirectory(prefix="tinyvllm-tls-") as d:
        cert_path, key_path = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        for path, data in ((cert_path, m.cert), (key_path, m.key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(cert_path, key_path)


def _check_pair(m: _Material) -> None:
    """Raises ssl.SSLError unless the key matches the certificate and the CA bundle parses."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load_pair(ctx, m)
    if m.client_ca is not None:
        ctx.load_verify_locations(cadata=m.client_ca.decode())


def tls_files_from_config(cert_file: Optional[str], key_file: Optional[str],
                          client_ca_file: Optional[str]) -> Optional[TlsFiles]:
    return TlsFiles(cert_file, key_file, client_ca_file) if cert_file and key_file else None



async def watch_tls_files(tls: TlsFiles, interval_s: float) -> None:
    """Reload `tls` whenever one of its files changes (mtime), checked every `interval_s`."""
    if interval_s <= 0:
        return
    while True:
        await asyncio.sleep(interval_s)
        if tls.changed_on_disk():
            tls.reload()
