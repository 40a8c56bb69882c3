"""The guide's recovery path (docs/user-guide.md §10): ``helm uninstall``, then ``kubectl delete
op <pool>`` (it waits: no operator removes the finalizer), then ``helm install`` again — the
deletion finishes on its own.

Real control plane and real helm (the chart's ServiceAccounts, RBAC and agent policy as the
release makes, keeps and adopts them); agents are real processes started by the simulated
kubelet from the pods the real DaemonSet controller made, each with a token of the chart's agent
ServiceAccount bound to its pod (the kubelet's projected token: the same one for every restart
of the container). What is not the chart's own: the operator runs as a process with a token of
the release's operator ServiceAccount, not as the release's Deployment (the test cluster has no
kubelet that runs it), stopped where ``helm uninstall`` deletes it and started where ``helm
install`` makes it again.

The second test is the same path where the agents' ServiceAccount did die (a chart that did not
keep it, or ``kubectl delete sa``) and was made again: the agents, refused with 401, exit to show
it, and the operator replaces their pods, whose tokens can never work again.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from fixtures.cluster import SimCluster, mounts_under
from fixtures.cluster_client import ClusterClient
from fixtures.operator_process import NAMESPACE, OperatorProcess, wait_agent_policy_in_force
from fixtures.wait import wait_for
from offloadpool.api.constants import GROUP, POOL_PLURAL, VERSION

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "offloadpool"
HOST_ROOT = "/var/lib/offloadpool"
AGENT_SA = "offloadpool-agent"
#: agents heartbeat every 2 s, silent after 12 s: the test's waits stay short
QUICK = ("--agent-heartbeat", "2", "--heartbeat-timeout", "12", "--resync", "5", "--deletion-retry", "1")
#: what each kept object of the release is, by kind: (kubectl resource, namespaced)
KEPT = {
    "ServiceAccount": ("serviceaccount", True),
    "Role": ("role.rbac.authorization.k8s.io", True),
    "RoleBinding": ("rolebinding.rbac.authorization.k8s.io", True),
    "ClusterRole": ("clusterrole.rbac.authorization.k8s.io", False),
    "ClusterRoleBinding": ("clusterrolebinding.rbac.authorization.k8s.io", False),
    "ValidatingAdmissionPolicy": ("validatingadmissionpolicy.admissionregistration.k8s.io", False),
    "ValidatingAdmissionPolicyBinding": (
        "validatingadmissionpolicybinding.admissionregistration.k8s.io",
        False,
    ),
}


class Release:
    """One helm release of the chart (CRDs left to the session: crds.install=false) and the
    operator process that stands for its Deployment."""

    def __init__(self, cp: Any, tmp: Path) -> None:
        self.cp = cp
        self.name = f"op{secrets.token_hex(3)}"
        self.ns = f"offloadpool-{self.name}"
        self.tmp = tmp
        self.operator: OperatorProcess | None = None

    def install(self) -> str:
        return self.cp.helm(
            "install",
            self.name,
            str(CHART),
            "--namespace",
            self.ns,
            "--create-namespace",
            "--set",
            "crds.install=false",
            "--set",
            "webhook.enabled=false",
            timeout=180,
        ).stdout

    def uninstall(self) -> str:
        return self.cp.helm("uninstall", self.name, "--namespace", self.ns, timeout=120).stdout

    def start_operator(self) -> OperatorProcess:
        """The release's operator: a process with a fresh token of the release's operator
        ServiceAccount, in the release's namespace, its agents run as the release's."""
        token = self.cp.token_for(self.ns, f"{self.name}-operator", expiration_seconds=3600)
        kubeconfig = self.cp.kubeconfig_for_token(token, self.tmp / f"operator.{secrets.token_hex(2)}.kc")
        workdir = self.tmp / "operator"
        workdir.mkdir(exist_ok=True)
        self.operator = OperatorProcess(
            self.cp,
            kubeconfig,
            workdir,
            namespace=self.ns,
            extra_args=("--agent-service-account", AGENT_SA, *QUICK),
        ).start()
        return self.operator

    def stop_operator(self) -> None:
        if self.operator is not None:
            self.operator.stop()

    def kept(self) -> dict[str, str]:
        """kind/name -> uid of every object of the release's agent that exists now."""
        found = {}
        selector = f"app.kubernetes.io/name=offloadpool-agent,app.kubernetes.io/instance={self.name}"
        for kind, (resource, namespaced) in KEPT.items():
            args = ["get", resource, "-l", selector, "-o", "json"] + (["-n", self.ns] if namespaced else [])
            for item in json.loads(self.cp.kubectl(*args).stdout)["items"]:
                found[f"{kind}/{item['metadata']['name']}"] = item["metadata"]["uid"]
        return found

    def remove(self) -> None:
        """What the guide says to do once no pool is left: the release, then what it kept."""
        self.stop_operator()
        self.cp.helm("uninstall", self.name, "--namespace", self.ns, check=False, timeout=120)
        selector = f"app.kubernetes.io/name=offloadpool-agent,app.kubernetes.io/instance={self.name}"
        cluster_wide = ",".join(r for r, namespaced in KEPT.values() if not namespaced)
        self.cp.kubectl("delete", cluster_wide, "-l", selector, "--ignore-not-found", check=False)
        self.cp.kubectl("delete", "namespace", self.ns, "--wait=false", check=False)


@pytest.fixture
def release(crds_installed: Any, tmp_path: Path) -> Iterator[Release]:
    r = Release(crds_installed, tmp_path)
    try:
        yield r
    finally:
        if r.operator is not None:
            print(r.operator.log(6000))
        r.remove()


