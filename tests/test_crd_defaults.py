"""The CRD's defaults are the models' defaults (the models hold them; the CRD restates them).

Walks the CRD's spec schema and the pydantic models side by side: every property has a model
field of the same wire name, every default in one is the default in the other, and applying
the CRD's defaults the way the API server does to a minimal spec gives exactly what the models
fill in. tests/test_crd_validation.py then checks the API server really applies them.
"""

from __future__ import annotations

import copy
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from offloadpool.api import OffloadPoolSpec

CRD = Path(__file__).resolve().parents[1] / "crds" / "offloadpool.io_offloadpools.yaml"


def _spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _model_of(field: FieldInfo) -> type[BaseModel] | None:
    """The pydantic model inside a field's annotation (through Optional), if any."""
    ann = field.annotation
    for arg in (ann, *typing.get_args(ann)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _default(field: FieldInfo) -> Any:
    if field.default_factory is not None:
        # pydantic types a factory as maybe taking the validated data; the models' factories take none
        value = field.default_factory()  # type: ignore[call-arg]
        return value.model_dump(by_alias=True, exclude_none=True) if isinstance(value, BaseModel) else value
    return None if field.default is PydanticUndefined else field.default


def _pairs(schema: dict[str, Any], model: type[BaseModel], path: str) -> list[tuple[str, Any, FieldInfo]]:
    fields = {(f.alias or name): f for name, f in model.model_fields.items()}
    assert set(schema.get("properties", {})) == set(fields), (
        f"{path}: CRD properties {sorted(schema.get('properties', {}))} != model fields {sorted(fields)}"
    )
    out = []
    for key, prop in schema["properties"].items():
        field = fields[key]
        out.append((f"{path}.{key}", prop, field))
        sub = _model_of(field)
        if sub is not None and prop.get("type") == "object" and "properties" in prop:
            out.extend(_pairs(prop, sub, f"{path}.{key}"))
        elif prop.get("type") == "array" and "properties" in prop.get("items", {}):
            item_model = next(
                a for a in typing.get_args(typing.get_args(field.annotation)[0]) if isinstance(a, type)
            )
            out.extend(_pairs(prop["items"], item_model, f"{path}.{key}[]"))
    return out


PAIRS = _pairs(_spec_schema(), OffloadPoolSpec, "spec")


@pytest.mark.parametrize(("path", "prop", "field"), PAIRS, ids=[p for p, _, _ in PAIRS])
def test_each_default_is_the_same_in_crd_and_model(path: str, prop: dict[str, Any], field: FieldInfo) -> None:
    crd_default = prop.get("default")
    model_default = _default(field)
    if isinstance(crd_default, dict):
        # An object defaulted (often to {}) so that its members' defaults apply: as the API
        # server does, its members' defaults are applied to it before it is stored.
        crd_default = _apply_openapi_defaults(crd_default, prop)
    assert crd_default == model_default, (
        f"{path}: CRD default {crd_default!r}, model default {model_default!r}"
    )


def test_every_required_field_has_no_default() -> None:
    for path, prop, field in PAIRS:
        if field.is_required():
            assert "default" not in prop, path


def _apply_openapi_defaults(obj: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """Structural defaulting as the API server does it: absent + default -> set, then recurse."""
    obj = copy.deepcopy(obj)
    for key, prop in schema.get("properties", {}).items():
        if key not in obj and "default" in prop:
            obj[key] = copy.deepcopy(prop["default"])
        if key in obj and isinstance(obj[key], dict) and prop.get("type") == "object":
            obj[key] = _apply_openapi_defaults(obj[key], prop)
    return obj


@pytest.mark.parametrize(
    "minimal",
    [
        {"capacity": "64Gi"},
        {"capacity": 2**30, "medium": "Memory", "layout": {"type": "PerRank", "ranks": 2}},
        {"capacity": "1Gi", "segments": {"maxFiles": 1}, "consumers": {"namespaces": ["a"]}},
    ],
)
def test_crd_defaulting_equals_model_defaulting(minimal: dict[str, Any]) -> None:
    by_crd = _apply_openapi_defaults(minimal, _spec_schema())
    by_model = OffloadPoolSpec.model_validate(minimal).model_dump(by_alias=True, exclude_none=True)
    assert by_crd == by_model
