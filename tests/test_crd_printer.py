"""Printer columns through the real `kubectl get`: the table answers "ready? where not? why?"."""

from __future__ import annotations

import pytest

from fixtures.crds import CustomObjects
from offloadpool.api import NODE_PLURAL, POOL_PLURAL, OffloadPoolNodeStatus, OffloadPoolStatus, now

pytestmark = pytest.mark.controlplane


def _table(text: str) -> tuple[list[str], dict[str, list[str]]]:
    lines = [line for line in text.splitlines() if line.strip()]
    header = lines[0].split()
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    return header, rows


def test_offloadpool_columns(cr_objects: CustomObjects) -> None:
    cr_objects.create(
        POOL_PLURAL,
        {
            "apiVersion": "offloadpool.io/v1alpha1",
            "kind": "OffloadPool",
            "metadata": {"name": "printed"},
            "spec": {
                "capacity": "64Gi",
                "medium": "HugePages-1Gi",
                "layout": {"type": "PerRank", "ranks": 4},
                "reclaimPolicy": "Retain",
            },
        },
    )
    status = OffloadPoolStatus(
        desired_nodes=3, ready_nodes=2, failed_nodes=1, pending_nodes=0, phase="Degraded"
    )
    cr_objects.patch_status(
        POOL_PLURAL, "printed", {"status": status.model_dump(by_alias=True, exclude_none=True)}
    )
    kubectl = cr_objects.control_plane.kubectl

    for resource in ("offloadpools", "op", "opool"):
        header, rows = _table(kubectl("get", resource, "printed").stdout)
        assert header == ["NAME", "CAPACITY", "MEDIUM", "LAYOUT", "READY", "DESIRED", "STATUS", "AGE"], header
        assert rows["printed"][:7] == ["printed", "64Gi", "HugePages-1Gi", "PerRank", "2", "3", "Degraded"]

    header, rows = _table(kubectl("get", "offloadpools", "printed", "-o", "wide").stdout)
    assert header[-3:] == ["FAILED", "PENDING", "RECLAIM"], header
    assert rows["printed"][-3:] == ["1", "0", "Retain"]


def test_offloadpoolnode_columns(cr_objects: CustomObjects) -> None:
    cr_objects.create(
        NODE_PLURAL,
        {
            "apiVersion": "offloadpool.io/v1alpha1",
            "kind": "OffloadPoolNode",
            "metadata": {"name": "printed.gpu-7"},
            "spec": {"pool": "printed", "nodeName": "gpu-7"},
        },
    )
    status = OffloadPoolNodeStatus(
        phase="Populating",
        progress=42,
        populate_gib_per_second=7.5,
        engines_attached=0,
        reason="Populating",
        huge_page_coverage=100,
        heartbeat=now(),
    )
    cr_objects.patch_status(
        NODE_PLURAL, "printed.gpu-7", {"status": status.model_dump(by_alias=True, exclude_none=True)}
    )
    kubectl = cr_objects.control_plane.kubectl

    for resource in ("offloadpoolnodes", "opn"):
        header, rows = _table(kubectl("get", resource, "printed.gpu-7").stdout)
        assert header == ["NAME", "POOL", "NODE", "PHASE", "PROGRESS", "GIB/S", "ENGINES", "AGE"], header
        assert rows["printed.gpu-7"][:7] == [
            "printed.gpu-7",
            "printed",
            "gpu-7",
            "Populating",
            "42",
            "7.5",
            "0",
        ]

    header, rows = _table(kubectl("get", "opn", "printed.gpu-7", "-o", "wide").stdout)
    assert header[-3:] == ["REASON", "HUGEPAGES%", "HEARTBEAT"], header
    assert rows["printed.gpu-7"][-3:-1] == ["Populating", "100"]
    assert rows["printed.gpu-7"][-1].endswith("s"), rows  # the heartbeat's age, e.g. 0s