def _agent_dump(cluster: SimCluster) -> str:
    return "\n".join(
        f"--- agent {a.pod} on {a.node.name} (alive {a.alive()}, restarts {a.restarts}):\n{a.log(2500)}"
        for a in list(cluster.agents.values())
    )


def test_uninstall_delete_reinstall_finishes_the_deletion(release: Release, sim_cluster: SimCluster) -> None:
    cp = release.cp
    release.install()
    wait_agent_policy_in_force(cp, release.ns, AGENT_SA)
    kept_before = release.kept()
    assert f"ServiceAccount/{AGENT_SA}" in kept_before and len(kept_before) == len(KEPT), kept_before
    release.start_operator()
    clients = ClusterClient(cp.api_client(), release.name)
    tag = clients.suffix
    node = sim_cluster.add_node(f"n0-{tag}", {"e2e.offloadpool.io/run": tag})
    selector = {"e2e.offloadpool.io/run": tag}
    pool = clients.create_pool("kept", {"capacity": "64Mi", "medium": "Memory", "nodeSelector": selector})
    try:
        wait_for(
            "pool Ready",
            lambda: clients.pool_status(pool).get("phase") == "Ready",
            timeout=120,
        )
        agent = sim_cluster.agent(node.name, pool)
        pool_dir = node.host_path(HOST_ROOT) / pool
        assert pool_dir.is_dir()

        # helm uninstall: the operator goes; the agents' ServiceAccount, RBAC and policy stay
        out = release.uninstall()
        release.stop_operator()
        print(out)
        assert "These resources were kept due to the resource policy" in out, out
        for kind_name in kept_before:
            kind, name = kind_name.split("/")
            assert f"[{kind}] {name}" in out, out
        assert release.kept() == kept_before, "helm uninstall removed (or replaced) the agents' objects"

        # kubectl delete op: it waits (no operator to remove the finalizer)...
        cp.kubectl("delete", "op", pool, "--wait=false")
        table = cp.kubectl("get", "op", pool).stdout
        assert "DELETING" in table.splitlines()[0], table
        # ...while the agent, its token still good, releases the memory
        wait_for("the agent released the memory", lambda: not pool_dir.exists(), timeout=60)
        assert clients.node_status(pool, node.name).get("phase") == "Released"
        assert clients.pool(pool) is not None, "the pool went away without an operator"

        # helm install again: the release adopts what it kept, and the deletion finishes
        release.install()
        assert release.kept() == kept_before, "the reinstall did not adopt the kept objects"
        release.start_operator()
        wait_for("the deletion finished", lambda: clients.pool(pool) is None, timeout=60)
        assert agent.restarts == 0 and "401" not in agent.log(20000), _agent_dump(sim_cluster)
        assert not mounts_under(node.root)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_agent_dump(sim_cluster)}") from None
    finally:
        clients.delete_pools()


@pytest.mark.operator_args(*QUICK)
def test_agents_whose_service_account_was_made_again_are_replaced(
    sim_cluster: SimCluster, offloadpool_operator: OperatorProcess
) -> None:
    """deploy/'s agent ServiceAccount deleted and made again (what uninstalling a chart that
    did not keep it and installing again did): the agent, refused with 401, says so and exits
    after a few heartbeats (restarted in the same pod it gets the same token), and the
    operator replaces its pod, made before the ServiceAccount: the pool's deletion, waiting
    since, finishes."""
    cp = sim_cluster.cp
    clients = ClusterClient(cp.api_client())
    tag = clients.suffix
    node = sim_cluster.add_node(f"n0-{tag}", {"e2e.offloadpool.io/run": tag})
    pool = clients.create_pool(
        "made-again",
        {"capacity": "64Mi", "medium": "Memory", "nodeSelector": {"e2e.offloadpool.io/run": tag}},
    )
    core = client.CoreV1Api(cp.api_client())
    account = core.read_namespaced_service_account(AGENT_SA, NAMESPACE)
    body = {"metadata": {"name": AGENT_SA, "namespace": NAMESPACE, "labels": account.metadata.labels}}
    try:
        wait_for("pool Ready", lambda: clients.pool_status(pool).get("phase") == "Ready", timeout=120)
        agent = sim_cluster.agent(node.name, pool)
        pod_uid, pool_dir = agent.uid, node.host_path(HOST_ROOT) / pool

        offloadpool_operator.stop()
        core.delete_namespaced_service_account(AGENT_SA, NAMESPACE)
        wait_for(
            "the agent says its token is refused and exits",
            lambda: agent.restarts >= 1 and "401 Unauthorized) for" in agent.log(20000),
            timeout=60,
        )
        assert "exiting" in agent.log(20000), agent.log()
        assert agent.uid == pod_uid and pool_dir.is_dir(), "the exit touched the memory or the pod"

        clients.custom.delete_cluster_custom_object(GROUP, VERSION, POOL_PLURAL, pool)
        core.create_namespaced_service_account(NAMESPACE, body)
        offloadpool_operator.start()
        wait_for("the deletion finished", lambda: clients.pool(pool) is None, timeout=90)
        assert not pool_dir.exists() and not mounts_under(node.root)
        assert "replaced agent pod" in offloadpool_operator.log(20000), offloadpool_operator.log()
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_agent_dump(sim_cluster)}\n{offloadpool_operator.log()}") from None
    finally:
        try:
            core.read_namespaced_service_account(AGENT_SA, NAMESPACE)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            core.create_namespaced_service_account(NAMESPACE, body)
        clients.delete_pools()
