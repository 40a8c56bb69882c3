"""RBAC split, asked of the real authorizer: only the operator writes Nodes; the agent reads
pools and OffloadPoolNodes, creates OffloadPoolNodes (its own, when it starts) and writes only
OffloadPoolNode status, Events and its heartbeat Lease (in its own namespace), with the verbs it
uses and no others; the operator only lists those Leases. (Which node's objects an agent may
write is the admission policy's: tests/test_agent_node_authority.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from fixtures.operator_world import NAMESPACE
from fixtures.wait import wait_for
from offloadpool.agent import kube

pytestmark = pytest.mark.controlplane

AGENT = f"system:serviceaccount:{NAMESPACE}:offloadpool-agent"
OPERATOR = f"system:serviceaccount:{NAMESPACE}:offloadpool-operator"

ALLOWED = [
    (AGENT, "get offloadpools"),
    (AGENT, "watch offloadpools"),
    (AGENT, "list offloadpoolnodes"),
    (AGENT, "create offloadpoolnodes"),
    (AGENT, "patch offloadpoolnodes --subresource=status"),
    (AGENT, "create events -n default"),
    (AGENT, f"create leases -n {NAMESPACE}"),
    (AGENT, f"patch leases -n {NAMESPACE}"),
    (OPERATOR, f"list leases -n {NAMESPACE}"),
    (OPERATOR, "patch nodes"),
    (OPERATOR, "patch nodes --subresource=status"),
    (OPERATOR, "watch nodes"),
    (OPERATOR, "create offloadpoolnodes"),
    (OPERATOR, "delete offloadpoolnodes"),
    (OPERATOR, "patch offloadpools"),
    (OPERATOR, "patch offloadpools --subresource=status"),
    (OPERATOR, f"create daemonsets -n {NAMESPACE}"),
    (OPERATOR, f"update daemonsets -n {NAMESPACE}"),
    (OPERATOR, "create events -n default"),
    (OPERATOR, f"delete pods -n {NAMESPACE}"),
    # an agent pod made before its ServiceAccount is replaced (operator/agentpods.py)
    (OPERATOR, f"get serviceaccounts -n {NAMESPACE}"),
]
DENIED = [
    (AGENT, "patch nodes"),
    (AGENT, "patch nodes --subresource=status"),
    (AGENT, "update offloadpools"),
    (AGENT, "patch offloadpools --subresource=status"),
    (AGENT, "patch offloadpoolnodes"),
    (AGENT, "delete offloadpoolnodes"),
    (AGENT, "get secrets -n default"),
    (AGENT, "create leases -n default"),
    (AGENT, f"delete leases -n {NAMESPACE}"),
    # what the agent never calls (agent/offloadpool/agent/kube.py)
    (AGENT, "update offloadpoolnodes --subresource=status"),
    (AGENT, "patch events -n default"),
    (AGENT, "create events.events.k8s.io -n default"),
    (AGENT, f"get leases -n {NAMESPACE}"),
    (OPERATOR, f"patch leases -n {NAMESPACE}"),
    (OPERATOR, "patch offloadpoolnodes --subresource=status"),
    (OPERATOR, "create daemonsets -n default"),
    (OPERATOR, "delete nodes"),
    (OPERATOR, "get secrets -n default"),
    (OPERATOR, "create pods -n default"),
    (OPERATOR, "delete pods -n default"),
    (OPERATOR, f"create pods -n {NAMESPACE}"),
    (OPERATOR, "get serviceaccounts -n default"),
    (OPERATOR, f"delete serviceaccounts -n {NAMESPACE}"),
    (OPERATOR, f"create serviceaccounts/token -n {NAMESPACE}"),
]


def can(cp: Any, who: str, what: str) -> str:
    return cp.kubectl("auth", "can-i", *what.split(), f"--as={who}", check=False).stdout.strip()


@pytest.mark.parametrize(("who", "what"), ALLOWED)
def test_allowed(operator_rbac: Any, control_plane: Any, who: str, what: str) -> None:
    assert can(control_plane, who, what) == "yes"


@pytest.mark.parametrize(("who", "what"), DENIED)
def test_denied(operator_rbac: Any, control_plane: Any, who: str, what: str) -> None:
    assert can(control_plane, who, what) == "no"


#: The admission webhook: the operator fills in the two configurations the installer created,
#: and can neither create webhook configurations nor touch any other.
WEBHOOK_ALLOWED = [
    (OPERATOR, "get mutatingwebhookconfigurations/offloadpool"),
    (OPERATOR, "patch mutatingwebhookconfigurations/offloadpool"),
    (OPERATOR, "patch validatingwebhookconfigurations/offloadpool"),
]
WEBHOOK_DENIED = [
    (OPERATOR, "create mutatingwebhookconfigurations"),
    (OPERATOR, "create validatingwebhookconfigurations"),
    (OPERATOR, "patch mutatingwebhookconfigurations/other"),
    (OPERATOR, "list validatingwebhookconfigurations"),
    (OPERATOR, "delete mutatingwebhookconfigurations/offloadpool"),
    (AGENT, "get mutatingwebhookconfigurations/offloadpool"),
]


@pytest.mark.parametrize(("who", "what"), WEBHOOK_ALLOWED)
def test_webhook_configurations_allowed(operator_rbac: Any, control_plane: Any, who: str, what: str) -> None:
    assert can(control_plane, who, what) == "yes"


@pytest.mark.parametrize(("who", "what"), WEBHOOK_DENIED)
def test_webhook_configurations_denied(operator_rbac: Any, control_plane: Any, who: str, what: str) -> None:
    assert can(control_plane, who, what) == "no"


def test_the_operators_requests_are_on_the_workload_high_level(
    operator_rbac: Any, control_plane: Any, tmp_path: Path
) -> None:
    """deploy/flowschema-operator.yaml: the API server classifies the operator's requests onto
    workload-high (its answers name the level), the agents' stay on workload-low."""
    admin = control_plane.api_client()
    operator = kube.api_client(str(operator_rbac))
    agent_token = control_plane.token_for(NAMESPACE, "offloadpool-agent")
    agent = kube.api_client(
        str(control_plane.kubeconfig_for_token(agent_token, tmp_path / "agent.kubeconfig"))
    )
    try:
        flow = client.FlowcontrolApiserverV1Api(admin)
        high = flow.read_priority_level_configuration("workload-high").metadata.uid
        low = flow.read_priority_level_configuration("workload-low").metadata.uid

        def level(api: client.ApiClient) -> str:
            _, _, headers = client.CustomObjectsApi(api).list_cluster_custom_object_with_http_info(
                "offloadpool.io", "v1alpha1", "offloadpools", limit=1
            )
            return str(headers.get("X-Kubernetes-Pf-Prioritylevel-Uid"))

        wait_for(
            "the operator's FlowSchema in force", lambda: level(operator) == high, timeout=60, interval=0.5
        )
        assert level(agent) == low
    finally:
        agent.close()
        operator.close()
        admin.close()
