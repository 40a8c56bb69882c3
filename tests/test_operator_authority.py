"""The operator writes only its own marks on Nodes and only the agent DaemonSets it renders
(deploy/policy-operator.yaml), asked of the real API server with the operator's own token.

RBAC cannot say it: the operator's right to patch Nodes is a right to every field of every
Node (a label that steers other workloads, a taint, an address the API server dials for the
kubelet, a GPU count), and its right to create DaemonSets in its namespace — which the pod
guard webhook skips — is a right to any privileged DaemonSet there. The writes the real
operator makes pass: tests/test_operator_lifecycle.py runs under the same policy (every
operator test does: ``operator_rbac`` applies deploy/ and waits for it to be in force).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from fixtures.operator_world import NAMESPACE, World
from fixtures.wait import wait_for
from offloadpool.api.constants import POOL_LABEL_READY, extended_resource_name, pool_label_key
from offloadpool.operator import daemonset
from offloadpool.operator.config import OperatorConfig

pytestmark = pytest.mark.controlplane

MERGE = "application/merge-patch+json"
POLICY = "ValidatingAdmissionPolicy 'offloadpool-operator'"
OPERATOR_SUBJECT = {"kind": "ServiceAccount", "name": "offloadpool-operator", "namespace": NAMESPACE}


def can(api: client.ApiClient, verb: str, resource: str, group: str = "", namespace: str = "") -> bool:
    """Whether RBAC lets ``api``'s user ``verb`` ``resource`` (so a refusal is the policy's)."""
    attributes = {"group": group, "resource": resource, "verb": verb, "namespace": namespace}
    review = client.AuthorizationV1Api(api).create_self_subject_access_review(
        {"spec": {"resourceAttributes": attributes}}
    )
    return bool(review.status.allowed)


def refused(call: Callable[[], Any], *expected: str) -> str:
    """The message of the 403 the operator's policy gives ``call`` (fails otherwise)."""
    with pytest.raises(ApiException) as info:
        call()
    assert info.value.status == 403, f"{info.value.status}: {info.value.body}"
    message = str(json.loads(info.value.body or "{}").get("message", ""))
    assert POLICY in message, message
    for text in expected:
        assert text in message, message
    return message


class Scene:
    """A Node, a pool, and the API as the operator (its ServiceAccount's token)."""

    def __init__(self, w: World, kubeconfig: Path) -> None:
        self.w = w
        self.node = w.add_node("auth", labels={"team": "a"}, taints=[])
        self.pool = w.create_pool("opauth", {"capacity": "64Mi", "medium": "Memory"})
        body = w.pool(self.pool)
        assert body is not None
        self.pool_body: dict[str, Any] = body
        self.api = config.new_client_from_config(config_file=str(kubeconfig))
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)

    def patch_status(self, patch: dict[str, Any]) -> Any:
        return self.core.patch_node_status(self.node, patch, dry_run="All", _content_type=MERGE)

    def patch(self, patch: dict[str, Any]) -> Any:
        return self.core.patch_node(self.node, patch, dry_run="All", _content_type=MERGE)

    def rendered(self, namespace: str = NAMESPACE) -> dict[str, Any]:
        """The agent DaemonSet the operator renders for the pool (as it runs in the tests)."""
        return daemonset.render(self.pool_body, OperatorConfig(namespace=namespace))

    def create(self, body: dict[str, Any]) -> Any:
        ns = body["metadata"]["namespace"]
        return self.apps.create_namespaced_daemon_set(ns, body, dry_run="All")


@pytest.fixture
def scene(world: World, operator_rbac: Path) -> Iterator[Scene]:
    s = Scene(world, operator_rbac)
    try:
        yield s
    finally:
        s.api.close()


