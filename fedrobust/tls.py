"""Self-signed TLS certificates and SuperNode authentication keys for a Flower deployment.

Usage::

    python -m fedrobust.tls --out certs [--host 127.0.0.1 --host localhost] [--supernodes N] [--keep-ca-key] [--force]
    python -m fedrobust.tls --out certs --renew [--host ...] [--days D]   # a new server certificate, same CA

TLS files, for ``flower-superlink --ssl-ca-certfile ca.crt --ssl-certfile server.pem --ssl-keyfile
server.key`` and ``flower-supernode --root-certificates ca.crt``:

- ``ca.crt``: a self-signed CA certificate (PEM). Its private key is used once and never written,
  so no more certificates can be issued under it; run the command again for a new set. With
  ``--keep-ca-key`` it is written as ``ca.key`` (mode 0600; keep it off the server if you can), and
  ``--renew`` then issues a new server certificate under the same CA: the devices keep their ``ca.crt``.
- ``server.pem``: the server certificate (PEM) signed by the CA, for every ``--host`` as a
  subjectAltName (IP address or DNS name); clients verify the host they dial against these.
- ``server.key``: the server's ECDSA P-256 private key (PKCS8 PEM, mode 0600).

SuperNode authentication keys (``--supernodes N``), in the formats Flower 1.41 reads: the SuperNode
loads ``--auth-supernode-private-key`` with ``load_ssh_private_key`` and requires an elliptic-curve
key; ``flwr supernode register <public key file>`` loads the public key with ``load_ssh_public_key``
and requires a NIST curve; the SuperLink checks them when started with ``--enable-supernode-auth``.

- ``supernode-<i>``: ECDSA P-384 private key, OpenSSH format (mode 0600), as ``ssh-keygen -t ecdsa
  -b 384 -N ""`` writes it.
- ``supernode-<i>.pub``: its OpenSSH public key line (``ecdsa-sha2-nistp384 AAAA... fedrobust-supernode-<i>``).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import logging
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedrobust.signing import write_private_file

log = logging.getLogger(__name__)

CA_CERT = "ca.crt"
SERVER_CERT = "server.pem"
SERVER_KEY = "server.key"
CA_KEY = "ca.key"  # written only with keep_ca_key / --keep-ca-key
CA_DAYS_KEPT = 3650  # a CA whose key is kept, to renew server certificates under: ten years
DEFAULT_HOSTS = ("127.0.0.1", "localhost")
# A certificate is accepted from a little before "now" so that small clock skew between machines does
# not make a freshly made certificate "not yet valid".
_BACKDATE = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class TlsFiles:
    """Paths of the files `generate_tls_certificates` wrote."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    ca_key: Path | None = None  # written only with keep_ca_key


def _general_name(host: str) -> x509.GeneralName:
    if not isinstance(host, str) or not host.strip():
        raise ValueError(f"host names must be non-empty strings, got {host!r}")
    bracketed = host.startswith("[") and host.endswith("]")  # an IPv6 address in URL brackets: [::1]
    try:
        return x509.IPAddress(ipaddress.ip_address(host[1:-1] if bracketed else host))
    except ValueError:
        pass
    if ":" in host or "/" in host:  # a port or a URL: the certificate names the host alone
        raise ValueError(f"host {host!r}: give the host alone, without scheme or port (e.g. 'fl.example.org' or "
                         "'10.0.0.5'); clients dial the port with --superlink")
    last = host.rstrip(".").rpartition(".")[2]
    if _NUMBER.fullmatch(last):  # no top-level domain is a number: a mistyped IP address (1.2.3, 127.1)
        raise ValueError(f"host {host!r} is not a valid IP address")
    # A DNS name, which x509 wants as IDNA/ASCII: labels of letters, digits, hyphens and underscores
    # (container service names), the first one possibly a wildcard.
    try:
        ascii_name = host.encode("idna").decode("ascii")
    except UnicodeError:
        ascii_name = ""
    labels = ascii_name.rstrip(".").split(".")
    if labels[0] == "*" and len(labels) > 1:
        labels = labels[1:]
    if not all(_DNS_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"host {host!r} is neither an IP address nor a valid DNS name")
    return x509.DNSName(ascii_name)


_NUMBER = re.compile(r"\d+|0[xX][0-9a-fA-F]+")
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def _check_writable(paths: Iterable[Path], overwrite: bool) -> None:
    if overwrite:
        return
    existing = [path for path in paths if path.exists()]
    if existing:
        # The command line's flag: the Python API's callers read overwrite=True in the docstring.
        raise FileExistsError(f"{existing[0]} exists (and {len(existing) - 1} more); pass --force to replace")


