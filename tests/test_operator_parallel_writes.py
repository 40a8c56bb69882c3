"""A pass's writes of one step — Node marks, OffloadPoolNodes it makes, rollout advances — go
out several at once (``--write-concurrency``), every answer reaches the index, and a failed
write neither stops the others nor is forgotten.

The reconciler runs in this process against the real API server, with the operator's own
watched indexes. What is added to its API access: a count of the writes in flight (the real
calls still go out), a rendezvous that holds the first write until a second one is in flight
(only writes sent at once can meet there; one after another, the first gives up after a
timeout and fails), and, in one test, one write refused before it is sent.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fixtures.reconciler_world import create_pool_over, remove_pool_over, report_ready, start_indexes
from fixtures.wait import wait_for
from offloadpool.api.constants import (
    GROUP,
    NODE_PLURAL,
    POOL_PLURAL,
    VERSION,
    pool_label_key,
)
from offloadpool.api.node import new_object
from offloadpool.operator.config import OperatorConfig
from offloadpool.operator.kube import MERGE, Kube
from offloadpool.operator.pool_node_report import PoolNodeReport
from offloadpool.operator.reconcile import Reconciler
from offloadpool.operator.watched import WatchedKind

pytestmark = pytest.mark.controlplane

NODES = 12
#: how long the first write waits for a second one to be sent
RENDEZVOUS_SECONDS = 10.0


class ObservedKube(Kube):
    """The operator's API access, counting the Node marks and OffloadPoolNode creates in flight."""

    def __init__(self, api: client.ApiClient, *, rendezvous: bool = False, refuse: str | None = None):
        super().__init__(api)
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most_in_flight = 0
        self.entered = 0
        self.second = threading.Event() if rendezvous else None
        self.refuse = refuse  # a node whose mark is refused once, before it is sent

    def _observed(self, call: Any, *args: Any) -> Any:
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.entered += 1
            first = self.entered == 1
        try:
            if self.second is not None and first:
                if not self.second.wait(RENDEZVOUS_SECONDS):
                    raise RuntimeError("no second write was sent while the first was in flight")
            elif self.second is not None:
                self.second.set()
            return call(*args)
        finally:
            with self.lock:
                self.in_flight -= 1

    def patch_node_status(self, name: str, patch: Any) -> Any:
        if name == self.refuse:
            self.refuse = None
            raise ApiException(status=500, reason="refused by the test")
        return self._observed(super().patch_node_status, name, patch)

    def create_node_object(self, body: Any) -> Any:
        return self._observed(super().create_node_object, body)

    def patch_node_object(self, name: str, patch: Any) -> Any:
        return self._observed(super().patch_node_object, name, patch)


@dataclass
class Pool:
    """A pool over this test's Nodes, and the operator's indexes of them."""

    name: str
    body: dict[str, Any]
    nodes: list[str]
    admin: client.ApiClient
    node_index: WatchedKind[Any]
    objects: WatchedKind[PoolNodeReport]

    def reconciler(self, kube: Kube, config: OperatorConfig) -> Reconciler:
        return Reconciler(kube, config, lambda _pool, _event: None, self.node_index, self.objects)

    def make_ready(self) -> None:
        """Each node's OffloadPoolNode, Ready, as its agent would have made and reported it."""
        report_ready(client.CustomObjectsApi(self.admin), self.body, self.nodes)
        wait_for(
            "the OffloadPoolNodes indexed Ready",
            lambda: sum(v.phase == "Ready" for v in self.objects.group(self.name).values()) == NODES,
        )

    def marked(self) -> list[str]:
        """This test's Nodes that carry the pool's Ready label, as the API server has them."""
        core = client.CoreV1Api(self.admin)
        return [
            n for n in self.nodes if (core.read_node(n).metadata.labels or {}).get(pool_label_key(self.name))
        ]


@pytest.fixture
def pool(crds_installed: Any) -> Iterator[Pool]:
    admin = crds_installed.api_client()
    kube = Kube(admin)
    tag = uuid.uuid4().hex[:6]
    names = [f"parallel-{tag}-{i:02d}" for i in range(NODES)]
    name = f"parallel-{tag}"
    node_index, objects = start_indexes(kube)
    try:
        body = create_pool_over(kube, name, names, "parallel", tag)
        wait_for("the Nodes indexed", lambda: sum(v.name in names for v in node_index.values()) == NODES)
        yield Pool(name, body, names, admin, node_index, objects)
    finally:
        node_index.stop()
        objects.stop()
        remove_pool_over(kube, name, names)
        admin.close()


