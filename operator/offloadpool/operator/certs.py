"""The webhook's TLS certificates: used as given (a mounted Secret), or made by the operator.

The API server calls the webhook over HTTPS and checks its certificate against the
``caBundle`` of the webhook configuration. Two sources, in this order:

- **given**: ``tls.crt`` and ``tls.key`` already in the certificate directory (a Secret
  mounted there, e.g. one cert-manager issues); ``ca.crt`` next to them is the CA the API server
  must trust (else the certificate itself). Renewed files are picked up by kopf's server, which
  re-reads them every minute and restarts with them; the operator then updates the caBundle.
- **made here** (the default): a private CA and a serving certificate signed by it, written to
  the directory when missing or within ``RENEW_BEFORE`` of expiry. The CA's key never leaves the
  process's directory; the configuration's caBundle is the CA certificate.

Why not kopf's own self-signed certificates: they need ``certbuilder``/``oscrypto``, whose
libcrypto version detection fails on OpenSSL ≥ 3.0.10 (an unreleased fix upstream), which is
what current images ship. ``cryptography`` is maintained and has wheels everywhere.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CERT_NAME = "tls.crt"
KEY_NAME = "tls.key"
CA_NAME = "ca.crt"
#: Lifetime of a made certificate, and how long before its end a new one is made.
VALIDITY = datetime.timedelta(days=365)
RENEW_BEFORE = datetime.timedelta(days=30)
#: Marks a directory whose certificates this module made (and may therefore replace).
MADE_HERE = ".made-by-offloadpool-operator"


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path
    ca: Path
    #: True when this module made them (and renews them); False for given ones.
    made_here: bool


def service_hostnames(service: str, namespace: str) -> list[str]:
    """The DNS names a Service-backed webhook is reached by (the API server uses ``.svc``)."""
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def ensure(directory: Path, hostnames: list[str], now: datetime.datetime | None = None) -> CertFiles:
    """Certificates for ``hostnames`` in ``directory``: the given ones, else made (or renewed)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = CertFiles(directory / CERT_NAME, directory / KEY_NAME, directory / CA_NAME, made_here=True)
    given = files.cert.exists() and files.key.exists() and not (directory / MADE_HERE).exists()
    if given:
        return CertFiles(
            files.cert, files.key, files.ca if files.ca.exists() else files.cert, made_here=False
        )
    if not needs_renewal(files, hostnames, now):
        return files
    make(directory, hostnames, now)
    return files


def needs_renewal(files: CertFiles, hostnames: list[str], now: datetime.datetime | None = None) -> bool:
    """True when the made certificate is missing, ends within RENEW_BEFORE, or lacks a name."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    try:
        cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    except (OSError, ValueError):
        return True
    if cert.not_valid_after_utc - now < RENEW_BEFORE:
        return True
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return True
    present = {str(v) for v in sans.get_values_for_type(x509.DNSName)}
    present |= {str(v) for v in sans.get_values_for_type(x509.IPAddress)}
    return not set(hostnames) <= present


def make(directory: Path, hostnames: list[str], now: datetime.datetime | None = None) -> None:
    """A fresh CA and a serving certificate for ``hostnames`` signed by it (EC P-256)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "offloadpool-webhook-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostnames[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hostnames]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    _write(directory / MADE_HERE, b"")
    _write(
        directory / KEY_NAME,
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        mode=0o600,
    )
    _write(directory / CA_NAME, ca.public_bytes(pem))
    # Last: kopf's server restarts when the files change; by then the key and CA are in place.
    _write(directory / CERT_NAME, cert.public_bytes(pem))


def _san(hostname: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(hostname))
    except ValueError:
        return x509.DNSName(hostname)


def _write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Atomically (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)
