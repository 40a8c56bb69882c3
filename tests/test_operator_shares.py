"""A pool of several shares on the real API server: the Node advertises the pool's extended
resource as ``spec.partitions`` (each pod requests one), changed in place when the count
changes; the API server refuses a count that does not split the capacity."""

from __future__ import annotations

import pytest
from kubernetes.client.rest import ApiException

from fixtures.operator_process import OperatorProcess
from fixtures.operator_world import MERGE, World
from fixtures.wait import wait_for
from offloadpool.api.constants import GROUP, POOL_PLURAL, VERSION, extended_resource_name
from offloadpool.api.pods import ENV_CAPACITY_BYTES, ENV_POD_UID, POD_POOL_LABEL
from offloadpool.operator import admission
from offloadpool.operator.admission import InjectionSettings


def advertised(w: World, pool: str, node: str) -> tuple[str | None, str | None]:
    n = w.node(node)
    status = n.status
    name = extended_resource_name(pool)
    return (status.capacity or {}).get(name), (status.allocatable or {}).get(name)


def test_the_node_advertises_one_resource_per_share(
    world: World, offloadpool_operator: OperatorProcess
) -> None:
    w = world
    group = w.name("g")
    node = w.add_node("s0", {"offloadpool-test/group": group})
    spec = {
        "capacity": "64Mi",
        "medium": "Memory",
        "partitions": 4,
        "nodeSelector": {"offloadpool-test/group": group},
    }
    pool = w.create_pool("shares", spec)
    wait_for("the pool's OffloadPoolNode", lambda: w.pool_nodes(pool) or None)
    w.report_ready(pool, node)
    wait_for("4 shares advertised", lambda: advertised(w, pool, node) == ("4", "4") or None)

    # the count follows the spec, in place
    w.custom.patch_cluster_custom_object(
        GROUP, VERSION, POOL_PLURAL, pool, {"spec": {"partitions": 2}}, _content_type=MERGE
    )
    w.report_ready(pool, node, generation=2)
    wait_for("2 shares advertised", lambda: advertised(w, pool, node) == ("2", "2") or None)


def test_a_count_that_does_not_split_the_capacity_is_refused(world: World) -> None:
    w = world
    for partitions, says in ((3, "spec.partitions equal shares"), (0, "partitions"), (65, "partitions")):
        with pytest.raises(ApiException) as refused:
            w.create_pool("bad", {"capacity": "64Mi", "medium": "Memory", "partitions": partitions})
        assert refused.value.status == 422 and says in str(refused.value.body)
    with pytest.raises(ApiException) as refused:
        w.create_pool(
            "bad",
            {"capacity": "64Mi", "medium": "Memory", "partitions": 2, "compat": {"vllm": {"engineId": "e"}}},
        )
    assert "cannot be combined with spec.compat.vllm" in str(refused.value.body)


def test_the_pods_of_a_shared_pool_are_told_their_uid_and_a_shares_capacity() -> None:
    """Every worker of a pod names the same engine (the pod's uid, by the downward API), so they
    claim one share; the capacity a container is told is one share's."""
    body = {"metadata": {"name": "kv"}, "spec": {"capacity": "64Mi", "medium": "Memory", "partitions": 4}}
    pod = {
        "metadata": {"name": "e", "namespace": "inference", "labels": {POD_POOL_LABEL: "kv"}},
        "spec": {"containers": [{"name": "c", "image": "vllm"}]},
    }
    new = admission.mutate(pod, body, InjectionSettings())
    env = {e["name"]: e for e in new["spec"]["containers"][0]["env"]}
    # apiVersion as the API server stores it (tests/test_webhook.py: the stored pod is admitted)
    field_ref = {"apiVersion": "v1", "fieldPath": "metadata.uid"}
    assert env[ENV_POD_UID] == {"name": ENV_POD_UID, "valueFrom": {"fieldRef": field_ref}}
    assert env[ENV_CAPACITY_BYTES]["value"] == str(16 << 20)
    one = {"metadata": {"name": "kv"}, "spec": {"capacity": "64Mi", "medium": "Memory"}}
    env = {
        e["name"]: e for e in admission.mutate(pod, one, InjectionSettings())["spec"]["containers"][0]["env"]
    }
    assert ENV_POD_UID not in env and env[ENV_CAPACITY_BYTES]["value"] == str(64 << 20)
