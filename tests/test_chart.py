"""The Helm chart, with the real helm: lint, template, the same CRDs and RBAC rules as the
repository's crds/ and deploy/, the values schema, every example values file (charts/offloadpool/ci/)
accepted by the real API server (server-side dry run), and real installs, upgrades and uninstalls
against the real API server."""

from __future__ import annotations

import filecmp
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import offloadpool
from fixtures.operator_process import wait_agent_policy_in_force
from offloadpool.api.agent_env import NODE_NAME_ENV
from offloadpool.api.constants import HOST_ROOT, MIN_HEARTBEATS_PER_TIMEOUT
from offloadpool.csi.config import DRIVER_NAME, CsiConfig
from offloadpool.operator.config import OperatorConfig
from offloadpool.operator.main import config_from_args, parse_args

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "offloadpool"
#: The chart's copies of crds/ (rendered by templates/crds.yaml; not the chart's crds/ folder,
#: which Helm would install once and never upgrade).
CHART_CRDS = CHART / "files" / "crds"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
DEPLOY = REPO / "deploy"
CRD_NAMES = ("offloadpools.offloadpool.io", "offloadpoolnodes.offloadpool.io")
#: Kinds whose CRDs the test cluster does not have (prometheus-operator, cert-manager): left out
#: of the server-side dry run and checked structurally instead.
ABSENT_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
}


#: Values that are the operator's own settings: (section, key) -> (flag, OperatorConfig field,
#: a value unlike the default). values.yaml only comments them; set, they become the flag.
OPERATOR_SETTINGS = {
    ("operator", "heartbeatTimeoutSeconds"): ("--heartbeat-timeout", "heartbeat_timeout_seconds", 0),
    ("operator", "resyncSeconds"): ("--resync", "resync_seconds", 7),
    ("agent", "cpuRequest"): ("--agent-cpu-request", "agent_cpu_request", "250m"),
    ("agent", "memoryOverhead"): ("--agent-memory-overhead", "agent_memory_overhead", "1Gi"),
    ("agent", "heartbeatSeconds"): ("--agent-heartbeat", "agent_heartbeat_seconds", 20),
    ("agent", "httpAddress"): ("--agent-http-address", "agent_http_address", "::"),
}


def docs_of(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]


def deploy_docs() -> list[dict[str, Any]]:
    return [d for p in sorted(DEPLOY.glob("*.yaml")) for d in docs_of(p.read_text())]


def by_kind_and_app(docs: list[dict[str, Any]], kind: str, app: str) -> dict[str, Any]:
    (doc,) = [
        d for d in docs if d["kind"] == kind and d["metadata"]["labels"]["app.kubernetes.io/name"] == app
    ]
    return doc


def test_chart_crds_are_the_repository_crds() -> None:
    """crds/ is the source of truth; the chart ships byte-identical copies in files/crds/
    (written by hack/sync_chart.py after changing them). The chart has no crds/
    folder: Helm would install those CRDs before the templates' own and the install would fail."""
    repo = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    chart = sorted(p.name for p in CHART_CRDS.glob("*.yaml"))
    assert repo and chart == repo
    match, mismatch, errors = filecmp.cmpfiles(REPO / "crds", CHART_CRDS, repo, shallow=False)
    assert not mismatch and not errors, f"chart CRDs differ from crds/: {mismatch + errors}"
    assert not (CHART / "crds").exists(), (
        "charts/offloadpool/crds/ must not exist: the copies go to files/crds/"
    )