def test_the_operator_sets_its_own_marks(scene: Scene) -> None:
    """The one patch the operator makes per node (nodes.marks_patch, on nodes/status): both
    labels and the extended resource, set and then removed."""
    # imported here: the module's refusals also run against a commit before this label
    # (hack/against.py)
    from offloadpool.api.constants import POOL_NODE_LABEL, POOL_NODE_VALUE

    s = scene
    resource = extended_resource_name(s.pool)
    label = {pool_label_key(s.pool): POOL_LABEL_READY, POOL_NODE_LABEL: POOL_NODE_VALUE}
    made = s.core.patch_node_status(
        s.node,
        {
            "metadata": {"labels": label},
            "status": {"capacity": {resource: "2"}, "allocatable": {resource: "2"}},
        },
        _content_type=MERGE,
    )
    assert made.status.capacity[resource] == "2" and made.metadata.labels[POOL_NODE_LABEL] == "true"
    gone = s.core.patch_node_status(
        s.node,
        {
            "metadata": {"labels": {k: None for k in label}},
            "status": {"capacity": {resource: None}, "allocatable": {resource: None}},
        },
        _content_type=MERGE,
    )
    assert resource not in (gone.status.capacity or {}) and "team" in gone.metadata.labels


def test_the_operator_cannot_change_anything_else_on_a_node(scene: Scene) -> None:
    """Another label, an annotation, a taint, another resource, an address, a condition: each
    refused, through the Node and through its status; a Node is never created or deleted."""
    s = scene
    for patch in (s.patch, s.patch_status):
        for metadata, says in (
            ({"labels": {"team": "b"}}, "only the labels"),
            ({"labels": {"team": None}}, "only the labels"),
            ({"labels": {"node-role.kubernetes.io/control-plane": ""}}, "only the labels"),
            # an owned key with a value the operator never writes
            ({"labels": {pool_label_key(s.pool): "yes"}}, "only the labels"),
            ({"annotations": {"x": "y"}}, "annotations"),
            ({"finalizers": ["example.com/hold"]}, "finalizers"),
        ):
            refused(partial(patch, {"metadata": metadata}), says)
    taint = {"key": "evil", "effect": "NoSchedule"}
    refused(lambda: s.patch({"spec": {"taints": [taint]}}), "spec")
    refused(lambda: s.patch({"spec": {"unschedulable": True}}), "spec")
    for status in (
        {"capacity": {"nvidia.com/gpu": "8"}},
        {"allocatable": {"cpu": "1000"}},
        {"addresses": [{"type": "InternalIP", "address": "203.0.113.9"}]},
        {"daemonEndpoints": {"kubeletEndpoint": {"Port": 1}}},
        {"conditions": [{"type": "Ready", "status": "False", "reason": "Forged"}]},
    ):
        refused(partial(s.patch_status, {"status": status}), "only the resources")
    # one write mixing an own mark with another change is refused whole
    refused(
        lambda: s.patch_status(
            {"metadata": {"labels": {pool_label_key(s.pool): POOL_LABEL_READY, "team": "b"}}}
        )
    )
    # where an admin's mistake gives the operator more rights on Nodes, the policy still holds
    rbac = client.RbacAuthorizationV1Api(s.w.api)
    grant = s.w.name("operator-nodes")
    rule = {"apiGroups": [""], "resources": ["nodes"], "verbs": ["create", "delete", "update"]}
    rbac.create_cluster_role({"metadata": {"name": grant}, "rules": [rule]})
    try:
        rbac.create_cluster_role_binding(
            {
                "metadata": {"name": grant},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": grant},
                "subjects": [OPERATOR_SUBJECT],
            }
        )
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": s.w.name("forged")}}
        wait_for("the grant in force", lambda: can(s.api, "create", "nodes"))
        refused(lambda: s.core.create_node(node, dry_run="All"), "may not create a Node")
        refused(lambda: s.core.delete_node(s.node, dry_run="All"), "may not delete a Node")
        whole = s.core.read_node(s.node)
        whole.metadata.labels["team"] = "b"
        refused(lambda: s.core.replace_node(s.node, whole, dry_run="All"), "only the labels")
    finally:
        rbac.delete_cluster_role_binding(grant)
        rbac.delete_cluster_role(grant)
    assert s.w.node(s.node).metadata.labels["team"] == "a"


def test_the_operator_creates_the_daemonsets_it_renders(scene: Scene) -> None:
    """The rendered agent DaemonSet passes, and its replacement (kube.apply_daemonset)."""
    s = scene
    made = s.apps.create_namespaced_daemon_set(NAMESPACE, s.rendered())
    try:
        again = s.rendered()
        again["spec"]["template"]["spec"]["tolerations"] = [{"operator": "Exists"}]
        # The DaemonSet controller writes the status meanwhile: replace at the latest version,
        # as kube.apply_daemonset does, again on a conflict (a policy refusal is a 422, not this).
        for attempt in range(5):
            current = s.apps.read_namespaced_daemon_set(made.metadata.name, NAMESPACE)
            again["metadata"]["resourceVersion"] = current.metadata.resource_version
            try:
                s.apps.replace_namespaced_daemon_set(made.metadata.name, NAMESPACE, again)
                break
            except ApiException as exc:
                if exc.status != 409 or attempt == 4:
                    raise
    finally:
        s.w.apps.delete_namespaced_daemon_set(made.metadata.name, NAMESPACE)


