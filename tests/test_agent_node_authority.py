"""Each agent writes only its own node (deploy/policy-agent.yaml), asked of the real API server.

Every agent has the same ServiceAccount, and RBAC cannot limit a create or a status write to
one object: without the policy a token of ``offloadpool-agent`` could write any node's
OffloadPoolNode and Lease (a forged Ready gets another node labelled, a forged Released lets a
pool's finalizer go). The policy reads the node from the token, as NodeRestriction does for
kubelets: tokens bound to agent pods on two nodes A and B (what the kubelet gives a DaemonSet's
pod), and an unbound token of the same ServiceAccount, with deploy/ applied (``world``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from fixtures import node_tokens
from fixtures.operator_world import NAMESPACE, World
from fixtures.wait import wait_for
from offloadpool.agent.kube import EVENT_NAMESPACE, MERGE, KubeAccess
from offloadpool.agent.slices import devices, slice_spec
from offloadpool.api import dra
from offloadpool.api.constants import API_VERSION, GROUP, NODE_PLURAL, VERSION, node_object_name
from offloadpool.api.node import new_object
from offloadpool.region.request import PoolRequest

pytestmark = pytest.mark.controlplane

AGENT_SA = "offloadpool-agent"
NO_NODE = "the token names no node"


def refused(call: Callable[[], Any]) -> str:
    """The message of the 403 ``call`` gets (fails if it is not refused with 403)."""
    with pytest.raises(ApiException) as info:
        call()
    assert info.value.status == 403, f"{info.value.status}: {info.value.body}"
    return str(json.loads(info.value.body or "{}").get("message", ""))


def by_policy(message: str, *expected: str) -> None:
    """The refusal is the agents' policy's, saying what it says."""
    assert "ValidatingAdmissionPolicy 'offloadpool-agent'" in message, message
    for text in expected:
        assert text in message, message


def can(api: client.ApiClient, verb: str, resource: str) -> bool:
    """Whether RBAC lets ``api``'s user ``verb`` ``resource`` of offloadpool.io (any object)."""
    review = client.AuthorizationV1Api(api).create_self_subject_access_review(
        {"spec": {"resourceAttributes": {"group": GROUP, "resource": resource, "verb": verb}}}
    )
    return bool(review.status.allowed)


class Scene:
    """Nodes A and B, a pool, the API as A's agent, B's agent and an unbound agent token."""

    def __init__(self, w: World, tmp: Path) -> None:
        self.w = w
        self.a, self.b = w.add_node("na"), w.add_node("nb")
        self.pool = w.create_pool("auth", {"capacity": "64Mi", "medium": "Memory"})
        body = w.pool(self.pool)
        assert body is not None
        self.pool_body: dict[str, Any] = body
        self.api_a, self.api_b = w.agent(self.a).api_client, w.agent(self.b).api_client
        token = w.cp.token_for(NAMESPACE, AGENT_SA)
        self.unbound = config.new_client_from_config(
            config_file=str(w.cp.kubeconfig_for_token(token, tmp / "unbound.kubeconfig"))
        )

    def name(self, node: str) -> str:
        return node_object_name(self.pool, node)

    def access(self, api: client.ApiClient, node: str) -> KubeAccess:
        """The agent's own calls, as the agent on ``node``'s OffloadPoolNode makes them."""
        return KubeAccess(api, self.pool, self.name(node), NAMESPACE)

    def event(self, api: client.ApiClient, about: str, host: str, namespace: str = EVENT_NAMESPACE) -> Any:
        """A core/v1 Event about ``about``'s OffloadPoolNode, as the agent writes one."""
        body: dict[str, Any] = {
            "metadata": {"generateName": f"{self.name(about)}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": "OffloadPoolNode",
                "name": self.name(about),
            },
            "reason": "Probe",
            "message": "node authority",
            "type": "Normal",
            "source": {"component": "offloadpool-agent", "host": host},
        }
        if namespace != EVENT_NAMESPACE:  # else the API server refuses it first (422)
            body["involvedObject"]["namespace"] = namespace
        return client.CoreV1Api(api).create_namespaced_event(namespace, body)

    def close(self) -> None:
        self.unbound.close()


@pytest.fixture
def scene(world: World, tmp_path: Path) -> Any:
    s = Scene(world, tmp_path)
    try:
        yield s
    finally:
        s.close()


