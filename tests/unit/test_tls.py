"""Tests for fedrobust.tls: certificates Flower's SuperLink can serve, SuperNode keys Flower can load."""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import re
import ssl
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from fedrobust.tls import TlsFiles, generate_supernode_keys, generate_tls_certificates, renew_server_certificate


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return generate_tls_certificates(tmp_path_factory.mktemp("tls"))


def _verify(files: TlsFiles, name: x509.verification.Subject) -> None:
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    leaf = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    verifier = PolicyBuilder().store(Store([ca])).build_server_verifier(name)
    verifier.verify(leaf, [])


def test_server_certificate_verifies_against_ca_for_each_san(tls_files: TlsFiles) -> None:
    # cryptography's RFC 5280 path validation: CA constraints, key usages, validity, and the name.
    _verify(tls_files, x509.DNSName("localhost"))
    _verify(tls_files, x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    with pytest.raises(VerificationError):
        _verify(tls_files, x509.DNSName("example.org"))
    other = generate_tls_certificates(tls_files.ca_cert.parent / "other")
    with pytest.raises(VerificationError):
        _verify(TlsFiles(other.ca_cert, tls_files.server_cert, tls_files.server_key), x509.DNSName("localhost"))


def test_certificate_contents_and_key_file(tls_files: TlsFiles) -> None:
    leaf = x509.load_pem_x509_certificate(tls_files.server_cert.read_bytes())
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert stat.S_IMODE(tls_files.server_key.stat().st_mode) == 0o600
    key = serialization.load_pem_private_key(tls_files.server_key.read_bytes(), password=None)
    assert key.public_key() == leaf.public_key()
    assert not (tls_files.ca_cert.parent / "ca.key").exists()  # the CA key is never written


@pytest.mark.parametrize("hostname", ["localhost", "127.0.0.1"])
def test_tls_handshake_with_the_files_flower_is_given(tls_files: TlsFiles, hostname: str) -> None:
    # The SuperLink's HTTP server (uvicorn) loads --ssl-certfile/--ssl-keyfile into an ssl.SSLContext;
    # a client trusting ca.crt must complete a handshake and verify the host name.
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tls_files.server_cert, tls_files.server_key)
    client_ctx = ssl.create_default_context(cafile=str(tls_files.ca_cert))
    assert _handshake(server_ctx, client_ctx, hostname) is None
    error = _handshake(server_ctx, client_ctx, "other.example")
    assert isinstance(error, ssl.SSLCertVerificationError)


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, hostname: str) -> ssl.SSLError | None:
    """Drive a TLS handshake through memory BIOs; return the client's verification error, if any."""
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=hostname)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(10):
        for name, end in (("client", client), ("server", server)):
            if not done[name]:
                try:
                    end.do_handshake()
                    done[name] = True
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    pass
                except ssl.SSLCertVerificationError as err:
                    return err
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return None
    raise AssertionError("handshake did not finish")


def test_custom_hosts_and_bad_hosts(tmp_path: Path) -> None:
    files = generate_tls_certificates(tmp_path, hosts=("10.1.2.3", "::1", "superlink.lan"))
    _verify(files, x509.IPAddress(ipaddress.ip_address("10.1.2.3")))
    _verify(files, x509.IPAddress(ipaddress.ip_address("::1")))
    _verify(files, x509.DNSName("superlink.lan"))
    for hosts in ((), ("",), "localhost"):
        with pytest.raises(ValueError, match="host"):
            generate_tls_certificates(tmp_path / "bad", hosts=hosts)
    # A certificate no client would match: refused when it is made, not at the first connection.
    for host, says in (("127.0.0.1:9092", "give the host alone, without scheme or port"),
                       ("https://example.com", "give the host alone"), ("999.1.1.1", "is not a valid IP address"),
                       ("1.2.3", "is not a valid IP address"), ("1.2.3.4.", "is not a valid IP address"),
                       ("0x7f.1.1.1", "is not a valid IP address"), ("[::1", "without scheme or port"),
                       ("not a host!!", "is neither an IP address nor a valid DNS name"),
                       ("-lead.example", "is neither an IP address nor a valid DNS name")):
        with pytest.raises(ValueError, match=re.escape(f"host {host!r}") + ".*" + re.escape(says)):
            generate_tls_certificates(tmp_path / "bad", hosts=(host,))
    assert not (tmp_path / "bad").exists()
    # An international name (as IDNA), a wildcard, container service names and an IPv6 address in brackets.
    files = generate_tls_certificates(tmp_path / "names", hosts=("bücher.example", "*.example.org", "fl_server",
                                                                  "superlink_1.local", "[::1]"))
    _verify(files, x509.DNSName("node-3.example.org"))  # by the wildcard
    _verify(files, x509.IPAddress(ipaddress.ip_address("::1")))
    leaf = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert {"xn--bcher-kva.example", "fl_server", "superlink_1.local"} <= set(names)
    with pytest.raises(FileExistsError):
        generate_tls_certificates(tmp_path)