def test_chart_crds_and_rbac_are_what_sync_chart_writes() -> None:
    """hack/sync_chart.py is how the chart's CRDs and RBAC templates come to equal crds/ and
    deploy/: its --check fails naming every file that differs from what it would write."""
    out = subprocess.run(
        [sys.executable, "-m", "hack.sync_chart", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture(scope="module")
def rendered(control_plane: Any) -> list[dict[str, Any]]:
    out = control_plane.helm("template", "op", str(CHART), "--namespace", "offloadpool-system").stdout
    return docs_of(out)


@pytest.mark.controlplane
@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: v.stem if v else "defaults")
def test_helm_lint(control_plane: Any, values: Path | None) -> None:
    args = ["-f", str(values)] if values else []
    out = control_plane.helm("lint", "--strict", str(CHART), *args)
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout, out.stdout + out.stderr
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


@pytest.mark.controlplane
@pytest.mark.parametrize(
    ("kind", "app"),
    [
        ("ClusterRole", "offloadpool-operator"),
        ("Role", "offloadpool-operator"),
        ("ClusterRole", "offloadpool-agent"),
        ("Role", "offloadpool-agent"),
    ],
)
def test_chart_rbac_rules_are_the_deploy_rules(rendered: list[dict[str, Any]], kind: str, app: str) -> None:
    assert by_kind_and_app(rendered, kind, app)["rules"] == by_kind_and_app(deploy_docs(), kind, app)["rules"]


def test_chart_flowschema_is_the_deploy_flowschema(rendered: list[dict[str, Any]]) -> None:
    """The operator's FlowSchema: the same level, precedence and rules, for the release's
    operator ServiceAccount."""
    chart = by_kind_and_app(rendered, "FlowSchema", "offloadpool-operator")["spec"]
    plain = by_kind_and_app(deploy_docs(), "FlowSchema", "offloadpool-operator")["spec"]
    ((subject,),) = [[s for s in r["subjects"]] for r in chart["rules"]]
    account = by_kind_and_app(rendered, "ServiceAccount", "offloadpool-operator")["metadata"]
    assert subject["serviceAccount"] == {"name": account["name"], "namespace": account["namespace"]}
    for rule in plain["rules"]:
        rule["subjects"][0]["serviceAccount"] = subject["serviceAccount"]
    assert chart == plain


@pytest.mark.controlplane
def test_chart_agent_policy_is_the_deploy_policy(rendered: list[dict[str, Any]], control_plane: Any) -> None:
    """The policy that holds each agent to its own node (deploy/policy-agent.yaml) is rendered by
    default, the same policy for the release's agent ServiceAccount, bound to the release's
    policy; ``agent.nodeRestriction.enabled=false`` leaves both out."""
    plain = deploy_docs()
    for namespace, account, args in (
        ("offloadpool-system", "offloadpool-agent", []),
        ("gpu-pools", "kv-agent", ["--set", "agent.serviceAccountName=kv-agent"]),
    ):
        docs = (
            rendered
            if args == []
            else docs_of(
                control_plane.helm("template", "op", str(CHART), "--namespace", namespace, *args).stdout
            )
        )
        policy = by_kind_and_app(docs, "ValidatingAdmissionPolicy", "offloadpool-agent")
        binding = by_kind_and_app(docs, "ValidatingAdmissionPolicyBinding", "offloadpool-agent")
        want = by_kind_and_app(plain, "ValidatingAdmissionPolicy", "offloadpool-agent")["spec"]
        (condition,) = want["matchConditions"]
        condition["expression"] = condition["expression"].replace(
            "system:serviceaccount:offloadpool-system:offloadpool-agent",
            f"system:serviceaccount:{namespace}:{account}",
        )
        assert policy["spec"] == want
        assert (
            f"'system:serviceaccount:{namespace}:{account}'"
            in policy["spec"]["matchConditions"][0]["expression"]
        )
        assert policy["metadata"]["name"] == "op-agent"
        assert binding["spec"] == {"policyName": "op-agent", "validationActions": ["Deny"]}
    off = docs_of(
        control_plane.helm(
            "template", "op", str(CHART), "--set", "agent.nodeRestriction.enabled=false"
        ).stdout
    )
    assert not [
        d
        for d in off
        if d["kind"].startswith("ValidatingAdmissionPolicy") and d["metadata"]["name"] == "op-agent"
    ]
    refused = control_plane.helm(
        "template", "op", str(CHART), "--set", "agent.nodeRestriction=on", check=False
    )
    assert refused.returncode != 0 and "nodeRestriction" in refused.stderr, refused.stderr


@pytest.mark.controlplane
def test_chart_operator_policy_is_the_deploy_policy(
    rendered: list[dict[str, Any]], control_plane: Any
) -> None:
    """The policy that holds the operator to its own marks and DaemonSets
    (deploy/policy-operator.yaml) is rendered by default, the same policy for the release's
    operator and agent ServiceAccounts; ``operator.writeRestriction.enabled=false`` leaves it
    out."""
    plain = deploy_docs()
    for namespace, agent, args in (
        ("offloadpool-system", "offloadpool-agent", []),
        ("gpu-pools", "kv-agent", ["--set", "agent.serviceAccountName=kv-agent"]),
    ):
        docs = (
            rendered
            if args == []
            else docs_of(
                control_plane.helm("template", "op", str(CHART), "--namespace", namespace, *args).stdout
            )
        )
        operator = by_kind_and_app(docs, "ServiceAccount", "offloadpool-operator")["metadata"]["name"]
        policy = by_kind_and_app(docs, "ValidatingAdmissionPolicy", "offloadpool-operator")
        binding = by_kind_and_app(docs, "ValidatingAdmissionPolicyBinding", "offloadpool-operator")
        want = json.loads(
            json.dumps(by_kind_and_app(plain, "ValidatingAdmissionPolicy", "offloadpool-operator")["spec"])
            .replace(
                "system:serviceaccount:offloadpool-system:offloadpool-operator",
                f"system:serviceaccount:{namespace}:{operator}",
            )
            .replace("serviceAccountName == 'offloadpool-agent'", f"serviceAccountName == '{agent}'")
            .replace("ServiceAccount offloadpool-agent,", f"ServiceAccount {agent},")
        )
        assert policy["spec"] == want
        assert f"serviceAccountName == '{agent}'" in json.dumps(policy["spec"])
        assert policy["metadata"]["name"] == "op-operator"
        assert binding["spec"] == {"policyName": "op-operator", "validationActions": ["Deny"]}
    off = docs_of(
        control_plane.helm(
            "template", "op", str(CHART), "--set", "operator.writeRestriction.enabled=false"
        ).stdout
    )
    assert not [
        d
        for d in off
        if d["kind"].startswith("ValidatingAdmissionPolicy") and d["metadata"]["name"] == "op-operator"
    ]
    assert [
        d for d in off if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"] == "op-agent"
    ]


@pytest.mark.controlplane
def test_helm_template_renders_the_operator(rendered: list[dict[str, Any]], control_plane: Any) -> None:
    dep = by_kind_and_app(rendered, "Deployment", "offloadpool-operator")
    assert dep["spec"]["strategy"] == {"type": "Recreate"} and dep["spec"]["replicas"] == 1
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["offloadpool-operator"] and "--standalone" in c["args"]
    assert "--agent-service-account=offloadpool-agent" in c["args"]
    flags = [flag for flag, _, _ in OPERATOR_SETTINGS.values()]
    assert [a for a in c["args"] if a.split("=")[0] in flags] == []  # the operator's defaults apply
    assert c["image"] == f"ghcr.io/offloadpool/offloadpool:{offloadpool.__version__}"
    kinds = sorted({d["kind"] for d in rendered})
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "Deployment",
        "FlowSchema",
        "MutatingWebhookConfiguration",
        "NetworkPolicy",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "ValidatingWebhookConfiguration",
    ]
    peered = docs_of(
        control_plane.helm("template", "op", str(CHART), "--set", "operator.peering=offloadpool").stdout
    )
    args = by_kind_and_app(peered, "Deployment", "offloadpool-operator")["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert "--peering=offloadpool" in args and "--standalone" not in args


@pytest.mark.controlplane
def test_helm_install_into_a_fresh_namespace(crds_installed: Any) -> None:
    cp = crds_installed
    release = f"op{secrets.token_hex(3)}"
    ns = f"offloadpool-{release}"
    # The CRDs exist already (applied with kubectl by crds_installed, or kept by an earlier
    # release): --take-ownership lets the release adopt them (docs/operator.md).
    out = helm_install(cp, release, ns, "--take-ownership", timeout=120).stdout
    try:
        status = cp.helm("status", release, "--namespace", ns).stdout
        assert "STATUS: deployed" in status, status
        # NOTES.txt: what to do next
        assert "kubectl get op,opn" in out and "offloadpool.io/pool: <pool name>" in out, out
        # what a node offers: one per share of a partitioned pool, not always 1
        assert "offer offloadpool.io/<pool>: 1\n   (a partitioned pool: its spec.partitions" in out, out
        assert f"kubectl label namespace {ns} pod-security.kubernetes.io/enforce=privileged" in out, out
        cp.kubectl("get", "deployment", f"{release}-operator", "-n", ns)
        agent = f"system:serviceaccount:{ns}:offloadpool-agent"
        operator = f"system:serviceaccount:{ns}:{release}-operator"

        def can(who: str, *args: str) -> bool:
            out = cp.kubectl("auth", "can-i", *args, f"--as={who}", check=False)
            return out.stdout.strip() == "yes"

        assert can(agent, "patch", "offloadpoolnodes", "--subresource=status")
        assert not can(agent, "patch", "nodes")
        # the release's policy holds its agents to their nodes: a token naming none is refused
        wait_agent_policy_in_force(cp, ns, "offloadpool-agent")
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

    docs = docs_of(
        control_plane.helm(
            "template",
            "op",
            str(CHART),
            "--namespace",
            "offloadpool-system",
            "--set",
            "webhook.excludeNamespaces={batch,ops}",
        ).stdout
    )
    expected = render(
        Endpoint(service="op-webhook", namespace="offloadpool-system"),
        None,
        excluded_namespaces("offloadpool-system", ["batch", "ops"]),
    )
    for want in expected:
        (got,) = [d for d in docs if d["kind"] == want["kind"]]
        assert got["metadata"]["name"] == want["metadata"]["name"] == "offloadpool"
        assert got["webhooks"] == want["webhooks"]
    service = by_kind_and_app(docs, "Service", "offloadpool-webhook")
    assert service["metadata"]["name"] == "op-webhook" and service["spec"]["ports"][0]["port"] == 443
    pod = by_kind_and_app(docs, "Deployment", "offloadpool-operator")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert {
        "--webhook",
        "--webhook-service=op-webhook",
        "--webhook-exclude-namespace=batch",
        "--webhook-exclude-namespace=ops",
    } <= set(c["args"])
    assert {"name": "webhook", "containerPort": 9443} in c["ports"]
    assert service["spec"]["ports"][0]["targetPort"] == "webhook"
    assert pod["volumes"] == [{"name": "webhook-certs", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}]

    given = docs_of(
        control_plane.helm("template", "op", str(CHART), "--set", "webhook.certSecret=op-webhook-tls").stdout
    )
    volumes = by_kind_and_app(given, "Deployment", "offloadpool-operator")["spec"]["template"]["spec"][
        "volumes"
    ]
    assert volumes == [{"name": "webhook-certs", "secret": {"secretName": "op-webhook-tls"}}]

    off = docs_of(control_plane.helm("template", "op", str(CHART), "--set", "webhook.enabled=false").stdout)
    assert not [
        d
        for d in off
        if d["kind"] in ("Service", "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
    ]
    assert (
        "--webhook"
        not in by_kind_and_app(off, "Deployment", "offloadpool-operator")["spec"]["template"]["spec"][
            "containers"
        ][0]["args"]
    )
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
    assert cert["spec"]["dnsNames"] == service_hostnames(
        "op-webhook", "ns1"
    )  # the names the operator would use
    assert cert["spec"]["secretName"] == "op-webhook-tls"
    (issuer,) = [d for d in docs if d["kind"] == "Issuer"]
    assert issuer["spec"] == {"selfSigned": {}} and cert["spec"]["issuerRef"] == {
        "kind": "Issuer",
        "name": issuer["metadata"]["name"],
    }
    pod = by_kind_and_app(docs, "Deployment", "offloadpool-operator")["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "webhook-certs", "secret": {"secretName": "op-webhook-tls"}}]
    assert pod["containers"][0]["volumeMounts"][0]["readOnly"] is True

    own = render(
        "webhook.certManager.enabled=true",
        "webhook.certManager.issuerRef.kind=ClusterIssuer",
        "webhook.certManager.issuerRef.name=internal-ca",
    )
    assert not [d for d in own if d["kind"] == "Issuer"]
    (cert,) = [d for d in own if d["kind"] == "Certificate"]
    assert cert["spec"]["issuerRef"] == {"kind": "ClusterIssuer", "name": "internal-ca"}
    assert not [
        d for d in render() if d["kind"] in ("Certificate", "Issuer")
    ]  # default: the operator's own CA


@pytest.mark.controlplane
def test_plain_manifests_are_accepted(operator_rbac: Any, control_plane: Any) -> None:
    """deploy/ (namespace, RBAC, the operator Deployment) passes the API server's validation."""
    out = control_plane.kubectl("apply", "--dry-run=server", "-f", str(DEPLOY))
    assert "deployment.apps/offloadpool-operator" in out.stdout, out.stdout


# --- CRDs, values schema, example values, install / upgrade / uninstall ---------------------------


@pytest.mark.controlplane
def test_chart_csi_renders_the_driver_and_one_node_plugin_only_when_enabled(control_plane: Any) -> None:
    """Off by default. On: the CSIDriver of inline ephemeral volumes, and a privileged DaemonSet
    running the plugin told only the kubelet's directory (by default the plugin's own), mounted
    Bidirectional (its binds and sockets reach the host, where the kubelet looks), the agents'
    host root HostToContainer, the node's name from the downward API; no API access, so no
    token and no RBAC."""
    plain = helm_template(control_plane)
    docs = helm_template(control_plane, "--set", "csi.enabled=true")
    added = [d for d in docs if d not in plain]
    # and the plugin's NetworkPolicy (networkPolicy.enabled, on by default): no ingress at all
    assert sorted(d["kind"] for d in added) == ["CSIDriver", "DaemonSet", "NetworkPolicy"]
    assert not [d for d in plain if d["kind"] in ("CSIDriver", "DaemonSet")]
    (policy,) = [d for d in added if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["policyTypes"] == ["Ingress"] and not policy["spec"].get("ingress")
    (driver,) = [d for d in added if d["kind"] == "CSIDriver"]
    assert driver["metadata"]["name"] == DRIVER_NAME
    assert driver["spec"] == {
        "attachRequired": False,
        "podInfoOnMount": True,
        "volumeLifecycleModes": ["Ephemeral"],
        "fsGroupPolicy": "None",
    }
    ds = by_kind_and_app(added, "DaemonSet", "offloadpool-csi")
    assert ds["metadata"]["namespace"] == "offloadpool-system"
    # an upgrade replaces the plugin one node at a time, the old one gone first (user guide §9)
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0},
    }
    pod = ds["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    (c,) = pod["containers"]
    assert c["command"] == ["python3", "-m", "offloadpool.csi"]
    defaults = CsiConfig(node_id="any")
    assert c["args"] == [f"--kubelet-dir={defaults.kubelet_dir}"]  # the plugin's own default
    assert c["image"] == f"ghcr.io/offloadpool/offloadpool:{offloadpool.__version__}"
    assert c["securityContext"] == {"privileged": True}
    assert c["env"] == [{"name": NODE_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    volumes = {v["name"]: v.get("hostPath", {}).get("path", "emptyDir") for v in pod["volumes"]}
    mounts = {m["mountPath"]: (volumes[m["name"]], m.get("mountPropagation")) for m in c["volumeMounts"]}
    assert mounts == {
        defaults.kubelet_dir: (defaults.kubelet_dir, "Bidirectional"),
        defaults.root: (HOST_ROOT, "HostToContainer"),
        # the stage's parent: private (no propagation), never the container's shared root
        os.path.dirname(defaults.stage): ("emptyDir", None),
    }
    for socket in (defaults.endpoint, defaults.registration):
        assert socket.startswith(defaults.kubelet_dir + "/"), socket
    agent_image = helm_template(control_plane, "--set", "csi.enabled=true", "--set", "agent.image=reg/a:1")
    c = by_kind_and_app(agent_image, "DaemonSet", "offloadpool-csi")["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert c["image"] == "reg/a:1"


@pytest.mark.controlplane
def test_chart_dra_renders_the_device_class_only_when_enabled(control_plane: Any) -> None:
    """Off by default. On: the DeviceClass offloadpool.io selecting the driver's devices, the
    object deploy/dra.yaml holds (but the release's labels), and the kubelet plugin's DaemonSet
    with its one right, reading ResourceClaims."""
    # imported here: the chart's other tests also run against a commit before DRA (hack/against.py)
    from offloadpool.api import dra
    from offloadpool.dra.config import DraConfig

    plain = helm_template(control_plane)
    docs = helm_template(control_plane, "--set", "dra.enabled=true")
    added = [d for d in docs if d not in plain]
    kinds = sorted(d["kind"] for d in added)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "DaemonSet", "DeviceClass", "ServiceAccount"], kinds
    assert not [d for d in plain if d["kind"] == "DeviceClass"]
    (cls,) = [d for d in added if d["kind"] == "DeviceClass"]
    (plain_cls,) = [d for d in deploy_docs() if d["kind"] == "DeviceClass"]
    assert cls["metadata"]["name"] == plain_cls["metadata"]["name"] == dra.DEVICE_CLASS
    assert cls["apiVersion"] == plain_cls["apiVersion"] == dra.RESOURCE_API_VERSION
    assert cls["spec"] == plain_cls["spec"]
    assert cls["spec"]["selectors"] == [{"cel": {"expression": f'device.driver == "{dra.DRA_DRIVER}"'}}]
    (role,) = [d for d in added if d["kind"] == "ClusterRole"]
    assert role["rules"] == [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]}
    ]
    ds = by_kind_and_app(added, "DaemonSet", "offloadpool-dra")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["python3", "-m", "offloadpool.dra"]
    defaults = DraConfig(node_id="any")
    assert c["args"] == [f"--kubelet-dir={defaults.kubelet_dir}"]
    pod = ds["spec"]["template"]["spec"]
    volumes = {v["name"]: v.get("hostPath", {}).get("path", "emptyDir") for v in pod["volumes"]}
    mounts = {m["mountPath"]: (volumes[m["name"]], m.get("mountPropagation")) for m in c["volumeMounts"]}
    assert mounts == {
        defaults.kubelet_dir: (defaults.kubelet_dir, "Bidirectional"),
        defaults.root: (HOST_ROOT, "HostToContainer"),
        defaults.cdi_dir: (defaults.cdi_dir, None),
        os.path.dirname(defaults.stage): ("emptyDir", None),
    }
    plain_ds = [
        d for d in deploy_docs() if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "offloadpool-dra"
    ]
    assert [d["spec"]["template"]["spec"]["volumes"] for d in plain_ds] == [pod["volumes"]]


def helm_template(
    cp: Any, *args: str, namespace: str = "offloadpool-system", chart: Path = CHART
) -> list[dict[str, Any]]:
    return docs_of(cp.helm("template", "op", str(chart), "--namespace", namespace, *args).stdout)


def network_policies(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{app name: the spec of its NetworkPolicy}."""
    return {
        d["metadata"]["labels"]["app.kubernetes.io/name"]: d["spec"]
        for d in docs
        if d["kind"] == "NetworkPolicy"
    }


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items()) and set(selector) == {
        "matchLabels"
    }


@pytest.mark.controlplane
def test_network_policies_admit_ingress_only_where_each_component_serves(control_plane: Any) -> None:
    """On by default: the agent pods (as the operator renders them) only on their HTTP port,
    the operator only on its liveness and webhook ports, the CSI plugin on none; each selects
    its component's pods, and networkPolicy.enabled=false renders none."""
    from offloadpool.operator.daemonset import render

    docs = helm_template(control_plane, "--set", "csi.enabled=true")
    policies = network_policies(docs)
    assert sorted(policies) == ["offloadpool-agent", "offloadpool-csi", "offloadpool-operator"]
    for spec in policies.values():
        assert spec["policyTypes"] == ["Ingress"]  # egress (the API server) stays open

    def ports(spec: dict[str, Any]) -> list[tuple[str, str]]:
        (rule,) = spec["ingress"]
        assert set(rule) == {"ports"}  # from anywhere: the kubelet, Prometheus, the API server
        return [(p["port"], p["protocol"]) for p in rule["ports"]]

    pool = {"metadata": {"name": "kv", "uid": "u"}, "spec": {"capacity": "1Gi"}}
    agent_pod = render(pool, OperatorConfig(namespace="offloadpool-system"))["spec"]["template"]
    assert selects(policies["offloadpool-agent"]["podSelector"], agent_pod["metadata"]["labels"])
    (agent,) = agent_pod["spec"]["containers"]
    assert ports(policies["offloadpool-agent"]) == [(p["name"], p["protocol"]) for p in agent["ports"]]

    operator_pod = by_kind_and_app(docs, "Deployment", "offloadpool-operator")["spec"]["template"]
    assert selects(policies["offloadpool-operator"]["podSelector"], operator_pod["metadata"]["labels"])
    (operator,) = operator_pod["spec"]["containers"]
    assert ports(policies["offloadpool-operator"]) == [(p["name"], "TCP") for p in operator["ports"]]
    assert [p["name"] for p in operator["ports"]] == ["health", "webhook"]

    csi_pod = by_kind_and_app(docs, "DaemonSet", "offloadpool-csi")["spec"]["template"]
    assert selects(policies["offloadpool-csi"]["podSelector"], csi_pod["metadata"]["labels"])
    assert "ingress" not in policies["offloadpool-csi"]  # no ingress at all

    no_webhook = network_policies(helm_template(control_plane, "--set", "webhook.enabled=false"))
    assert ports(no_webhook["offloadpool-operator"]) == [("health", "TCP")]
    assert "offloadpool-csi" not in no_webhook  # csi off: no plugin, no policy
    assert network_policies(helm_template(control_plane, "--set", "networkPolicy.enabled=false")) == {}


@pytest.mark.controlplane
def test_the_operator_keeps_off_pool_nodes_by_default(control_plane: Any, tmp_path: Path) -> None:
    """By default the operator's pod must not land on a node carrying the label the operator
    puts on every node with a Ready pool (its privileged agents could read the operator's token)
    and prefers nodes without agent pods (as the operator renders them); deploy/operator.yaml
    says the same; an affinity of one's own replaces the default whole."""
    from offloadpool.operator.daemonset import render

    def affinity(docs: list[dict[str, Any]]) -> Any:
        return by_kind_and_app(docs, "Deployment", "offloadpool-operator")["spec"]["template"]["spec"].get(
            "affinity"
        )

    default = affinity(helm_template(control_plane))
    assert default, f"nothing keeps the operator off pool nodes: its default affinity is {default!r}"
    # imported after that check: it reaches a chart from before this label (hack/against.py)
    from offloadpool.api.constants import POOL_NODE_LABEL

    (term,) = default["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term == {"matchExpressions": [{"key": POOL_NODE_LABEL, "operator": "DoesNotExist"}]}
    (preferred,) = default["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in default["podAntiAffinity"]
    pool = {"metadata": {"name": "kv", "uid": "u"}, "spec": {"capacity": "1Gi"}}
    agent_labels = render(pool, OperatorConfig())["spec"]["template"]["metadata"]["labels"]
    assert preferred["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert selects(preferred["podAffinityTerm"]["labelSelector"], agent_labels)
    plain = by_kind_and_app(deploy_docs(), "Deployment", "offloadpool-operator")
    assert plain["spec"]["template"]["spec"]["affinity"] == default
    own = tmp_path / "own.yaml"
    own.write_text(yaml.safe_dump({"operator": {"affinity": {"nodeAffinity": {}}}}))
    assert affinity(helm_template(control_plane, "-f", str(own))) == {"nodeAffinity": {}}


#: The install tests run the operator without its admission webhook (no serving certificate to wait for).
NO_WEBHOOK = ("--set", "webhook.enabled=false")


def helm_install(cp: Any, release: str, ns: str, *args: str, **kwargs: Any) -> Any:
    """``helm install`` of the repository's chart as ``release`` into ``ns`` (made if missing)."""
    return cp.helm("install", release, str(CHART), "--namespace", ns, "--create-namespace", *args, **kwargs)


def repo_crds() -> dict[str, dict[str, Any]]:
    docs = [yaml.safe_load(p.read_text()) for p in sorted((REPO / "crds").glob("*.yaml"))]
    return {d["metadata"]["name"]: d for d in docs}


def values_id(values: Path | None) -> str:
    return values.stem if values else "defaults"


@pytest.mark.controlplane
def test_chart_renders_the_repository_crds_kept_on_uninstall(control_plane: Any) -> None:
    """templates/crds.yaml renders crds/ as they are, plus the release's labels and
    helm.sh/resource-policy: keep; crds.keep=false drops the annotation, crds.install=false the CRDs."""
    docs = helm_template(control_plane)
    crds = {d["metadata"]["name"]: d for d in docs if d["kind"] == "CustomResourceDefinition"}
    repo = repo_crds()
    assert sorted(crds) == sorted(repo) == sorted(CRD_NAMES)
    for name, got in crds.items():
        meta = got.pop("metadata")
        want_meta = repo[name].pop("metadata")
        assert got == repo[name], f"{name}: the chart's CRD is not crds/'s"
        assert meta["annotations"] == {"helm.sh/resource-policy": "keep"}
        assert meta["name"] == want_meta["name"] and meta["labels"] == {
            **want_meta["labels"],
            "app.kubernetes.io/instance": "op",
            "app.kubernetes.io/managed-by": "Helm",
            "helm.sh/chart": f"offloadpool-{offloadpool.__version__}",
        }

    unkept = [
        d
        for d in helm_template(control_plane, "--set", "crds.keep=false")
        if d["kind"] == "CustomResourceDefinition"
    ]
    assert len(unkept) == 2 and all("annotations" not in d["metadata"] for d in unkept)
    assert not [
        d
        for d in helm_template(control_plane, "--set", "crds.install=false")
        if d["kind"] == "CustomResourceDefinition"
    ]


@pytest.fixture(scope="module")
def dry_run_namespace(crds_installed: Any) -> Iterator[tuple[Any, str]]:
    ns = f"offloadpool-dryrun-{secrets.token_hex(3)}"
    crds_installed.kubectl("create", "namespace", ns)
    try:
        yield crds_installed, ns
    finally:
        crds_installed.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def check_absent_kinds(docs: list[dict[str, Any]], ns: str) -> None:
    """What the server cannot check for lack of their CRDs: ServiceMonitor and cert-manager
    objects point at what the chart renders."""
    for sm in [d for d in docs if d["kind"] == "ServiceMonitor"]:
        from offloadpool.operator.config import OperatorConfig
        from offloadpool.operator.daemonset import render

        (svc,) = [
            d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-agent-metrics")
        ]
        assert sm["apiVersion"] == "monitoring.coreos.com/v1"
        assert (
            sm["spec"]["namespaceSelector"] == {"matchNames": [svc["metadata"]["namespace"]]}
            and svc["metadata"]["namespace"] == ns
        )
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        ports = {p["name"]: p for p in svc["spec"]["ports"]}
        assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"] and sm["spec"]["endpoints"][0][
            "path"
        ] == "/metrics"
        # the Service reaches the agent pods the operator renders, on their metrics port
        agent = render(
            {
                "apiVersion": "offloadpool.io/v1alpha1",
                "kind": "OffloadPool",
                "metadata": {"name": "p", "uid": "u"},
                "spec": {"capacity": "1Gi", "medium": "Memory"},
            },
            OperatorConfig(namespace=ns),
        )
        pod = agent["spec"]["template"]
        assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        (c,) = pod["spec"]["containers"]
        (port,) = [p for p in c["ports"] if p["name"] == ports["metrics"]["targetPort"]]
        assert port["containerPort"] == ports["metrics"]["port"] == 9475
    for cert in [d for d in docs if d["kind"] == "Certificate"]:
        volumes = by_kind_and_app(docs, "Deployment", "offloadpool-operator")["spec"]["template"]["spec"][
            "volumes"
        ]
        assert volumes == [{"name": "webhook-certs", "secret": {"secretName": cert["spec"]["secretName"]}}]
        ref = cert["spec"]["issuerRef"]
        issuers = [d for d in docs if d["kind"] == "Issuer"]
        if issuers:
            (issuer,) = issuers
            assert ref == {"kind": "Issuer", "name": issuer["metadata"]["name"]} and issuer["spec"] == {
                "selfSigned": {}
            }
        else:
            assert ref["kind"] in ("Issuer", "ClusterIssuer") and ref["name"]


@pytest.mark.controlplane
@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=values_id)
def test_rendered_chart_is_accepted_by_the_api_server(
    dry_run_namespace: tuple[Any, str], values: Path | None
) -> None:
    """helm template with the defaults and each charts/offloadpool/ci/ file, through the real API
    server's validation (kubectl apply --dry-run=server): CRDs, RBAC, Deployment, webhook
    configurations, Services, the sample pool against the OffloadPool CRD. ServiceMonitor and
    cert-manager's Certificate/Issuer are left out (their CRDs are not in the test cluster; the
    test asserts that) and checked structurally."""
    cp, ns = dry_run_namespace
    # --api-versions: as `helm install` against this cluster, which serves OffloadPools
    docs = helm_template(
        cp,
        *(["-f", str(values)] if values else []),
        "--api-versions",
        "offloadpool.io/v1alpha1/OffloadPool",
        namespace=ns,
    )
    absent = [d for d in docs if (d["apiVersion"], d["kind"]) in ABSENT_KINDS]
    present = [d for d in docs if (d["apiVersion"], d["kind"]) not in ABSENT_KINDS]
    served = set(cp.kubectl("api-resources", "-o", "name").stdout.split())
    for d in absent:  # left out only because the server cannot know them
        group = d["apiVersion"].split("/")[0]
        assert not [r for r in served if r.endswith("." + group)], (
            f"{group} is served: dry-run {d['kind']} too"
        )
    out = cp.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(present))
    done = {}
    for line in out.stdout.splitlines():
        ref, _, outcome = line.partition(" ")
        kind, _, name = ref.partition("/")
        done[(kind.split(".")[0], name)] = outcome
    for d in present:
        outcome = done.get((d["kind"].lower(), d["metadata"]["name"]), "")
        assert outcome.endswith("(server dry run)"), f"{d['kind']}/{d['metadata']['name']}: {out.stdout}"
    assert len(done) == len(present), out.stdout
    check_absent_kinds(docs, ns)
    if values is not None and values.stem == "servicemonitor-values":
        assert [d["kind"] for d in absent] == ["ServiceMonitor"]
    if values is not None and values.stem == "sample-pool-values":
        (pool,) = [d for d in present if d["kind"] == "OffloadPool"]
        assert pool["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
        assert pool["spec"] == yaml.safe_load(values.read_text())["samplePool"]["spec"]
        # a cluster without the OffloadPool API (a fresh install creates the CRDs first): no pool
        assert not [d for d in helm_template(cp, "-f", str(values)) if d["kind"] == "OffloadPool"]
    if values is None:
        assert not absent and not [d for d in docs if d["kind"] == "OffloadPool"]  # all optional parts off


@pytest.mark.controlplane
@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (
            "image.pullPolicy=Sometimes",
            "at '/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'",
        ),
        ("image.tag=1", "at '/image/tag': got number, want string"),
        ("crds.install=maybe", "at '/crds/install': got string, want boolean"),
        ("operater.peering=x", "additional properties 'operater' not allowed"),
        ("operator.livenessPort=80", "at '/operator/livenessPort': minimum: got 80, want 1,024"),
        ("operator.resyncSeconds=0", "at '/operator/resyncSeconds'"),
        ("webhook.port=443", "at '/webhook/port': minimum: got 443, want 1,024"),
        ("webhook.excludeNamespaces={Batch}", "at '/webhook/excludeNamespaces/0'"),
        (
            "webhook.certManager.issuerRef.kind=Issuer",
            "at '/webhook/certManager/issuerRef': missing property 'name'",
        ),
        (
            "webhook.certManager.issuerRef.kind=CA",
            "at '/webhook/certManager/issuerRef/kind': value must be one of 'Issuer', 'ClusterIssuer'",
        ),
        ("agent.memoryOverhead=lots", "at '/agent/memoryOverhead'"),
        ("agent.heartbeatSeconds=0", "at '/agent/heartbeatSeconds'"),
        (
            "metrics.serviceMonitor.interval=soon",
            "at '/metrics/serviceMonitor/interval': 'soon' does not match pattern",
        ),
        ("csi.enabled=maybe", "at '/csi/enabled': got string, want boolean"),
        ("csi.resources.requests.cpu=lots", "at '/csi/resources/requests/cpu'"),
        ("csi.nodeSelector=x", "at '/csi/nodeSelector': got string, want object"),
        ("csi.kubeletDir=var/lib/kubelet", "at '/csi/kubeletDir': 'var/lib/kubelet' does not match pattern"),
        ("samplePool.spec.medium=Disk", "at '/samplePool/spec/medium': value must be one of 'HugePages-2Mi'"),
        ("samplePool.name=Not_A_Pool", "at '/samplePool/name'"),
    ],
)
def test_invalid_values_are_refused_naming_the_field(control_plane: Any, setting: str, message: str) -> None:
    out = control_plane.helm("template", "op", str(CHART), "--set", setting, check=False)
    assert out.returncode != 0 and "values don't meet the specifications of the schema" in out.stderr, (
        out.stderr
    )
    assert message in out.stderr, out.stderr


@pytest.mark.controlplane
def test_helm_install_refuses_invalid_values_and_clashing_ports(control_plane: Any) -> None:
    release = f"bad{secrets.token_hex(3)}"
    out = control_plane.helm(
        "install", release, str(CHART), "--namespace", "default", "--set", "webhook.port=80", check=False
    )
    assert out.returncode != 0 and "at '/webhook/port': minimum: got 80, want 1,024" in out.stderr, out.stderr
    listed = control_plane.helm("list", "--all", "--namespace", "default", "-o", "json").stdout
    assert release not in listed  # nothing was installed
    out = control_plane.helm("template", "op", str(CHART), "--set", "operator.livenessPort=9443", check=False)
    assert out.returncode != 0 and "webhook.port and operator.livenessPort are both 9443" in out.stderr, (
        out.stderr
    )
    # a timeout shorter than three agent heartbeats: nodes would flap between Ready and not
    # (the chart's check and the operator's are the one rule: MIN_HEARTBEATS_PER_TIMEOUT); the
    # chart checks it when both are set, the operator against its default when one is
    timeout = 60
    least = timeout // MIN_HEARTBEATS_PER_TIMEOUT  # the largest heartbeat the timeout spans
    out = control_plane.helm(
        "template",
        "op",
        str(CHART),
        "--set",
        f"operator.heartbeatTimeoutSeconds={timeout}",
        "--set",
        f"agent.heartbeatSeconds={least + 1}",
        check=False,
    )
    assert (
        out.returncode != 0
        and (
            f"operator.heartbeatTimeoutSeconds {timeout} is shorter than {MIN_HEARTBEATS_PER_TIMEOUT} agent "
            f"heartbeats (agent.heartbeatSeconds {least + 1}, so at least "
            f"{MIN_HEARTBEATS_PER_TIMEOUT * (least + 1)})"
        )
        in out.stderr
    ), out.stderr
    for fine in (
        (f"agent.heartbeatSeconds={least}", f"operator.heartbeatTimeoutSeconds={timeout}"),
        (f"agent.heartbeatSeconds={least + 1}", "operator.heartbeatTimeoutSeconds=0"),
    ):
        sets = [a for v in fine for a in ("--set", v)]
        args = operator_args(control_plane, *sets)
        assert f"--agent-heartbeat={fine[0].split('=')[1]}" in args


def operator_args(control_plane: Any, *helm_args: str) -> list[str]:
    """The operator container's args as ``helm template`` renders them with ``helm_args``."""
    docs = docs_of(control_plane.helm("template", "op", str(CHART), *helm_args).stdout)
    dep = by_kind_and_app(docs, "Deployment", "offloadpool-operator")
    return list(dep["spec"]["template"]["spec"]["containers"][0]["args"])


def test_values_yaml_comments_the_operators_defaults_and_sets_none_of_them() -> None:
    """The operator's settings are written once, in ``OperatorConfig``: values.yaml leaves them
    unset and shows each default in a comment (``# resyncSeconds: 15``), which must be the
    settings' default."""
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    section = ""
    commented: dict[tuple[str, str], Any] = {}
    for line in text.splitlines():
        if line and not line.startswith((" ", "#")):
            section = line.rstrip(":")
        elif line.startswith("  # ") and ": " in line and " " not in line[4:].split(": ")[0]:
            key, value = line[4:].split(": ", 1)
            commented[(section, key)] = yaml.safe_load(value)
    defaults = OperatorConfig()
    for (sec, key), (_, name, _) in OPERATOR_SETTINGS.items():
        assert key not in values[sec], f"values.yaml sets {sec}.{key}: leave it to the operator"
        assert commented.get((sec, key)) == getattr(defaults, name), (sec, key)


@pytest.mark.controlplane
def test_a_value_set_becomes_the_operators_setting(control_plane: Any) -> None:
    """Each of the operator's settings the chart can set reaches the operator: the rendered
    args, parsed by the operator's own flags, give that value."""
    sets = [a for (sec, key), (_, _, v) in OPERATOR_SETTINGS.items() for a in ("--set", f"{sec}.{key}={v}")]
    config = config_from_args(parse_args(operator_args(control_plane, *sets)))
    for (sec, key), (_, name, value) in OPERATOR_SETTINGS.items():
        assert value != getattr(OperatorConfig(), name), (sec, key)  # a value unlike the default
        assert getattr(config, name) == value, (sec, key)


def kubectl_json(cp: Any, *args: str) -> dict[str, Any]:
    return json.loads(cp.kubectl(*args, "-o", "json").stdout)


def crd_versions(cp: Any) -> dict[str, str]:
    """Each of offloadpool's CRDs by name -> its resourceVersion: equal only if none was written."""
    return {n: kubectl_json(cp, "get", "crd", n)["metadata"]["resourceVersion"] for n in CRD_NAMES}


def set_status(cp: Any, kind: str, name: str, status: dict[str, Any]) -> None:
    cp.kubectl(
        "patch", kind, name, "--subresource=status", "--type=merge", "-p", json.dumps({"status": status})
    )


def pool_names(cp: Any) -> list[str]:
    return [i["metadata"]["name"] for i in kubectl_json(cp, "get", "offloadpools")["items"]]


def restore_crds(cp: Any) -> None:
    """Put crds/ back as the other tests expect them, should a test end without them or with
    another chart's version of them."""
    repo = repo_crds()
    for name in CRD_NAMES:
        live = cp.kubectl("get", "crd", name, "-o", "json", check=False)
        if live.returncode != 0:
            cp.kubectl(
                "apply",
                "--server-side",
                "--field-manager=offloadpool-tests",
                "--force-conflicts",
                "-f",
                str(REPO / "crds"),
            )
            continue
        crd = json.loads(live.stdout)
        if crd["spec"]["versions"] != repo[name]["spec"]["versions"]:
            crd["spec"] = repo[name]["spec"]
            cp.kubectl("replace", "-f", "-", input=json.dumps(crd))
    cp.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", *[f"crd/{n}" for n in CRD_NAMES], timeout=90
    )


def assert_uninstalled_but_kept(cp: Any, release: str, ns: str, pools: list[str]) -> None:
    """After helm uninstall: the operator is gone, the CRDs and the pools are not."""
    assert cp.kubectl("get", "deployment", f"{release}-operator", "-n", ns, check=False).returncode != 0
    assert release not in cp.helm("list", "--all", "--namespace", ns, "-o", "json").stdout
    for name in CRD_NAMES:
        crd = kubectl_json(cp, "get", "crd", name)
        assert crd["metadata"].get("deletionTimestamp") is None, f"{name} is being deleted"
    left = pool_names(cp)
    assert set(pools) <= set(left), left


@pytest.mark.controlplane
def test_helm_install_creates_the_crds_and_the_sample_pool_on_a_fresh_cluster(crds_installed: Any) -> None:
    """A cluster without offloadpool's CRDs: the install creates them (templates, not crds/), the
    next upgrade the sample pool (Helm cannot create a kind its own install creates; NOTES.txt
    says so); uninstall leaves both. The session's CRDs are deleted for this and come back from
    the release, identical to crds/ (the suite's other tests have no pools at this point:
    asserted)."""
    cp = crds_installed
    assert pool_names(cp) == [], "pools from another test: this test deletes the CRDs"
    release = f"op{secrets.token_hex(3)}"
    ns = f"offloadpool-{release}"
    sample = f"sample-{release}"
    cp.kubectl("delete", "crd", *CRD_NAMES, "--wait=true", timeout=120)
    installed = False
    try:
        out = helm_install(
            cp,
            release,
            ns,
            *NO_WEBHOOK,
            "--set",
            "samplePool.enabled=true",
            "--set",
            f"samplePool.name={sample}",
            timeout=180,
        )
        installed = True
        assert "STATUS: deployed" in out.stdout, out.stdout
        assert f"helm upgrade {release} <this chart> -n {ns} --reuse-values" in out.stdout, out.stdout
        cp.kubectl(
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            *[f"crd/{n}" for n in CRD_NAMES],
            timeout=90,
        )
        repo = repo_crds()
        for name in CRD_NAMES:
            crd = kubectl_json(cp, "get", "crd", name)
            assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
            assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == release
            assert crd["spec"]["versions"] == repo[name]["spec"]["versions"]
        assert pool_names(cp) == []
        out = cp.helm("upgrade", release, str(CHART), "--namespace", ns, "--reuse-values", timeout=180)
        assert f"The sample pool {sample} (1Gi of Memory) is part of this release" in out.stdout, out.stdout
        pool = kubectl_json(cp, "get", "offloadpool", sample)
        assert pool["spec"]["capacity"] == "1Gi" and pool["spec"]["medium"] == "Memory"
        cp.kubectl("get", "deployment", f"{release}-operator", "-n", ns)

        cp.helm("uninstall", release, "--namespace", ns, timeout=120)
        installed = False
        assert_uninstalled_but_kept(cp, release, ns, [sample])
        assert kubectl_json(cp, "get", "offloadpool", sample)["metadata"]["uid"] == pool["metadata"]["uid"]
    finally:
        if installed:
            cp.helm("uninstall", release, "--namespace", ns, check=False, timeout=120)
        restore_crds(cp)
        cp.kubectl("delete", "offloadpool", sample, "--ignore-not-found", check=False)
        cp.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def chart_with_a_new_pool_field(tmp_path: Path) -> Path:
    """A copy of the chart, version 0.1.1, whose OffloadPool CRD has an added optional field
    spec.note (what a next release's CRD looks like)."""
    chart = tmp_path / "offloadpool"
    shutil.copytree(CHART, chart)
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    (chart / "Chart.yaml").write_text(yaml.safe_dump({**meta, "version": "0.1.1"}))
    path = chart / "files" / "crds" / "offloadpool.io_offloadpools.yaml"
    crd = yaml.safe_load(path.read_text())
    for version in crd["spec"]["versions"]:
        version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["note"] = {
            "type": "string",
            "maxLength": 64,
            "description": "Free text (added in chart 0.1.1).",
        }
    path.write_text(yaml.safe_dump(crd, sort_keys=False))
    return chart


POOL_STATUS = {"phase": "Ready", "desiredNodes": 2, "readyNodes": 2}
NODE_STATUS = {"phase": "Ready", "progress": 100, "enginesAttached": 1}


@pytest.mark.controlplane
def test_helm_upgrade_carries_a_new_crd_field_and_keeps_pools(crds_installed: Any, tmp_path: Path) -> None:
    """helm upgrade to a chart whose CRD gained a field: the CRD is upgraded (Helm would never
    upgrade a crds/ folder), existing pools keep their spec and status, the new field is accepted
    (the old chart's CRD refuses it); back to the old chart the field is gone again; helm uninstall
    leaves the CRDs and the pools."""
    cp = crds_installed
    release = f"op{secrets.token_hex(3)}"
    ns = f"offloadpool-{release}"
    pool, node = f"up-{release}", f"up-{release}.node-a"
    new_chart = chart_with_a_new_pool_field(tmp_path)
    installed = True
    try:
        helm_install(cp, release, ns, "--take-ownership", *NO_WEBHOOK, timeout=180)
        body = {
            "apiVersion": "offloadpool.io/v1alpha1",
            "kind": "OffloadPool",
            "metadata": {"name": pool},
            "spec": {"capacity": "64Mi", "medium": "Memory"},
        }
        cp.kubectl("create", "-f", "-", input=json.dumps(body))
        cp.kubectl(
            "create",
            "-f",
            "-",
            input=json.dumps(
                {
                    "apiVersion": "offloadpool.io/v1alpha1",
                    "kind": "OffloadPoolNode",
                    "metadata": {"name": node},
                    "spec": {"pool": pool, "nodeName": "node-a"},
                }
            ),
        )
        set_status(cp, "offloadpool", pool, POOL_STATUS)
        set_status(cp, "offloadpoolnode", node, NODE_STATUS)
        before = kubectl_json(cp, "get", "offloadpool", pool)
        noted = {**body, "spec": {**body["spec"], "note": "kv cache for team a"}}
        refused = cp.kubectl("apply", "--validate=strict", "-f", "-", input=json.dumps(noted), check=False)
        assert refused.returncode != 0 and 'unknown field "spec.note"' in refused.stderr, refused.stderr

        cp.helm("upgrade", release, str(new_chart), "--namespace", ns, *NO_WEBHOOK, timeout=180)
        crd = kubectl_json(cp, "get", "crd", CRD_NAMES[0])
        assert (
            "note"
            in crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        )
        after = kubectl_json(cp, "get", "offloadpool", pool)
        assert after["metadata"]["uid"] == before["metadata"]["uid"]
        assert after["spec"] == before["spec"] and after["status"] == before["status"]
        assert kubectl_json(cp, "get", "offloadpoolnode", node)["status"] == NODE_STATUS
        cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{CRD_NAMES[0]}", timeout=90)
        cp.kubectl("apply", "--validate=strict", "-f", "-", input=json.dumps(noted))
        got = kubectl_json(cp, "get", "offloadpool", pool)
        assert got["spec"]["note"] == "kv cache for team a" and got["status"] == before["status"]

        # back to the repository's chart: the CRD is crds/'s again, the pools stay
        cp.helm("upgrade", release, str(CHART), "--namespace", ns, *NO_WEBHOOK, timeout=180)
        crd = kubectl_json(cp, "get", "crd", CRD_NAMES[0])
        assert crd["spec"]["versions"] == repo_crds()[CRD_NAMES[0]]["spec"]["versions"]
        assert kubectl_json(cp, "get", "offloadpool", pool)["status"] == POOL_STATUS

        cp.helm("uninstall", release, "--namespace", ns, timeout=120)
        installed = False
        assert_uninstalled_but_kept(cp, release, ns, [pool])
        assert kubectl_json(cp, "get", "offloadpool", pool)["status"] == POOL_STATUS
        assert kubectl_json(cp, "get", "offloadpoolnode", node)["status"] == NODE_STATUS
    finally:
        if installed:
            cp.helm("uninstall", release, "--namespace", ns, check=False, timeout=120)
        restore_crds(cp)
        cp.kubectl("delete", "offloadpoolnode", node, "--ignore-not-found", check=False)
        cp.kubectl("delete", "offloadpool", pool, "--ignore-not-found", check=False)
        cp.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.mark.controlplane
def test_existing_crds_are_refused_without_take_ownership_and_left_alone_with_crds_install_false(
    crds_installed: Any,
) -> None:
    """CRDs this release does not own (applied with kubectl, or kept by another release): a plain
    install refuses to adopt them and says so; with crds.install=false the chart leaves them alone."""
    cp = crds_installed
    release = f"op{secrets.token_hex(3)}"
    ns = f"offloadpool-{release}"
    try:
        refused = helm_install(cp, release, ns, *NO_WEBHOOK, check=False, timeout=120)
        assert refused.returncode != 0, refused.stdout
        assert (
            "CustomResourceDefinition" in refused.stderr
            and "cannot be imported into the current release" in refused.stderr
        ), refused.stderr
        cp.helm("uninstall", release, "--namespace", ns, check=False, timeout=120)
        before = crd_versions(cp)
        out = helm_install(cp, release, ns, *NO_WEBHOOK, "--set", "crds.install=false", timeout=120).stdout
        assert "STATUS: deployed" in out and "not in this release: crds.install=false" in out, out
        manifest = cp.helm("get", "manifest", release, "--namespace", ns).stdout
        assert "kind: CustomResourceDefinition" not in manifest
        assert crd_versions(cp) == before
        cp.kubectl("get", "deployment", f"{release}-operator", "-n", ns)
    finally:
        cp.helm("uninstall", release, "--namespace", ns, check=False, timeout=120)
        cp.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    assert crd_versions(cp) == before
