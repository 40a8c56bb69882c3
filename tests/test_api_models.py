"""The typed API models (offloadpool.api) on their own: quantities, pages, defaults, rules.

No control plane here; tests/test_crd_*.py hold the models against the real API server.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from crd_cases import EXAMPLE_POOLS, INVALID_POOLS, ExamplePool, InvalidPool, names_field, without_indices
from offloadpool.api import (
    GROUP,
    LAYOUTS,
    MEDIA,
    OffloadPool,
    OffloadPoolNode,
    OffloadPoolNodeSpec,
    OffloadPoolSpec,
    OffloadPoolStatus,
    QuantityError,
    extended_resource_name,
    format_quantity,
    format_time,
    node_object_name,
    page_size,
    parse_quantity,
    pool_label_key,
    pool_request,
    split_node_object_name,
)


# -- quantities ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64Gi", 64 * 2**30),
        ("1Ki", 1024),
        ("1.5Ki", 1536),
        ("2Mi", 2 * 2**20),
        ("1Ei", 2**60),
        ("1k", 1000),
        ("2M", 2_000_000),
        ("1G", 10**9),
        ("2e9", 2 * 10**9),
        ("1E3", 1000),
        ("1E", 10**18),
        ("+4096", 4096),
        ("0.5Ki", 512),
        (".5Ki", 512),
        ("5.", 5),
        ("1000m", 1),
        ("1073741824", 2**30),
        (1073741824, 2**30),
    ],
)
def test_parse_quantity_reads_kubernetes_quantities(text: str | int, expected: int) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "Gi", "64GB", "64 Gi", "lots", "0x10", "1.2.3", "100m", "0.5", "1e30", "1Gi ", True, 1.5, None],
)
def test_parse_quantity_rejects_what_is_not_whole_bytes(text: object) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(text)  # type: ignore[arg-type]


@given(st.integers(min_value=0, max_value=2**62))
def test_format_quantity_round_trips(n: int) -> None:
    text = format_quantity(n)
    assert parse_quantity(text) == n
    assert len(text) <= len(str(n))


# -- media and names -----------------------------------------------------------------------
def test_page_sizes() -> None:
    assert page_size("HugePages-2Mi") == 2 * 2**20
    assert page_size("HugePages-1Gi") == 2**30
    assert page_size("Memory") == 4096
    assert page_size("MemoryTHP") == 2 * 2**20
    with pytest.raises(ValueError, match="Tape"):
        page_size("Tape")


def test_media_and_layouts_match_the_node_engine() -> None:
    """The API and the node engine must mean the same by every medium, layout and page size."""
    from offloadpool.region.files import manifest
    from offloadpool.region.memory import media as engine_media

    assert set(MEDIA) == set(manifest.MEDIA) == set(engine_media.MEDIA)
    assert set(LAYOUTS) == set(manifest.LAYOUTS)
    for medium in ("HugePages-2Mi", "HugePages-1Gi", "MemoryTHP"):
        assert page_size(medium) == engine_media.medium(medium).page_size, medium
    # Memory: the engine uses the machine's base page; the API guarantees 4 KiB multiples.
    assert engine_media.medium("Memory").page_size % 4096 == 0


def test_derived_names() -> None:
    assert GROUP == "offloadpool.io"
    assert pool_label_key("kv") == "pool.offloadpool.io/kv"
    assert extended_resource_name("kv") == "offloadpool.io/kv"
    assert node_object_name("kv", "gpu-1.example.com") == "kv.gpu-1.example.com"
    assert split_node_object_name("kv.gpu-1.example.com") == ("kv", "gpu-1.example.com")
    with pytest.raises(ValueError):
        split_node_object_name("nodot")


# -- the spec ------------------------------------------------------------------------------
def test_defaults_fill_an_empty_spec() -> None:
    spec = OffloadPoolSpec(capacity="64Gi")
    assert spec.model_dump(by_alias=True, exclude_none=True) == {
        "capacity": "64Gi",
        "medium": "HugePages-2Mi",
        "layout": {"type": "Replicated"},
        "segments": {"maxFiles": 32, "minSize": "1Gi"},
        "prefault": {"workers": 0, "numa": "None"},
        "consumers": {"uid": 0, "gid": 0, "mode": "0660"},
        "partitions": 1,
        "reclaimPolicy": "Delete",
    }
    assert spec.layout.rank_count == 1
    assert spec.region_count() == 1


def test_helpers_give_bytes_and_modes() -> None:
    spec = OffloadPoolSpec.model_validate(
        {
            "capacity": "8Gi",
            "medium": "MemoryTHP",
            "layout": {"type": "Interleaved", "ranks": 4, "slotSize": "512Ki"},
            "segments": {"minSize": 2**30, "maxFiles": 1},
            "consumers": {"mode": "0640"},
            "compat": {"vllm": {"engineId": "e-1", "rowSize": "2Mi"}},
        }
    )
    assert spec.capacity_bytes() == 8 * 2**30
    assert spec.min_size_bytes() == 2**30
    assert spec.slot_size_bytes() == 512 * 1024
    assert spec.row_bytes() == 2 * 2**20
    assert spec.mode_int() == 0o640
    assert spec.page_size() == 2 * 2**20
    assert spec.compat_file() == "vllm_offload_e-1.mmap"
    assert spec.vllm_compat_file_count() == 8  # min(32 segments, 8Gi // 1Gi) files of 512 rows
    per_rank = OffloadPoolSpec(capacity="8Gi", layout={"type": "PerRank", "ranks": 4})
    assert per_rank.region_count() == 4 and per_rank.region_bytes() == 2 * 2**30


def test_snake_case_attributes_and_camel_case_wire_names() -> None:
    spec = OffloadPoolSpec(capacity=2**30, reclaim_policy="Retain", node_selector={"a": "b"})
    dumped = spec.model_dump(by_alias=True, exclude_none=True)
    assert dumped["reclaimPolicy"] == "Retain" and dumped["nodeSelector"] == {"a": "b"}
    assert dumped["capacity"] == 2**30  # an integer quantity stays an integer


def test_quantities_keep_their_spelling() -> None:
    spec = OffloadPoolSpec(capacity="65536Mi", segments={"minSize": "2048Mi"})
    dumped = spec.model_dump(by_alias=True)
    assert dumped["capacity"] == "65536Mi" and dumped["segments"]["minSize"] == "2048Mi"


def test_assignment_is_validated() -> None:
    spec = OffloadPoolSpec(capacity="64Gi")
    with pytest.raises(ValidationError, match="capacity"):
        spec.capacity = "64GB"


@pytest.mark.parametrize("example", EXAMPLE_POOLS, ids=[p.id for p in EXAMPLE_POOLS])
def test_examples_are_valid_for_the_models(example: ExamplePool) -> None:
    obj = example.doc
    pool = OffloadPool.model_validate(obj)
    assert pool.name == obj["metadata"]["name"]
    # Everything the user wrote comes back as written (defaults are only added).
    dumped = pool.model_dump(by_alias=True, exclude_none=True)
    _assert_contains(dumped, obj)


def _assert_contains(outer: object, inner: object, path: str = "") -> None:
    if isinstance(inner, dict):
        assert isinstance(outer, dict), path
        for key, value in inner.items():
            assert key in outer, f"{path}.{key} lost"
            _assert_contains(outer[key], value, f"{path}.{key}")
    else:
        assert outer == inner, path


@pytest.mark.parametrize("case", INVALID_POOLS, ids=[c.id for c in INVALID_POOLS])
def test_models_reject_what_the_api_server_rejects(case: InvalidPool) -> None:
    with pytest.raises(ValidationError) as info:
        OffloadPool.model_validate(case.body("model-case"))
    assert names_field(without_indices(str(info.value)), without_indices(case.field)), str(info.value)


# -- status and node objects ---------------------------------------------------------------
def test_conditions_keep_transition_time_until_status_flips() -> None:
    status = OffloadPoolStatus()
    assert status.set_condition("Ready", "False", "Provisioning", "0/3 nodes ready", 1)
    first = status.condition("Ready")
    assert first is not None
    assert not status.set_condition("Ready", "False", "Provisioning", "0/3 nodes ready", 1)
    assert status.set_condition("Ready", "False", "Provisioning", "1/3 nodes ready", 1)
    assert status.condition("Ready").last_transition_time == first.last_transition_time  # type: ignore[union-attr]
    assert status.set_condition("Ready", "True", "AllNodesReady", "3/3 nodes ready", 1)
    assert [c.type for c in status.conditions or ()] == ["Ready"]


def test_times_are_written_as_kubernetes_writes_them() -> None:
    t = datetime(2026, 11, 29, 15, 0, 1, tzinfo=timezone.utc)
    assert format_time(t) == "2026-11-29T15:00:01Z"
    assert format_time(t.replace(microsecond=250000)) == "2026-11-29T15:00:01.25Z"
    node = OffloadPoolNode.model_validate(
        {
            "apiVersion": "offloadpool.io/v1alpha1",
            "kind": "OffloadPoolNode",
            "metadata": {"name": "kv.n1"},
            "spec": {"pool": "kv", "nodeName": "n1"},
            "status": {"phase": "Ready", "heartbeat": "2026-11-29T15:00:01Z", "populateGiBPerSecond": 7.5},
        }
    )
    assert node.status is not None and node.status.heartbeat == t
    assert node.status.populate_gib_per_second == 7.5
    assert node.model_dump(by_alias=True, exclude_none=True)["status"] == {
        "phase": "Ready",
        "heartbeat": "2026-11-29T15:00:01Z",
        "populateGiBPerSecond": 7.5,
    }


def test_node_object_for_pool_and_node() -> None:
    node = OffloadPoolNode(
        metadata={"name": node_object_name("kv", "gpu-1")},
        spec=OffloadPoolNodeSpec(pool="kv", node_name="gpu-1"),
    )
    assert node.model_dump(by_alias=True, exclude_none=True) == {
        "apiVersion": "offloadpool.io/v1alpha1",
        "kind": "OffloadPoolNode",
        "metadata": {"name": "kv.gpu-1"},
        "spec": {"pool": "kv", "nodeName": "gpu-1"},
    }
    with pytest.raises(ValidationError, match="phase"):
        OffloadPoolNode.model_validate({**node.model_dump(by_alias=True), "status": {"phase": "Sleeping"}})


def test_status_keeps_fields_it_does_not_know() -> None:
    """A newer operator's status must survive a read-modify-write by an older component."""
    status = OffloadPoolStatus.model_validate({"readyNodes": 1, "futureField": {"x": 1}})
    assert status.model_dump(by_alias=True, exclude_none=True) == {"readyNodes": 1, "futureField": {"x": 1}}