def generate_tls_certificates(
    out_dir: str | Path,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    *,
    days: int = 365,
    overwrite: bool = False,
    keep_ca_key: bool = False,
    ca_days: int | None = None,
) -> TlsFiles:
    """Write a self-signed CA certificate and a server certificate and key signed by it.

    Parameters
    ----------
    out_dir : str or Path
        Output directory (created if missing).
    hosts : sequence of str
        The addresses clients dial: IP addresses and DNS names, all put in the server certificate's
        subjectAltName; the first is also its common name.
    days : int
        Validity of both certificates, in days.
    overwrite : bool
        Replace existing files; otherwise any existing output file raises `FileExistsError` before
        anything is written.
    keep_ca_key : bool
        Also write the CA's private key, ``ca.key`` (mode 0600), so that :func:`renew_server_certificate`
        can issue the next server certificate under the same CA and no device needs a new ``ca.crt``.
        Without it the key is used once and never written.
    ca_days : int, optional
        Validity of the CA certificate; default ``days``, or ten years with ``keep_ca_key`` (the server
        certificates renewed under it can then outlive the first one).

    Returns
    -------
    TlsFiles
        The paths of ``ca.crt``, ``server.pem`` and ``server.key`` (and ``ca.key`` when kept).
    """
    names = _subject_alt_names(hosts)
    _check_days(days)
    out = Path(out_dir)
    files = TlsFiles(ca_cert=out / CA_CERT, server_cert=out / SERVER_CERT, server_key=out / SERVER_KEY,
                     ca_key=out / CA_KEY if keep_ca_key else None)
    # A ca.key left from an earlier set would not match the new CA: it is replaced, or refused, too.
    _check_writable((files.ca_cert, files.server_cert, files.server_key, out / CA_KEY), overwrite)

    ca_days = ca_days if ca_days is not None else (max(CA_DAYS_KEPT, days) if keep_ca_key else days)
    _check_days(ca_days)
    if ca_days < days:
        raise ValueError(f"ca_days ({ca_days}) must be >= days ({days}): the server certificate cannot outlive its CA")
    now = datetime.datetime.now(datetime.UTC)
    not_before, not_after = now - _BACKDATE, now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_cert = _ca_certificate(ca_key, not_before, now + datetime.timedelta(days=ca_days))
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = _server_certificate(server_key, hosts[0], names, ca_cert, ca_key, not_before, not_after)

    out.mkdir(parents=True, exist_ok=True)
    if files.ca_key is not None:
        write_private_file(files.ca_key, _private_pem(ca_key), overwrite=overwrite)
    elif overwrite and (out / CA_KEY).exists():
        (out / CA_KEY).unlink()
    write_private_file(files.server_key, _private_pem(server_key), overwrite=overwrite)
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    log.info("wrote TLS CA %s, server certificate %s for %s, key %s (0600)%s",
             files.ca_cert, files.server_cert, ", ".join(hosts), files.server_key,
             f", CA key {files.ca_key} (0600)" if files.ca_key else "")
    return files


