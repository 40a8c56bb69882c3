"""Status belongs to the status subresource: written there, ignored through the main resource.

That split is what lets the operator own the pool's status and each agent its node's status
while users own the spec (RBAC grants `offloadpools/status` and `offloadpoolnodes/status`
separately). Checked against the real API server.
"""

from __future__ import annotations

from typing import Any

import pytest

from fixtures.crds import CustomObjects
from offloadpool.api import NODE_PLURAL, POOL_PLURAL

pytestmark = pytest.mark.controlplane

POOL = {
    "apiVersion": "offloadpool.io/v1alpha1",
    "kind": "OffloadPool",
    "metadata": {"name": "status-split"},
    "spec": {"capacity": "64Mi", "medium": "Memory"},
}
NODE = {
    "apiVersion": "offloadpool.io/v1alpha1",
    "kind": "OffloadPoolNode",
    "metadata": {"name": "status-split.node-a"},
    "spec": {"pool": "status-split", "nodeName": "node-a"},
}


@pytest.mark.parametrize(
    ("plural", "body", "status"),
    [
        (POOL_PLURAL, POOL, {"readyNodes": 3, "desiredNodes": 3, "phase": "Ready"}),
        (NODE_PLURAL, NODE, {"phase": "Ready", "progress": 100, "enginesAttached": 1}),
    ],
    ids=["OffloadPool", "OffloadPoolNode"],
)
def test_status_only_through_the_subresource(
    plural: str, body: dict[str, Any], status: dict[str, Any], cr_objects: CustomObjects
) -> None:
    name = body["metadata"]["name"]
    # Status sent with the create is dropped.
    created = cr_objects.create(plural, {**body, "status": status})
    assert "status" not in created
    generation = created["metadata"]["generation"]

    # A patch of status through the main resource is ignored (and is no spec change).
    patched = cr_objects.patch(plural, name, {"status": status})
    assert "status" not in patched
    assert patched["metadata"]["generation"] == generation
    # So is a full replace carrying status.
    replaced = cr_objects.replace(plural, name, {**patched, "status": status})
    assert "status" not in replaced
    assert "status" not in cr_objects.get(plural, name)

    # Through the status subresource it is written...
    written = cr_objects.patch_status(plural, name, {"status": status})
    assert written["status"] == status
    assert cr_objects.get(plural, name)["status"] == status
    # ...without bumping the generation, and the spec cannot be changed that way.
    assert written["metadata"]["generation"] == generation
    spec_change = (
        {"spec": {"capacity": "128Mi"}} if plural == POOL_PLURAL else {"spec": {"nodeName": "node-b"}}
    )
    after = cr_objects.patch_status(plural, name, spec_change)
    assert after["spec"] == created["spec"]
    assert cr_objects.get(plural, name)["spec"] == created["spec"]

    # A spec change through the main resource bumps the generation; status stays.
    if plural == POOL_PLURAL:
        bumped = cr_objects.patch(plural, name, {"spec": {"capacity": "128Mi"}})
        assert bumped["metadata"]["generation"] == generation + 1
        assert bumped["status"] == status
