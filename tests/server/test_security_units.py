"""ApiKeyAuth and the TLS files on their own (the servers are tested in test_security.py)."""

from __future__ import annotations

import ssl

import pytest

from tinyvllm.config import ServerConfig
from tinyvllm.server.security import ApiKeyAuth, TlsFiles

from .certs import CertificateAuthority, write_pair


def test_api_key_checks_bearer_scheme_and_every_key(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team keys\n\n  key-one  \nkey-two\n")
    auth = ApiKeyAuth.from_config(None, str(f))
    assert auth.check("Bearer key-one") and auth.check("bearer key-two")
    assert auth.check("BEARER   key-two ")
    for bad in (None, "", "key-one", "Bearer", "Bearer ", "Bearer key-on", "Bearer key-one2",
                "Basic key-one", "Bearer # team keys"):
        assert not auth.check(bad), bad
    assert ApiKeyAuth.from_config(None, None) is None
    assert ApiKeyAuth.from_config("k", None).check("Bearer k")


def test_empty_key_file_and_conflicting_options_are_refused(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# nothing but a comment\n\n")
    with pytest.raises(ValueError, match="at least one key"):
        ApiKeyAuth.from_config(None, str(f))
    with pytest.raises(ValueError, match="not both"):
        ServerConfig(api_key="a", api_key_file=str(f))
    with pytest.raises(ValueError, match="together"):
        ServerConfig(tls_cert_file="c.pem")
    with pytest.raises(ValueError, match="needs tls_cert_file"):
        ServerConfig(tls_client_ca_file="ca.pem")
    with pytest.raises(ValueError, match="must not be empty"):
        ServerConfig(api_key="  ")


def test_tls_files_refuse_a_mismatched_pair_at_start_and_keep_the_old_on_reload(tmp_path):
    ca = CertificateAuthority()
    first, second = ca.issue("127.0.0.1", server=True), ca.issue("127.0.0.1", server=True)
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_bytes(first.cert_pem)
    key.write_bytes(second.key_pem)
    with pytest.raises(ssl.SSLError):
        TlsFiles(str(cert), str(key), None)
    write_pair(first, cert, key)
    tls = TlsFiles(str(cert), str(key), None)
    ctx = tls.ssl_context(client_required=True)
    assert ctx.verify_mode == ssl.CERT_NONE  # no client CA: no client certificates asked
    key.write_bytes(second.key_pem)
    assert tls.changed_on_disk()
    assert not tls.reload() and tls.material.cert == first.cert_pem and tls.generation == 0
    write_pair(second, cert, key)
    assert tls.reload() and tls.material.cert == second.cert_pem and tls.generation == 1


def test_client_ca_sets_required_or_optional(tmp_path):
    ca = CertificateAuthority()
    write_pair(ca.issue("127.0.0.1", server=True), tmp_path / "c.pem", tmp_path / "k.pem")
    (tmp_path / "ca.pem").write_bytes(ca.pem)
    tls = TlsFiles(str(tmp_path / "c.pem"), str(tmp_path / "k.pem"), str(tmp_path / "ca.pem"))
    assert tls.ssl_context(client_required=True).verify_mode == ssl.CERT_REQUIRED
    assert tls.ssl_context(client_required=False).verify_mode == ssl.CERT_OPTIONAL
