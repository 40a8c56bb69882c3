"""A write the API server refuses with 429 is sent again after its Retry-After.

Real API server, real API priority and fairness: a FlowSchema puts one ServiceAccount's
requests on a priority level of a few seats that rejects what does not fit (``limitResponse:
Reject``), and a few dozen agents' clients, acting as that ServiceAccount, create their heartbeat
Leases at the same moment — what a new pool's agents do at once on a large cluster. With the
agent's client configuration (``kube.configuration``) every Lease is made although the server
rejected some of the requests; with the kubernetes client's default retries the same storm
leaves agents with a 429 in hand.
"""

from __future__ import annotations

import re
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from offloadpool.agent import kube

pytestmark = pytest.mark.controlplane

NAMESPACE = "default"
AGENTS = 40
ROUNDS = 10  # storms until the server has rejected something (it nearly always does at once)


def rejected(cp: Any, level: str) -> int:
    """Requests the API server rejected on priority level ``level`` so far (its /metrics)."""
    text = cp.kubectl("get", "--raw", "/metrics").stdout
    pattern = re.compile(
        r'^apiserver_flowcontrol_rejected_requests_total\{[^}]*priority_level="'
        + re.escape(level)
        + r'"[^}]*\} (\S+)$',
        re.M,
    )
    return sum(int(float(v)) for v in pattern.findall(text))


@pytest.fixture
def throttled(control_plane: Any, tmp_path: Path) -> Any:
    """A ServiceAccount that may write Leases, whose requests get three seats and no queue."""
    cp = control_plane
    tag = uuid.uuid4().hex[:6]
    name = f"throttled-{tag}"
    admin = cp.api_client()
    core, rbac = client.CoreV1Api(admin), client.RbacAuthorizationV1Api(admin)
    flow = client.FlowcontrolApiserverV1Api(admin)
    core.create_namespaced_service_account(NAMESPACE, {"metadata": {"name": name}})
    rbac.create_namespaced_role(
        NAMESPACE,
        {
            "metadata": {"name": name},
            "rules": [
                {
                    "apiGroups": ["coordination.k8s.io"],
                    "resources": ["leases"],
                    "verbs": ["get", "list", "create", "patch"],
                }
            ],
        },
    )
    rbac.create_namespaced_role_binding(
        NAMESPACE,
        {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}],
        },
    )
    flow.create_priority_level_configuration(
        {
            "metadata": {"name": name},
            "spec": {
                "type": "Limited",
                "limited": {
                    "nominalConcurrencyShares": 1,
                    "lendablePercent": 0,
                    "borrowingLimitPercent": 0,
                    "limitResponse": {"type": "Reject"},
                },
            },
        }
    )
    schema = flow.create_flow_schema(
        {
            "metadata": {"name": name},
            "spec": {
                "priorityLevelConfiguration": {"name": name},
                "matchingPrecedence": 100,
                "distinguisherMethod": {"type": "ByUser"},
                "rules": [
                    {
                        "subjects": [
                            {
                                "kind": "ServiceAccount",
                                "serviceAccount": {"name": name, "namespace": NAMESPACE},
                            }
                        ],
                        "resourceRules": [
                            {
                                "verbs": ["*"],
                                "apiGroups": ["*"],
                                "resources": ["*"],
                                "namespaces": ["*"],
                                "clusterScope": True,
                            }
                        ],
                    }
                ],
            },
        }
    )
    token = cp.token_for(NAMESPACE, name)
    kubeconfig = cp.kubeconfig_for_token(token, tmp_path / "throttled.kubeconfig")
    try:
        yield {"name": name, "kubeconfig": str(kubeconfig), "schema_uid": schema.metadata.uid}
    finally:
        flow.delete_flow_schema(name)
        flow.delete_priority_level_configuration(name)
        rbac.delete_namespaced_role_binding(name, NAMESPACE)
        rbac.delete_namespaced_role(name, NAMESPACE)
        core.delete_namespaced_service_account(name, NAMESPACE)
        admin.close()


def storm(kubeconfig: str, names: list[str], *, agent_retries: bool) -> list[BaseException | None]:
    """Each name's agent creates its Lease at the same moment (connections made beforehand)."""
    cfg = kube.configuration(kubeconfig)
    if not agent_retries:
        cfg.retries = None  # the kubernetes client's own default
    apis = [client.ApiClient(cfg) for _ in names]
    barrier = threading.Barrier(len(names))
    outcome: list[BaseException | None] = [None] * len(names)

    def agent(i: int) -> None:
        access = kube.KubeAccess(apis[i], "throttled", names[i], NAMESPACE)
        try:
            try:  # connect first, so the creates below reach the server together
                access.coordination.list_namespaced_lease(NAMESPACE, limit=1)
            finally:
                barrier.wait()
            access.renew_heartbeat(40, {"metadata": {"name": "throttled"}})
        except BaseException as exc:  # reported by the caller
            outcome[i] = exc

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(names))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for api in apis:
        api.close()
    return outcome


def wait_for_schema(kubeconfig: str, schema_uid: str) -> None:
    """Until the API server classifies the ServiceAccount's requests by the new FlowSchema."""
    from fixtures.wait import wait_for

    api = kube.api_client(kubeconfig)
    leases = client.CoordinationV1Api(api)

    def classified() -> bool:
        _, _, headers = leases.list_namespaced_lease_with_http_info(NAMESPACE, limit=1)
        return headers.get("X-Kubernetes-Pf-Flowschema-Uid") == schema_uid

    try:
        wait_for("the FlowSchema in force", classified, timeout=60, interval=0.5)
    finally:
        api.close()


def test_leases_made_by_a_throttled_crowd_of_agents(control_plane: Any, throttled: Any) -> None:
    cp, level = control_plane, throttled["name"]
    wait_for_schema(throttled["kubeconfig"], throttled["schema_uid"])
    leases = client.CoordinationV1Api(cp.api_client())
    made: list[str] = []
    try:
        before, rounds = rejected(cp, level), 0
        while rejected(cp, level) == before and rounds < ROUNDS:
            names = [f"{level}.r{rounds}-n{i:02d}" for i in range(AGENTS)]
            outcome = storm(throttled["kubeconfig"], names, agent_retries=True)
            made += names
            failed = [
                f"{n}: {getattr(e, 'status', e)}"
                for n, e in zip(names, outcome, strict=True)
                if e is not None
            ]
            assert not failed, f"throttled agents failed to make their Lease: {failed[:3]}"
            for n in names:
                assert leases.read_namespaced_lease(n, NAMESPACE).spec.holder_identity == n
            rounds += 1
        assert rejected(cp, level) > before, f"the server rejected nothing in {rounds} storms"

        # the same storm with the client's default retries: a refusal reaches the agent
        before, refused, rounds = rejected(cp, level), [], 0
        while not refused and rounds < ROUNDS:
            names = [f"{level}.d{rounds}-n{i:02d}" for i in range(AGENTS)]
            outcome = storm(throttled["kubeconfig"], names, agent_retries=False)
            made += names
            refused = [e for e in outcome if isinstance(e, ApiException) and e.status == 429]
            rounds += 1
        assert refused, f"no 429 reached an agent without the retries in {rounds} storms"
    finally:
        for n in made:
            try:
                leases.delete_namespaced_lease(n, NAMESPACE)
            except ApiException:
                pass
        leases.api_client.close()