def test_an_agent_writes_its_own_nodes_objects(scene: Scene) -> None:
    """A's agent, with its own code and a token bound to its pod on A: creates its
    OffloadPoolNode, writes its status, creates and renews its Lease, records an Event."""
    s = scene
    own = s.access(s.api_a, s.a)
    made = own.create_pool_node(s.pool_body)
    assert made is not None and made["spec"]["nodeName"] == s.a
    patched = own.patch_status({"phase": "Ready", "observedGeneration": 1})
    assert patched is not None and patched["status"]["phase"] == "Ready"
    own.renew_heartbeat(40, s.pool_body)  # created
    first = s.w.lease(NAMESPACE, s.name(s.a))
    KubeAccess(s.api_a, s.pool, s.name(s.a), NAMESPACE).renew_heartbeat(40, s.pool_body)  # a restart: patched
    again = s.w.lease(NAMESPACE, s.name(s.a))
    assert first is not None and again is not None
    assert again["spec"]["holderIdentity"] == s.name(s.a)
    assert again["spec"]["renewTime"] > first["spec"]["renewTime"]
    event = s.event(s.api_a, s.a, s.a)
    assert event.involved_object.name == s.name(s.a)


def test_an_agent_is_refused_another_nodes_objects(scene: Scene) -> None:
    """A's token on B's OffloadPoolNode (create, status patch) and B's Lease (create, renew of
    the one B's agent made, a Lease of A's name held by B) and Events about B: each a 403 that
    names A and the object."""
    s = scene
    theirs = s.access(s.api_a, s.b)  # A's credentials, B's names

    by_policy(refused(lambda: theirs.create_pool_node(s.pool_body)), f"on node {s.a}", s.name(s.b))
    assert s.w.pool_nodes(s.pool).get(s.b) is None

    # B's agent makes its own object and Lease; A's agent cannot write them
    assert s.access(s.api_b, s.b).create_pool_node(s.pool_body) is not None
    s.access(s.api_b, s.b).renew_heartbeat(40, s.pool_body)
    by_policy(refused(lambda: theirs.patch_status({"phase": "Ready"})), f"on node {s.a}", s.name(s.b))
    by_policy(refused(lambda: theirs.patch_status({"phase": "Released", "reason": "Released"})), s.name(s.b))
    assert "phase" not in (s.w.pool_nodes(s.pool).get(s.b) or {}).get("status", {})
    leases = client.CoordinationV1Api(s.api_a)
    by_policy(
        refused(
            lambda: leases.patch_namespaced_lease(
                s.name(s.b),
                NAMESPACE,
                {"spec": {"renewTime": "2030-01-01T00:00:00.000000Z"}},
                _content_type=MERGE,
            )
        ),
        f"on node {s.a}",
        f"Leases (<pool>.{s.a}",
    )

    # B's Lease made by A: as the agent makes it, and as a Lease of A's name held by B's
    fresh = s.w.name("other")
    by_policy(
        refused(
            lambda: KubeAccess(s.api_a, fresh, f"{fresh}.{s.b}", NAMESPACE).renew_heartbeat(40, s.pool_body)
        )
    )
    forged = {
        "metadata": {"name": f"{fresh}.{s.a}", "namespace": NAMESPACE},
        "spec": {"holderIdentity": f"{fresh}.{s.b}", "leaseDurationSeconds": 40},
    }
    by_policy(refused(lambda: leases.create_namespaced_lease(NAMESPACE, forged)), f"{fresh}.{s.a}")

    # Events: only about its own node's objects, naming itself, in default
    by_policy(refused(lambda: s.event(s.api_a, s.b, s.b)), "may record Events only")
    by_policy(refused(lambda: s.event(s.api_a, s.b, s.a)), "may record Events only")
    by_policy(refused(lambda: s.event(s.api_a, s.a, s.b)), "may record Events only")
    by_policy(refused(lambda: s.event(s.api_a, s.a, s.a, namespace=NAMESPACE)), "may record Events only")


