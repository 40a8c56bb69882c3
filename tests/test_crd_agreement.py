"""The API server's rules and the Python models' rules accept exactly the same specs.

Hand-picked cases (tests/crd_cases.py) show each rule fires; this drives generated specs that
mix capacities, media, layouts, ranks, slot sizes and segment sizes through both the real API
server (a server-side dry-run create, so nothing is stored) and ``OffloadPoolSpec``, and
demands the same verdict, so the CEL arithmetic and its Python restatement cannot drift.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from fixtures.crds import api_error
from offloadpool.api import API_VERSION, GROUP, POOL_KIND, POOL_PLURAL, VERSION, OffloadPoolSpec

pytestmark = pytest.mark.controlplane

UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


@st.composite
def quantities(draw: st.DrawFn, counts: tuple[int, int] = (0, 48)) -> int | str:
    """A quantity spelled as an integer, with a binary suffix, or decimally."""
    low, high = counts
    powers = [n for n in (1, 2, 4, 8, 16, 32, 64) if low <= n <= high]
    count = draw(st.one_of(st.sampled_from(powers), st.integers(low, high)))
    unit = draw(st.sampled_from(["Ki", "Mi", "Mi", "Gi", "Gi", "Gi"]))
    spelling = draw(st.sampled_from(["suffix", "suffix", "int", "decimal"]))
    if spelling == "suffix":
        return f"{count}{unit}"
    if spelling == "int":
        return count * UNITS[unit]
    return str(count * draw(st.sampled_from([1000, 10**6, 4096, 3 * 2**20])))


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    """Specs near the rules' edges: about as many accepted as rejected."""
    medium = draw(st.sampled_from(["HugePages-2Mi", "HugePages-1Gi", "Memory", "MemoryTHP"]))
    spec: dict[str, Any] = {"capacity": draw(quantities(counts=(0, 64))), "medium": medium}
    layout: dict[str, Any] = {"type": draw(st.sampled_from(["Replicated", "PerRank", "Interleaved"]))}
    if draw(st.integers(0, 4)):
        layout["ranks"] = draw(st.sampled_from([1, 2, 3, 4, 8]))
    if layout["type"] == "Interleaved" and draw(st.booleans()) or draw(st.integers(0, 9)) == 0:
        layout["slotSize"] = draw(quantities(counts=(0, 4)))
    spec["layout"] = layout
    segments: dict[str, Any] = {}
    if draw(st.booleans()):
        segments["maxFiles"] = draw(st.integers(1, 32))
    if draw(st.integers(0, 2)) == 0:
        segments["minSize"] = draw(st.sampled_from(["4Ki", "1Mi", "2Mi", "1Gi", "2Gi", 4096, 2**21, "0"]))
    if draw(st.integers(0, 5)) == 0:
        vllm: dict[str, Any] = {"engineId": "e1"}
        if draw(st.integers(0, 2)):
            vllm["rowSize"] = draw(
                st.one_of(quantities(counts=(0, 4)), st.sampled_from([12288, 3 * 4096 * 8, 1000]))
            )
        if draw(st.booleans()):
            vllm["numSegments"] = draw(st.sampled_from([1, 2, 32]))
        spec["compat"] = {"vllm": vllm}
    spec["segments"] = segments
    return spec


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=specs())
def test_api_server_and_models_agree(spec: dict[str, Any], crds_installed: Any) -> None:
    from kubernetes import client

    try:
        OffloadPoolSpec.model_validate(spec)
        model_ok, model_why = True, ""
    except ValidationError as exc:
        model_ok, model_why = False, str(exc)

    body = {"apiVersion": API_VERSION, "kind": POOL_KIND, "metadata": {"name": "agreement"}, "spec": spec}
    with crds_installed.api_client() as api_client:
        api = client.CustomObjectsApi(api_client)
        try:
            api.create_cluster_custom_object(
                GROUP, VERSION, POOL_PLURAL, body, dry_run="All", field_validation="Strict"
            )
            server_ok, server_why = True, ""
        except ApiException as exc:
            status, server_why, _ = api_error(exc)
            assert status == 422, server_why
            server_ok = False

    event("accepted" if server_ok else "rejected")  # see --hypothesis-show-statistics
    assert model_ok == server_ok, (
        f"spec {spec}: API server {'accepts' if server_ok else 'rejects'} ({server_why}); "
        f"models {'accept' if model_ok else 'reject'} ({model_why})"
    )