def test_a_row_size_splits_replicated_and_per_rank_files_on_whole_rows() -> None:
    """``layout.rowSize`` reaches the engine as its row: every segment file is whole rows, where
    the same pool without it splits on pages alone (7.5 MiB files, no row boundary)."""
    from offloadpool.region.files.planner import plan

    row = 3 * 2**20
    base = {"capacity": "30Mi", "medium": "Memory", "segments": {"maxFiles": 4, "minSize": "4Ki"}}
    for layout, regions in (({"type": "Replicated"}, 1), ({"type": "PerRank", "ranks": 2}, 2)):
        capacity = "30Mi" if regions == 1 else "60Mi"
        pool = {"metadata": {"name": "kv", "uid": "u"}, "spec": {**base, "capacity": capacity}}
        spec = pool["spec"]
        plain = pool_request(OffloadPool.model_validate({**pool, "spec": {**spec, "layout": layout}}))
        rowed_layout = {**layout, "rowSize": "3Mi"}
        rowed = pool_request(OffloadPool.model_validate({**pool, "spec": {**spec, "layout": rowed_layout}}))
        assert plain.slot_bytes is None and rowed.slot_bytes == row
        assert rowed.fingerprint() != plain.fingerprint()  # a shape field
        sizes = [s.bytes for r in plan(rowed).regions for s in r.segments]
        assert len(plan(rowed).regions) == regions and all(b % row == 0 for b in sizes), sizes
        assert plan(rowed).layout.row_bytes == row
        plain_sizes = [s.bytes for r in plan(plain).regions for s in r.segments]
        assert any(b % row for b in plain_sizes), plain_sizes


def test_a_pool_without_row_size_keeps_the_fingerprint_of_the_release_before() -> None:
    """Pools made by 0.1.0 (which had no ``layout.rowSize``) must not look reshaped to an agent
    that knows the field: their fingerprint is the one 0.1.0 recorded (computed by 0.1.0's
    ``PoolRequest.fingerprint`` for this spec), so an upgrade re-provisions nothing."""
    pool = {
        "metadata": {"name": "kv", "uid": "u"},
        "spec": {"capacity": "64Mi", "medium": "Memory", "layout": {"type": "PerRank", "ranks": 2}},
    }
    assert pool_request(OffloadPool.model_validate(pool)).fingerprint() == RELEASE_0_1_0_FINGERPRINT


#: ``pool_request(...).fingerprint()`` of the pool above, as offloadpool 0.1.0 (45a1a73) computes it
RELEASE_0_1_0_FINGERPRINT = "c1d23e6e53024a43"
