"""A DRA pool (``spec.consumers.delivery: DRA``) on the real node: pods keep their simple form.

A pod of the pool carries the pool label (examples/dra/pod-labelled.yaml), or writes
``offloadpool.io/<pool>: 1`` into its container itself; nothing else. The webhook adds the
resource, no node advertises it, and the kube-scheduler satisfies it with a device of the
DeviceClass the operator rendered for the pool (``extendedResourceName``, KEP-5004: a claim it
makes for the pod, named in ``status.extendedResourceClaimStatus``); the kubelet has the chart's
DRA plugin prepare that claim and containerd applies the plugin's CDI edits (the pool's
directory and ``OFFLOADPOOL_POOL_DIR``). Why real: that the pinned scheduler and kubelet do this
for the resource, only the real binaries can say.

One pool of one device (``partitions`` 1), two pods in a namespace enforcing Pod Security
``restricted``: the labelled one is given the device and writes the pool (read back on the
host); the second, asking by hand, stays Pending with the scheduler's reason, and runs on the
device once the first is deleted. The release and fixtures are tests/test_dra_real_node.py's
(its own release name, so the two modules never share one).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fixtures.chart_node import import_offloadpool_image, remove_release
from fixtures.node import TOLERATION, RealNode
from offloadpool.api import dra
from offloadpool.api.constants import extended_resource_name, pool_label_key
from offloadpool.api.pods import POD_POOL_LABEL
from offloadpool.region.holding import published
from test_dra_real_node import ENGINE, SECURITY, DraE2E, install_dra

pytestmark = pytest.mark.node

RELEASE = "dra-er"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXAMPLE_POOL = EXAMPLES / "tmpfs-dra.yaml"
EXAMPLE_POD = EXAMPLES / "dra" / "pod-labelled.yaml"


class DraErE2E(DraE2E):
    def labelled_engine(self, name: str, token: str, by_hand: bool = False) -> None:
        """examples/dra/pod-labelled.yaml with the test's name, image, engine and toleration:
        the pool label and the container's security, nothing of offloadpool's besides (with
        ``by_hand`` the container also asks for the resource itself)."""
        body = yaml.safe_load(EXAMPLE_POD.read_text())
        assert body["metadata"]["labels"] == {POD_POOL_LABEL: "tmpfs-dra"}
        (container,) = body["spec"]["containers"]
        assert container["securityContext"] == SECURITY and "resources" not in container
        assert "resourceClaims" not in body["spec"] and "volumes" not in body["spec"]
        body["metadata"] = {"name": name, "labels": {POD_POOL_LABEL: self.pool}}
        body["spec"].update(
            automountServiceAccountToken=False, terminationGracePeriodSeconds=1, tolerations=[TOLERATION]
        )
        resources: dict[str, Any] = {"limits": {"memory": "64Mi", "cpu": "100m"}}
        if by_hand:
            resources["limits"][extended_resource_name(self.pool)] = "1"
        container.update(
            image=self.image,
            imagePullPolicy="Never",
            command=["python", "-c", ENGINE, token],
            resources=resources,
        )
        self.cp.kubectl("apply", "-n", self.consumer_ns, "-f", "-", input=json.dumps(body))


@pytest.fixture(scope="module")
def dra_er(real_node: RealNode, crds_installed: Any, shared_agent_root: Path) -> Iterator[DraErE2E]:
    """helm install with the DRA driver on the test node's kubelet and CDI directories, a
    namespace enforcing restricted, examples/tmpfs-dra.yaml for it (one device); afterwards all
    of it gone, whatever happened."""
    image = import_offloadpool_image(real_node)
    suffix = uuid.uuid4().hex[:6]
    e2e = DraErE2E(
        node=real_node,
        root=shared_agent_root,
        ns=f"offloadpool-draer-{suffix}",
        consumer_ns=f"draer-restricted-{suffix}",
        pool=f"draer-{suffix}",
        image=image,
    )
    cp = real_node.control_plane
    try:
        install_dra(real_node, RELEASE, e2e.ns, e2e.consumer_ns, image)
        pool = yaml.safe_load(EXAMPLE_POOL.read_text())
        assert pool["spec"]["consumers"]["delivery"] == "DRA"
        pool["metadata"]["name"] = e2e.pool
        pool["spec"].update(capacity="16Mi", partitions=1, tolerations=[TOLERATION])
        pool["spec"]["consumers"]["namespaces"] = [e2e.consumer_ns]
        cp.kubectl("apply", "-f", "-", input=json.dumps(pool))
        yield e2e
    finally:
        remove_release(cp, RELEASE, e2e.ns, [e2e.pool], real_node.name, [e2e.consumer_ns])
        cp.kubectl("delete", "deviceclass", dra.DEVICE_CLASS, "--ignore-not-found", check=False)


def scheduled_false(e2e: DraErE2E, name: str) -> str | None:
    pod = e2e.pod(name) or {}
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("message"):
            return str(cond["message"])
    return None


def test_dra_er_a_labelled_pod_gets_the_pool_by_its_resource_and_one_beyond_waits(dra_er: DraErE2E) -> None:
    e2e, cp = dra_er, dra_er.cp
    resource = extended_resource_name(e2e.pool)
    # The operator's DeviceClass, the agent's slice, the node Ready for the pool without the resource.
    cls = e2e.wait(
        "the pool's DeviceClass", lambda: e2e.get("deviceclass", dra.pool_device_class(e2e.pool)), 120
    )
    assert cls["spec"]["extendedResourceName"] == resource, cls
    name = dra.slice_name(e2e.pool, e2e.node.name)

    def offered() -> dict | None:
        s = e2e.get("resourceslice", name)
        return s if s and [d["name"] for d in s["spec"].get("devices") or []] == [dra.POOL_DEVICE] else None

    e2e.wait("the pool's slice with its device", offered, 240)

    def labelled() -> dict | None:
        node = e2e.node.node_json()
        return (
            node if (node["metadata"].get("labels") or {}).get(pool_label_key(e2e.pool)) == "ready" else None
        )

    node = e2e.wait("the node labelled Ready for the pool", labelled, 120)
    assert resource not in (node["status"].get("allocatable") or {}), node["status"].get("allocatable")

    tokens = {n: f"{n}-{uuid.uuid4().hex[:8]}" for n in ("engine-a", "engine-b")}
    e2e.labelled_engine("engine-a", tokens["engine-a"])
    e2e.wrote("engine-a", tokens["engine-a"])
    pod = e2e.pod("engine-a") or {}
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["requests"][resource] == "1" and not pod["spec"].get("volumes"), pod["spec"]
    claim_status = pod["status"]["extendedResourceClaimStatus"]
    claim = e2e.get("resourceclaim", claim_status["resourceClaimName"], "-n", e2e.consumer_ns)
    assert claim is not None
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"], result["device"]) == (dra.DRA_DRIVER, name, dra.POOL_DEVICE)
    assert claim_status["requestMappings"][0]["containerName"] == container["name"], claim_status
    with open(e2e.root / e2e.pool / "mnt" / "r0-s000", "rb") as fh:
        assert fh.read(len(tokens["engine-a"])) == tokens["engine-a"].encode()
    (record,) = [p for p in published.load_all(e2e.root / e2e.pool) if p.is_dra]
    assert record.pod_namespace == e2e.consumer_ns

    # Beyond the one device: the pod asking by hand waits with the scheduler's reason.
    e2e.labelled_engine("engine-b", tokens["engine-b"], by_hand=True)
    reason = e2e.wait(
        "the scheduler's refusal of the second pod", lambda: scheduled_false(e2e, "engine-b"), 120
    )
    assert (e2e.pod("engine-b") or {}).get("status", {}).get("phase") == "Pending"
    print(f"the scheduler's reason: {reason}")
    assert "cannot allocate all claims" in reason, reason

    cp.kubectl("delete", "pod", "engine-a", "-n", e2e.consumer_ns, "--timeout=90s")
    e2e.wrote("engine-b", tokens["engine-b"])
    with open(e2e.root / e2e.pool / "mnt" / "r0-s000", "rb") as fh:
        assert fh.read(len(tokens["engine-b"])) == tokens["engine-b"].encode()