def test_supernode_keys_load_with_flowers_loaders(tmp_path: Path) -> None:
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supernode.cli.flower_supernode import _try_setup_client_authentication

    pairs = generate_supernode_keys(tmp_path, 2)
    assert [(p.name, q.name) for p, q in pairs] == [
        ("supernode-0", "supernode-0.pub"), ("supernode-1", "supernode-1.pub")
    ]
    for private_path, public_path in pairs:
        assert stat.S_IMODE(private_path.stat().st_mode) == 0o600
        assert private_path.read_bytes().startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----")
        # What `flower-supernode --auth-supernode-private-key` runs (exits the process on a bad key).
        args = argparse.Namespace(auth_supernode_private_key=str(private_path), auth_supernode_public_key=None)
        private_key, public_key = _try_setup_client_authentication(args)
        assert isinstance(private_key, ec.EllipticCurvePrivateKey) and isinstance(private_key.curve, ec.SECP384R1)
        # What `flwr supernode register <public key>` runs; it returns the key as PEM bytes.
        registered = serialization.load_pem_public_key(try_load_public_key(public_path))
        assert registered == public_key
    with pytest.raises(FileExistsError):
        generate_supernode_keys(tmp_path, 1)
    with pytest.raises(ValueError, match="positive"):
        generate_supernode_keys(tmp_path, 0)