def test_a_token_that_names_no_node_is_refused_everything(scene: Scene) -> None:
    """The same ServiceAccount's token bound to no pod: RBAC lets it write, the policy does
    not, whichever node it claims."""
    s = scene
    for api, node in ((s.api_a, s.a), (s.api_b, s.b)):  # each node's own, to write to
        s.access(api, node).create_pool_node(s.pool_body)
        s.access(api, node).renew_heartbeat(40, s.pool_body)
    for node in (s.a, s.b):
        anyone = s.access(s.unbound, node)
        by_policy(refused(lambda: anyone.create_pool_node(s.pool_body)), NO_NODE)  # noqa: B023
        by_policy(refused(lambda: anyone.patch_status({"phase": "Ready"})), NO_NODE)  # noqa: B023
        by_policy(refused(lambda: anyone.renew_heartbeat(40, s.pool_body)), NO_NODE)  # noqa: B023
        by_policy(refused(lambda: s.event(s.unbound, node, node)), NO_NODE)  # noqa: B023
    assert not any("phase" in (o.get("status") or {}) for o in s.w.pool_nodes(s.pool).values())
    by_policy(
        refused(
            lambda: client.CoordinationV1Api(s.unbound).patch_namespaced_lease(
                s.name(s.a),
                NAMESPACE,
                {"spec": {"renewTime": "2030-01-01T00:00:00.000000Z"}},
                _content_type=MERGE,
            )
        ),
        NO_NODE,
    )


def test_the_policy_holds_where_rbac_grants_more(scene: Scene) -> None:
    """Were the agent's ServiceAccount granted spec updates and deletes (another binding, a
    mistake), the policy still keeps A's token off B's objects — and lets it change its own."""
    s = scene
    rbac = client.RbacAuthorizationV1Api(s.w.api)
    role = s.w.name("agent-wider")
    rbac.create_cluster_role(
        {
            "metadata": {"name": role},
            "rules": [
                {"apiGroups": [GROUP], "resources": [NODE_PLURAL], "verbs": ["update", "patch", "delete"]},
                {
                    "apiGroups": ["coordination.k8s.io"],
                    "resources": ["leases"],
                    "verbs": ["update", "delete"],
                },
            ],
        }
    )
    rbac.create_cluster_role_binding(
        {
            "metadata": {"name": role},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": AGENT_SA, "namespace": NAMESPACE}],
        }
    )
    try:
        wait_for("the wider grant in force", lambda: can(s.api_a, "update", NODE_PLURAL), timeout=30)
        for api, node in ((s.api_a, s.a), (s.api_b, s.b)):
            s.access(api, node).create_pool_node(s.pool_body)
            s.access(api, node).renew_heartbeat(40, s.pool_body)
        custom = client.CustomObjectsApi(s.api_a)
        target = {"metadata": {"labels": {"forged": "yes"}}, "spec": {"targetGeneration": 99}}

        def spec_update(node: str) -> Any:
            return custom.patch_cluster_custom_object(
                GROUP, VERSION, NODE_PLURAL, s.name(node), target, _content_type=MERGE
            )

        def replace(node: str) -> Any:
            body = s.w.pool_nodes(s.pool)[node]
            body["spec"]["targetGeneration"] = 98
            return custom.replace_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, s.name(node), body)

        by_policy(refused(lambda: spec_update(s.b)), f"on node {s.a}", s.name(s.b))
        by_policy(refused(lambda: replace(s.b)), s.name(s.b))
        by_policy(
            refused(lambda: custom.delete_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, s.name(s.b))),
            s.name(s.b),
        )
        by_policy(
            refused(
                lambda: client.CoordinationV1Api(s.api_a).delete_namespaced_lease(s.name(s.b), NAMESPACE)
            ),
            s.name(s.b),
        )
        assert s.w.pool_nodes(s.pool)[s.b]["spec"].get("targetGeneration") != 99
        assert spec_update(s.a)["spec"]["targetGeneration"] == 99  # its own: the policy allows
    finally:
        rbac.delete_cluster_role_binding(role)
        rbac.delete_cluster_role(role)


def test_the_operator_is_not_held_to_a_node(scene: Scene, operator_rbac: Path) -> None:
    """The policy matches the agents' ServiceAccount only: the operator (its own token, bound to
    no pod) still creates any node's OffloadPoolNode and records Events."""
    s = scene
    operator = config.new_client_from_config(config_file=str(operator_rbac))
    try:
        made = client.CustomObjectsApi(operator).create_cluster_custom_object(
            GROUP, VERSION, NODE_PLURAL, new_object(s.pool_body, s.b, 1)
        )
        assert made["metadata"]["name"] == s.name(s.b)
        assert s.event(operator, s.b, "operator").involved_object.name == s.name(s.b)
    finally:
        operator.close()