def renew_server_certificate(out_dir: str | Path, hosts: Sequence[str] | None = None, *, days: int = 365) -> TlsFiles:
    """Replace ``server.pem`` and ``server.key`` in ``out_dir`` with a new key and a certificate signed by the
    CA there (``ca.crt`` with the ``ca.key`` that ``keep_ca_key`` wrote). ``ca.crt`` is unchanged, so the
    SuperNodes and ``flwr`` machines that trust it need nothing new: restart the SuperLink with the new files.

    ``hosts`` default to those of the current ``server.pem`` (so the devices keep dialing what they dial).
    The new certificate is valid for ``days``, but never past the CA's own end (it would not verify then);
    a shortened validity is logged. Raises `FileNotFoundError` when ``ca.crt`` or ``ca.key`` is missing (a
    set made without ``keep_ca_key``: make a new set and give every device its ``ca.crt``), and
    ValueError when ``ca.key`` is not the key of ``ca.crt`` or the CA has expired.
    """
    _check_days(days)
    out = Path(out_dir)
    if hosts is None:
        hosts = _current_hosts(out / SERVER_CERT)
    names = _subject_alt_names(hosts)
    ca_key_path = out / CA_KEY
    files = TlsFiles(ca_cert=out / CA_CERT, server_cert=out / SERVER_CERT, server_key=out / SERVER_KEY,
                     ca_key=ca_key_path)
    for path, made_by in ((files.ca_cert, "a set"), (ca_key_path, "a set made with keep_ca_key/--keep-ca-key")):
        if not path.exists():
            raise FileNotFoundError(
                f"{path} not found: renewing needs {made_by}; without the CA's key make a new set (every device "
                f"then needs the new {CA_CERT})"
            )
    ca_cert = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    try:
        ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
    except (TypeError, ValueError) as err:  # a password-protected or damaged key
        raise ValueError(f"{ca_key_path} cannot be read as an unencrypted private key: {err}") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey) or ca_key.public_key() != ca_cert.public_key():
        raise ValueError(f"{ca_key_path} is not the private key of {files.ca_cert}")
    now = datetime.datetime.now(datetime.UTC)
    ca_end = ca_cert.not_valid_after_utc
    if ca_end <= now:
        raise ValueError(f"the CA {files.ca_cert} expired on {ca_end:%Y-%m-%d}: make a new set")
    not_after = now + datetime.timedelta(days=days)
    if not_after > ca_end:
        log.warning("the server certificate ends with the CA on %s, not in %d days: a new set is due then",
                    f"{ca_end:%Y-%m-%d}", days)
        not_after = ca_end
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = _server_certificate(server_key, hosts[0], names, ca_cert, ca_key, now - _BACKDATE, not_after)
    # Both written in full beside the old ones first, then renamed over them one right after the other: a
    # failure while writing leaves the old pair as it was.
    new_key = files.server_key.with_name(f".{SERVER_KEY}.new")
    new_key.unlink(missing_ok=True)
    write_private_file(new_key, _private_pem(server_key))
    new_cert = files.server_cert.with_name(f".{SERVER_CERT}.new")
    new_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    new_key.replace(files.server_key)
    new_cert.replace(files.server_cert)
    log.info("renewed server certificate %s for %s until %s under CA %s",
             files.server_cert, ", ".join(hosts), f"{not_after:%Y-%m-%d}", files.ca_cert)
    return files


def _current_hosts(server_cert: Path) -> list[str]:
    """The addresses of the current server certificate's subjectAltName."""
    if not server_cert.exists():
        raise FileNotFoundError(f"{server_cert} not found: give the addresses the devices dial (hosts / --host)")
    cert = x509.load_pem_x509_certificate(server_cert.read_bytes())
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise ValueError(f"{server_cert} names no addresses (no subjectAltName): give them (hosts / --host)") from None
    names = [*sans.get_values_for_type(x509.DNSName), *(str(ip) for ip in sans.get_values_for_type(x509.IPAddress))]
    common = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    return sorted(names, key=lambda name: name not in common)  # the common name stays first, as it was made


def _subject_alt_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    if isinstance(hosts, str):
        raise ValueError(f"hosts must be a sequence of host names, got the string {hosts!r}")
    names = [_general_name(host) for host in hosts]
    if not names:
        raise ValueError("hosts must name at least one IP address or DNS name")
    return names


def _check_days(days: int) -> None:
    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")


def _private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    pkcs8 = serialization.PrivateFormat.PKCS8
    return key.private_bytes(serialization.Encoding.PEM, pkcs8, serialization.NoEncryption())


_CA_NAME = x509.Name([
    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedrobust"),
    x509.NameAttribute(NameOID.COMMON_NAME, "fedrobust self-signed CA"),
])


def _ca_certificate(
    ca_key: ec.EllipticCurvePrivateKey, not_before: datetime.datetime, not_after: datetime.datetime
) -> x509.Certificate:
    return (
        x509.CertificateBuilder()
        .subject_name(_CA_NAME)
        .issuer_name(_CA_NAME)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )


def _server_certificate(
    server_key: ec.EllipticCurvePrivateKey,
    common_name: str,
    names: list[x509.GeneralName],
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    not_before: datetime.datetime,
    not_after: datetime.datetime,
) -> x509.Certificate:
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedrobust"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]))
        .issuer_name(ca_cert.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA384())
    )