def test_tls_cli(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    command = [sys.executable, "-m", "fedrobust.tls", "--out", str(out), "--supernodes", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "ca.crt", "server.key", "server.pem", "supernode-0", "supernode-0.pub"
    ]
    assert "--ssl-ca-certfile" in result.stdout and "PRIVATE KEY" not in result.stdout
    again = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert again.returncode == 1 and "--force" in again.stderr


def test_renewal_issues_a_new_server_certificate_under_the_same_ca(tmp_path: Path) -> None:
    """What an operator does before the server certificate expires: the devices keep their ca.crt."""
    first = generate_tls_certificates(tmp_path, hosts=("localhost",), keep_ca_key=True)
    assert first.ca_key is not None and stat.S_IMODE(first.ca_key.stat().st_mode) == 0o600
    ca_before, leaf_before = first.ca_cert.read_bytes(), first.server_cert.read_bytes()
    key_before = first.server_key.read_bytes()

    renewed = renew_server_certificate(tmp_path, hosts=("localhost", "fl.example.org"), days=30)
    assert renewed.ca_cert.read_bytes() == ca_before  # the devices' trust anchor is untouched
    assert renewed.server_cert.read_bytes() != leaf_before and renewed.server_key.read_bytes() != key_before
    assert stat.S_IMODE(renewed.server_key.stat().st_mode) == 0o600
    _verify(renewed, x509.DNSName("fl.example.org"))  # the new host, against the old CA
    leaf = x509.load_pem_x509_certificate(renewed.server_cert.read_bytes())
    assert serialization.load_pem_private_key(renewed.server_key.read_bytes(), None).public_key() == leaf.public_key()
    assert 29 <= (leaf.not_valid_after_utc - leaf.not_valid_before_utc).days <= 30
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(renewed.server_cert, renewed.server_key)
    assert _handshake(server_ctx, ssl.create_default_context(cafile=str(first.ca_cert)), "localhost") is None


def test_a_kept_ca_outlives_the_server_certificates_renewed_under_it(tmp_path: Path) -> None:
    """Renewing before the server certificate expires must push its end back: with its key kept, the CA is
    made for ten years, the first server certificate for --days; a renewal without hosts keeps the current
    certificate's addresses (the devices dial those)."""
    files = generate_tls_certificates(tmp_path, hosts=("fl.example.org", "10.0.0.5"), days=30, keep_ca_key=True)
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    first = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    assert (ca.not_valid_after_utc - ca.not_valid_before_utc).days >= 3649
    assert (first.not_valid_after_utc - first.not_valid_before_utc).days <= 30
    renew_server_certificate(tmp_path, days=365)
    renewed = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    assert renewed.subject == first.subject  # its common name is the first address, as it was made
    assert renewed.not_valid_after_utc > first.not_valid_after_utc + datetime.timedelta(days=300)
    _verify(files, x509.DNSName("fl.example.org"))
    _verify(files, x509.IPAddress(ipaddress.ip_address("10.0.0.5")))
    assert not generate_tls_certificates(tmp_path / "plain").ca_key  # without the key kept: one life for both
    with pytest.raises(ValueError, match=r"ca_days \(10\) must be >= days \(30\)"):
        generate_tls_certificates(tmp_path / "bad", days=30, ca_days=10)
    long = generate_tls_certificates(tmp_path / "long", days=4000, keep_ca_key=True)  # the CA lives as long
    ca = x509.load_pem_x509_certificate(long.ca_cert.read_bytes())
    assert (ca.not_valid_after_utc - ca.not_valid_before_utc).days >= 4000


def test_renewal_never_outlives_the_ca_and_needs_its_key(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    files = generate_tls_certificates(tmp_path / "short", days=2, keep_ca_key=True, ca_days=2)
    renew_server_certificate(tmp_path / "short", days=365)
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    leaf = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    assert leaf.not_valid_after_utc == ca.not_valid_after_utc  # past it, the chain would not verify
    assert "ends with the CA" in caplog.text

    without_key = generate_tls_certificates(tmp_path / "plain")  # the default: the CA key is never written
    with pytest.raises(FileNotFoundError, match=r"ca\.key not found: renewing needs a set made with .*keep-ca-key"):
        renew_server_certificate(tmp_path / "plain")
    assert without_key.ca_key is None
    other = generate_tls_certificates(tmp_path / "other", keep_ca_key=True)
    assert other.ca_key is not None
    (tmp_path / "plain" / "ca.key").write_bytes(other.ca_key.read_bytes())
    with pytest.raises(ValueError, match=r"is not the private key of .*ca\.crt"):
        renew_server_certificate(tmp_path / "plain")
    locked = serialization.load_pem_private_key(other.ca_key.read_bytes(), None).private_bytes(  # type: ignore[union-attr]
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")
    )
    (tmp_path / "plain" / "ca.key").write_bytes(locked)
    before = (tmp_path / "plain" / "server.key").read_bytes()
    with pytest.raises(ValueError, match=r"cannot be read as an unencrypted private key"):
        renew_server_certificate(tmp_path / "plain")
    assert (tmp_path / "plain" / "server.key").read_bytes() == before  # the pair in place is untouched
    # A new set over an old one takes the old CA's key away with it: it would sign for a CA nobody trusts.
    generate_tls_certificates(tmp_path / "other", overwrite=True)
    assert not (tmp_path / "other" / "ca.key").exists()


def test_tls_cli_renew(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    base = [sys.executable, "-m", "fedrobust.tls", "--out", str(out)]
    made = subprocess.run([*base, "--keep-ca-key"], capture_output=True, text=True, timeout=60, check=False)
    assert made.returncode == 0, made.stderr
    assert "ca.key" in made.stdout and sorted(p.name for p in out.iterdir()) == [
        "ca.crt", "ca.key", "server.key", "server.pem"
    ]
    renewed = subprocess.run([*base, "--renew", "--days", "90"], capture_output=True, text=True, timeout=60,
                             check=False)
    assert renewed.returncode == 0, renewed.stderr
    assert "unchanged" in renewed.stdout and "restart the SuperLink" in renewed.stdout
    mixed = subprocess.run([*base, "--renew", "--supernodes", "2"], capture_output=True, text=True, timeout=60,
                           check=False)
    assert mixed.returncode == 2 and "--renew replaces the server certificate and key only" in mixed.stderr
