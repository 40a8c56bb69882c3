"""CSI delivery (``spec.consumers.delivery: CSI``) through the real API server: the operator's
webhook injects an inline ``csi`` volume and no sidecar, and the API server's own Pod Security
admission, enforcing ``restricted`` in the pod's namespace, admits the mutated pod; the same
pod for a HostPath pool is refused there (so the check is the API server's, not ours).

Mutating webhooks run before the API server's validating admission (Pod Security among it), so
what PodSecurity judges is the pod as the webhook left it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fixtures.wait import wait_for
from offloadpool.api.pods import (
    CSI_DRIVER,
    CSI_POOL_ATTRIBUTE,
    ENV_CAPACITY_BYTES,
    ENV_POD_UID,
    ENV_POOL_DIR,
    POD_POOL_LABEL,
)
from offloadpool.operator import admission
from offloadpool.operator.admission import InjectionSettings
from test_webhook import SIDECAR_IMAGE, Webhook, serving_operator, wait_admitted

pytestmark = pytest.mark.controlplane

ENFORCE = "pod-security.kubernetes.io/enforce"
#: what a container needs of itself to pass ``restricted`` (the user's part)
RESTRICTED_CONTAINER = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


@pytest.fixture(scope="module")
def restricted(
    crds_installed: Any, operator_rbac: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Webhook, str]]:
    """The serving operator and a namespace that enforces Pod Security ``restricted``."""
    with serving_operator(crds_installed, operator_rbac, tmp_path_factory.mktemp("csi-webhook")) as wh:
        ns = f"wh-restricted-{wh.suffix}"
        meta = client.V1ObjectMeta(name=ns, labels={ENFORCE: "restricted"})
        wh.core.create_namespace(client.V1Namespace(metadata=meta))
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


def restricted_pod(name: str, pool: str | None, containers: int = 1) -> dict[str, Any]:
    """A pod whose own containers pass ``restricted``; the ServiceAccount plugin's token volume
    is left in (the webhook is called again after it, reinvocationPolicy IfNeeded)."""
    labels = {POD_POOL_LABEL: pool} if pool else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "containers": [
                {
                    "name": f"engine-{i}",
                    "image": "vllm/vllm-openai:v0.33.0",
                    "securityContext": RESTRICTED_CONTAINER,
                }
                for i in range(containers)
            ],
        },
    }


def forbidden(wh: Webhook, body: dict[str, Any], ns: str) -> str:
    with pytest.raises(ApiException) as err:
        wh.core.create_namespaced_pod(ns, copy.deepcopy(body))
    assert err.value.status == 403, err.value.body
    return str(json.loads(err.value.body)["message"])


def test_restricted_namespace_admits_a_csi_pool_pod_as_the_webhook_mutates_it(
    restricted: tuple[Webhook, str],
) -> None:
    wh, ns = restricted
    pool = wh.create_pool("csi", consumers={"delivery": "CSI", "namespaces": [ns]})
    pod = wait_admitted(wh, restricted_pod("engine", pool, containers=2), ns)
    spec = pod["spec"]
    volume = f"offloadpool-{pool}"
    ours = [v for v in spec["volumes"] if v["name"] == volume]
    assert ours == [
        {"name": volume, "csi": {"driver": CSI_DRIVER, "volumeAttributes": {CSI_POOL_ATTRIBUTE: pool}}}
    ]
    assert not [v for v in spec["volumes"] if v.get("hostPath")]
    assert not spec.get("initContainers"), "a CSI pod has no lease sidecar"
    resource = f"offloadpool.io/{pool}"
    for i, container in enumerate(spec["containers"]):
        assert {"name": volume, "mountPath": f"/offloadpool/{pool}"} in container["volumeMounts"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[ENV_POOL_DIR] == f"/offloadpool/{pool}"
        asked = (container.get("resources") or {}).get("limits") or {}
        assert (resource in asked) == (i == 0), container.get("resources")
    settings = InjectionSettings(sidecar_image=SIDECAR_IMAGE)
    assert admission.not_mutated(pod, wh.pool(pool), settings) == []


def test_restricted_namespace_admits_a_pod_of_a_partitioned_csi_pool(
    restricted: tuple[Webhook, str],
) -> None:
    """CSI delivery of a pool of 2 shares: the pod is admitted as the API server stores it
    (the uid's ``fieldRef`` as it defaults it), with one share's capacity in its environment."""
    wh, ns = restricted
    pool = wh.create_pool("csiparts", partitions=2, consumers={"delivery": "CSI", "namespaces": [ns]})
    pod = wait_admitted(wh, restricted_pod("parts", pool), ns)
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env[ENV_POD_UID]["valueFrom"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}
    assert env[ENV_CAPACITY_BYTES]["value"] == str(512 << 20)
    assert admission.differences(pod, wh.pool(pool), InjectionSettings(sidecar_image=SIDECAR_IMAGE)) == []


def test_restricted_namespace_refuses_the_same_pod_for_a_hostpath_pool(
    restricted: tuple[Webhook, str],
) -> None:
    """The API server's Pod Security admission judges the mutated pod: a HostPath pool's
    volume and sidecar are refused under ``restricted`` (and so the admission above is its
    word on the CSI pod, not a namespace that enforces nothing)."""
    wh, ns = restricted
    pool = wh.create_pool("hp", consumers={"namespaces": [ns]})
    message = forbidden(wh, restricted_pod("engine-hp", pool), ns)
    assert 'violates PodSecurity "restricted:latest"' in message and "hostPath" in message, message


def test_restricted_csi_compat_pool_mounts_vllms_file_from_the_volume(
    restricted: tuple[Webhook, str],
) -> None:
    wh, ns = restricted
    pool = wh.create_pool(
        "csicompat",
        medium="MemoryTHP",
        segments={"maxFiles": 1},
        compat={"vllm": {"engineId": "llama-tp4", "numSegments": 1}},
        consumers={"delivery": "CSI"},
    )
    pod = wait_admitted(wh, restricted_pod("compat", pool), ns)
    (container,) = pod["spec"]["containers"]
    assert {
        "name": f"offloadpool-{pool}",
        "mountPath": "/dev/shm/vllm_offload_llama-tp4.mmap",
        "subPath": "mnt/vllm_offload_llama-tp4.mmap",
    } in container["volumeMounts"]


def test_csi_a_hand_written_csi_volume_of_the_driver_is_refused_the_labelled_pod_admitted(
    restricted: tuple[Webhook, str],
) -> None:
    """Issue 36 finding 7: a csi volume of the driver takes a share at publish; written by hand
    it carries no ``offloadpool.io/<pool>`` request, so the scheduler counts no slot for it
    and labelled pods placed by that count fail ``RESOURCE_EXHAUSTED``. The guard refuses it,
    unlabelled (even for a pool its namespace may have) or beside a labelled pod's own volume;
    the labelled pod, whose volume is exactly the mutation's (with the resource), is admitted."""
    wh, ns = restricted
    pool = wh.create_pool("csiown", consumers={"delivery": "CSI", "namespaces": [ns]})
    body = restricted_pod("own-csi", None)
    body["spec"]["volumes"] = [
        {"name": "p", "csi": {"driver": CSI_DRIVER, "volumeAttributes": {"pool": pool}}}
    ]
    body["spec"]["containers"][0]["volumeMounts"] = [{"name": "p", "mountPath": "/pool"}]
    message = forbidden(wh, body, ns)
    assert "pods.guard.offloadpool.io" in message, message
    assert f"volume 'p': an inline csi volume of driver {CSI_DRIVER} (pool '{pool}')" in message, message
    assert f"by the label {POD_POOL_LABEL}: <pool>" in message and "offloadpool.io/<pool>" in message, message
    # a labelled pod bringing a second share of its pool under another name
    labelled = restricted_pod("two-csi", pool)
    labelled["spec"]["volumes"] = copy.deepcopy(body["spec"]["volumes"])
    labelled["spec"]["containers"][0]["volumeMounts"] = [{"name": "p", "mountPath": "/pool"}]
    message = forbidden(wh, labelled, ns)
    assert f"is not the volume the webhook writes for {POD_POOL_LABEL}: {pool}" in message, message
    pod = wait_admitted(wh, restricted_pod("labelled", pool), ns)
    asked = pod["spec"]["containers"][0]["resources"]["limits"]
    assert asked == {f"offloadpool.io/{pool}": "1"}, asked


def test_csi_pool_a_labelled_pod_with_its_own_hostpath_of_the_pool_is_refused(
    restricted: tuple[Webhook, str],
) -> None:
    """The guard still refuses a hand-written hostPath of the pool directory (here in a
    namespace that allows hostPath: the webhook's refusal, not Pod Security's)."""
    wh = restricted[0]
    pool = wh.create_pool("csihp", consumers={"delivery": "CSI"})
    body = wh.pod_body("own-hp", pool)
    body["spec"]["volumes"] = [{"name": "mine", "hostPath": {"path": f"/var/lib/offloadpool/{pool}"}}]
    message = wh.refusal(body)
    assert "pods.guard.offloadpool.io" in message or "pods.validate.offloadpool.io" in message, message
    assert "volume 'mine'" in message and "reaches /var/lib/offloadpool" in message, message
