"""Static checks of the CRD files: what kubectl explain shows and what the rules say.

The API server checks that the schemas are structural and that the CEL compiles (see
tests/test_crd_validation.py); these checks cover what it does not insist on but users need:
a description on every field, messages that name their field, printer columns that point at
real fields, and a quantity pattern that agrees with offloadpool.api.parse_quantity.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from offloadpool.api import (
    CATEGORY,
    CRD_NAMES,
    GROUP,
    PLURALS,
    SHORT_NAMES,
    VERSION,
    QuantityError,
    parse_quantity,
)

CRD_DIR = Path(__file__).resolve().parents[1] / "crds"
CRDS = {p.name: yaml.safe_load(p.read_text()) for p in sorted(CRD_DIR.glob("*.yaml"))}


def _walk(schema: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for key, prop in schema.get("properties", {}).items():
        yield from _walk(prop, f"{path}.{key}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}.*")


def _root(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_two_crds_named_as_the_api_package_says() -> None:
    assert sorted(CRDS) == ["offloadpool.io_offloadpoolnodes.yaml", "offloadpool.io_offloadpools.yaml"]
    for crd in CRDS.values():
        names = crd["spec"]["names"]
        assert crd["metadata"]["name"] == CRD_NAMES[names["kind"]]
        assert crd["spec"]["group"] == GROUP and crd["spec"]["scope"] == "Cluster"
        assert names["plural"] == PLURALS[names["kind"]]
        assert tuple(names["shortNames"]) == SHORT_NAMES[names["kind"]]
        assert names["categories"] == [CATEGORY]
        (version,) = crd["spec"]["versions"]
        assert version["name"] == VERSION and version["served"] and version["storage"]
        assert version["subresources"] == {"status": {}}


@pytest.mark.parametrize("crd_file", sorted(CRDS))
def test_every_field_is_described(crd_file: str) -> None:
    root = _root(CRDS[crd_file])
    missing = [
        path
        for section in ("spec", "status")
        for path, prop in _walk(root["properties"][section], section)
        if "description" not in prop and not path.endswith(("[]", ".*"))
    ]
    assert not missing, f"fields without a description: {missing}"


@pytest.mark.parametrize("crd_file", sorted(CRDS))
def test_every_rule_message_names_a_field(crd_file: str) -> None:
    rules = [
        (path, rule)
        for path, prop in _walk(_root(CRDS[crd_file]), "")
        for rule in prop.get("x-kubernetes-validations", [])
    ]
    assert rules
    for path, rule in rules:
        assert re.search(r"\b(spec|status|metadata)\.[A-Za-z]", rule["message"]), (path, rule)


@pytest.mark.parametrize("crd_file", sorted(CRDS))
def test_printer_columns_point_at_schema_fields(crd_file: str) -> None:
    crd = CRDS[crd_file]
    root = _root(crd)
    paths = {path for path, _ in _walk(root, "")}
    for column in crd["spec"]["versions"][0]["additionalPrinterColumns"]:
        jp = column["jsonPath"]
        # metadata is every object's, not in the CRD's schema: the two timestamps kubectl shows
        assert jp in (".metadata.creationTimestamp", ".metadata.deletionTimestamp") or jp in paths, column


def _quantity_props() -> list[tuple[str, dict[str, Any]]]:
    root = _root(CRDS["offloadpool.io_offloadpools.yaml"])
    return [(p, s) for p, s in _walk(root, "") if s.get("x-kubernetes-int-or-string")]


def test_quantity_fields_are_int_or_string_with_a_pattern() -> None:
    props = _quantity_props()
    assert [p for p, _ in props] == [
        ".spec.capacity",
        ".spec.layout.slotSize",
        ".spec.layout.rowSize",
        ".spec.segments.minSize",
        ".spec.compat.vllm.rowSize",
    ]
    for _, prop in props:
        assert prop["anyOf"] == [{"type": "integer"}, {"type": "string"}]
        assert prop["pattern"] and prop["x-kubernetes-validations"]


@pytest.mark.parametrize(
    "text",
    [
        "64Gi",
        "1",
        "1.5Ki",
        ".5Mi",
        "5.",
        "2e9",
        "1E3",
        "1E",
        "+2Mi",
        "100m",
        "64GB",
        "Gi",
        "-1Gi",
        "64 Gi",
        "1e-3",
        "0x10",
        "1.2.3",
        "1Ki1",
    ],
)
def test_crd_pattern_and_parser_agree_on_non_negative_quantities(text: str) -> None:
    """Whatever the pattern lets through, parse_quantity reads (or calls not whole bytes)."""
    pattern = re.compile(_quantity_props()[0][1]["pattern"])
    try:
        parse_quantity(text)
        parsed = True
    except QuantityError as exc:
        parsed = "whole number" in str(exc)  # a quantity, just not whole bytes
    assert bool(pattern.match(text)) == (parsed and not text.startswith("-") and "e-" not in text)
