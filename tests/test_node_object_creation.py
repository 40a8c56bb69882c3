"""Who creates a node's OffloadPoolNode: its agent when it starts, the operator for the rest.

As node-feature-discovery's workers create their NodeFeature objects, an agent creates its
own node's object (with the agent's own code and ServiceAccount token here); the operator
creates the object of a selected node only when no agent has within ``--node-object-grace``,
so a node whose agent never starts still shows. Both make the same body, and each takes the
other's 409 for "there already". Against the real API server and the operator as a process.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from fixtures.operator_process import OperatorProcess
from fixtures.operator_world import NAMESPACE, World, dump
from fixtures.wait import wait_for
from offloadpool.agent.kube import KubeAccess
from offloadpool.api.base import parse_time
from offloadpool.api.constants import API_VERSION, POOL_NAME_LABEL

GRACE = 4.0

pytestmark = [
    pytest.mark.controlplane,
    pytest.mark.operator_args(
        "--heartbeat-timeout", "900", "--resync", "1", "--deletion-retry", "1", "--node-object-grace", GRACE
    ),
]


def created_at(obj: dict[str, Any]) -> float:
    stamp = parse_time(obj["metadata"]["creationTimestamp"])
    assert stamp is not None
    return stamp.timestamp()


def test_agent_creates_its_own_the_operator_the_one_left_after_the_grace(
    world: World, offloadpool_operator: OperatorProcess
) -> None:
    w = world
    group = w.name("g")
    with_agent, without = (w.add_node(f"n{i}", {"offloadpool-test/group": group}) for i in range(2))
    pool = w.create_pool(
        "claim", {"capacity": "64Mi", "medium": "Memory", "nodeSelector": {"offloadpool-test/group": group}}
    )
    pool_obj = w.pool(pool)
    assert pool_obj is not None

    # n0's agent starts and creates its object, with the agent's code and credentials
    access = KubeAccess(w.agent(with_agent).api_client, pool, f"{pool}.{with_agent}", NAMESPACE)
    made = access.create_pool_node(pool_obj)
    assert made is not None
    assert made["metadata"]["labels"] == {POOL_NAME_LABEL: pool}
    assert made["metadata"]["ownerReferences"] == [
        {
            "apiVersion": API_VERSION,
            "kind": "OffloadPool",
            "name": pool,
            "uid": pool_obj["metadata"]["uid"],
            "controller": True,
        }
    ], dump(made)
    assert made["spec"] == {"pool": pool, "nodeName": with_agent, "targetGeneration": 1}
    again = access.create_pool_node(pool_obj)  # a restarted agent: 409, then the object read
    assert again is not None and again["metadata"]["uid"] == made["metadata"]["uid"]

    # the operator makes n1's only after the grace, counted from its first pass
    objs = wait_for(
        "the operator's OffloadPoolNode for the node without an agent",
        lambda: (lambda o: o if len(o) == 2 else None)(w.pool_nodes(pool)),
        timeout=GRACE + 30,
    )
    late = objs[without]
    waited = created_at(late) - created_at(pool_obj)
    assert waited >= GRACE - 1, f"created {waited:.0f} s after the pool: the grace was not kept"
    assert objs[with_agent]["metadata"]["uid"] == made["metadata"]["uid"], "the agent's object was replaced"
    assert late["spec"] == {"pool": pool, "nodeName": without, "targetGeneration": 1}
    assert late["metadata"]["ownerReferences"] == made["metadata"]["ownerReferences"], dump(late)

    selected = wait_for(
        "NodeSelected event",
        lambda: [e.message for e in w.events(pool) if e.reason == "NodeSelected"] or None,
    )
    assert len(selected) == 1 and without in selected[0] and with_agent not in selected[0], selected

    # both count: Ready 2/2 and both Nodes marked once both report
    for node in (with_agent, without):
        w.report_ready(pool, node)
    wait_for("pool Ready 2/2", lambda: ((w.pool(pool) or {}).get("status") or {}).get("readyNodes") == 2)
    for node in (with_agent, without):
        wait_for(f"{node} marked", lambda node=node: w.marked(pool, node) == (True, True))


def test_an_agent_without_create_permission_is_refused_once_and_waits(
    world: World, offloadpool_operator: OperatorProcess
) -> None:
    """An agent of a newer release under an older release's RBAC: no create, the operator's."""
    from prometheus_client import CollectorRegistry

    from offloadpool.agent.loop import Agent
    from offloadpool.agent.metrics import AgentMetrics

    w = world
    node = w.add_node("n", {"offloadpool-test/group": w.name("g")})
    pool = w.create_pool("refused", {"capacity": "64Mi", "medium": "Memory", "nodeSelector": {"none": "x"}})
    pool_obj = w.pool(pool)
    assert pool_obj is not None
    token = w.cp.token_for("default", "default")  # bound to no role at all
    nobody = config.new_client_from_config(config_file=str(w.cp.kubeconfig_for_token(token, w.tmp / "nb")))
    registry = CollectorRegistry()
    agent = Agent(
        KubeAccess(nobody, pool, f"{pool}.{node}", NAMESPACE),
        w.tmp,
        metrics=AgentMetrics(pool, node, registry),
        watches=False,
    )
    assert agent.creation.create(pool_obj) is None
    assert (
        registry.get_sample_value(
            "offloadpool_agent_errors_total", {"pool": pool, "node": node, "reason": "CreatePoolNode"}
        )
        == 1.0
    )
    assert agent.creation.create(pool_obj) is None
    assert (
        registry.get_sample_value(
            "offloadpool_agent_errors_total", {"pool": pool, "node": node, "reason": "CreatePoolNode"}
        )
        == 1.0
    ), "a refused create was tried again"
    with pytest.raises(ApiException) as refused:
        client.CustomObjectsApi(nobody).get_cluster_custom_object(
            "offloadpool.io", "v1alpha1", "offloadpoolnodes", f"{pool}.{node}"
        )
    assert refused.value.status == 403
    assert w.pool_nodes(pool) == {}, "nothing was created"


def test_a_create_refused_for_another_reason_is_tried_again_soon_and_spread(world: World) -> None:
    """A new pool's agents all start at once, and a busy API server refuses many creates (429
    from priority and fairness): the agent comes back after 1 s, doubling, with up to half
    again at random, not a whole retry period later. Here the refusal is the API server's
    own 422 (a node name no object may carry): the same path as a 429 without a Retry-After."""
    from prometheus_client import CollectorRegistry

    from offloadpool.agent.loop import Agent
    from offloadpool.agent.metrics import AgentMetrics

    w = world
    pool = w.create_pool("retry", {"capacity": "64Mi", "medium": "Memory", "nodeSelector": {"none": "x"}})
    node = "Not_A_Node"
    registry = CollectorRegistry()
    agent = Agent(
        KubeAccess(w.cp.api_client(), pool, f"{pool}.{node}", NAMESPACE),
        w.tmp,
        metrics=AgentMetrics(pool, node, registry),
        retry_seconds=30,
        watches=False,
    )
    delays = [agent.step() for _ in range(3)]
    assert 1.0 <= delays[0] <= 1.5 and 2.0 <= delays[1] <= 3.0 and 4.0 <= delays[2] <= 6.0, delays
    assert (
        registry.get_sample_value(
            "offloadpool_agent_errors_total", {"pool": pool, "node": node, "reason": "CreatePoolNode"}
        )
        == 3.0
    )
    assert not agent.creation.refused, "a refusal other than RBAC's stopped the agent trying"
