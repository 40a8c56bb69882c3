"""The webhook's TLS certificates: used as given (a mounted Secret), or made by the operator.

The API server calls the webhook over HTTPS and checks its certificate against the
``caBundle`` of the webhook configurations. Two sources, in this order:

- **given**: ``tls.crt`` and ``tls.key`` already in the certificate directory (a Secret
  mounted there, e.g. one cert-manager issues); ``ca.crt`` next to them is the CA the API server
  must trust (else the certificate itself). Renewed files are picked up by kopf's server, which
  re-reads them every minute and restarts with them; the operator then updates the caBundle.
- **made here** (the default): a private CA (``ca.crt``, its key ``ca.key`` 0600, both kept in
  the directory, so a restarted operator keeps its CA while it is valid) and a serving
  certificate signed by it. The caBundle is ``ca-bundle.crt``: the current CA, plus for an
  overlap the CA before it.

Rotation without a window. A new CA (made ``RENEW_BEFORE`` its end, or when the directory lost
it: a re-created pod's emptyDir) goes into the bundle next to the old one first; the serving
certificate is re-issued under the new CA only once the configurations the API server reads
trust it (``published``: read back from them), so every certificate served is trusted by every
bundle the API server may still hold. The old CA leaves the bundle ``OVERLAP`` after the serving
certificate moved to the new CA. A directory with no usable serving certificate gets one at
once (nothing is served yet; the caller publishes the bundle before its server starts).

Only the operator's own CA is adopted. A caBundle is read back from objects others can write,
and anyone can make a self-signed CA named ``offloadpool-webhook-ca``: a CA read from the
configurations is used (its ``ca.crt`` lost, its key kept) or carried into the bundle only when
its key is the directory's ``ca.key`` (same public key, signed by it); any other, however it is
named, is left out, and a directory without a usable CA and key makes a new one.

Why not kopf's own self-signed certificates: they need ``certbuilder``/``oscrypto``, whose
libcrypto version detection fails on OpenSSL ≥ 3.0.10 (an unreleased fix upstream), which is
what current images ship. ``cryptography`` is maintained and has wheels everywhere.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CERT_NAME = "tls.crt"
KEY_NAME = "tls.key"
CA_NAME = "ca.crt"
CA_KEY_NAME = "ca.key"
BUNDLE_NAME = "ca-bundle.crt"
#: Lifetime of a made certificate (the CA and the serving one), and how long before its end a
#: new one is made.
VALIDITY = datetime.timedelta(days=365)
RENEW_BEFORE = datetime.timedelta(days=30)
#: How long a replaced CA stays in the bundle after the serving certificate moved to its
#: successor: every API server (each caches the configurations) has long seen the new bundle.
OVERLAP = datetime.timedelta(hours=1)
#: Made certificates start this long before they are made (clock skew between machines).
BACKDATE = datetime.timedelta(minutes=5)
CA_COMMON_NAME = "offloadpool-webhook-ca"
#: Marks a directory whose certificates this module made (and may therefore replace).
MADE_HERE = ".made-by-offloadpool-operator"


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path
    #: What the configurations' caBundle holds (PEM; kopf's ``cafile``).
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


def ensure(
    directory: Path,
    hostnames: list[str],
    now: datetime.datetime | None = None,
    published: Sequence[x509.Certificate] | None = None,
) -> CertFiles:
    """Certificates for ``hostnames`` in ``directory``: the given ones, else made, rotated and
    renewed as the module says. ``published``: the CAs every webhook configuration trusts now
    (None: unknown), which decides whether the serving certificate may move to a new CA."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / CERT_NAME, directory / KEY_NAME
    given = cert.exists() and key.exists() and not (directory / MADE_HERE).exists()
    if given:
        ca = directory / CA_NAME
        return CertFiles(cert, key, ca if ca.exists() else cert, made_here=False)
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if not (directory / MADE_HERE).exists():
        _write(directory / MADE_HERE, b"")
    ca_cert, ca_key, previous = _current_ca(directory, now, published or ())
    serving = _load(cert)
    usable = serving is not None and _valid_for(serving, hostnames, now)
    moved = serving is not None and _issued_by(serving, ca_cert)
    trusted = {_fingerprint(c) for c in published or ()}
    if not (usable and moved and serving is not None and not _ending(serving, now)):
        if not usable or _fingerprint(ca_cert) in trusted:
            _issue(directory, hostnames, ca_cert, ca_key, now)
            serving, moved = _load(cert), True
    switched = serving.not_valid_before_utc + BACKDATE if moved and serving is not None else None
    # The bundle trusts what this directory made: the CA, the one it replaced (for the overlap),
    # and what its bundle held; never a CA read from the configurations whose key is not ca.key.
    keep = [
        c
        for c in [
            *previous,
            *_load_all(directory / BUNDLE_NAME),
            *(p for p in published or () if _key_held(p, ca_key)),
        ]
        if _fingerprint(c) != _fingerprint(ca_cert)
        and _is_ours(c)
        and c.not_valid_after_utc > now
        and (switched is None or now < switched + OVERLAP)
    ]
    bundle = [ca_cert, *{_fingerprint(c): c for c in keep}.values()]
    data = b"".join(c.public_bytes(serialization.Encoding.PEM) for c in bundle)
    if _read(directory / BUNDLE_NAME) != data:
        _write(directory / BUNDLE_NAME, data)
    return CertFiles(cert, key, directory / BUNDLE_NAME, made_here=True)


