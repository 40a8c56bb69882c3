"""The Python models round-trip what the API server returns, unchanged.

Every example goes in through `kubectl apply --server-side`, comes back from the API server,
and `OffloadPool.model_validate(obj).model_dump(by_alias=True, exclude_none=True)` must equal
the object as served, byte for byte in JSON terms; the models' own defaulting of the example
must equal the server's. Statuses written from the models come back equal too.
"""

from __future__ import annotations

import pytest
import yaml

from crd_cases import EXAMPLE_POOLS, ExamplePool
from fixtures.crds import CustomObjects
from offloadpool.api import (
    NODE_PLURAL,
    POOL_PLURAL,
    FailingNode,
    OffloadPool,
    OffloadPoolNode,
    OffloadPoolNodeSpec,
    OffloadPoolNodeStatus,
    OffloadPoolSpec,
    OffloadPoolStatus,
    node_object_name,
    now,
)

pytestmark = pytest.mark.controlplane


@pytest.mark.parametrize("example", EXAMPLE_POOLS, ids=[p.id for p in EXAMPLE_POOLS])
def test_example_round_trips_through_the_api_server(example: ExamplePool, cr_objects: CustomObjects) -> None:
    source = example.doc
    name = example.name
    cr_objects.track(POOL_PLURAL, name)
    cr_objects.control_plane.kubectl(
        "apply", "--server-side", "--field-manager=roundtrip", "-f", "-", input=yaml.safe_dump(source)
    )
    served = cr_objects.get(POOL_PLURAL, name)

    pool = OffloadPool.model_validate(served)
    assert pool.model_dump(by_alias=True, exclude_none=True) == served
    # The models default the example exactly as the API server did.
    assert (
        OffloadPoolSpec.model_validate(source["spec"]).model_dump(by_alias=True, exclude_none=True)
        == served["spec"]
    )
    # And what the models write back is accepted unchanged: no new generation.
    replaced = cr_objects.replace(POOL_PLURAL, name, pool.model_dump(by_alias=True, exclude_none=True))
    assert replaced["metadata"]["generation"] == served["metadata"]["generation"]
    assert replaced["spec"] == served["spec"]


def test_pool_status_written_from_the_models_round_trips(cr_objects: CustomObjects) -> None:
    cr_objects.create(
        POOL_PLURAL,
        {
            "apiVersion": "offloadpool.io/v1alpha1",
            "kind": "OffloadPool",
            "metadata": {"name": "rt-status"},
            "spec": {"capacity": "64Mi", "medium": "Memory"},
        },
    )
    status = OffloadPoolStatus(
        observed_generation=1,
        phase="Degraded",
        desired_nodes=3,
        ready_nodes=2,
        failed_nodes=1,
        pending_nodes=0,
        total_bytes=2 * 64 * 2**20,
        failing_nodes=[
            FailingNode(
                node="gpu-3", reason="InsufficientHugePages", message="needs 32 free 2Mi pages, has 10"
            )
        ],
    )
    status.set_condition("Ready", "False", "NodesFailed", "2/3 nodes ready", 1)
    status.set_condition("Degraded", "True", "NodesFailed", "gpu-3: InsufficientHugePages", 1)
    assert status.conditions is not None
    status.conditions[0].last_transition_time = now().replace(microsecond=0)
    status.conditions[1].last_transition_time = now().replace(microsecond=123000)
    cr_objects.patch_status(
        POOL_PLURAL, "rt-status", {"status": status.model_dump(by_alias=True, exclude_none=True)}
    )

    served = cr_objects.get(POOL_PLURAL, "rt-status")
    assert served["status"] == status.model_dump(by_alias=True, exclude_none=True)
    assert OffloadPool.model_validate(served).model_dump(by_alias=True, exclude_none=True) == served


def test_node_status_written_from_the_models_round_trips(cr_objects: CustomObjects) -> None:
    node = OffloadPoolNode(
        metadata={"name": node_object_name("rt", "gpu-9")},
        spec=OffloadPoolNodeSpec(pool="rt", node_name="gpu-9"),
    )
    cr_objects.create(NODE_PLURAL, node.model_dump(by_alias=True, exclude_none=True))
    status = OffloadPoolNodeStatus(
        phase="Ready",
        progress=100,
        bytes_total=2**30,
        bytes_populated=2**30,
        populate_gib_per_second=7.8,
        huge_page_coverage=100.0,
        numa_nodes=[0, 1],
        numa_placement=[[0], [0], [1], []],
        engines_attached=2,
        agent_version="0.1.0",
        heartbeat=now(),
        observed_generation=3,
        pending_generation=4,
        reason="InUse",
        message="generation 4 waits for 2 attached engines",
    )
    cr_objects.patch_status(
        NODE_PLURAL, "rt.gpu-9", {"status": status.model_dump(by_alias=True, exclude_none=True)}
    )
    served = cr_objects.get(NODE_PLURAL, "rt.gpu-9")
    assert served["status"] == status.model_dump(by_alias=True, exclude_none=True)
    back = OffloadPoolNode.model_validate(served)
    assert back.model_dump(by_alias=True, exclude_none=True) == served
    assert back.status is not None and back.status.heartbeat == status.heartbeat
