"""The test control plane itself: it is real, complete enough for offloadpool, and current.

Later tests rely on exactly these behaviours (garbage collection of owned objects, DaemonSet
pods per Node, RBAC denials for limited service accounts, real kubectl and helm), so each is
checked here on its own, where a failure points at the platform and not at offloadpool.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fixtures.controlplane import ControlPlaneHandle, json_of
from fixtures.wait import wait_for

pytestmark = pytest.mark.controlplane


@pytest.fixture
def namespace(control_plane: ControlPlaneHandle) -> Iterator[str]:
    """A fresh namespace whose `default` ServiceAccount exists (so pods are admitted)."""
    name = f"cp-test-{uuid.uuid4().hex[:8]}"
    control_plane.kubectl("create", "namespace", name)
    try:
        wait_for(
            f"ServiceAccount {name}/default",
            lambda: (
                control_plane.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode
                == 0
            ),
            120,
            interval=0.5,
        )
        yield name
    finally:
        control_plane.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")


def test_readyz_is_ok(control_plane: ControlPlaneHandle) -> None:
    out = control_plane.kubectl("get", "--raw", "/readyz")
    assert out.stdout.strip() == "ok"


def test_server_and_kubectl_are_the_pinned_release(control_plane: ControlPlaneHandle) -> None:
    version = json_of(control_plane.kubectl("version", "-o", "json"))
    assert version["serverVersion"]["gitVersion"] == "v1.37.2"
    assert version["clientVersion"]["gitVersion"] == "v1.37.2"


def test_helm_version_template_and_install(
    control_plane: ControlPlaneHandle, tmp_path: Path, namespace: str
) -> None:
    assert control_plane.helm("version", "--short").stdout.startswith("v3.22.0")
    # A tiny chart of our own: one ConfigMap whose data comes from values.
    chart = tmp_path / "tiny"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(json.dumps({"apiVersion": "v2", "name": "tiny", "version": "0.1.0"}))
    (chart / "values.yaml").write_text(json.dumps({"greeting": "hello"}))
    (chart / "templates" / "configmap.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-tiny\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n"
    )
    rendered = control_plane.helm("template", "demo", str(chart), "--set", "greeting=hi").stdout
    assert "name: demo-tiny" in rendered
    assert 'greeting: "hi"' in rendered
    control_plane.helm("install", "demo", str(chart), "-n", namespace)
    cm = json_of(control_plane.kubectl("get", "configmap", "demo-tiny", "-n", namespace, "-o", "json"))
    assert cm["data"] == {"greeting": "hello"}
    control_plane.helm("uninstall", "demo", "-n", namespace)


def test_garbage_collector_deletes_owned_objects(control_plane: ControlPlaneHandle, namespace: str) -> None:
    control_plane.kubectl("create", "configmap", "owner", "-n", namespace)
    owner_uid = json_of(control_plane.kubectl("get", "configmap", "owner", "-n", namespace, "-o", "json"))[
        "metadata"
    ]["uid"]
    owned = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "owned",
            "namespace": namespace,
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}],
        },
    }
    control_plane.kubectl("create", "-f", "-", input=json.dumps(owned))
    control_plane.kubectl("delete", "configmap", "owner", "-n", namespace)

    def owned_is_gone() -> bool:
        got = control_plane.kubectl("get", "configmap", "owned", "-n", namespace, check=False)
        return got.returncode != 0 and "NotFound" in got.stderr

    wait_for("the garbage collector to delete the owned ConfigMap", owned_is_gone, 120, interval=0.5)


def test_daemonset_controller_creates_a_pod_per_node(
    control_plane: ControlPlaneHandle, namespace: str
) -> None:
    node_name = f"cp-test-node-{uuid.uuid4().hex[:6]}"
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node_name, "labels": {"offloadpool.io/test-node": namespace}},
    }
    control_plane.kubectl("create", "-f", "-", input=json.dumps(node))
    try:
        ds = {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": "probe", "namespace": namespace},
            "spec": {
                "selector": {"matchLabels": {"app": "probe"}},
                "template": {
                    "metadata": {"labels": {"app": "probe"}},
                    "spec": {
                        # Only our node: other tests' Nodes must not matter here.
                        "nodeSelector": {"offloadpool.io/test-node": namespace},
                        # No kubelet exists: the pod is never run, only created.
                        "containers": [{"name": "probe", "image": "registry.invalid/probe:1"}],
                    },
                },
            },
        }
        control_plane.kubectl("create", "-f", "-", input=json.dumps(ds))

        def pod_for_node() -> dict | None:
            pods = json_of(
                control_plane.kubectl("get", "pods", "-n", namespace, "-l", "app=probe", "-o", "json")
            )["items"]
            return pods[0] if pods else None

        pod = wait_for("the DaemonSet controller to create a pod", pod_for_node, 120, interval=0.5)
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "DaemonSet"
        terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        fields = [f for t in terms for f in t.get("matchFields", [])]
        assert {"key": "metadata.name", "operator": "In", "values": [node_name]} in fields
    finally:
        control_plane.kubectl("delete", "node", node_name, "--ignore-not-found")


def test_rbac_denies_a_fresh_service_account(
    control_plane: ControlPlaneHandle, namespace: str, tmp_path: Path
) -> None:
    control_plane.kubectl("create", "serviceaccount", "nobody", "-n", namespace)
    token = control_plane.token_for(namespace, "nobody")
    kubeconfig = control_plane.kubeconfig_for_token(token, tmp_path / "nobody.kubeconfig")
    # The token authenticates (so a denial below is authorization, not a bad credential) ...
    whoami = json_of(control_plane.kubectl("--kubeconfig", str(kubeconfig), "auth", "whoami", "-o", "json"))
    assert whoami["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:nobody"
    # ... and RBAC denies listing nodes.
    denied = control_plane.kubectl("--kubeconfig", str(kubeconfig), "get", "nodes", check=False)
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr.lower()
    assert "nodes" in denied.stderr
    can_i = control_plane.kubectl(
        "--kubeconfig", str(kubeconfig), "auth", "can-i", "list", "nodes", check=False
    )
    assert can_i.stdout.strip() == "no"


def test_api_client_talks_to_the_server_as_admin(control_plane: ControlPlaneHandle) -> None:
    from kubernetes import client

    with control_plane.api_client() as api:
        names = [ns.metadata.name for ns in client.CoreV1Api(api).list_namespace().items]
    assert "kube-system" in names


def test_a_stopped_control_plane_leaves_nothing_running(
    control_plane: ControlPlaneHandle, tmp_path: Path
) -> None:
    """What the session fixture does at teardown, checked on a second, short-lived instance."""
    import socket
    from urllib.parse import urlparse

    from hack.controlplane import ControlPlane

    plane = ControlPlane(control_plane.bin_dir, tmp_path / "second")
    try:
        plane.start()
        pids = plane.pids()
        assert len(pids) == 3
        port = urlparse(plane.server).port
    finally:
        plane.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # neither the process nor anything in its group is left
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
