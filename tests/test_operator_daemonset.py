"""The agent DaemonSet: rendered per medium (pure), accepted by the real API server, and its
pods created by the real DaemonSet controller on the selected Nodes only."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kubernetes import client

from fixtures.operator_process import QUICK_PASSES, OperatorProcess
from fixtures.operator_world import MERGE, NAMESPACE, World
from fixtures.wait import wait_for
from offloadpool.agent.config import AgentConfig
from offloadpool.api import agent_env
from offloadpool.api.quantity import parse_quantity
from offloadpool.operator.config import OperatorConfig
from offloadpool.operator.daemonset import HASH_ANNOTATION, render

POOL = {
    "metadata": {"name": "kv", "uid": "0b5e5f8e-0000-4000-8000-000000000001"},
    "spec": {
        "capacity": "4Gi",
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
}
CONFIG = OperatorConfig(
    namespace=NAMESPACE,
    agent_image="example.org/offloadpool:test",
    agent_memory_overhead="256Mi",
    agent_cpu_request="100m",
)


def with_medium(medium: str) -> dict:
    return {**POOL, "spec": {**POOL["spec"], "medium": medium}}


@pytest.mark.parametrize(
    ("medium", "requests", "limits"),
    [
        (
            "HugePages-2Mi",
            {"hugepages-2Mi": "4Gi", "memory": "256Mi", "cpu": "100m"},
            {"hugepages-2Mi": "4Gi", "memory": "256Mi"},
        ),
        (
            "HugePages-1Gi",
            {"hugepages-1Gi": "4Gi", "memory": "256Mi", "cpu": "100m"},
            {"hugepages-1Gi": "4Gi", "memory": "256Mi"},
        ),
        ("Memory", {"memory": "4352Mi", "cpu": "100m"}, {"memory": "4352Mi"}),
        ("MemoryTHP", {"memory": "4352Mi", "cpu": "100m"}, {"memory": "4352Mi"}),
    ],
)
def test_render_per_medium(medium: str, requests: dict, limits: dict) -> None:
    ds = render(with_medium(medium), CONFIG)
    pod = ds["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    assert agent["resources"] == {"requests": requests, "limits": limits}
    assert agent["command"] == ["offloadpool-agent"] and agent["args"] == ["--pool", "kv"]
    env = {e["name"]: e for e in agent["env"]}
    assert env[agent_env.NODE_NAME_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env[agent_env.POD_NAMESPACE_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert (
        env[agent_env.POOL_NAME_ENV]["value"],
        env[agent_env.ROOT_ENV]["value"],
        env[agent_env.HTTP_PORT_ENV]["value"],
        env[agent_env.HEARTBEAT_ENV]["value"],
    ) == ("kv", "/var/lib/offloadpool", "9475", f"{AgentConfig.heartbeat_seconds:g}")
    # what the limits were made for: the agent never applies another capacity under them
    capacity = parse_quantity(POOL["spec"]["capacity"])
    assert env[agent_env.SIZED_FOR_ENV]["value"] == agent_env.sized_for(medium, capacity)
    assert agent["volumeMounts"] == [
        {"name": "host-root", "mountPath": "/var/lib/offloadpool", "mountPropagation": "Bidirectional"}
    ]
    assert pod["volumes"] == [
        {"name": "host-root", "hostPath": {"path": "/var/lib/offloadpool", "type": "DirectoryOrCreate"}}
    ]
    assert agent["securityContext"]["privileged"] is True
    assert pod["hostPID"] is True  # to see the pool's holders in every pod (region.holding.holders)
    assert not any(pod.get(k) for k in ("hostNetwork", "hostIPC"))
    assert agent["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert agent["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert agent["ports"] == [{"name": "http", "containerPort": 9475, "protocol": "TCP"}]
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["tolerations"] == POOL["spec"]["tolerations"]
    assert pod["serviceAccountName"] == "offloadpool-agent"
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
    owner = ds["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "OffloadPool",
        "kv",
        POOL["metadata"]["uid"],
        True,
    )
    assert ds["metadata"]["name"] == "offloadpool-agent-kv" and ds["metadata"]["namespace"] == NAMESPACE


def test_the_agents_heartbeat_is_the_operators_setting_and_the_agent_reads_it() -> None:
    """The operator's --agent-heartbeat reaches the agents through their DaemonSet's environment,
    under the name the agent's configuration reads."""
    from offloadpool.agent.config import load as load_agent_config

    for seconds, text in ((2.5, "2.5"), (30.0, "30"), (12.3456789, "12.3456789")):
        ds = render(with_medium("Memory"), replace(CONFIG, agent_heartbeat_seconds=seconds))
        (agent,) = ds["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in agent["env"]}
        assert env[agent_env.HEARTBEAT_ENV] == text
        loaded = load_agent_config(agent["args"], environ={**env, agent_env.NODE_NAME_ENV: "n1"})
        assert loaded.heartbeat_seconds == seconds


def test_render_hash_follows_content() -> None:
    a, b = render(with_medium("Memory"), CONFIG), render(with_medium("Memory"), CONFIG)
    assert a == b
    c = render({**POOL, "spec": {**POOL["spec"], "medium": "Memory", "capacity": "8Gi"}}, CONFIG)
    assert a["metadata"]["annotations"][HASH_ANNOTATION] != c["metadata"]["annotations"][HASH_ANNOTATION]


@pytest.mark.controlplane
@pytest.mark.parametrize("medium", ["HugePages-2Mi", "HugePages-1Gi", "Memory", "MemoryTHP"])
def test_api_server_accepts_rendered_daemonset(operator_rbac, control_plane, medium: str) -> None:
    """Server-side dry run: privileged + Bidirectional, huge-page requests == limits, probes..."""
    apps = client.AppsV1Api(control_plane.api_client())
    body = render(with_medium(medium), CONFIG)
    created = apps.create_namespaced_daemon_set(NAMESPACE, client.V1DaemonSet.from_dict(body), dry_run="All")
    assert created.spec.template.spec.containers[0].volume_mounts[0].mount_propagation == "Bidirectional"


@pytest.mark.controlplane
@pytest.mark.operator_args(*QUICK_PASSES)
def test_daemonset_controller_runs_agents_on_selected_nodes_only(
    world: World, offloadpool_operator: OperatorProcess
) -> None:
    w = world
    group = w.name("g")
    selected = {w.add_node(f"d{i}", {"offloadpool-test/group": group}) for i in range(2)}
    w.add_node("d9", {"offloadpool-test/group": "other"})
    pool = w.create_pool(
        "ds",
        {
            "capacity": "64Mi",
            "medium": "HugePages-2Mi",
            "nodeSelector": {"offloadpool-test/group": group},
            "tolerations": [{"operator": "Exists"}],
        },
    )

    def pod_nodes() -> set[str]:
        pods = w.core.list_namespaced_pod(NAMESPACE, label_selector=f"offloadpool.io/pool={pool}").items
        found = set()
        for pod in pods:
            required = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
            terms = required.node_selector_terms
            found |= {v for t in terms for f in (t.match_fields or []) for v in f.values}
        return found

    assert wait_for("one agent pod per selected node", lambda: pod_nodes() == selected or None, timeout=90)
    pods = w.core.list_namespaced_pod(NAMESPACE, label_selector=f"offloadpool.io/pool={pool}").items
    for pod in pods:
        (agent,) = pod.spec.containers
        assert agent.resources.requests["hugepages-2Mi"] == "64Mi"
        assert pod.spec.service_account_name == "offloadpool-agent"
        assert pod.metadata.owner_references[0].kind == "DaemonSet"

    # Capacity grows: the agent about to apply it gets a pod with the new limits; the agent of a
    # node where an engine is attached is left alone (OnDelete: never restarted under an engine).
    engaged, free = sorted(selected)
    w.report_ready(pool, engaged, enginesAttached=1)
    before = {
        n: p
        for p in pods
        for n in [
            p.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms[
                0
            ]
            .match_fields[0]
            .values[0]
        ]
    }
    w.custom.patch_cluster_custom_object(
        "offloadpool.io",
        "v1alpha1",
        "offloadpools",
        pool,
        {"spec": {"capacity": "128Mi"}},
        _content_type=MERGE,
    )

    def pod_on(node: str):
        for p in w.core.list_namespaced_pod(NAMESPACE, label_selector=f"offloadpool.io/pool={pool}").items:
            required = p.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
            if (
                required.node_selector_terms[0].match_fields[0].values[0] == node
                and p.metadata.deletion_timestamp is None
            ):
                return p
        return None

    new = wait_for(
        "a new agent pod with the new limits on the free node",
        lambda: (
            lambda p: p if p and p.spec.containers[0].resources.limits["hugepages-2Mi"] == "128Mi" else None
        )(pod_on(free)),
        timeout=90,
    )
    assert new.metadata.uid != before[free].metadata.uid
    # The operator records the event after its delete call returns, and the DaemonSet
    # controller may create the new pod before that: wait for the event, don't race it.
    wait_for("the AgentReplaced event", lambda: "AgentReplaced" in w.event_reasons(pool), timeout=30)
    kept = pod_on(engaged)
    assert kept.metadata.uid == before[engaged].metadata.uid
    assert kept.spec.containers[0].resources.limits["hugepages-2Mi"] == "64Mi"


def test_the_agents_http_address_is_the_operators_setting_and_the_agent_binds_it() -> None:
    """The operator's --agent-http-address reaches the agents through their DaemonSet's
    environment, under the name the agent's configuration reads; its default is the agent's."""
    from offloadpool.agent.config import load as load_agent_config

    for config, address in (
        (CONFIG, AgentConfig.http_address),
        (replace(CONFIG, agent_http_address="::"), "::"),
    ):
        (agent,) = render(with_medium("Memory"), config)["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in agent["env"]}
        assert env[agent_env.HTTP_ADDRESS_ENV] == address
        loaded = load_agent_config(agent["args"], environ={**env, agent_env.NODE_NAME_ENV: "n1"})
        assert loaded.http_address == address
