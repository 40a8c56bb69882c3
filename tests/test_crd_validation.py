"""The real API server enforces the CRDs: examples accepted, invalid pools rejected naming the
field, defaults applied, OffloadPoolNode invariants held.

Everything here goes through a real kube-apiserver (the session's `control_plane`), with the
CRDs applied by `kubectl apply --server-side` exactly as users install them.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from crd_cases import EXAMPLE_POOLS, EXAMPLES_DIR, INVALID_POOLS, ExamplePool, InvalidPool, names_field
from fixtures.crds import CustomObjects, api_error
from offloadpool.api import NODE_PLURAL, POOL_PLURAL, OffloadPoolSpec

pytestmark = pytest.mark.controlplane


def test_crds_are_served_with_short_names_and_category(crds_installed: Any) -> None:
    out = crds_installed.kubectl("api-resources", "--api-group=offloadpool.io", "-o", "wide").stdout
    lines = {line.split()[0]: line for line in out.splitlines()[1:] if line.strip()}
    assert set(lines) == {"offloadpools", "offloadpoolnodes"}, out
    assert "op,opool" in lines["offloadpools"] and "offloadpool-all" in lines["offloadpools"]
    assert "opn" in lines["offloadpoolnodes"] and "offloadpool-all" in lines["offloadpoolnodes"]
    assert "false" in lines["offloadpools"].split()  # NAMESPACED: cluster-scoped
    # The category lists both kinds at once; the singular still names one kind.
    crds_installed.kubectl("get", "offloadpool-all")
    missing = crds_installed.kubectl("get", "offloadpool", "no-such-pool", check=False)
    assert 'offloadpools.offloadpool.io "no-such-pool" not found' in missing.stderr, missing.stderr


def test_examples_cover_the_documented_cases() -> None:
    """Each top-level example file holds a pool; together they show every layout and medium."""
    top_level = {p.path for p in EXAMPLE_POOLS if p.path.parent == EXAMPLES_DIR}
    assert top_level == set(EXAMPLES_DIR.glob("*.yaml"))
    assert len(EXAMPLE_POOLS) >= 6
    specs = [p.doc["spec"] for p in EXAMPLE_POOLS]
    assert {s.get("layout", {}).get("type", "Replicated") for s in specs} == {
        "Replicated",
        "PerRank",
        "Interleaved",
    }
    assert {s.get("medium", "HugePages-2Mi") for s in specs} == {
        "HugePages-2Mi",
        "HugePages-1Gi",
        "Memory",
        "MemoryTHP",
    }
    assert any(s.get("reclaimPolicy") == "Retain" for s in specs)
    assert any("compat" in s for s in specs)


@pytest.mark.parametrize("example", EXAMPLE_POOLS, ids=[p.id for p in EXAMPLE_POOLS])
def test_example_is_accepted(example: ExamplePool, cr_objects: CustomObjects) -> None:
    cr_objects.track(POOL_PLURAL, example.name)
    out = cr_objects.control_plane.kubectl(
        "apply",
        "--server-side",
        "--field-manager=examples",
        "--validate=strict",
        "-f",
        "-",
        input=yaml.safe_dump(example.doc),
    )
    assert "serverside-applied" in out.stdout, out.stdout
    stored = json.loads(
        cr_objects.control_plane.kubectl("get", "offloadpool", example.name, "-o", "json").stdout
    )
    assert stored["spec"]["capacity"] == example.doc["spec"]["capacity"]


@pytest.mark.parametrize("case", INVALID_POOLS, ids=[c.id for c in INVALID_POOLS])
def test_invalid_pool_is_rejected_naming_the_field(case: InvalidPool, cr_objects: CustomObjects) -> None:
    body = case.body(case.id)
    with pytest.raises(ApiException) as info:
        cr_objects.create(POOL_PLURAL, body)
    status, message, causes = api_error(info.value)
    assert status in (400, 422), (status, message)
    assert names_field(message, case.field), f"message does not name {case.field!r}: {message}"
    with pytest.raises(ApiException) as gone:
        cr_objects.get(POOL_PLURAL, body["metadata"]["name"])
    assert gone.value.status == 404


def test_enough_distinct_invalid_pools() -> None:
    assert len({c.id for c in INVALID_POOLS}) >= 25
    assert len({c.field for c in INVALID_POOLS}) >= 20


@pytest.mark.parametrize(
    "spec",
    [
        {"capacity": "64Mi", "medium": "Memory"},
        {"capacity": 67108864},
        {"capacity": "128Mi", "medium": "MemoryTHP", "layout": {"type": "PerRank", "ranks": 2}},
        {"capacity": "64Mi", "medium": "Memory", "segments": {"maxFiles": 4}, "prefault": {"numa": "Spread"}},
        {
            "capacity": "64Mi",
            "medium": "Memory",
            "layout": {"type": "PerRank", "ranks": 4},
            "prefault": {"numaNodes": [0, 0, 1, 1]},
        },
        {
            "capacity": "64Mi",
            "medium": "Memory",
            "layout": {"type": "PerRank", "ranks": 2},
            "prefault": {"numa": "GPU"},
        },
    ],
    ids=["memory", "integer-capacity", "perrank", "partial-objects", "numa-nodes", "numa-gpu"],
)
def test_defaults_are_applied_by_the_api_server(spec: dict[str, Any], cr_objects: CustomObjects) -> None:
    created = cr_objects.create(
        POOL_PLURAL,
        {
            "apiVersion": "offloadpool.io/v1alpha1",
            "kind": "OffloadPool",
            "metadata": {"name": "defaults"},
            "spec": spec,
        },
    )
    stored = cr_objects.get(POOL_PLURAL, "defaults")
    expected = OffloadPoolSpec.model_validate(spec).model_dump(by_alias=True, exclude_none=True)
    assert created["spec"] == stored["spec"] == expected
    assert stored["spec"]["segments"]["minSize"] == "1Gi"
    assert stored["spec"]["consumers"] == {"uid": 0, "gid": 0, "mode": "0660"}


def test_valid_edge_values_are_accepted(cr_objects: CustomObjects) -> None:
    """The rules reject exactly what they should: the boundary values themselves pass."""
    cases = {
        "edge-max-files": {"capacity": "2Mi", "segments": {"maxFiles": 32, "minSize": "2Mi"}},
        "edge-one-gi-page": {"capacity": "1Gi", "medium": "HugePages-1Gi"},
        "edge-one-thp-page": {"capacity": "2Mi", "medium": "MemoryTHP", "segments": {"minSize": "2Mi"}},
        "edge-4ki": {"capacity": 4096, "medium": "Memory", "segments": {"minSize": "4Ki"}},
        "edge-ranks-256": {"capacity": "512Mi", "layout": {"type": "PerRank", "ranks": 256}},
        "edge-ids": {"capacity": "2Mi", "consumers": {"uid": 2**31 - 1, "gid": 2**31 - 1, "mode": "0777"}},
        "edge-workers": {"capacity": "2Mi", "prefault": {"workers": 256}},
        "edge-row-is-capacity": {
            "capacity": "4Mi",
            "layout": {"type": "Interleaved", "ranks": 2, "slotSize": "2Mi"},
        },
        "edge-odd-slot": {
            "capacity": 3 * 2**21,
            "medium": "HugePages-2Mi",
            "layout": {"type": "Interleaved", "ranks": 3, "slotSize": 1048576},
        },
        "edge-row-per-rank-region": {
            "capacity": "12Mi",
            "medium": "Memory",
            "partitions": 2,
            "layout": {"type": "PerRank", "ranks": 2, "rowSize": "3Mi"},
        },
        "edge-row-is-capacity-replicated": {"capacity": "2Mi", "layout": {"rowSize": 2097152}},
        "p" * 40: {"capacity": "2Mi"},
        "edge-tolerations": {
            "capacity": "2Mi",
            "tolerations": [
                {"operator": "Exists"},
                {"key": "k", "value": "v", "effect": "NoExecute", "tolerationSeconds": 30},
            ],
        },
        "edge-compat-interleaved": {
            "capacity": "8Mi",
            "layout": {"type": "Interleaved", "ranks": 2},
            "segments": {"maxFiles": 1},
            "compat": {"vllm": {"engineId": "a.B_c-1"}},
        },
    }
    for name, spec in cases.items():
        OffloadPoolSpec.model_validate(spec)  # the models agree
        cr_objects.create(
            POOL_PLURAL,
            {
                "apiVersion": "offloadpool.io/v1alpha1",
                "kind": "OffloadPool",
                "metadata": {"name": name},
                "spec": spec,
            },
        )


def _node_body(name: str, pool: str = "kv", node: str = "gpu-1") -> dict[str, Any]:
    return {
        "apiVersion": "offloadpool.io/v1alpha1",
        "kind": "OffloadPoolNode",
        "metadata": {"name": name},
        "spec": {"pool": pool, "nodeName": node},
    }


def test_node_object_name_must_be_pool_dot_node(cr_objects: CustomObjects) -> None:
    with pytest.raises(ApiException) as info:
        cr_objects.create(NODE_PLURAL, _node_body("kv-gpu-1"))
    assert "metadata.name" in api_error(info.value)[1]
    cr_objects.create(NODE_PLURAL, _node_body("kv.gpu-1"))


def test_node_object_spec_is_immutable(cr_objects: CustomObjects) -> None:
    cr_objects.create(NODE_PLURAL, _node_body("kv.gpu-2", node="gpu-2"))
    for patch, field in (
        ({"spec": {"nodeName": "gpu-3"}}, "spec.nodeName"),
        ({"spec": {"pool": "other"}}, "spec.pool"),
    ):
        with pytest.raises(ApiException) as info:
            cr_objects.patch(NODE_PLURAL, "kv.gpu-2", patch)
        message = api_error(info.value)[1]
        assert f"{field} is immutable" in message, message


@pytest.mark.parametrize(
    ("status", "field"),
    [
        ({"phase": "Sleeping"}, "status.phase"),
        ({"progress": 101}, "status.progress"),
        ({"hugePageCoverage": -1}, "status.hugePageCoverage"),
        ({"bytesTotal": 10, "bytesPopulated": 11}, "status.bytesPopulated"),
        ({"heartbeat": "yesterday"}, "status.heartbeat"),
        ({"enginesAttached": -1}, "status.enginesAttached"),
    ],
    ids=["phase", "progress", "coverage", "populated-beyond-total", "heartbeat", "engines"],
)
def test_node_status_is_validated(status: dict[str, Any], field: str, cr_objects: CustomObjects) -> None:
    cr_objects.create(NODE_PLURAL, _node_body("kv.gpu-4", node="gpu-4"))
    with pytest.raises(ApiException) as info:
        cr_objects.patch_status(NODE_PLURAL, "kv.gpu-4", {"status": status})
    message = api_error(info.value)[1]
    assert field in message, message


def _explain(control_plane: Any, field: str, expected: str) -> str:
    """`kubectl explain` output once the API server's OpenAPI includes the CRD.

    The OpenAPI document is rebuilt asynchronously after a CRD is Established, so a fresh
    control plane may briefly explain without our schema; wait (bounded) for it to appear.
    """
    out = ""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        proc = control_plane.kubectl("explain", field, check=False)
        out = proc.stdout + proc.stderr
        if expected in out:
            break
        time.sleep(1)
    return out


def test_kubectl_explain_shows_the_descriptions(crds_installed: Any) -> None:
    expected = "Bytes of offload memory every selected node holds"
    assert expected in _explain(crds_installed, "offloadpool.spec.capacity", expected)
    out = _explain(crds_installed, "opn.status.phase", "Populating")
    assert "Populating" in out and "Draining" in out, out


def test_plain_kubectl_apply_rejects_a_typo_naming_it(cr_objects: CustomObjects) -> None:
    """What a user sees by default: kubectl's default validation is the server's Strict."""
    doc = yaml.safe_dump(
        {
            "apiVersion": "offloadpool.io/v1alpha1",
            "kind": "OffloadPool",
            "metadata": {"name": "typo"},
            "spec": {"capacity": "64Mi", "medium": "Memory", "segments": {"maxfiles": 4}},
        }
    )
    cr_objects.track(POOL_PLURAL, "typo")
    out = cr_objects.control_plane.kubectl("apply", "-f", "-", input=doc, check=False)
    assert out.returncode != 0
    assert 'unknown field "spec.segments.maxfiles"' in out.stderr, out.stderr
