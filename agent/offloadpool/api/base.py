"""Shared pydantic plumbing: camelCase aliases, quantity and timestamp field types, and the
reading of an object's resourceVersion.

Every model reads and writes the API's camelCase names (``by_alias=True``) while Python code
uses snake_case attributes (``populate_by_name``). Spec models forbid unknown fields (a typo in
a spec must fail, as the API server's strict field validation does); status and object models
keep unknown fields so a newer operator's status survives a round trip through an older agent.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer
from pydantic.alias_generators import to_camel

from .quantity import QuantityError, parse_quantity


class SpecModel(BaseModel):
    """Base of user-written spec models: unknown fields are errors."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_assignment=True
    )


class StatusModel(BaseModel):
    """Base of status and object models: unknown fields are kept, not lost."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="allow", validate_assignment=True
    )


def _check_quantity(value: Any) -> int | str:
    """Keep the user's spelling (``64Gi`` stays ``64Gi``) but insist it is whole bytes > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{value!r} is not a quantity (expected an integer or a string like 64Gi)")
    try:
        n = parse_quantity(value)
    except QuantityError as exc:
        raise ValueError(f"{exc}; must be a positive whole number of bytes, for example 64Gi") from None
    if n <= 0:
        raise ValueError(f"{value!r} must be a positive whole number of bytes, for example 64Gi")
    return value


#: A positive, whole-byte Kubernetes quantity, stored as written (int or string).
Quantity = Annotated[int | str, BeforeValidator(_check_quantity)]


def _utc(value: datetime) -> datetime:
    """``value`` in UTC; a naive time is taken to be UTC already."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


def format_time(value: datetime) -> str:
    """RFC 3339 in UTC with a ``Z``, as Kubernetes writes times; fractions only when present
    (pass ``value.replace(microsecond=0)`` for a metav1.Time's whole seconds)."""
    value = _utc(value)
    text = value.strftime("%Y-%m-%dT%H:%M:%S")
    if value.microsecond:
        text += f".{value.microsecond:06d}".rstrip("0")
    return text + "Z"


def format_micro_time(value: datetime) -> str:
    """A metav1.MicroTime (a Lease's ``renewTime``): RFC 3339 in UTC, always six fraction digits."""
    return _utc(value).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: str | None) -> datetime | None:
    """An RFC 3339 time as the API server writes it (``2026-11-29T16:00:00Z``, fractions
    optional) as an aware UTC datetime; None when absent or unreadable (a hand-edited status
    must not stop a reconcile)."""
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def now() -> datetime:
    """The current time in UTC, for heartbeats and condition transitions."""
    return datetime.now(timezone.utc)


def resource_revision(meta: Mapping[str, Any]) -> int:
    """An object's ``metadata.resourceVersion`` as a number (etcd's revision), to tell the
    newer of two copies of one object apart; 0 when it is absent or not a number."""
    rv = str(meta.get("resourceVersion") or "")
    return int(rv) if rv.isdigit() else 0


#: A date-time field that serialises the way the API server stores it.
Timestamp = Annotated[datetime, PlainSerializer(format_time, return_type=str)]
