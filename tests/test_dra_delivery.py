"""``spec.consumers.delivery: DRA`` as pure functions: what the webhook gives a labelled pod (its
extended resource alone), the DeviceClass the operator renders for the pool (its devices of the
driver, standing for that resource) and the Node marks (the label, never the resource).

The real API server's word on each is tests/test_webhook_dra.py; the scheduler's, the kubelet's
and containerd's is tests/test_dra_er_real_node.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from offloadpool.api import dra
from offloadpool.api.constants import extended_resource_name, pool_label_key
from offloadpool.operator import admission, deviceclass, hostguard, nodes
from offloadpool.operator.admission import Refused
from offloadpool.operator.runtime import node_info
from offloadpool.operator.selection import SelectableNode
from test_admission import SETTINGS, pod, pool


def dra_pool(name: str = "kv", **spec: Any) -> dict[str, Any]:
    consumers = {"delivery": "DRA", **spec.pop("consumers", {})}
    body = pool(name, medium="Memory", capacity="64Mi", consumers=consumers, **spec)
    body["metadata"]["uid"] = "0000-pool-uid"
    return body


RESOURCE = extended_resource_name("kv")
ASKED = {"requests": {RESOURCE: "1"}, "limits": {RESOURCE: "1"}}


def test_a_labelled_pod_of_a_dra_pool_gets_the_resource_on_its_first_container_and_nothing_else() -> None:
    """No volume, mount, env, affinity or sidecar: the plugin's CDI edits bring the files and the
    env to the container that asks, and the scheduler places the pod where a device is free."""
    given = pod(containers=2)
    new = admission.mutate(given, dra_pool(partitions=2), SETTINGS)
    first, second = new["spec"]["containers"]
    assert first == {**given["spec"]["containers"][0], "resources": ASKED}
    assert second == given["spec"]["containers"][1]
    assert {k: v for k, v in new["spec"].items() if k != "containers"} == {}
    assert new["metadata"] == given["metadata"]
    assert "hostPath" not in json.dumps(new) and "securityContext" not in json.dumps(new)


def test_dra_mutating_its_own_output_changes_nothing_and_an_unmutated_pod_is_told_apart() -> None:
    once = admission.mutate(pod(), dra_pool(), SETTINGS)
    assert admission.mutate(once, dra_pool(), SETTINGS) == once
    assert admission.differences(once, dra_pool(), SETTINGS) == []
    assert admission.not_mutated(pod(), dra_pool(), SETTINGS) == ["/spec/containers/0/resources"]


def test_dra_a_container_that_asks_for_the_pool_itself_keeps_it_and_none_is_added() -> None:
    asking = pod(containers=2)
    asking["spec"]["containers"][1]["resources"] = {"limits": {RESOURCE: "1"}}
    assert admission.mutate(asking, dra_pool(), SETTINGS) == asking


def test_dra_a_mount_where_the_plugin_mounts_the_pool_is_refused() -> None:
    mine = pod(volumes=[{"name": "scratch", "emptyDir": {}}])
    mine["spec"]["containers"][0]["volumeMounts"] = [{"name": "scratch", "mountPath": "/offloadpool/kv/"}]
    with pytest.raises(Refused, match="container 'c0' mounts volume 'scratch' at /offloadpool/kv"):
        admission.mutate(mine, dra_pool(), SETTINGS)


def test_dra_the_guard_allows_a_dra_pools_pod_no_volume_of_the_pool() -> None:
    """A DRA pool's mutation has no volume, so the guard's one exception is empty: the pool
    directory as a hostPath, even exactly the HostPath mutation's, is refused."""
    p = dra_pool()
    assert admission.volumes(p, SETTINGS) == []
    hostpath = {
        "name": "offloadpool-kv",
        "hostPath": {"path": "/var/lib/offloadpool/kv", "type": "Directory"},
    }
    mutated = admission.mutate(pod(volumes=[hostpath]), p, SETTINGS)
    why = hostguard.refusals(mutated, SETTINGS.guarded(), "kv", admission.volumes(p, SETTINGS))
    assert why and "volume 'offloadpool-kv'" in why[0], why
    plain = admission.mutate(pod(), p, SETTINGS)
    assert hostguard.refusals(plain, SETTINGS.guarded(), "kv", []) == []


def test_the_device_class_selects_the_pools_devices_and_stands_for_its_resource() -> None:
    body = deviceclass.render(dra_pool())
    assert body["apiVersion"] == "resource.k8s.io/v1" and body["kind"] == "DeviceClass"
    assert body["metadata"]["name"] == "kv.offloadpool.io" == dra.pool_device_class("kv")
    assert body["metadata"]["labels"] == {
        "app.kubernetes.io/name": "offloadpool-deviceclass",
        "offloadpool.io/pool": "kv",
    }
    (owner,) = body["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "OffloadPool",
        "kv",
        "0000-pool-uid",
        True,
    )
    selector = 'device.driver == "offloadpool.io" && device.attributes["offloadpool.io"].pool == "kv"'
    assert body["spec"] == {
        "selectors": [{"cel": {"expression": selector}}],
        "extendedResourceName": "offloadpool.io/kv",
    }
    assert dra.ATTR_POOL == "pool" and dra.DRA_DRIVER == "offloadpool.io"  # what the slices publish


def test_only_a_live_dra_pool_wants_a_device_class() -> None:
    assert deviceclass.wanted(dra_pool())
    assert not deviceclass.wanted(pool("kv", consumers={"delivery": "CSI"}))
    assert not deviceclass.wanted(pool("kv"))
    deleting = dra_pool()
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert not deviceclass.wanted(deleting)


def test_the_rendering_compares_what_the_operator_owns_not_what_the_api_server_adds() -> None:
    body = deviceclass.render(dra_pool())
    stored = json.loads(json.dumps(body))
    stored["metadata"].update(
        resourceVersion="7", uid="x", generation=1, creationTimestamp="2026-01-01T00:00:00Z"
    )
    stored["metadata"]["labels"]["team"] = "a"
    assert deviceclass.essence(stored) == deviceclass.essence(body)
    stored["spec"]["extendedResourceName"] = "nvidia.com/gpu"
    assert deviceclass.essence(stored) != deviceclass.essence(body)


def node(labels: dict[str, str] | None = None, resources: dict[str, str] | None = None) -> SelectableNode:
    status = {"capacity": resources or {}, "allocatable": resources or {}}
    return node_info({"metadata": {"name": "n1", "labels": labels or {}}, "status": status})


def test_a_ready_dra_pools_node_gets_the_label_and_never_the_resource() -> None:
    patch = nodes.marks_patch("kv", node(), True, 0)
    assert patch == {
        "metadata": {"labels": {pool_label_key("kv"): "ready", "node.offloadpool.io/pools": "true"}}
    }
    # a resource the pool advertised before it became a DRA pool goes, the label stays
    was = node({pool_label_key("kv"): "ready", "node.offloadpool.io/pools": "true"}, {RESOURCE: "2"})
    assert nodes.marks_patch("kv", was, True, 0) == {
        "status": {"capacity": {RESOURCE: None}, "allocatable": {RESOURCE: None}}
    }
    settled = node({pool_label_key("kv"): "ready", "node.offloadpool.io/pools": "true"})
    assert nodes.marks_patch("kv", settled, True, 0) is None