def bundle_certificates(pem: bytes) -> list[x509.Certificate]:
    """The certificates of a PEM bundle (a caBundle); nothing for what does not parse."""
    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError:
        return []


def _current_ca(
    directory: Path, now: datetime.datetime, published: Sequence[x509.Certificate]
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, list[x509.Certificate]]:
    """The CA to sign with: the kept one while valid, else a new one (the old one returned as
    ``previous``, still to be trusted for the overlap). Only a CA whose key is ``ca.key`` is ever
    used: the directory's ``ca.crt``, else one of ``published`` (a caBundle is anyone's to
    write, and a CA of the right name made elsewhere is not the operator's)."""
    ca = _load(directory / CA_NAME)
    try:
        loaded = serialization.load_pem_private_key((directory / CA_KEY_NAME).read_bytes(), password=None)
    except (OSError, ValueError):
        loaded = None
    key = loaded if isinstance(loaded, ec.EllipticCurvePrivateKey) else None
    if key is not None:
        for held in (ca, *published):
            if held is not None and _key_held(held, key) and not _ending(held, now):
                if held is not ca:  # ca.crt was lost or replaced, its key kept: the same CA again
                    _write(directory / CA_NAME, held.public_bytes(serialization.Encoding.PEM))
                return held, key, []
    new_ca, new_key = _make_ca(now)
    pem = serialization.Encoding.PEM
    _write(
        directory / CA_KEY_NAME,
        new_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        mode=0o600,
    )
    _write(directory / CA_NAME, new_ca.public_bytes(pem))
    return new_ca, new_key, [ca] if ca is not None else []


def _make_ca(now: datetime.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_COMMON_NAME)])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
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
    return ca, ca_key


def _issue(
    directory: Path,
    hostnames: list[str],
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    now: datetime.datetime,
) -> None:
    """A serving certificate for ``hostnames`` signed by ``ca`` (EC P-256), ending with the CA
    at the latest."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostnames[0])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(min(now + VALIDITY, ca.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hostnames]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    _write(
        directory / KEY_NAME,
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        mode=0o600,
    )
    # Last: kopf's server restarts when the files change; by then the key is in place.
    _write(directory / CERT_NAME, cert.public_bytes(pem))


def _load(path: Path) -> x509.Certificate | None:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return None


def _load_all(path: Path) -> list[x509.Certificate]:
    return bundle_certificates(_read(path) or b"")


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _fingerprint(cert: x509.Certificate) -> bytes:
    return cert.fingerprint(hashes.SHA256())


def _ending(cert: x509.Certificate, now: datetime.datetime) -> bool:
    return cert.not_valid_after_utc - now < RENEW_BEFORE


def _is_ours(cert: x509.Certificate) -> bool:
    """A CA this module made (a foreign CA found in the configurations is not carried over)."""
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return cert.subject == cert.issuer and [n.value for n in names] == [CA_COMMON_NAME]


def _key_held(ca: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> bool:
    """``ca`` is one of ours, for ``key``: named as ours, of ``key``'s public key, and signed by it."""
    return _is_ours(ca) and ca.public_key() == key.public_key() and _issued_by(ca, ca)


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _valid_for(cert: x509.Certificate, hostnames: list[str], now: datetime.datetime) -> bool:
    if not cert.not_valid_before_utc <= now < cert.not_valid_after_utc:
        return False
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    present = {str(v) for v in sans.get_values_for_type(x509.DNSName)}
    present |= {str(v) for v in sans.get_values_for_type(x509.IPAddress)}
    return set(hostnames) <= present


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