def test_the_operator_cannot_create_other_daemonsets(scene: Scene, world: World) -> None:
    """Another namespace (even where RBAC grants it), another name, no or other labels, another
    ServiceAccount, another command, a hostPath beyond the agent's root, host network: each
    refused."""
    s = scene

    def variant(change: Callable[[dict[str, Any]], None], namespace: str = NAMESPACE) -> dict[str, Any]:
        body = json.loads(json.dumps(s.rendered(namespace)))  # no shared label dicts
        change(body)
        return body

    def pod(body: dict[str, Any]) -> dict[str, Any]:
        return body["spec"]["template"]["spec"]

    # another namespace, where an admin's RoleBinding gives the operator DaemonSet rights
    other = world.name("elsewhere")
    world.core.create_namespace({"metadata": {"name": other}})
    try:
        rbac = client.RbacAuthorizationV1Api(world.api)
        rbac.create_namespaced_role(
            other,
            {
                "metadata": {"name": "ds"},
                "rules": [{"apiGroups": ["apps"], "resources": ["daemonsets"], "verbs": ["create"]}],
            },
        )
        rbac.create_namespaced_role_binding(
            other,
            {
                "metadata": {"name": "ds"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "ds"},
                "subjects": [OPERATOR_SUBJECT],
            },
        )
        wait_for("the grant in force", lambda: can(s.api, "create", "daemonsets", "apps", other))
        refused(lambda: s.create(s.rendered(other)), "in its own namespace")
    finally:
        world.core.delete_namespace(other)

    def rename(b: dict[str, Any]) -> None:
        b["metadata"]["name"] = "evil"

    def unlabel(b: dict[str, Any]) -> None:
        b["metadata"]["labels"] = {}

    def other_pool(b: dict[str, Any]) -> None:  # labelled, selecting and owned for another pool
        for labels in (b["metadata"]["labels"], b["spec"]["selector"]["matchLabels"]):
            labels["offloadpool.io/pool"] = "other"
        b["spec"]["template"]["metadata"]["labels"]["offloadpool.io/pool"] = "other"
        b["metadata"]["ownerReferences"][0]["name"] = "other"

    def account(b: dict[str, Any]) -> None:
        pod(b)["serviceAccountName"] = "offloadpool-operator"

    def command(b: dict[str, Any]) -> None:
        pod(b)["containers"][0]["command"] = ["sh", "-c", "cat /host/etc/shadow"]

    def host_path(b: dict[str, Any]) -> None:
        pod(b)["volumes"].append({"name": "host", "hostPath": {"path": "/"}})

    def root_ancestor(b: dict[str, Any]) -> None:
        pod(b)["volumes"][0]["hostPath"]["path"] = "/var/lib"  # holds the kubelet's tree

    def secret(b: dict[str, Any]) -> None:
        pod(b)["volumes"].append({"name": "s", "secret": {"secretName": "offloadpool-webhook"}})

    def host_network(b: dict[str, Any]) -> None:
        pod(b)["hostNetwork"] = True

    def init(b: dict[str, Any]) -> None:
        pod(b)["initContainers"] = [{"name": "first", "image": "busybox", "command": ["true"]}]

    def unowned(b: dict[str, Any]) -> None:
        del b["metadata"]["ownerReferences"]

    for change, says in (
        (rename, "only the agent DaemonSets it renders"),
        (unlabel, "only the agent DaemonSets it renders"),
        (other_pool, "only the agent DaemonSets it renders"),
        (account, "must run the agent"),
        (command, "must run the agent"),
        (host_path, "must run the agent"),
        (root_ancestor, "must run the agent"),
        (secret, "must run the agent"),
        (host_network, "must run the agent"),
        (init, "must run the agent"),
        (unowned, "owned by the OffloadPool"),
    ):
        refused(lambda: s.create(variant(change)), says)  # noqa: B023 (called at once)
