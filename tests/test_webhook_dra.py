"""DRA delivery (``spec.consumers.delivery: DRA``) through the real API server: the CRD takes the
value, the operator's webhook gives a labelled pod the pool's extended resource alone and the
API server's own Pod Security admission, enforcing ``restricted``, admits it; the serving
operator keeps the pool's DeviceClass (through its write policy) and removes it with the pool.

The scheduler's side (the resource satisfied by a device of that class) is
tests/test_dra_er_real_node.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fixtures.wait import wait_for
from offloadpool.api import dra
from offloadpool.api.constants import GROUP, POOL_PLURAL, VERSION, extended_resource_name
from offloadpool.operator import admission, deviceclass
from offloadpool.operator.admission import InjectionSettings
from test_webhook import SIDECAR_IMAGE, Webhook, serving_operator, wait_admitted
from test_webhook_csi import ENFORCE, restricted_pod

pytestmark = pytest.mark.controlplane


def device_class(wh: Webhook, name: str) -> dict[str, Any] | None:
    try:
        return wh.custom.get_cluster_custom_object(
            dra.RESOURCE_GROUP, dra.RESOURCE_VERSION, dra.DEVICE_CLASS_PLURAL, name
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


@pytest.fixture(scope="module")
def dra_ns(
    crds_installed: Any, operator_rbac: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Webhook, str]]:
    """The serving operator and a namespace that enforces Pod Security ``restricted``."""
    with serving_operator(crds_installed, operator_rbac, tmp_path_factory.mktemp("dra-webhook")) as wh:
        ns = f"wh-dra-{wh.suffix}"
        wh.core.create_namespace(
            client.V1Namespace(metadata=client.V1ObjectMeta(name=ns, labels={ENFORCE: "restricted"}))
        )
        try:
            wait_for(
                f"ServiceAccount {ns}/default",
                lambda: (
                    wh.core.list_namespaced_service_account(ns, field_selector="metadata.name=default").items
                ),
            )
            yield wh, ns
        finally:
            wh.core.delete_namespace(ns)


def test_restricted_namespace_admits_a_dra_pool_pod_with_its_resource_alone(
    dra_ns: tuple[Webhook, str],
) -> None:
    """The CRD takes ``delivery: DRA``; the labelled pod comes back with
    ``offloadpool.io/<pool>: 1`` on its first container and nothing else of the webhook's (no
    volume, env, affinity or sidecar), admitted under ``restricted``; the validating webhook
    finds it exactly mutated."""
    wh, ns = dra_ns
    pool = wh.create_pool("dra", partitions=2, consumers={"delivery": "DRA", "namespaces": [ns]})
    stored = wh.pool(pool)
    assert stored is not None and stored["spec"]["consumers"]["delivery"] == "DRA"
    pod = wait_admitted(wh, restricted_pod("engine", pool, containers=2), ns)
    spec = pod["spec"]
    resource = extended_resource_name(pool)
    first, second = spec["containers"]
    assert first["resources"] == {"requests": {resource: "1"}, "limits": {resource: "1"}}
    assert resource not in str(second.get("resources"))
    assert not spec.get("initContainers") and not spec.get("affinity")
    assert [v["name"] for v in spec["volumes"]] == [m["name"] for m in first["volumeMounts"]]  # the token's
    assert all(v.get("projected") for v in spec["volumes"])
    assert not [e for c in spec["containers"] for e in c.get("env") or []]
    settings = InjectionSettings(sidecar_image=SIDECAR_IMAGE)
    assert admission.differences(pod, stored, settings) == []


def test_dra_the_crd_refuses_dra_with_stock_vllm_files(dra_ns: tuple[Webhook, str]) -> None:
    wh = dra_ns[0]
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "OffloadPool",
        "metadata": {"name": wh.name("dracompat")},
        "spec": {
            "capacity": "64Mi",
            "medium": "Memory",
            "segments": {"maxFiles": 1},
            "compat": {"vllm": {"engineId": "e-1"}},
            "consumers": {"delivery": "DRA"},
        },
    }
    with pytest.raises(ApiException) as info:
        wh.custom.create_cluster_custom_object(GROUP, VERSION, POOL_PLURAL, body)
    assert info.value.status == 422 and "spec.consumers.delivery" in str(info.value.body), info.value.body


def test_dra_a_labelled_pod_mounting_where_the_plugin_mounts_is_refused(dra_ns: tuple[Webhook, str]) -> None:
    wh, ns = dra_ns
    pool = wh.create_pool("dramnt", consumers={"delivery": "DRA"})
    body = restricted_pod("mounting", pool)
    body["spec"]["volumes"] = [{"name": "scratch", "emptyDir": {}}]
    body["spec"]["containers"][0]["volumeMounts"] = [{"name": "scratch", "mountPath": f"/offloadpool/{pool}"}]
    message = wh.refusal(body, ns)
    assert "where the DRA plugin mounts the pool" in message, message


def test_the_operator_keeps_a_dra_pools_device_class_and_removes_it_with_the_pool(
    dra_ns: tuple[Webhook, str],
) -> None:
    """Made as rendered (the operator's write policy lets it through), made again once deleted
    by hand, removed when the pool stops being a DRA pool, and deleted with the pool."""
    wh = dra_ns[0]
    pool = wh.create_pool("dracls", consumers={"delivery": "DRA"})
    name = dra.pool_device_class(pool)
    made = wait_for(f"DeviceClass {name}", lambda: device_class(wh, name), timeout=60)
    stored = wh.pool(pool)
    assert stored is not None
    assert deviceclass.essence(made) == deviceclass.essence(deviceclass.render(stored))
    assert made["spec"]["extendedResourceName"] == extended_resource_name(pool)

    wh.custom.delete_cluster_custom_object(
        dra.RESOURCE_GROUP, dra.RESOURCE_VERSION, dra.DEVICE_CLASS_PLURAL, name
    )
    wait_for(f"DeviceClass {name} made again", lambda: device_class(wh, name), timeout=60)

    patch = {"spec": {"consumers": {"delivery": "CSI"}}}
    wh.custom.patch_cluster_custom_object(GROUP, VERSION, POOL_PLURAL, pool, patch)
    wait_for(f"DeviceClass {name} gone with delivery CSI", lambda: device_class(wh, name) is None, timeout=60)

    patch = {"spec": {"consumers": {"delivery": "DRA"}}}
    wh.custom.patch_cluster_custom_object(GROUP, VERSION, POOL_PLURAL, pool, patch)
    wait_for(f"DeviceClass {name} back with delivery DRA", lambda: device_class(wh, name), timeout=60)
    wh.custom.delete_cluster_custom_object(GROUP, VERSION, POOL_PLURAL, pool)
    wait_for(f"DeviceClass {name} deleted with the pool", lambda: device_class(wh, name) is None, timeout=60)


def test_dra_any_pod_may_ask_a_dra_pools_resource_by_hand_in_its_namespaces(
    dra_ns: tuple[Webhook, str],
) -> None:
    """A DRA pool's extended resource brings nothing of the host (the scheduler allocates one of
    the pool's devices, the plugin checks the claim's namespace at prepare), so the guard lets
    an unlabelled pod ask for it by hand where the pool allows the namespace; a pool delivered
    otherwise, or one whose namespaces leave this one out, is still refused, naming the rule."""
    wh, ns = dra_ns
    dra_pool = wh.create_pool("drahand", partitions=2, consumers={"delivery": "DRA", "namespaces": [ns]})
    elsewhere = wh.create_pool("draelse", consumers={"delivery": "DRA", "namespaces": ["not-" + ns]})
    host_path = wh.create_pool("drahp", consumers={"namespaces": [ns]})

    def by_hand(name: str, pool: str) -> dict[str, Any]:
        body = restricted_pod(name, None)
        resource = extended_resource_name(pool)
        body["spec"]["containers"][0]["resources"] = {"requests": {resource: "1"}, "limits": {resource: "1"}}
        return body

    pod = wait_admitted(wh, by_hand("hand", dra_pool), ns)
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {extended_resource_name(dra_pool): "1"}
    assert not pod["metadata"].get("labels")  # nothing of the webhook's: the guard only admits
    for name, pool in (("elsewhere", elsewhere), ("hostpath", host_path)):
        message = wh.refusal(by_hand(name, pool), ns)
        assert f"resource {extended_resource_name(pool)}: only a pod labelled" in message, message
