"""Printer columns through the real `kubectl get`: the table answers "ready? where not? why?"."""

from __future__ import annotations

import re

import pytest

from fixtures.crds import CustomObjects
from offloadpool.api import NODE_PLURAL, POOL_PLURAL, OffloadPoolNodeStatus, OffloadPoolStatus, now
from offloadpool.api.constants import FINALIZER

pytestmark = pytest.mark.controlplane


def _table(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """Header and rows by name, each cell cut at its header's column (kubectl left-aligns
    every cell under its header), so an empty cell is '' rather than the next cell shifted."""
    lines = [line for line in text.splitlines() if line.strip()]
    starts = [m.start() for m in re.finditer(r"\S+", lines[0])]
    ends = starts[1:] + [None]
    cut = [[line[a:b].strip() for a, b in zip(starts, ends, strict=True)] for line in lines]
    return cut[0], {row[0]: row for row in cut[1:]}


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
        assert header == [
            "NAME", "CAPACITY", "MEDIUM", "LAYOUT", "READY", "DESIRED", "STATUS", "DELETING", "AGE"
        ], header  # fmt: skip
        assert rows["printed"][:8] == [
            "printed", "64Gi", "HugePages-1Gi", "PerRank", "2", "3", "Degraded", ""
        ]  # fmt: skip

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
        shares_claimed="1/4",
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
        assert header == ["NAME", "POOL", "NODE", "PHASE", "PROGRESS", "GIB/S", "ENGINES", "SHARES", "AGE"], (
            header
        )
        assert rows["printed.gpu-7"][:8] == [
            "printed.gpu-7",
            "printed",
            "gpu-7",
            "Populating",
            "42",
            "7.5",
            "0",
            "1/4",  # a partitioned pool's shares claimed of the node's shares
        ]

    header, rows = _table(kubectl("get", "opn", "printed.gpu-7", "-o", "wide").stdout)
    # the status' own timestamp is when it last changed, not a heartbeat (liveness is the
    # agent's Lease): the column says so, so a healthy node's minutes-old write reads as such
    assert header[-3:] == ["REASON", "HUGEPAGES%", "REPORTED"], header
    assert "HEARTBEAT" not in header, header
    assert rows["printed.gpu-7"][-3:-1] == ["Populating", "100"]
    assert rows["printed.gpu-7"][-1].endswith("s"), rows  # the write's age, e.g. 0s


def test_a_deleted_pool_reads_deleting_without_an_operator(cr_objects: CustomObjects) -> None:
    """A pool deleted while no operator runs keeps the status the operator last wrote (Ready);
    the API server's own deletionTimestamp is what the table shows, so it reads as deleting."""
    cr_objects.create(
        POOL_PLURAL,
        {
            "apiVersion": "offloadpool.io/v1alpha1",
            "kind": "OffloadPool",
            # the operator's finalizer: nothing here removes it, as no operator runs
            "metadata": {"name": "orphan-deleted", "finalizers": [FINALIZER]},
            "spec": {"capacity": "1Gi", "medium": "Memory"},
        },
    )
    status = OffloadPoolStatus(desired_nodes=1, ready_nodes=1, phase="Ready")
    cr_objects.patch_status(
        POOL_PLURAL, "orphan-deleted", {"status": status.model_dump(by_alias=True, exclude_none=True)}
    )
    kubectl = cr_objects.control_plane.kubectl
    try:
        kubectl("delete", "offloadpool", "orphan-deleted", "--wait=false")
        header, rows = _table(kubectl("get", "op", "orphan-deleted").stdout)
        row = dict(zip(header, rows["orphan-deleted"], strict=True))
        assert row["STATUS"] == "Ready" and row["DELETING"], row
        assert row["DELETING"][-1] in "smhd", row  # how long ago it was deleted, e.g. 0s
    finally:
        cr_objects.patch(POOL_PLURAL, "orphan-deleted", {"metadata": {"finalizers": None}})
