"""The Helm chart, with the real helm: lint, template, the same CRDs and RBAC rules as the
repository's crds/ and deploy/, and a real install against the real API server."""

from __future__ import annotations

import filecmp
import secrets
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "offloadpool"
DEPLOY = REPO / "deploy"


def docs_of(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]


def deploy_docs() -> list[dict[str, Any]]:
    return [d for p in sorted(DEPLOY.glob("*.yaml")) for d in docs_of(p.read_text())]


def by_kind_and_app(docs: list[dict[str, Any]], kind: str, app: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["labels"]["app.kubernetes.io/name"] == app]
    return doc


def test_chart_crds_are_the_repository_crds() -> None:
    """crds/ is the source of truth; the chart ships byte-identical copies (cp crds/*.yaml
    charts/offloadpool/crds/ after changing them)."""
    repo = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    chart = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert repo and chart == repo
    match, mismatch, errors = filecmp.cmpfiles(REPO / "crds", CHART / "crds", repo, shallow=False)
    assert not mismatch and not errors, f"chart CRDs differ from crds/: {mismatch + errors}"


@pytest.fixture(scope="module")
def rendered(control_plane: Any) -> list[dict[str, Any]]:
    out = control_plane.helm("template", "op", str(CHART), "--namespace", "offloadpool-system").stdout
    return docs_of(out)


@pytest.mark.controlplane
def test_helm_lint(control_plane: Any) -> None:
    out = control_plane.helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in out.stdout, out.stdout + out.stderr


@pytest.mark.controlplane
@pytest.mark.parametrize(("kind", "app"), [("ClusterRole", "offloadpool-operator"), ("Role", "offloadpool-operator"),
                                           ("ClusterRole", "offloadpool-agent"), ("Role", "offloadpool-agent")])
def test_chart_rbac_rules_are_the_deploy_rules(rendered: list[dict[str, Any]], kind: str, app: str) -> None:
    assert by_kind_and_app(rendered, kind, app)["rules"] == by_kind_and_app(deploy_docs(), kind, app)["rules"]


