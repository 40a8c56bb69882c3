"""The webhook's configurations and certificates, without a cluster: deploy/webhook.yaml holds
exactly what the operator renders; the operator's certificates verify as the API server
verifies them, are renewed before they expire, and given ones are used as they are."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from offloadpool.operator import certs
from offloadpool.operator.webhook import WebhookOptions
from offloadpool.operator.webhookconfig import Endpoint, contains, excluded_namespaces, render

REPO = Path(__file__).resolve().parents[1]


def test_deploy_webhook_yaml_is_what_the_operator_renders() -> None:
    docs = [
        d
        for d in yaml.safe_load_all((REPO / "deploy" / "webhook.yaml").read_text())
        if d["kind"].endswith("WebhookConfiguration")
    ]
    expected = render(
        Endpoint(service="offloadpool-webhook", namespace="offloadpool-system"),
        None,
        excluded_namespaces("offloadpool-system"),
    )
    assert docs == expected


def test_the_scope_is_labelled_pods_outside_system_namespaces_only() -> None:
    (mutating, validating) = render(
        Endpoint(url="https://127.0.0.1:9443"), "Q0E=", excluded_namespaces("ops", ["batch"])
    )
    for hook in (mutating["webhooks"][0], validating["webhooks"][0]):
        assert hook["objectSelector"]["matchExpressions"][0] == {
            "key": "offloadpool.io/pool",
            "operator": "Exists",
        }
        assert hook["namespaceSelector"]["matchExpressions"][0]["values"] == [
            "kube-system",
            "kube-public",
            "kube-node-lease",
            "ops",
            "batch",
        ]
        assert hook["rules"][0]["resources"] == ["pods"] and hook["rules"][0]["operations"] == ["CREATE"]
        assert hook["sideEffects"] == "None" and hook["failurePolicy"] == "Fail"
    assert mutating["webhooks"][0]["clientConfig"] == {
        "url": "https://127.0.0.1:9443/mutate-pod",
        "caBundle": "Q0E=",
    }
    assert validating["webhooks"][0]["clientConfig"]["url"] == "https://127.0.0.1:9443/validate-pod"


def test_stored_configurations_with_defaults_filled_in_count_as_equal() -> None:
    (wanted,) = render(Endpoint(url="https://x:1"), "Q0E=", excluded_namespaces("ops"))[0]["webhooks"]
    live = yaml.safe_load(yaml.safe_dump(wanted))
    live["rules"][0]["extra"] = "defaulted by the API server"
    assert contains([live], [wanted])
    live["clientConfig"]["caBundle"] = "b2xk"
    assert not contains([live], [wanted])


def test_made_certificates_verify_for_the_service_name(tmp_path: Path) -> None:
    names = certs.service_hostnames("offloadpool-webhook", "offloadpool-system")
    files = certs.ensure(tmp_path, names)
    assert files.made_here and files.key.stat().st_mode & 0o077 == 0
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    )
    assert "offloadpool-webhook.offloadpool-system.svc" in sans
    # what a TLS client (the API server) does with the caBundle: the server context loads the pair
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(files.cert, files.key)
    ssl.create_default_context(cadata=files.ca.read_text())


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _bundle(files: certs.CertFiles) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(files.ca.read_bytes())


def test_made_certificates_and_their_ca_are_kept_across_restarts_while_valid(tmp_path: Path) -> None:
    names = ["127.0.0.1"]
    files = certs.ensure(tmp_path, names)
    first = {n: (tmp_path / n).read_bytes() for n in (certs.CERT_NAME, certs.CA_NAME, certs.BUNDLE_NAME)}
    (ca,) = _bundle(files)
    again = certs.ensure(tmp_path, names, published=[ca])  # what a restarted operator does
    assert {n: (tmp_path / n).read_bytes() for n in first} == first
    assert (tmp_path / certs.CA_KEY_NAME).stat().st_mode & 0o077 == 0 and again == files
    certs.ensure(tmp_path, ["127.0.0.2"], published=[ca])  # a new name: re-issued, same CA
    cert = _cert(files.cert)
    cert.verify_directly_issued_by(ca)
    assert "127.0.0.2" in {
        str(ip)
        for ip in cert.extensions.get_extension_for_class(
            x509.SubjectAlternativeName
        ).value.get_values_for_type(x509.IPAddress)
    }


def test_a_ca_rotation_trusts_both_cas_until_the_overlap_has_passed(tmp_path: Path) -> None:
    """Near its end the CA is replaced: the bundle carries old and new; the serving certificate
    moves to the new CA only once the configurations trust it; the old CA leaves the bundle
    OVERLAP after that. At every step the served certificate verifies with the bundle."""
    names = ["127.0.0.1"]
    files = certs.ensure(tmp_path, names)
    (old,) = _bundle(files)
    served = _cert(files.cert)

    def verifies(bundle: list[x509.Certificate]) -> bool:
        cert = _cert(files.cert)
        return any(cert.issuer == ca.subject and _signed(cert, ca) for ca in bundle)

    rotate = old.not_valid_after_utc - certs.RENEW_BEFORE / 2
    certs.ensure(tmp_path, names, now=rotate, published=[old])
    new = _cert(tmp_path / certs.CA_NAME)
    assert new != old and _bundle(files) == [new, old]
    assert _cert(files.cert) == served  # not yet: the API server may hold only the old bundle
    assert verifies([old])
    # the configurations now trust both: the serving certificate moves to the new CA
    certs.ensure(tmp_path, names, now=rotate, published=[new, old])
    assert _signed(_cert(files.cert), new) and _bundle(files) == [new, old] and verifies([new, old])
    # within the overlap both stay, after it the old one goes
    certs.ensure(tmp_path, names, now=rotate + certs.OVERLAP / 2, published=[new, old])
    assert _bundle(files) == [new, old]
    certs.ensure(tmp_path, names, now=rotate + certs.OVERLAP + certs.BACKDATE, published=[new, old])
    assert _bundle(files) == [new] and verifies([new])


def test_a_lost_certificate_directory_makes_a_new_ca_and_trusts_only_it(tmp_path: Path) -> None:
    """A re-created pod (the chart's emptyDir is gone): the CA the configurations trust has no
    key here any more, so it is not carried over; the new CA is the bundle, and the new serving
    certificate is issued under it."""
    first = certs.ensure(tmp_path / "a", ["127.0.0.1"])
    (old,) = _bundle(first)
    files = certs.ensure(tmp_path / "b", ["127.0.0.1"], published=[old])
    new = _cert(tmp_path / "b" / certs.CA_NAME)
    assert new != old and _bundle(files) == [new] and _signed(_cert(files.cert), new)


def test_a_foreign_ca_of_the_same_name_in_the_configurations_is_never_adopted(tmp_path: Path) -> None:
    """Anyone can make a self-signed CA named offloadpool-webhook-ca and write it into a
    caBundle: neither a fresh directory nor one with its own CA takes it into the bundle or
    issues under it."""
    foreign_files = certs.ensure(tmp_path / "elsewhere", ["127.0.0.1"])
    (foreign,) = _bundle(foreign_files)
    assert (
        foreign.subject.rfc4514_string() == f"CN={certs.CA_COMMON_NAME}" and foreign.subject == foreign.issuer
    )
    fresh = certs.ensure(tmp_path / "fresh", ["127.0.0.1"], published=[foreign])
    own = _cert(tmp_path / "fresh" / certs.CA_NAME)
    assert own != foreign and _bundle(fresh) == [own] and not _signed(_cert(fresh.cert), foreign)
    # the operator's own CA is published next to the foreign one: still only its own
    again = certs.ensure(tmp_path / "fresh", ["127.0.0.1"], published=[own, foreign])
    assert _bundle(again) == [own] and _signed(_cert(again.cert), own)


def test_a_published_ca_is_adopted_only_for_the_key_the_directory_holds(tmp_path: Path) -> None:
    """ca.crt lost, ca.key kept: the published CA of that key is the same CA again (no new CA,
    nothing re-issued); a certificate that only claims that key (signed by another) is not."""
    files = certs.ensure(tmp_path, ["127.0.0.1"])
    (own,) = _bundle(files)
    served = files.cert.read_bytes()
    (tmp_path / certs.CA_NAME).unlink()
    key = serialization.load_pem_private_key((tmp_path / certs.CA_KEY_NAME).read_bytes(), password=None)
    other = ec.generate_private_key(ec.SECP256R1())
    claim = (  # our name and public key, signed with another key
        x509.CertificateBuilder()
        .subject_name(own.subject)
        .issuer_name(own.subject)
        .public_key(key.public_key())  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(own.not_valid_before_utc)
        .not_valid_after(own.not_valid_after_utc)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(other, hashes.SHA256())
    )
    adopted = certs.ensure(tmp_path, ["127.0.0.1"], published=[claim, own])
    assert _cert(tmp_path / certs.CA_NAME) == own and _bundle(adopted) == [own]
    assert files.cert.read_bytes() == served
    (tmp_path / certs.CA_NAME).unlink()
    certs.ensure(tmp_path, ["127.0.0.1"], published=[claim])
    assert _cert(tmp_path / certs.CA_NAME) not in (own, claim)


def _signed(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except Exception:
        return False
    return True


def test_given_certificates_are_used_as_they_are(tmp_path: Path) -> None:
    made = tmp_path / "made"
    certs.ensure(made, ["issuer-made.example"])
    given = tmp_path / "secret"
    given.mkdir()
    for name in (certs.CERT_NAME, certs.KEY_NAME, certs.CA_NAME):
        (given / name).write_bytes((made / name).read_bytes())
    before = (given / certs.CERT_NAME).read_bytes()
    files = certs.ensure(given, ["some-other-name.example"])
    assert not files.made_here and files.ca == given / certs.CA_NAME
    assert (given / certs.CERT_NAME).read_bytes() == before  # never replaced, even for another name


@pytest.mark.parametrize(
    ("url", "service", "expected"),
    [
        ("https://127.0.0.1:9443", None, ["127.0.0.1"]),
        (None, "hook", ["hook", "hook.ns", "hook.ns.svc", "hook.ns.svc.cluster.local"]),
    ],
)
def test_the_certificate_names_follow_how_the_api_server_calls(
    url: str | None, service: str | None, expected: list[str]
) -> None:
    options = WebhookOptions(url=url, service=service or "x", namespace="ns")
    assert options.hostnames() == expected