def generate_supernode_keys(out_dir: str | Path, n: int, *, overwrite: bool = False) -> list[tuple[Path, Path]]:
    """Write ECDSA P-384 SuperNode authentication key pairs in OpenSSH format.

    Parameters
    ----------
    out_dir : str or Path
        Output directory (created if missing).
    n : int
        Number of key pairs: ``supernode-0`` .. ``supernode-<n-1>`` (+ ``.pub``).
    overwrite : bool
        Replace existing files; otherwise any existing output file raises `FileExistsError` before
        anything is written.

    Returns
    -------
    list[tuple[Path, Path]]
        ``(private key path, public key path)`` per SuperNode. Start SuperNode ``i`` with
        ``--auth-supernode-private-key <private>`` and register it with
        ``flwr supernode register <public> <superlink connection>``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    out = Path(out_dir)
    pairs = [(out / f"supernode-{index}", out / f"supernode-{index}.pub") for index in range(n)]
    _check_writable((path for pair in pairs for path in pair), overwrite)
    out.mkdir(parents=True, exist_ok=True)
    for index, (private_path, public_path) in enumerate(pairs):
        key = ec.generate_private_key(ec.SECP384R1())
        write_private_file(
            private_path,
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
            ),
            overwrite=overwrite,
        )
        line = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        public_path.write_bytes(line + f" fedrobust-supernode-{index}\n".encode("ascii"))
    log.info("wrote %d SuperNode authentication key pairs under %s", n, out)
    return pairs


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m fedrobust.tls",
        description="Generate a self-signed CA, a SuperLink server certificate/key and, optionally, "
        "SuperNode authentication keys.",
    )
    parser.add_argument("--out", required=True, type=Path, help="output directory (created if missing)")
    parser.add_argument(
        "--host",
        action="append",
        dest="hosts",
        metavar="HOST",
        help="IP address or DNS name clients dial; repeat for several (default: 127.0.0.1 and localhost; "
        "with --renew, those of the current server certificate)",
    )
    parser.add_argument("--days", type=int, default=365, help="certificate validity in days (default: 365)")
    parser.add_argument("--supernodes", type=int, default=0, metavar="N",
                        help="also write N SuperNode authentication key pairs (default: 0)")
    parser.add_argument("--force", action="store_true", help="overwrite existing files")
    parser.add_argument("--keep-ca-key", action="store_true",
                        help="also write the CA's private key (ca.key, 0600), so that --renew can be used later")
    parser.add_argument("--renew", action="store_true",
                        help="replace server.pem/server.key in --out with a new certificate under the CA there "
                        "(ca.crt and the ca.key of --keep-ca-key); ca.crt stays, devices need nothing new")
    args = parser.parse_args(argv)
    if args.renew and (args.supernodes or args.force or args.keep_ca_key):
        parser.error("--renew replaces the server certificate and key only: it takes --out, --host and --days")
    if args.days < 1:
        parser.error(f"--days must be >= 1, got {args.days}")
    if args.supernodes < 0:
        parser.error(f"--supernodes must be >= 0, got {args.supernodes}")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a directory")
    if args.renew:  # without --host: the addresses of the current server certificate
        return _renew(args.out, tuple(args.hosts) if args.hosts else None, args.days, parser)
    hosts = tuple(args.hosts or DEFAULT_HOSTS)
    try:
        files = generate_tls_certificates(
            args.out, hosts, days=args.days, overwrite=args.force, keep_ca_key=args.keep_ca_key
        )
        pairs = generate_supernode_keys(args.out, args.supernodes, overwrite=args.force) if args.supernodes else []
    except ValueError as err:
        parser.error(str(err))
    except OSError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"CA certificate:     {files.ca_cert}")
    print(f"server certificate: {files.server_cert}  (subjectAltName: {', '.join(hosts)})")
    print(f"server key:         {files.server_key}  (mode 0600)")
    if files.ca_key is not None:
        print(f"CA key:             {files.ca_key}  (mode 0600; for --renew, keep it safe)")
    for private_path, public_path in pairs:
        print(f"SuperNode key:      {private_path}  (mode 0600), public {public_path}")
    print(
        "\nflower-superlink --ssl-ca-certfile {0} --ssl-certfile {1} --ssl-keyfile {2}{3}\n"
        "flower-supernode --root-certificates {0}{4} ...".format(
            files.ca_cert, files.server_cert, files.server_key,
            " --enable-supernode-auth" if pairs else "",
            " --auth-supernode-private-key <supernode-i>" if pairs else "",
        )
    )
    if pairs:
        print("register each SuperNode first: flwr supernode register <supernode-i.pub> <superlink connection>")
    return 0


def _renew(out: Path, hosts: tuple[str, ...] | None, days: int, parser: argparse.ArgumentParser) -> int:
    try:
        files = renew_server_certificate(out, hosts, days=days)
    except ValueError as err:
        parser.error(str(err))
    except OSError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    end = x509.load_pem_x509_certificate(files.server_cert.read_bytes()).not_valid_after_utc
    names = ", ".join(_current_hosts(files.server_cert))
    print(f"server certificate: {files.server_cert}  (subjectAltName: {names}; until {end:%Y-%m-%d})")
    print(f"server key:         {files.server_key}  (mode 0600)")
    print(f"CA certificate:     {files.ca_cert}  (unchanged: the devices keep theirs)")
    print("restart the SuperLink with these files; SuperNodes reconnect by themselves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
