"""A DRA pool (``spec.consumers.delivery: DRA``) and the operator, against the real API server:
its Ready nodes get the pool's label and never its extended resource (the scheduler would count
node capacity instead of DRA devices: ``filterExtendedResources`` hands a resource to DRA only
where the node's allocatable lacks it), a pool turned DRA loses the resource it advertised,
and the operator's write policy (deploy/policy-operator.yaml) lets it write exactly the
DeviceClass it renders for the pool, nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from fixtures.operator_process import QUICK_PASSES, OperatorProcess
from fixtures.operator_world import World
from fixtures.wait import wait_for
from offloadpool.api import dra
from offloadpool.api.constants import GROUP, POOL_PLURAL, VERSION
from offloadpool.operator import deviceclass
from test_operator_authority import Scene, refused

pytestmark = [pytest.mark.controlplane, pytest.mark.operator_args(*QUICK_PASSES)]


def test_a_dra_pools_ready_node_is_labelled_and_advertises_no_resource(
    world: World, offloadpool_operator: OperatorProcess
) -> None:
    """Ready on the node: the label, no resource, the DeviceClass. Turned HostPath: the resource
    (its 2 shares) comes; turned DRA again: it goes, the label stays."""
    w = world
    group = w.name("g")
    node = w.add_node("dra", {"offloadpool-test/group": group})
    pool = w.create_pool(
        "draer",
        {
            "capacity": "64Mi",
            "medium": "Memory",
            "partitions": 2,
            "nodeSelector": {"offloadpool-test/group": group},
            "consumers": {"delivery": "DRA"},
        },
    )
    wait_for("the pool's OffloadPoolNode", lambda: w.pool_nodes(pool).get(node))
    w.report_ready(pool, node)
    wait_for("the node labelled", lambda: w.marked(pool, node)[0])
    name = dra.pool_device_class(pool)
    custom = w.custom
    made = custom.get_cluster_custom_object(
        dra.RESOURCE_GROUP, dra.RESOURCE_VERSION, dra.DEVICE_CLASS_PLURAL, name
    )
    assert made["spec"]["extendedResourceName"] == f"offloadpool.io/{pool}"
    w.renew_heartbeat(pool, node)
    assert w.marked(pool, node) == (True, False)

    def switch(delivery: str) -> None:
        custom.patch_cluster_custom_object(
            GROUP, VERSION, POOL_PLURAL, pool, {"spec": {"consumers": {"delivery": delivery}}}
        )

    switch("HostPath")
    wait_for("the resource advertised for HostPath", lambda: w.marked(pool, node) == (True, True))
    assert w.node(node).status.allocatable[f"offloadpool.io/{pool}"] == "2"
    switch("DRA")
    wait_for("the resource gone for DRA", lambda: w.marked(pool, node) == (True, False))


@pytest.fixture
def scene(world: World, operator_rbac: Path) -> Iterator[Scene]:
    s = Scene(world, operator_rbac)
    try:
        yield s
    finally:
        s.api.close()


def test_the_operator_writes_only_the_device_class_it_renders(scene: Scene) -> None:
    """As the operator (dry run): the rendered class passes, created, replaced and deleted; one
    of another name, labels, owner, selector, resource or with config is refused."""
    s = scene
    custom = client.CustomObjectsApi(s.api)
    where = (dra.RESOURCE_GROUP, dra.RESOURCE_VERSION, dra.DEVICE_CLASS_PLURAL)
    rendered = deviceclass.render(s.pool_body)
    name = rendered["metadata"]["name"]

    def create(body: dict[str, Any]) -> Any:
        return custom.create_cluster_custom_object(*where, body, dry_run="All")

    made = custom.create_cluster_custom_object(*where, rendered)
    try:
        again = json.loads(json.dumps(rendered))
        again["metadata"]["resourceVersion"] = made["metadata"]["resourceVersion"]
        custom.replace_cluster_custom_object(*where, name, again, dry_run="All")
        custom.delete_cluster_custom_object(*where, name, dry_run="All")
    finally:
        s.w.custom.delete_cluster_custom_object(*where, name)

    def variant(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(json.dumps(rendered))
        change(body)
        return body

    def rename(b: dict[str, Any]) -> None:
        b["metadata"]["name"] = "gpu.example.com"

    def unlabel(b: dict[str, Any]) -> None:
        b["metadata"]["labels"] = {"offloadpool.io/pool": s.pool}

    def unowned(b: dict[str, Any]) -> None:
        del b["metadata"]["ownerReferences"]

    def any_device(b: dict[str, Any]) -> None:
        b["spec"]["selectors"] = [{"cel": {"expression": 'device.driver == "offloadpool.io"'}}]

    def another_driver(b: dict[str, Any]) -> None:
        b["spec"]["selectors"] = [{"cel": {"expression": 'device.driver == "gpu.nvidia.com"'}}]

    def a_gpu(b: dict[str, Any]) -> None:
        b["spec"]["extendedResourceName"] = "nvidia.com/gpu"

    def configured(b: dict[str, Any]) -> None:
        opaque = {"driver": "offloadpool.io", "parameters": {"x": 1}}
        b["spec"]["config"] = [{"opaque": opaque}]

    for change, says in (
        (rename, "only the DeviceClasses it renders"),
        (unlabel, "only the DeviceClasses it renders"),
        (unowned, "must be owned by the OffloadPool"),
        (any_device, "select exactly its devices"),
        (another_driver, "select exactly its devices"),
        (a_gpu, "stand for the resource"),
        (configured, "with no config"),
    ):
        refused(partial(create, variant(change)), says)