def test_the_pod_bound_token_names_its_node(scene: Scene) -> None:
    """What the policy reads: the API server puts the node of the pod a token is bound to into
    the request's user info (a SelfSubjectReview shows it), and nothing for an unbound token."""
    key = "authentication.kubernetes.io/node-name"

    def extra(api: client.ApiClient) -> dict[str, list[str]]:
        review = client.AuthenticationV1Api(api).create_self_subject_review({})
        return dict(review.status.user_info.extra or {})

    assert extra(scene.api_a)[key] == [scene.a]
    assert extra(scene.api_b)[key] == [scene.b]
    assert key not in extra(scene.unbound)


def test_a_token_ends_with_its_pod(scene: Scene) -> None:
    """A node's token stops working once its pod is deleted (what a kubelet's token does)."""
    s = scene
    t = node_tokens.node_token(s.w.cp, s.w.core, NAMESPACE, AGENT_SA, s.a)
    api = config.new_client_from_config(
        config_file=str(s.w.cp.kubeconfig_for_token(t.token, s.w.tmp / "short.kubeconfig"))
    )
    try:
        assert s.access(api, s.a).get_pool_node() is None  # works (nothing made yet)
        node_tokens.end(s.w.core, [t])

        def unauthorized() -> bool:
            try:
                s.access(api, s.a).get_pool_node()
            except ApiException as exc:
                assert exc.status == 401, exc.body
                return True
            return False

        wait_for("the token refused once its pod is gone", unauthorized, timeout=30)
    finally:
        api.close()


def test_an_agent_writes_only_its_own_nodes_resource_slices(scene: Scene) -> None:
    """The pool's ResourceSlice (``agent.slices``): A's agent creates, replaces and deletes its
    own; a slice of B's name, one of A's name that says node B, another DRA pool or another
    driver, B's own slice replaced or deleted, and any slice with a token naming no node: each a
    403 of the policy. RBAC alone would let every one through."""
    s = scene
    req = PoolRequest(name=s.pool, capacity=64 << 20, medium="Memory")

    def body(name: str, node: str, **spec: Any) -> dict[str, Any]:
        pool = name.split(".", 1)[0]
        return {
            "apiVersion": dra.RESOURCE_API_VERSION,
            "kind": dra.SLICE_KIND,
            "metadata": {"name": name},
            "spec": {**slice_spec(node, pool, devices(pool, req, [], None)), **spec},
        }

    own, theirs = s.access(s.api_a, s.a), s.access(s.api_b, s.b)
    mine, b_name = dra.slice_name(s.pool, s.a), dra.slice_name(s.pool, s.b)
    made = own.create_slice(body(mine, s.a))
    assert made["spec"]["nodeName"] == s.a
    made["spec"]["devices"] = []
    own.replace_slice(mine, made)  # its own: the policy allows
    assert theirs.create_slice(body(b_name, s.b))["spec"]["nodeName"] == s.b

    says = (f"on node {s.a}", "ResourceSlices")
    by_policy(refused(lambda: own.create_slice(body(b_name, s.b))), *says, b_name)
    other = dra.slice_name(s.w.name("other"), s.a)
    by_policy(refused(lambda: own.create_slice(body(other, s.b))), *says)  # A's name, node B
    by_policy(
        refused(lambda: own.create_slice(body(other, s.a, pool={"name": b_name, "resourceSliceCount": 1}))),
        *says,
    )  # B's DRA pool
    by_policy(refused(lambda: own.create_slice(body(other, s.a, driver="gpu.example.com"))), *says)
    stored = theirs.get_slice(b_name)
    assert stored is not None
    stored["spec"]["devices"] = []
    by_policy(refused(lambda: own.replace_slice(b_name, stored)), *says, b_name)
    by_policy(refused(lambda: own.delete_slice(b_name)), *says, b_name)
    by_policy(refused(lambda: s.access(s.unbound, s.a).create_slice(body(other, s.a))), NO_NODE)
    assert own.get_slice(other) is None
    assert [d["name"] for d in (theirs.get_slice(b_name) or {})["spec"]["devices"]] == [dra.POOL_DEVICE]

    own.delete_slice(mine)
    theirs.delete_slice(b_name)
    assert own.get_slice(mine) is None and theirs.get_slice(b_name) is None