def config(write_concurrency: int, **kwargs: Any) -> OperatorConfig:
    return OperatorConfig(
        namespace="default", heartbeat_timeout_seconds=0, write_concurrency=write_concurrency, **kwargs
    )


@pytest.mark.parametrize("concurrency", [4, 1])
def test_a_pass_marks_the_nodes_it_finds_ready_several_at_once(pool: Pool, concurrency: int) -> None:
    pool.make_ready()
    kube = ObservedKube(pool.admin, rendezvous=concurrency > 1)
    reconciler = pool.reconciler(kube, config(concurrency))
    result = reconciler.run(pool.name)
    assert result is not None
    marks = [w for w in result.writes if w.startswith("marked node")]
    assert len(marks) == NODES and result.status["readyNodes"] == NODES, result.writes
    assert sorted(pool.marked()) == pool.nodes
    # at most the setting, and more than one at a time when the setting allows it (one after
    # another, the first write would have failed at the rendezvous)
    if concurrency == 1:
        assert kube.most_in_flight == 1
    else:
        assert 2 <= kube.most_in_flight <= concurrency
    # every answer reached the index: the next pass has nothing to write
    again = reconciler.run(pool.name)
    assert again is not None and again.writes == []


def test_a_refused_mark_stops_no_other_and_the_next_pass_makes_it(pool: Pool) -> None:
    pool.make_ready()
    refused = pool.nodes[5]
    kube = ObservedKube(pool.admin, refuse=refused)
    reconciler = pool.reconciler(kube, config(4))
    with pytest.raises(ApiException) as failed:
        reconciler.run(pool.name)  # the daemon retries a pass that raised
    assert failed.value.status == 500
    assert sorted(pool.marked()) == sorted(set(pool.nodes) - {refused}), "the other marks were not all made"
    result = reconciler.run(pool.name)
    assert result is not None
    assert [w for w in result.writes if "node" in w] == [f"marked node {refused}"], result.writes
    assert "patched pool status" in result.writes and result.status["readyNodes"] == NODES
    assert sorted(pool.marked()) == pool.nodes


def test_a_pass_makes_the_missing_offloadpoolnodes_several_at_once(pool: Pool) -> None:
    kube = ObservedKube(pool.admin, rendezvous=True)
    reconciler = pool.reconciler(kube, config(4, node_object_grace_seconds=0))
    result = reconciler.run(pool.name)
    assert result is not None
    made = [w for w in result.writes if w.startswith("created OffloadPoolNode")]
    assert len(made) == NODES, result.writes
    assert 2 <= kube.most_in_flight <= 4
    listed = client.CustomObjectsApi(pool.admin).list_cluster_custom_object(GROUP, VERSION, NODE_PLURAL)
    assert sorted(o["metadata"]["name"] for o in listed["items"] if o["spec"]["pool"] == pool.name) == [
        f"{pool.name}.{n}" for n in pool.nodes
    ]
    again = reconciler.run(pool.name)
    assert again is not None and not [w for w in again.writes if w.startswith("created")], again.writes


def test_a_pass_advances_the_nodes_not_ready_to_a_new_generation_several_at_once(pool: Pool) -> None:
    custom = client.CustomObjectsApi(pool.admin)
    for node in pool.nodes:  # made at generation 1; no agent has reported (not Ready)
        custom.create_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, new_object(pool.body, node, 1))
    changed = custom.patch_cluster_custom_object(
        GROUP, VERSION, POOL_PLURAL, pool.name, {"spec": {"capacity": "8Mi"}}, _content_type=MERGE
    )
    assert changed["metadata"]["generation"] == 2
    wait_for("the OffloadPoolNodes indexed", lambda: len(pool.objects.group(pool.name)) == NODES)
    kube = ObservedKube(pool.admin, rendezvous=True)
    reconciler = pool.reconciler(kube, config(4))
    result = reconciler.run(pool.name)
    assert result is not None
    advanced = [w for w in result.writes if w.startswith("advanced")]
    assert sorted(advanced) == [f"advanced {n} to generation 2" for n in pool.nodes], result.writes
    assert 2 <= kube.most_in_flight <= 4
    listed = custom.list_cluster_custom_object(GROUP, VERSION, NODE_PLURAL)
    targets = {o["spec"]["nodeName"]: o["spec"].get("targetGeneration") for o in listed["items"]}
    assert [targets.get(n) for n in pool.nodes] == [2] * NODES
    again = reconciler.run(pool.name)
    assert again is not None and not [w for w in again.writes if w.startswith("advanced")], again.writes