@pytest.mark.controlplane
def test_helm_template_renders_the_operator(rendered: list[dict[str, Any]], control_plane: Any) -> None:
    dep = by_kind_and_app(rendered, "Deployment", "offloadpool-operator")
    assert dep["spec"]["strategy"] == {"type": "Recreate"} and dep["spec"]["replicas"] == 1
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["offloadpool-operator"] and "--standalone" in c["args"]
    assert "--agent-service-account=offloadpool-agent" in c["args"]
    assert c["image"] == "ghcr.io/offloadpool/offloadpool:0.1.0"
    kinds = sorted({d["kind"] for d in rendered})
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "MutatingWebhookConfiguration", "Role",
                     "RoleBinding", "Service", "ServiceAccount", "ValidatingWebhookConfiguration"]
    peered = docs_of(control_plane.helm("template", "op", str(CHART), "--set", "operator.peering=offloadpool").stdout)
    args = by_kind_and_app(peered, "Deployment", "offloadpool-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--peering=offloadpool" in args and "--standalone" not in args


@pytest.mark.controlplane
def test_helm_install_into_a_fresh_namespace(crds_installed: Any) -> None:
    cp = crds_installed
    release = f"op{secrets.token_hex(3)}"
    ns = f"offloadpool-{release}"
    cp.helm("install", release, str(CHART), "--namespace", ns, "--create-namespace", timeout=120)
    try:
        status = cp.helm("status", release, "--namespace", ns).stdout
        assert "STATUS: deployed" in status, status
        cp.kubectl("get", "deployment", f"{release}-operator", "-n", ns)
        agent = f"system:serviceaccount:{ns}:offloadpool-agent"
        operator = f"system:serviceaccount:{ns}:{release}-operator"

        def can(who: str, *args: str) -> bool:
            out = cp.kubectl("auth", "can-i", *args, f"--as={who}", check=False)
            return out.stdout.strip() == "yes"

        assert can(agent, "patch", "offloadpoolnodes", "--subresource=status")
        assert not can(agent, "patch", "nodes")
        assert can(operator, "patch", "nodes", "--subresource=status")
        assert can(operator, "create", "daemonsets", "-n", ns)
        assert not can(operator, "create", "daemonsets", "-n", "default")
    finally:
        cp.helm("uninstall", release, "--namespace", ns, check=False, timeout=120)
        cp.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.mark.controlplane
def test_chart_webhooks_are_what_the_operator_renders(control_plane: Any) -> None:
    """The operator writes its own rendering back when the stored webhooks differ, so the
    chart must render exactly that (for the release's Service and namespace and the values)."""
    from offloadpool.operator.webhookconfig import Endpoint, excluded_namespaces, render

    docs = docs_of(control_plane.helm("template", "op", str(CHART), "--namespace", "offloadpool-system",
                                      "--set", "webhook.excludeNamespaces={batch,ops}").stdout)
    expected = render(Endpoint(service="op-webhook", namespace="offloadpool-system"), None,
                      excluded_namespaces("offloadpool-system", ["batch", "ops"]))
    for want in expected:
        (got,) = [d for d in docs if d["kind"] == want["kind"]]
        assert got["metadata"]["name"] == want["metadata"]["name"] == "offloadpool"
        assert got["webhooks"] == want["webhooks"]
    service = by_kind_and_app(docs, "Service", "offloadpool-webhook")
    assert service["metadata"]["name"] == "op-webhook" and service["spec"]["ports"][0]["port"] == 443
    pod = by_kind_and_app(docs, "Deployment", "offloadpool-operator")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert {"--webhook", "--webhook-service=op-webhook", "--webhook-exclude-namespace=batch",
            "--webhook-exclude-namespace=ops"} <= set(c["args"])
    assert {"name": "webhook", "containerPort": 9443} in c["ports"]
    assert service["spec"]["ports"][0]["targetPort"] == "webhook"
    assert pod["volumes"] == [{"name": "webhook-certs", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}]

    given = docs_of(control_plane.helm("template", "op", str(CHART), "--set", "webhook.certSecret=op-webhook-tls").stdout)
    volumes = by_kind_and_app(given, "Deployment", "offloadpool-operator")["spec"]["template"]["spec"]["volumes"]
    assert volumes == [{"name": "webhook-certs", "secret": {"secretName": "op-webhook-tls"}}]

    off = docs_of(control_plane.helm("template", "op", str(CHART), "--set", "webhook.enabled=false").stdout)
    assert not [d for d in off if d["kind"] in ("Service", "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")]
    assert "--webhook" not in by_kind_and_app(off, "Deployment", "offloadpool-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
    rules = by_kind_and_app(off, "ClusterRole", "offloadpool-operator")["rules"]
    assert not [r for r in rules if "admissionregistration.k8s.io" in r["apiGroups"]]


@pytest.mark.controlplane
def test_chart_can_have_cert_manager_issue_the_webhook_certificate(control_plane: Any) -> None:
    from offloadpool.operator.certs import service_hostnames

    def render(*values: str) -> list[dict[str, Any]]:
        args = [a for v in values for a in ("--set", v)]
        return docs_of(control_plane.helm("template", "op", str(CHART), "--namespace", "ns1", *args).stdout)

    docs = render("webhook.certManager.enabled=true")
    (cert,) = [d for d in docs if d["kind"] == "Certificate"]
    assert cert["spec"]["dnsNames"] == service_hostnames("op-webhook", "ns1")  # the names the operator would use
    assert cert["spec"]["secretName"] == "op-webhook-tls"
    (issuer,) = [d for d in docs if d["kind"] == "Issuer"]
    assert issuer["spec"] == {"selfSigned": {}} and cert["spec"]["issuerRef"] == {"kind": "Issuer", "name": issuer["metadata"]["name"]}
    pod = by_kind_and_app(docs, "Deployment", "offloadpool-operator")["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "webhook-certs", "secret": {"secretName": "op-webhook-tls"}}]
    assert pod["containers"][0]["volumeMounts"][0]["readOnly"] is True

    own = render("webhook.certManager.enabled=true", "webhook.certManager.issuerRef.kind=ClusterIssuer",
                 "webhook.certManager.issuerRef.name=internal-ca")
    assert not [d for d in own if d["kind"] == "Issuer"]
    (cert,) = [d for d in own if d["kind"] == "Certificate"]
    assert cert["spec"]["issuerRef"] == {"kind": "ClusterIssuer", "name": "internal-ca"}
    assert not [d for d in render() if d["kind"] in ("Certificate", "Issuer")]  # default: the operator's own CA


@pytest.mark.controlplane
def test_plain_manifests_are_accepted(operator_rbac: Any, control_plane: Any) -> None:
    """deploy/ (namespace, RBAC, the operator Deployment) passes the API server's validation."""
    out = control_plane.kubectl("apply", "--dry-run=server", "-f", str(DEPLOY))
    assert "deployment.apps/offloadpool-operator" in out.stdout, out.stdout
